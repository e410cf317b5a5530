import os
from collections import Counter

import pytest
import torch

try:
    from service.config import LOCAL_RAY_ENVIRONMENT, RAY_ENVIRONMENT
except ImportError:  # no pydantic, hence no Ray either: the GPU check runs tests/model and tests/engine only
    LOCAL_RAY_ENVIRONMENT = RAY_ENVIRONMENT = {}

# Before anything imports Ray (Serve reads its settings when imported): the tests' own Ray listens
# on 127.0.0.1 only and runs as `python -m service` runs it (service/config.py).
os.environ.update(LOCAL_RAY_ENVIRONMENT | RAY_ENVIRONMENT)
# One intra-op thread, as a Serve replica runs (Ray sets OMP_NUM_THREADS to its num_cpus): on a
# busy 2-core machine, two threads that wait for each other at every operation ran the engine's
# checkpoint tests 50 times slower (70 s instead of 1.5 s).
torch.set_num_threads(1)

# The full tier only (`make test-all`; `make test` deselects the marker `slow`), by node id prefix,
# with why; measured with `pytest --durations=0` on a 2-core machine. `make test` keeps the unit,
# API and engine tests and one real Serve app (tests/service/test_smoke.py).
FULL_TIER = {
    "tests/cluster/": "two-node Ray clusters (LONG_TIER)",
    "tests/engine/test_compiled_decode.py": "torch.compile of the decode step (about a minute of compilation)",
    "tests/service/test_soak.py": "a 1-minute soak (LONG_TIER: the 5-minute one)",
    "tests/service/test_faults.py": "a second Serve app whose replicas fail, stall and are killed (2 minutes)",
    "tests/service/test_overload.py": "bursts of 3x capacity",
    "tests/service/test_schema_fuzz.py": "schema fuzzing",
    "tests/service/test_locust_smoke.py": "Locust runs",
    "tests/service/test_metrics.py": "Prometheus and Ray's metrics",
    "tests/service/test_playground.py": "the browser, and attention through the real app",
    "tests/service/test_http.py": "the real app's routes one by one (tests/api covers them in-process)",
    "tests/service/test_real_text.py": "real paragraphs through the real app",
    "tests/service/test_security.py": "keyed apps beside the session's",
    "tests/service/test_weight_types.py": "an app per weight type",
    "tests/service/test_logprobs.py": "logprobs through the real app against the model offline",
    "tests/service/test_lm_eval.py": "lm-evaluation-harness's client scoring a task through the real app (20 s)",
    "tests/service/test_own_models.py": "python -m service on Hugging Face folders built in the test, its own Ray (1-2 minutes)",
    "tests/service/test_gguf_service.py": "python -m service on a GGUF file and a folder quantized at load, its own Ray (1 minute)",
    "tests/service/test_structured_outputs.py": "python -m service on three Llama-family folders, its own Ray; the hostile corpus (90 s)",
    "tests/service/test_tool_formats.py": "python -m service on four Llama folders, one per tool-call format's template, its own Ray",
    "tests/test_benchmarks_run.py": "every benchmark command the README lists, in its quickest form (3.5 minutes)",
    "tests/api/test_memory.py": "12,000 requests: a soak in-process (30 s)",
    "tests/api/test_security.py::test_the_playground_sends_the_key_it_is_given": "the browser",
    "tests/api/test_playground_chat.py": "the browser",
    "tests/model/test_kernels_asan.py": "the C kernels built with AddressSanitizer (LONG_TIER)",
    "tests/model/test_quantize.py::test_int8_translator_keeps_greedy_bleu_within": "BLEU on test_2016 twice (25 s)",
    "tests/model/test_quantize.py::test_int8_generator_keeps_nats_per_char_within": "a quarter of the validation split twice (30 s)",
    "tests/model/test_export.py::test_peers_benchmark_translates_alike_in_every_system": "exports and runs every peer system (1 minute)",
}


# The scenarios that run for minutes on end or wait on a cluster's autoscaler and rollouts, whose time
# on a loaded 2-core machine swung from 15 to 25 minutes between runs, and the AddressSanitizer build:
# `make test-long` runs them (before a change to the C kernels, the service's draining, retries,
# autoscaling or deploy configs lands, and before a release), `make test` and `make test-all` leave
# them out (marker `long`), keeping CI under 40 minutes. RELIABILITY.md's T8: a soak short in CI,
# long by hand.
LONG_TIER = {
    "tests/cluster/test_cluster.py": "a two-node cluster: placement, token authentication, autoscaling out and back in under load,"
    " the replicas panel in Prometheus, a rollout with a held stream, the image's GPU config (10-20 minutes)",
    "tests/cluster/test_node_loss.py": "a second two-node cluster, its worker node killed under load (4-6 minutes)",
    "tests/service/test_soak.py::test_soak_with_cancelled_streams_leaks_nothing[5-minutes]": "the 5-minute soak, memory included",
    "tests/model/test_kernels_asan.py": "the C kernels built with AddressSanitizer and their tests run under it (2.5 minutes)",
}


# Benchmark commands whose quickest form still measures for minutes: `make test-benchmarks` runs
# them (before a change to a benchmark lands), `make test` and `make test-all` leave them out
# (marker `benchmarks`), keeping CI under 40 minutes on a slow 2-core machine.
BENCHMARK_TIER = {
    "tests/test_benchmarks_run.py::test_peers_quick_on_the_shipped_checkpoints": "every peer system on the shipped models (2-4 minutes)",
    "tests/test_benchmarks_run.py::test_peers_quick_on_hugging_face_folders": "every peer system on Hugging Face folders (1.5 minutes)",
    "tests/test_benchmarks_run.py::test_serving_quick_serves_the_default_models": "the default service in and out of process (2 minutes)",
    "tests/test_benchmarks_run.py::test_front_door_quick_measures_refusals": "Apache's ab against the front door (1.5 minutes)",
    "tests/test_benchmarks_run.py::test_training_speed_quick_times_every_setting[generator]": "four settings of training (1.5 minutes)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="where the tests taking the `device` fixture run their models: cpu or cuda")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device here")


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """The device of --device (default cpu): exactness tests run their models there."""
    return str(request.config.getoption("--device"))


# Two pytest workers (pytest-xdist, `-n 2`: the Makefile) share the 2 cores: each test runs
# in-process on one torch thread, and many wait on Ray, replicas or a soak's clock. A group runs on
# one worker, so what a group's tests share is set up once: the session's Serve app
# (tests/service/conftest.py), the two-node clusters (one at a time), each other module's fixtures.
# Groups start longest first (durations measured on a 2-core machine), the rest in file order.
SESSION_APP = "tests/service/"  # its modules that start their own service are module groups
OWN_SERVICE = (
    "tests/service/test_own_models.py",
    "tests/service/test_gguf_service.py",
    "tests/service/test_structured_outputs.py",
    "tests/service/test_tool_formats.py",
)
LONGEST_FIRST = (
    "session-app",  # about 750 s: the soak, metrics, faults, lm-eval, Locust, fuzzing
    "cluster",  # make test-long only: 15-25 minutes
    "tests/test_benchmarks_run.py",  # about 340 s
    "tests/model/test_quantize.py",
    "tests/engine/test_compiled_decode.py",
    "tests/service/test_own_models.py",
)


def group_of(nodeid: str) -> str:
    """The group a test runs in: tests of one group run on one worker, one after another."""
    module = nodeid.split("::")[0]
    if module.startswith("tests/cluster/"):
        return "cluster"
    if module.startswith(SESSION_APP) and module not in OWN_SERVICE:
        return "session-app"
    return module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of FULL_TIER `slow`, of LONG_TIER `long` and of BENCHMARK_TIER `benchmarks`; orders the groups, longest
    first. Refuses two tests of one name: the workers would run only one of them."""
    named_twice = [nodeid for nodeid, count in Counter(item.nodeid for item in items).items() if count > 1]
    if named_twice:
        raise pytest.UsageError(f"tests named alike (give each its own id): {sorted(named_twice)}")
    for item in items:
        if item.nodeid.startswith(tuple(FULL_TIER)):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(tuple(LONG_TIER)):
            item.add_marker(pytest.mark.long)
        if item.nodeid.startswith(tuple(BENCHMARK_TIER)):
            item.add_marker(pytest.mark.benchmarks)
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: file order within


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # optional: a run without xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduler by scope, with group_of as the scope, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # the order is pytest_collection_modifyitems's
    return GroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
