"""Every benchmark command the README and docs list runs in its quickest form, as a user starts it
(a subprocess in the repository), finishes, and writes the figures the docs' tables are made of:
each table that benchmarks.report renders from a benchmark's JSON renders from the quick run's.
The full tier (a few minutes in all). Not here: benchmarks.vs_vllm (it installs vLLM in a
virtualenv of its own), benchmarks.gguf and benchmarks.gguf_agreement (they build llama.cpp:
tests/model/test_gguf.py checks what it loads and computes) and benchmarks.gpu (a GPU; tests/test_gpu_check.py runs its CPU tier)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks import front_door, peers, report, translator_drafting
from service.config import ServiceConfig
from service.engine.config import EngineConfig
from service.engine.speculation import RecentOutputs
from tests.hf_folders import build_llama_folder, build_marian_folder

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600  # a bound on a run that cannot finish, not a speed limit


def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m module args` in the repository; it must exit 0."""
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def printed_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a --json run prints as its last line."""
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def rendered(monkeypatch: pytest.MonkeyPatch, results: Path, *names: str) -> None:
    """The docs' tables `names` render from the JSON files in results (benchmarks.report)."""
    monkeypatch.setattr(report, "RESULTS", results)
    for name in names:
        assert "|" in report.REPORTS[name](), name


def llama_ending_early(path: Path) -> Path:
    """A Llama folder (tests/hf_folders.py) with room for a prompt and peers.NEW_TOKENS, whose
    generation_config adds one more eos id: the token it makes fifth after the peers' first
    prompt, so that greedy generation ends that prompt after 4 tokens."""
    folder = build_llama_folder(path, max_positions=256)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer(peers.PROMPTS[0], return_tensors="pt")["input_ids"]
    made = model.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert len(made) == 5 and made[4] not in made[:4], made
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [*config["eos_token_id"], made[4]]
    config_path.write_text(json.dumps(config))
    return folder


def test_engine_quick_writes_its_figures_to_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = printed_json(run("benchmarks.engine", "--quick", "--json", env={"TMPDIR": str(tmp_path)}))
    written = tmp_path / "benchmarks-quick"  # --quick without --out: never over benchmarks/results
    assert json.loads((written / "engine.json").read_text()) == figures
    assert (written / "engine_concurrency.png").stat().st_size > 0
    for key in ["kv_cache_speedup", "batching_speedup_16", "continuous_vs_static_throughput", "translator_sentences_per_s"]:
        assert figures[key] > 0, key
    assert all(row["tokens_per_s"] > 0 and row["p99_latency_s"] > 0 for row in figures["concurrency_curve"])
    rendered(monkeypatch, written, "engine-concurrency")


def test_peers_quick_on_the_shipped_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = printed_json(run("benchmarks.peers", "--quick", "--json", "--out", str(tmp_path)))
    assert json.loads((tmp_path / "peers.json").read_text()) == figures and (tmp_path / "peers.png").stat().st_size > 0
    # The shipped generator makes all its tokens on every prompt: 2 prompts one after another, then 16 at once.
    assert figures["generate_batch_1_tokens_ours"] == 2 * peers.NEW_TOKENS
    assert figures["generate_batch_16_tokens_ours"] == 16 * peers.NEW_TOKENS
    for work in report.WORKS:
        assert all(figures[f"{work}_vs_{peer}"] > 0 for peer in peers.PEERS), work
    for work in ["generate_batch_1", "generate_batch_16"]:
        assert (
            figures[f"{work}_tokens_{peers.COMPILED}"] == figures[f"{work}_tokens_{peers.COMPILED_INT8}"] == figures[f"{work}_tokens_ours"]
        )
    for work in report.WORKS:  # int8 weights with the compiled step, as the service runs them
        assert figures[f"{work}_int8_compiled_vs_ct2_int8"] > 0, work
    for work in report.WORKS:  # the compiled decode step, in translation at up to 8 rows
        assert figures[f"{work}_compiled_vs_ct2_float32"] > 0 and figures[f"{work}_start_seconds_{peers.COMPILED}"] > 0
        # Every system is fed the same inputs: the float32 ones make exactly our outputs.
        for system in ("transformers", "ct2_float32", peers.COMPILED):
            assert figures[f"{work}_same_as_ours_{system}"] == 1.0, (work, system)
    for work in ("translate_greedy", "translate_beam4"):
        assert figures[f"{work}_bleu_ours"] == figures[f"{work}_bleu_transformers"] > 0
        ours, ct2 = figures[f"{work}_sentences_per_s_ours"], figures[f"{work}_sentences_per_s_ct2_float32"]
        assert figures[f"{work}_vs_ct2_float32"] == ours / ct2
    rendered(monkeypatch, tmp_path, "peers", "peers-targets")


def test_peers_quick_on_hugging_face_folders_counts_what_a_generator_ending_at_eos_made(tmp_path: Path) -> None:
    """`--translator PATH --generator FOLDER`: a Marian translator, and a Llama generator that ends
    its first prompt at an eos id: every system is counted by the tokens it generated."""
    translator = build_marian_folder(tmp_path / "opus-mt-en-fr")
    generator = llama_ending_early(tmp_path / "llama-ending-early")
    out = tmp_path / "out"
    args = ["--quick", "--json", "--translator", str(translator), "--generator", str(generator), "--out", str(out)]
    figures = printed_json(run("benchmarks.peers", *args))
    assert json.loads((out / "peers.json").read_text()) == figures
    assert figures["models"]["generator"]["kind"] == "hugging_face"
    made = figures["generate_batch_1_tokens_ours"]  # 2 prompts, the first ended after 4 tokens
    assert 4 <= made < 2 * peers.NEW_TOKENS
    assert figures["generate_batch_1_tokens_transformers"] == made  # the same work: transformers ends at the same eos ids
    assert figures["generate_batch_1_same_as_ours_transformers"] == 1.0
    assert all(figures[f"generate_batch_1_tokens_per_s_{system}"] > 0 for system in peers.SYSTEMS)
    for work in ["translate_greedy", "translate_beam4"]:
        assert all(figures[f"{work}_sentences_per_s_{system}"] > 0 for system in peers.SYSTEMS), work


def test_serving_quick_serves_the_default_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default service (three models) on this machine's cores: Ray is given room for every
    replica it asks, and every mode makes the same tokens."""
    figures = printed_json(run("benchmarks.serving", "--quick", "--json", "--tokens", "16", "--out", str(tmp_path / "serving.json")))
    assert json.loads((tmp_path / "serving.json").read_text()) == figures
    assert figures["ray_cpus"] >= len(ServiceConfig().models) and figures["commit"]
    for n in (1, 16, 32):
        assert figures[f"inprocess_{n}_tokens"] == figures[f"http_{n}_stream_tokens"] == figures[f"http_{n}_nostream_tokens"] > 0
        assert figures[f"http_vs_inprocess_{n}_stream"] > 0 and figures[f"http_vs_inprocess_{n}_nostream"] > 0
        assert figures[f"http_{n}_stream_ttft_p50_ms"] > 0
    rendered(monkeypatch, tmp_path, "serving")


@pytest.mark.skipif(shutil.which("ab") is None, reason="Apache's ab is not installed (Debian: apache2-utils; .ci/run installs it)")
def test_front_door_quick_measures_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = printed_json(run("benchmarks.front_door", "--quick", "--json", "--out", str(tmp_path / "front_door.json")))
    assert json.loads((tmp_path / "front_door.json").read_text()) == figures
    assert figures["refusal"]["status"] == 429
    for c in (50, 400):
        assert figures[f"healthz_c{c}"]["non_2xx"] == 0
        assert figures[f"refused_completion_c{c}"]["non_2xx"] == front_door.QUICK_REQUESTS  # every completion refused
        assert figures[f"refused_vs_healthz_p50_c{c}"] > 0
    rendered(monkeypatch, tmp_path, "front-door")


def test_structured_quick(tmp_path: Path) -> None:
    figures = printed_json(run("benchmarks.structured", "--quick", "--json", "--out", str(tmp_path)))
    assert json.loads((tmp_path / "structured.json").read_text()) == figures
    batches = [figures[key] for key in figures if key.startswith("batch_")]
    assert batches and all(b["constrained_tok_s"] > 0 and b["unconstrained_tok_s"] > 0 and b["ratio"] > 0 for b in batches)


def test_step_cost_quick_times_its_three_settings(tmp_path: Path) -> None:
    written = tmp_path / "step_cost.json"
    run("benchmarks.step_cost", "--sequences", "3", "--steps", "1", "--rounds", "1", "--json", str(written))
    rows = json.loads(written.read_text())["rows"]
    assert [(r["sequences"], r["sampling"]) for r in rows] == [(3, "greedy"), (3, "sampled")]
    for r in rows:
        assert r["block_rows"] == 64 and all(r["ms_per_step"][name] > 0 for name in ("default", "plain", "whole"))
        assert r["default_over_plain"] > 0 and r["default_over_whole"] > 0


def test_linear_quick() -> None:
    figures = printed_json(run("benchmarks.linear", "--quick", "--json"))
    assert all(figures[f"{kind}_speedup_{rows}"] > 0 for kind in ("packed", "projection") for rows in (1, 16))
    assert figures["panel_kernel"] is True and all(figures[f"panel_vs_onednn_{rows}"] > 0 for rows in (1, 16))


def test_compiled_decode_quick_times_both_graphs() -> None:
    figures = printed_json(run("benchmarks.compiled_decode", "--quick", "--json"))
    for batch in (1, 2):
        assert figures[f"eager_ms_b{batch}"] > 0 and figures[f"compiled_ms_b{batch}"] > 0
        eager, compiled = figures[f"eager_ms_b{batch}"], figures[f"compiled_ms_b{batch}"]  # rounded to 0.01 ms
        ratio = eager / compiled  # the times' rounding moves it by this share at most, its own 3 decimals by 0.0005 more
        assert abs(figures[f"compiled_vs_eager_b{batch}"] - ratio) <= ratio * (0.001 + 0.005 / eager + 0.005 / compiled) + 0.0005


def test_paged_attention_quick_times_the_kernel_and_the_plain_path() -> None:
    figures = printed_json(run("benchmarks.paged_attention", "--quick", "--json"))
    speedups = {k: v for k, v in figures.items() if k.startswith("kernel_vs_plain_")}
    assert len(speedups) == 3  # one layer at two head shapes, and the shipped generator's step
    for key, speedup in speedups.items():
        stem = key.removeprefix("kernel_vs_plain_")
        unit, half_step = ("us", 0.05) if stem.startswith("attention") else ("ms", 0.005)  # the times' rounding
        plain, kernel = figures[f"{stem}_plain_{unit}"], figures[f"{stem}_kernel_{unit}"]
        # the times' rounding, and the speed-up's own to 3 decimals (0.0005: a speed-up far below 1)
        ratio = plain / kernel  # the times' rounding moves it by this share at most, the speed-up's own 3 decimals by 0.0005 more
        assert abs(speedup - ratio) <= ratio * (0.001 + half_step / plain + half_step / kernel) + 0.0005


def test_translator_drafting_counts_the_steps_drafting_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six tokens with nothing repeated take six steps; the same six again, drafted from the answer
    before them, three (one token, then the 2-gram matched: four proposed and taken, one more)."""
    config = EngineConfig()
    twice = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    assert translator_drafting.decoder_steps(twice, None, None, config) == 12
    assert translator_drafting.decoder_steps(twice, None, RecentOutputs(2, 4, 8192), config) == 6 + 3
    figures = printed_json(run("benchmarks.translator_drafting", "--quick", "--json"))
    assert figures["sentences"] == 16 and all(figures[f"{key}_tokens_per_step"] >= 1.0 for key in ("output", "source_and_output"))
    (tmp_path / "translator_drafting.json").write_text(json.dumps(figures))
    rendered(monkeypatch, tmp_path, "translator-drafting")


def test_translator_parts_quick_turns_each_part_off_and_translates_the_same() -> None:
    """Each part off translates as with every part on (the parts compute the same to float rounding,
    which could flip a near-tie: all 16 sentences were the same when written), timed beside it."""
    figures = printed_json(run("benchmarks.translator_parts", "--quick", "--json"))
    for work in ("translate_greedy", "translate_beam4"):
        assert figures[f"{work}_sentences_per_s"] > 0
        for part in ("ragged_encode", "source_kernel", "top_k_kernel"):
            assert figures[f"{work}_{part}_speedup"] > 0 and figures[f"{work}_{part}_same"] >= 0.9


@pytest.mark.parametrize("model", ["generator", "translator"])
def test_training_speed_quick_times_every_setting(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = printed_json(
        run(
            "benchmarks.training_speed",
            "--model",
            model,
            "--steps",
            "2",
            "--batch-size",
            "1",
            "--json",
            str(tmp_path / "training_speed.json"),
        )
    )
    assert json.loads((tmp_path / "training_speed.json").read_text()) == figures
    assert [(r["threads"], r["bf16_autocast"]) for r in figures["settings"]] == [(1, False), (1, True), (2, False), (2, True)]
    baseline = figures["settings"][0]["seconds_per_step"]
    for row in figures["settings"]:
        assert row["seconds_per_step"] > 0 and row["target_tokens_per_s"] > 0
        # The speed-up is rounded to 2 decimals from unrounded times (0.005), the times to 4 (0.00005 s each).
        ratio = baseline / row["seconds_per_step"]
        assert abs(row["speedup_vs_1_thread_float32"] - ratio) <= ratio * (0.00005 / baseline + 0.00005 / row["seconds_per_step"]) + 0.005
    rendered(monkeypatch, tmp_path, "training-speed")


def test_report_check_finds_every_page_up_to_date() -> None:
    assert run("benchmarks.report", "--check").stdout == ""
