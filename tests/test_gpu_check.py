"""The GPU check (benchmarks/gpu.py) runs where the GPU machine's packages are the only ones: its
CPU tier, with Ray, FastAPI, pydantic, starlette and ctranslate2 made unimportable, prints one JSON
object with every key the check reports."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_THE_GPU_MACHINE = ["ray", "fastapi", "pydantic", "starlette", "ctranslate2"]
REQUIRED_KEYS = {
    *(f"gen_tok_s_{n}" for n in (1, 16, 64, 256)),
    *(f"gen_vs_transformers_{n}" for n in (1, 16, 64, 256)),
    "translate_greedy_sent_s",
    "translate_beam4_sent_s",
    "translate_greedy_vs_transformers",
    "translate_beam4_vs_transformers",
    "decode_step_vs_bandwidth_floor",
    "bf16_agreement",
    "bf16_bleu_delta",
    "cuda_graph_equal",
    "engine_equals_recomputation",
    "peak_memory_bytes",
    "peak_memory_kind",
    "tests",
}


def test_the_cpu_quick_tier_prints_every_key_without_the_serving_packages(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    argv = ["benchmarks.gpu", "--device", "cpu", "--quick", "--json", "--out", str(out)]
    probe = (
        f"import runpy, sys\nfor name in {ABSENT_ON_THE_GPU_MACHINE!r}:\n    sys.modules[name] = None  # import fails\n"
        f"sys.argv = {argv!r}\nrunpy.run_module('benchmarks.gpu', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) >= REQUIRED_KEYS, REQUIRED_KEYS - set(report)
    assert report["device"] == "cpu" and report["tests"] == "skipped (--quick)"
    assert report["engine_equals_recomputation"] is True and report["cuda_graph_equal"] is True
    assert 0.0 <= report["bf16_agreement"] <= 1.0 and report["peak_memory_bytes"] > 0
    assert json.loads(out.read_text()) == report
    assert "cuda_graph_equal" in out.with_suffix(".md").read_text()
