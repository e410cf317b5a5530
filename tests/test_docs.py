"""The docs hold: generated figures match their JSON, the README stays a front page, links resolve."""

import re
from pathlib import Path

import pytest

from benchmarks import report

ROOT = report.ROOT
README_MAX_LINES = 250
# [text](target) and ![alt](target); the target up to a space, a '#' or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]*)(?:#[^)\s]*)?\)")
EXTERNAL = ("http://", "https://", "mailto:")
PAGES = report.pages()


def test_generated_regions_match_their_json() -> None:
    assert report.main(["--check"]) == 0, "run `python -m benchmarks.report` and commit the pages"


def test_every_report_is_on_some_page() -> None:
    text = "".join(page.read_text() for page in PAGES)
    assert {m["name"] for m in report.REGION.finditer(text)} == set(report.REPORTS)


def test_an_unknown_region_is_an_error() -> None:
    with pytest.raises(ValueError, match="no report named 'nothing'"):
        report.render("<!-- report:nothing -->\n<!-- /report:nothing -->\n")


def test_a_changed_figure_is_stale() -> None:
    page = report.render("<!-- report:engine-concurrency -->\n<!-- /report:engine-concurrency -->\n")
    assert report.stale(page) == []
    figure = re.search(r"\| (\d[\d,]*) \|", page)  # the table's first figure, whatever the last run measured
    assert figure is not None
    changed = page.replace(figure.group(0), f"| {figure.group(1)}0 |", 1)
    assert report.stale(changed) == ["engine-concurrency"]


def test_readme_is_a_front_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page: Path) -> None:
    targets = [m[1] for m in LINK.finditer(page.read_text()) if m[1] and not m[1].startswith(EXTERNAL)]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
