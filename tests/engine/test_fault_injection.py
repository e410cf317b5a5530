"""The fault-injecting runner: armed steps fail or stall, then the wrapped runner's steps go on."""

import threading
from pathlib import Path

from loading.checkpoint import DEFAULT_GENERATOR, DEFAULT_TRANSLATOR
from service.engine.config import EngineConfig
from service.engine.core import ModelInfo
from service.engine.engine import Engine, StepOutput
from service.engine.faults import FaultInjectingRunner
from service.engine.request import GenerationParams, Request
from tests.engine.helpers import FakeRunner


def test_an_armed_error_fails_one_step_and_the_next_request_is_served_by_the_wrapped_runner() -> None:
    faults = FaultInjectingRunner(FakeRunner())
    engine = Engine(faults, EngineConfig(n_slots=2))
    faults.arm("error", steps=1)
    engine.add_request(Request("failed", [10, 2], GenerationParams(max_tokens=5)))
    output = engine.step()
    assert isinstance(output.error, RuntimeError) and str(output.error) == "injected fault"
    assert [(d.request_id, d.finish_reason) for d in output.deltas] == [("failed", "error")]
    engine.add_request(Request("served", [10, 2], GenerationParams(max_tokens=5)))
    tokens = [t for _ in range(3) for d in engine.step().deltas for t in d.token_ids]
    assert tokens == [11, 12] and not engine.has_work  # 11, 12, then eos: what FakeRunner makes


def test_a_stall_forever_wedges_the_step_and_a_timed_stall_then_serves() -> None:
    wedged = FaultInjectingRunner(FakeRunner())
    wedged.arm("stall", steps=1, stall_s=None)  # the step never returns: it waits on an event never set
    engine = Engine(wedged, EngineConfig(n_slots=2))
    engine.add_request(Request("stalled", [10, 2], GenerationParams(max_tokens=5)))
    stepping = threading.Thread(target=engine.step, daemon=True)
    stepping.start()
    stepping.join(timeout=0.5)
    assert stepping.is_alive()

    paused = FaultInjectingRunner(FakeRunner())
    paused.arm("stall", steps=1, stall_s=0.01)
    engine = Engine(paused, EngineConfig(n_slots=2))
    engine.add_request(Request("paused", [10, 2], GenerationParams(max_tokens=5)))
    output = engine.step()
    assert output.error is None and [t for d in output.deltas for t in d.token_ids] == [11]


def test_a_stall_until_a_file_exists_holds_the_step_until_the_file_is_written(tmp_path: Path) -> None:
    release = tmp_path / "release"
    held = FaultInjectingRunner(FakeRunner())
    held.arm("stall", steps=1, release_file=release)
    engine = Engine(held, EngineConfig(n_slots=2))
    engine.add_request(Request("held", [10, 2], GenerationParams(max_tokens=5)))
    outputs: list[StepOutput] = []
    stepping = threading.Thread(target=lambda: outputs.append(engine.step()), daemon=True)
    stepping.start()
    stepping.join(timeout=0.5)
    assert stepping.is_alive() and not outputs  # held: the file is not there
    release.touch()
    stepping.join(timeout=60)
    assert not stepping.is_alive() and [t for d in outputs[0].deltas for t in d.token_ids] == [11]


def test_the_replica_encodes_prompts_as_the_engines_runner_with_or_without_faults() -> None:
    """core.ModelInfo (what the engine's process tells its replica) reads a generator's prompt (bos
    or not) and a translator's source (ending with eos) as the runner does, through a
    FaultInjectingRunner too."""
    texts = ["ROMEO:\n", "A man rides a bike.", ""]
    for checkpoint in (DEFAULT_GENERATOR, DEFAULT_TRANSLATOR):
        engine = Engine.from_checkpoint(checkpoint, EngineConfig(n_slots=2))
        for runner in (engine.runner, FaultInjectingRunner(engine.runner)):
            info = ModelInfo.of(runner, 2)  # type: ignore[arg-type]
            assert [info.encode_prompt(t) for t in texts] == [engine.runner.encode_prompt(t) for t in texts], checkpoint
