"""The compiled decode step (service/engine/compiled_decode.py) computes what the eager step
computes: logits within 1e-4 at batch 1 and at batch sizes of the shared dynamic graph, with key
blocks padded or not, and greedy answers equal to the plain engine's, for a generator and for the
translator (whose rows read their sources in place, beams sharing one); a trained folder's answers
with speculation on equal to transformers'; a step that would need a new graph runs eagerly
instead of compiling."""

from pathlib import Path

import pytest
import torch
from torch._dynamo.symbolic_convert import TensorifyState
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding.sampling_params import GREEDY
from exports.gguf import export_gguf
from loading.checkpoint import DEFAULT_TRANSLATOR, load_checkpoint
from loading.gguf_load import load_gguf
from loading.tokenizer import TextTokenizer
from model.block_quant import set_activation_bits
from model.config import GeneratorConfig
from model.generator import Generator
from model.kv_cache import PagedKVCache, ragged_step
from model.packed_linear import pack_linear_layers, packing_available
from model.translator import Translator
from service.engine.compile_cache import CompileCache
from service.engine.compiled_decode import CompiledDecode, size_buckets
from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepReport
from service.engine.request import GenerationParams, Request
from service.engine.runner import GeneratorRunner, TranslatorRunner
from tests.engine.helpers import assert_equal_up_to_a_tie, run
from tests.hf_folders import build_llama_folder

pytestmark = pytest.mark.skipif(not packing_available(), reason="the packed (oneDNN) products are what the compiled graph calls")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Generator, TextTokenizer]:
    folder = build_llama_folder(tmp_path_factory.mktemp("llama"), max_positions=128)  # fewer than the warm-up's 256 keys
    model, tokenizer = load_checkpoint(folder)
    assert isinstance(model, Generator)
    pack_linear_layers(model)  # as Engine.from_checkpoint does on the CPU
    return model, tokenizer


def assert_the_same_answers(
    model: Generator, prompts: dict[str, list[int]], got: dict[str, list[int]], expected: dict[str, list[int]]
) -> None:
    """Each request's tokens (by id, after prompts[id]) equal the expected ones, or leave them at a
    near-tie: where they first part, the model's logits after the common prefix within 1e-4."""
    assert got.keys() == expected.keys()
    for request_id, tokens in got.items():

        def logits_after(prefix: list[int], prompt: list[int] = prompts[request_id]) -> torch.Tensor:
            return model(torch.tensor([prompt + prefix]))[0, -1]

        assert_equal_up_to_a_tie(tokens, expected[request_id], logits_after, 1e-4)


@pytest.fixture(scope="module")
def runner(llama: tuple[Generator, TextTokenizer]) -> GeneratorRunner:
    """A runner whose both graphs (batch 1 and the shared one) are compiled, and which runs every
    size 1-4 compiled, whatever the timings said. Its warm-up timed one size per bucket (3 and 4
    share 4's), and kept the buckets where compiled was faster."""
    model, tokenizer = llama
    counters.clear()
    runner = GeneratorRunner(model, tokenizer, EngineConfig(n_slots=4, compiled_decode=(1, 2, 3, 4)))
    assert runner.compiled is not None
    assert not counters["graph_break"], f"the decode step is not one graph: {dict(counters['graph_break'])}"
    timings = runner.compiled.timings
    assert set(timings) == {1, 2, 4} and all(eager > 0 and fast > 0 for eager, fast in timings.values())
    won = {size for size, (eager, fast) in timings.items() if fast < eager}
    assert runner.compiled.batch_sizes == {size for size in (1, 2, 3, 4) if (4 if size == 3 else size) in won}
    runner.compiled.batch_sizes = frozenset({1, 2, 3, 4})
    return runner


@pytest.fixture
def compiled(runner: GeneratorRunner, monkeypatch: pytest.MonkeyPatch) -> CompiledDecode:
    """The runner's compiled steps, failing where a step would not run a compiled graph (so that
    no test below passes by running the eager step)."""
    assert runner.compiled is not None
    monkeypatch.setattr(runner.compiled, "stance", "fail_on_recompile")
    return runner.compiled


@torch.inference_mode()
@pytest.mark.parametrize(("batch", "length"), [(1, 5), (1, 70), (3, 5), (3, 70), (4, 33)])
def test_the_compiled_step_computes_the_eager_steps_logits(compiled: CompiledDecode, batch: int, length: int) -> None:
    """length 5: one key block, padded to two inside the compiled step; 70: five blocks."""
    torch.manual_seed(batch * 1000 + length)
    cache, block_size = compiled.cache, compiled.cache.block_size
    for pool in cache.keys + cache.values:
        pool.normal_()  # keys and values of earlier tokens, as a prefill would have written them
    blocks = -(-length // block_size)
    tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(batch)]
    positions_list = [length - 1 - b for b in range(batch)]  # rows of different lengths
    step = ragged_step([1] * batch, positions_list, tables, block_size, torch.device("cpu"))
    ids = torch.randint(0, compiled.model.config.vocab_size, (batch,))
    positions = torch.tensor(positions_list)
    fast = compiled(ids, positions_list, tables)
    assert fast is not None
    rows = torch.arange(batch)
    eager = compiled.model.forward_ragged(ids, positions, cache.layers(step), rows)  # writes the same keys again
    assert fast.shape == eager.shape == (batch, compiled.model.config.vocab_size)
    torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_compiled_steps_of_two_models_in_one_process_each_compute_their_eager_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A RoPE and an ALiBi model compiled one after the other: each runs its own graphs (their
    guards no longer check the models' modules), and ALiBi's biased mask, which the compiled step
    makes from each row's length inside its graph, is the one ragged_step makes."""
    block_size, batch, length = 16, 3, 40
    blocks = -(-length // block_size)
    tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(batch)]
    positions_list = [length - 1 - 7 * b for b in range(batch)]  # rows of different lengths
    steps = []
    for positions in ("rope", "alibi"):
        config = GeneratorConfig.from_dict({**GeneratorConfig.preset("tiny").to_dict(), "positions": positions})
        model = Generator(config).eval()
        pack_linear_layers(model)
        cache = PagedKVCache(config.n_layers, 16, block_size, config.kv_heads, config.head_dim, torch.device("cpu"), torch.float32)
        compiled = CompiledDecode(model, cache, [batch])
        compiled.batch_sizes = frozenset({batch})  # whatever the timings said
        monkeypatch.setattr(compiled, "stance", "fail_on_recompile")
        steps.append(compiled)
    torch.manual_seed(0)
    for compiled in steps:
        model, cache = compiled.model, compiled.cache
        assert isinstance(model, Generator)
        for pool in cache.keys + cache.values:
            pool.normal_()
        ids = torch.randint(0, model.config.vocab_size, (batch,))
        fast = compiled(ids, positions_list, tables)
        assert fast is not None
        step = ragged_step([1] * batch, positions_list, tables, block_size, torch.device("cpu"), model.positions.alibi_slopes)
        eager = model.forward_ragged(ids, torch.tensor(positions_list), cache.layers(step), torch.arange(batch))
        torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("activation_bits", [8, 32])
def test_a_gguf_models_compiled_step_computes_its_eager_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, activation_bits: int
) -> None:
    """Weights kept in GGUF blocks (Q4_1; q, k and v of one type, stacked): the block kernels are
    operations of the one graph (no graph break), and its logits are the eager step's."""
    path = export_gguf(build_llama_folder(tmp_path / "llama", max_positions=128), tmp_path / "llama.gguf", "Q4_1")
    model, _ = load_gguf(path)
    assert set_activation_bits(model, activation_bits) > 0
    pack_linear_layers(model)
    assert_the_compiled_step_computes_the_eager_logits(model, monkeypatch)


@torch.inference_mode()
def test_an_int8_models_compiled_step_computes_its_eager_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear layers quantized to int8 at load (model/quantize.py, the weights Engine.from_checkpoint
    takes as "int8"): their kernel is an operation of the one graph, and its logits are the eager step's."""
    model, _ = load_checkpoint(build_llama_folder(tmp_path / "llama", max_positions=128), "cpu", "int8")
    assert isinstance(model, Generator)
    assert_the_compiled_step_computes_the_eager_logits(model, monkeypatch)


def assert_the_compiled_step_computes_the_eager_logits(model: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """model's decode step compiled at batch 1 and 3 as one graph (no graph break), its logits
    within 1e-4 of the eager step's over keys and values of earlier tokens in 3 blocks."""
    block_size, batch, length = 16, 3, 40
    config = model.config
    cache = PagedKVCache(config.n_layers, 16, block_size, config.kv_heads, config.head_dim, torch.device("cpu"), torch.float32)
    counters.clear()
    compiled = CompiledDecode(model, cache, [1, batch])
    assert not counters["graph_break"], f"the decode step is not one graph: {dict(counters['graph_break'])}"
    compiled.batch_sizes = frozenset({1, batch})  # whatever the timings said
    monkeypatch.setattr(compiled, "stance", "fail_on_recompile")
    torch.manual_seed(0)
    for pool in cache.keys + cache.values:
        pool.normal_()
    for rows in (1, batch):
        blocks = -(-length // block_size)
        tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(rows)]
        positions_list = [length - 1 - 7 * b for b in range(rows)]
        ids = torch.randint(0, config.vocab_size, (rows,))
        fast = compiled(ids, positions_list, tables)
        assert fast is not None
        step = ragged_step([1] * rows, positions_list, tables, block_size, torch.device("cpu"))
        eager = model.forward_ragged(ids, torch.tensor(positions_list), cache.layers(step), torch.arange(rows))
        torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_a_step_that_needs_a_new_graph_runs_eagerly(runner: GeneratorRunner) -> None:
    """Under the stance steps run with (eager_on_recompile) no call compiles: int32 ids where the
    graphs took int64 ones fail their guards and the step runs eagerly, with the same logits."""
    compiled = runner.compiled
    assert compiled is not None and compiled.stance == "eager_on_recompile"
    graphs = counters["stats"]["unique_graphs"]
    positions, tables = [20, 30], [[1, 2], [3, 4]]
    ids = torch.tensor([5, 6], dtype=torch.int32)
    compiled.stance = "fail_on_recompile"  # what the other tests run under: this step would fail there
    with pytest.raises(RuntimeError, match="recompile"):
        compiled(ids, positions, tables)
    del compiled.stance  # back to the class's
    logits = compiled(ids, positions, tables)
    assert counters["stats"]["unique_graphs"] == graphs, "a request paid for a compilation"
    assert logits is not None
    step = ragged_step([1, 1], positions, tables, compiled.cache.block_size, torch.device("cpu"))
    eager = compiled.model.forward_ragged(ids.long(), torch.tensor(positions), compiled.cache.layers(step), torch.arange(2))
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_an_engine_with_compiled_decodes_answers_as_the_plain_engine(
    llama: tuple[Generator, TextTokenizer], runner: GeneratorRunner, compiled: CompiledDecode
) -> None:
    model, tokenizer = llama
    config = EngineConfig(n_slots=4, num_speculative_tokens=0)  # every step after a prompt a decode-only one
    plain = Engine(GeneratorRunner(model, tokenizer, config), config)
    fast = Engine(runner, config)  # every decode-only step through a compiled graph (or failing)
    texts = ["You are all resolved rather to die than to famish?", "Let us kill him", "O", "We are accounted poor citizens"]
    params = GenerationParams(max_tokens=20, sampling=GREEDY)

    def arrivals(engine: Engine) -> dict[int, list[Request]]:
        return {i: [Request(str(i), engine.runner.encode_prompt(t), params)] for i, t in enumerate(texts)}  # batches of 1 to 4

    expected, got = run(plain, arrivals(plain)), run(fast, arrivals(fast))
    assert_the_same_answers(model, {str(i): plain.runner.encode_prompt(t) for i, t in enumerate(texts)}, got, expected)


def test_speculations_verification_steps_run_compiled_and_answer_as_the_plain_engine(
    llama: tuple[Generator, TextTokenizer], runner: GeneratorRunner, compiled: CompiledDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that only verifies drafts is a decode step of a row per token (each row's key written
    before any row attends, so a draft's row sees the rows before it): it runs the compiled graph
    at its number of rows, and the answers are the plain engine's (no speculation, eager)."""
    model, tokenizer = llama
    plain_config = EngineConfig(n_slots=4, num_speculative_tokens=0)
    plain = Engine(GeneratorRunner(model, tokenizer, plain_config), plain_config)
    config = EngineConfig(n_slots=4, num_speculative_tokens=3)  # a request's verification: up to 4 rows, compiled sizes 1-4
    fast = Engine(runner, config)
    reports: list[StepReport] = []
    fast.on_step = reports.append
    verified: list[int] = []  # rows of each compiled step whose rows share a block table: a verification
    call = CompiledDecode.__call__

    def recorded(self: CompiledDecode, ids: torch.Tensor, positions: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        logits = call(self, ids, positions, tables)
        if logits is not None and len({tuple(t) for t in tables}) < len(tables):
            verified.append(len(tables))
        return logits

    monkeypatch.setattr(CompiledDecode, "__call__", recorded)
    texts = ["Let us kill him", "O", "We are accounted poor citizens"]
    params = GenerationParams(max_tokens=30, sampling=GREEDY)

    def arrivals(engine: Engine) -> dict[int, list[Request]]:
        return {20 * i: [Request(str(i), engine.runner.encode_prompt(t), params)] for i, t in enumerate(texts)}  # one at a time

    expected, got = run(plain, arrivals(plain)), run(fast, arrivals(fast))
    assert verified and max(verified) > 1  # random weights' answers repeat themselves: their drafts are verified
    assert {r.compiled_batch_sizes for r in reports} == {4}  # the sizes running compiled, in every step's report
    compiled.ready.clear()  # as while a background compile runs
    fast.report_idle()
    compiled.ready.set()
    assert reports[-1].compiled_batch_sizes == -1
    assert_the_same_answers(model, {str(i): plain.runner.encode_prompt(t) for i, t in enumerate(texts)}, got, expected)


@torch.inference_mode()
def test_a_background_compile_serves_eagerly_meanwhile_and_keeps_its_artifacts(
    llama: tuple[Generator, TextTokenizer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_in_background: the engine answers from the start (eagerly while the graphs compile,
    on another thread), the same as without; once ready, the timed sizes run compiled where they
    won, and the compile cache holds the artifacts for the next start (one entry, which loads)."""
    monkeypatch.setenv("TRANSFORMER_SERVING_CACHE", str(tmp_path))
    model, tokenizer = llama
    plain_config = EngineConfig(n_slots=4, num_speculative_tokens=0)
    config = EngineConfig(n_slots=4, num_speculative_tokens=0, compiled_decode=(1, 2), compile_in_background=True)
    plain = Engine(GeneratorRunner(model, tokenizer, plain_config), plain_config)
    background = Engine(GeneratorRunner(model, tokenizer, config), config)
    params = GenerationParams(max_tokens=12, sampling=GREEDY)

    prompts = {"a": plain.runner.encode_prompt("Let us kill him"), "b": [5, 9, 13]}

    def arrivals() -> dict[int, list[Request]]:
        return {0: [Request("a", prompts["a"], params)], 2: [Request("b", prompts["b"], params)]}

    expected, got = run(plain, arrivals()), run(background, arrivals())
    assert_the_same_answers(model, prompts, got, expected)  # eager or compiled steps: within 1e-4
    compiled = background.runner.compiled
    assert isinstance(compiled, CompiledDecode) and compiled.ready.wait(timeout=900)  # a bound on a broken compile, not a speed
    assert set(compiled.timings) == {1, 2}
    assert compiled.batch_sizes == {size for size, (eager, fast) in compiled.timings.items() if fast < eager}
    (entry,) = (tmp_path / "torch-compile").glob("*.bin")
    assert CompileCache(entry.parent).load(entry.stem)


def test_a_warm_up_times_the_largest_size_of_each_power_of_two_bucket() -> None:
    assert size_buckets(list(range(1, 18))) == {
        1: [1],
        2: [2],
        4: [3, 4],
        8: [5, 6, 7, 8],
        16: list(range(9, 17)),
        17: [17],
    }
    assert size_buckets([1, 4, 48]) == {1: [1], 4: [4], 48: [48]}  # sizes named one by one are each timed
    assert size_buckets([5, 6]) == {6: [5, 6]}


def test_a_warm_up_traces_each_graph_once(llama: tuple[Generator, TextTokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's floats are constants of its graphs (DYNAMO_CONFIG): dynamo does not trace them as
    symbols, then trace the whole step again to specialize them, which doubled a start's compile time."""
    specialized: list[str] = []
    specialize = TensorifyState.specialize  # bound to the class

    def recorded(cls: type, name: str) -> None:
        specialized.append(name)
        specialize(name)

    monkeypatch.setattr(TensorifyState, "specialize", classmethod(recorded))
    model, tokenizer = llama
    runner = GeneratorRunner(model, tokenizer, EngineConfig(n_slots=2, compiled_decode=(1, 2), compile_cache=False))
    assert runner.compiled is not None and set(runner.compiled.timings) == {1, 2}  # both graphs compiled
    assert specialized == []


def test_compiled_batch_sizes_are_within_a_decode_steps_rows() -> None:
    """A row per sequence, or per token a verification computes (1 + 4 for each of 4 sequences)."""
    with pytest.raises(ValueError, match="compiled_decode"):
        EngineConfig(n_slots=4, num_speculative_tokens=0, compiled_decode=(1, 8))
    assert EngineConfig(n_slots=4, compiled_decode=(1, 20)).max_decode_rows == 20
    with pytest.raises(ValueError, match="compiled_decode"):
        EngineConfig(n_slots=4, compiled_decode=(1, 21))


def test_a_runner_compiles_only_what_the_config_names(tmp_path: Path) -> None:
    model, tokenizer = load_checkpoint(build_llama_folder(tmp_path / "llama"))
    assert isinstance(model, Generator)
    assert GeneratorRunner(model, tokenizer, EngineConfig(n_slots=4)).compiled is None
    assert GeneratorRunner(model, tokenizer, EngineConfig(n_slots=4, compiled_decode=(1,)), fixed_shape_decode=True).compiled is None


@pytest.fixture(scope="module")
def translator_runner() -> TranslatorRunner:
    """The shipped translator's runner with both graphs compiled, running every size 1-8 compiled."""
    model, tokenizer = load_checkpoint(DEFAULT_TRANSLATOR)
    assert isinstance(model, Translator)
    pack_linear_layers(model)
    counters.clear()
    runner = TranslatorRunner(model, tokenizer, n_slots=8, config=EngineConfig(n_slots=8, compiled_decode=(1, 2)))
    if runner.compiled is None:
        pytest.skip("the CPU attention kernel, which a compiled translator step reads its sources through, is off")
    assert not counters["graph_break"], f"the decoder step is not one graph: {dict(counters['graph_break'])}"
    runner.compiled.batch_sizes = frozenset(range(1, 9))
    return runner


@torch.inference_mode()
@pytest.mark.parametrize(("batch", "length"), [(1, 3), (5, 3), (5, 40)])
def test_the_compiled_translator_step_computes_the_eager_steps_logits(
    translator_runner: TranslatorRunner, monkeypatch: pytest.MonkeyPatch, batch: int, length: int
) -> None:
    """Rows 0-3 are one sentence's beams (they read slot 0's source), row 4 another sentence's."""
    compiled, cross = translator_runner.compiled, translator_runner.cross_cache
    assert compiled is not None
    monkeypatch.setattr(compiled, "stance", "fail_on_recompile")
    torch.manual_seed(batch * 1000 + length)
    cache, block_size = compiled.cache, compiled.cache.block_size
    for pool in cache.keys + cache.values + cross.keys + cross.values:
        pool.normal_()
    cross.src_valid[:] = torch.arange(cross.length)[None] < torch.tensor([11, 0, 0, 0, 0, 7, 0, 0])[:, None]
    blocks = -(-length // block_size)
    tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(batch)]
    positions_list = [max(length - 1 - b, 0) for b in range(batch)]
    step = ragged_step([1] * batch, positions_list, tables, block_size, torch.device("cpu"))
    sources = cross.sources([0, 0, 0, 0, 5][:batch])
    ids = torch.randint(0, compiled.model.config.vocab_size, (batch,))
    positions = torch.tensor(positions_list)
    fast = compiled(ids, positions_list, tables, sources)
    assert fast is not None
    model = translator_runner.model
    eager = model.decode(ids[:, None], cross.bound(*sources), None, positions[:, None], cache.layers(step))[:, -1]
    assert fast.shape == eager.shape == (batch, model.config.vocab_size)
    torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_an_engine_with_a_compiled_translator_step_translates_as_the_plain_engine(
    translator_runner: TranslatorRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert translator_runner.compiled is not None
    monkeypatch.setattr(translator_runner.compiled, "stance", "fail_on_recompile")
    model, tokenizer = translator_runner.model, translator_runner.tokenizer
    config = EngineConfig(n_slots=8)
    plain = Engine(TranslatorRunner(model, tokenizer, n_slots=8), config)
    fast = Engine(translator_runner, config)  # every decoder step through a compiled graph (or failing)
    texts = ["A man rides a bike.", "Two dogs play in the snow.", "A girl reads a book.", "People walk down a busy street."]
    params = GenerationParams(sampling=GREEDY)

    def arrivals(engine: Engine) -> dict[int, list[Request]]:
        return {i: [Request(str(i), engine.runner.encode_prompt(t), params)] for i, t in enumerate(texts)}  # 1 to 4 rows

    expected, got = run(plain, arrivals(plain)), run(fast, arrivals(fast))
    assert got.keys() == expected.keys()
    for request_id, tokens in got.items():
        source = torch.tensor([plain.runner.encode_prompt(texts[int(request_id)])])

        def logits_after(prefix: list[int], source: torch.Tensor = source) -> torch.Tensor:
            return model(source, torch.tensor([[model.config.start_id, *prefix]]))[0, -1]

        assert_equal_up_to_a_tie(tokens, expected[request_id], logits_after, 1e-4)


CHAT_TOOLS = Path(__file__).parents[2] / "evals" / "chat_tools" / "model"  # trained by this project (evals/chat_tools)


@torch.inference_mode()
def test_a_trained_folder_answers_as_transformers_with_speculation_and_compiled_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trained model's greedy answers, with prompt-lookup speculation and every decode step
    (verifications included) through the compiled graph, equal transformers' generate() on the
    same folder, up to a tie of its logits. The trained model copies from its prompts (tool
    calls' arguments), so drafts are proposed and accepted: the test asserts they were."""
    tokenizer = AutoTokenizer.from_pretrained(CHAT_TOOLS)
    hf = AutoModelForCausalLM.from_pretrained(CHAT_TOOLS).eval()
    config = EngineConfig(n_slots=1, num_speculative_tokens=3, compiled_decode=(1, 2, 3, 4))
    engine = Engine.from_checkpoint(CHAT_TOOLS, config)
    assert isinstance(engine.runner, GeneratorRunner) and engine.runner.compiled is not None
    engine.runner.compiled.batch_sizes = frozenset({1, 2, 3, 4})  # whatever the start's timings said
    monkeypatch.setattr(engine.runner.compiled, "stance", "fail_on_recompile")
    ran: list[int] = []
    call = CompiledDecode.__call__

    def recorded(self: CompiledDecode, ids: torch.Tensor, positions: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        logits = call(self, ids, positions, tables)
        if logits is not None:
            ran.append(len(tables))
        return logits

    monkeypatch.setattr(CompiledDecode, "__call__", recorded)
    reports: list[StepReport] = []
    engine.on_step = reports.append
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    questions = ["What is the weather in Paris?", "Is it raining in San Francisco today?", "Repeat after me: the cat sat on the mat."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=[tool], add_generation_prompt=True, return_dict=False)
        for q in questions
    ]
    params = GenerationParams(max_tokens=40, sampling=GREEDY)
    got = run(engine, {30 * i: [Request(str(i), p, params)] for i, p in enumerate(prompts)})  # one at a time
    eos = set(engine.runner.eos_ids)
    for i, prompt in enumerate(prompts):
        theirs = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :].tolist()
        if theirs and theirs[-1] in eos:
            theirs.pop()  # the eos that ended it: the engine streams no token for it

        def logits_after(prefix: list[int], prompt: list[int] = prompt) -> torch.Tensor:
            return hf(torch.tensor([prompt + prefix])).logits[0, -1]

        assert_equal_up_to_a_tie(got[str(i)], theirs, logits_after, 1e-4)
    assert sum(r.draft_tokens for r in reports) > 0 and sum(sum(r.accepted_per_position) for r in reports) > 0
    assert max(ran) > 1  # verification steps (a row per token) ran compiled
