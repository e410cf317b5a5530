"""Sentence splitting is lossless and bounded; HTML markup survives translation untouched."""

import pytest

from service.api.html_text import HtmlDocument, share_words
from service.api.sentences import Span, join_translations, split_sentences


def pieces(text: str, max_chars: int = 200) -> list[str]:
    return [text[s.start : s.end] for s in split_sentences(text, max_chars)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Dr. Smith met Mr. Jones at 5 p.m. today. They talked, e.g. about dogs.",
            ["Dr. Smith met Mr. Jones at 5 p.m. today.", "They talked, e.g. about dogs."],
        ),
        ("It rose 3.5% to $1,234.56 in 2021. It fell.", ["It rose 3.5% to $1,234.56 in 2021.", "It fell."]),
        ('He said, "Stop. Go home." Then he left.', ['He said, "Stop. Go home."', "Then he left."]),
        ("Wait... what happened? I don't know...", ["Wait... what happened?", "I don't know..."]),
        ("A man rides. Two dogs run", ["A man rides.", "Two dogs run"]),
        ("List:\n- apples\n- two pears\n\nThe end.", ["List:", "- apples", "- two pears", "The end."]),
        ("  \n\t ", []),
    ],
)
def test_sentences_of_hard_cases(text: str, expected: list[str]) -> None:
    assert pieces(text) == expected


def test_a_long_sentence_is_cut_at_clauses_then_words_then_characters_never_truncated() -> None:
    clauses = ", ".join(["a man in a red shirt rides a bike"] * 20) + "."
    assert all(p.endswith(",") for p in pieces(clauses)[:-1])
    words = " ".join(["word"] * 600)
    assert all(len(p) <= 200 for p in pieces(words)) and " ".join(pieces(words)) == words
    letters = "x" * 450
    assert pieces(letters) == ["x" * 200, "x" * 200, "x" * 50]


def test_join_keeps_everything_between_sentences() -> None:
    text = "  One.\n\nTwo!\r\n\tThree  "
    spans = split_sentences(text, 200)
    assert spans == [Span(2, 6), Span(8, 12), Span(15, 20)]
    assert join_translations(text, spans, ["Eins.", "Zwei!", "Drei."]) == "  Eins.\n\nZwei!\r\n\tDrei.  "


def test_words_are_shared_by_the_source_words_each_node_held() -> None:
    assert share_words("Ein Mann fährt Rad", [1, 1, 2]) == ["Ein", "Mann", "fährt Rad"]
    assert share_words("eins", [3]) == ["eins"]
    assert share_words("a b", [1, 1, 1]) == ["a", "b", ""]  # fewer words than pieces: the last go empty
    assert share_words("a b c", [1, 0, 1]) == ["a b", "", "c"]  # a piece without words gets none


def test_html_round_trip_and_inline_tags_stay_in_one_sentence() -> None:
    page = '<p class="x">A <b>man</b> rides a <a href="/b?a=1&amp;c=2">red bike</a>. Dogs&nbsp;run.</p><pre>A cat.</pre>'
    document = HtmlDocument.parse(page)
    assert document.block_texts() == ["A man rides a red bike. Dogs\xa0run."]  # <pre> is not translated
    assert document.render([[]]) == page  # nothing translated: the page comes back byte for byte
    text = document.block_texts()[0]
    upper = [(s, text[s.start : s.end].upper()) for s in split_sentences(text, 200)]
    assert (
        document.render([upper])
        == '<p class="x">A <b>MAN</b> RIDES A <a href="/b?a=1&amp;c=2">RED BIKE</a>. DOGS&nbsp;RUN.</p><pre>A cat.</pre>'
    )
