"""The model deployment: one engine per replica on one device. Thin: it turns a GenerateRequest
into token ids and engine parameters, streams the engine's deltas as protocol Chunks (or one
Refusal) and reports health; limits and defaults are the engine's."""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from ray import serve

from loading.chat_template import ChatTemplateError
from loading.checkpoint import WeightType
from loading.tokenizer import TextTokenizer
from loading.tool_calls import FunctionTool, ToolCallParser, tool_call_format
from loading.tool_formats import call_id
from loading.tool_grammars import forced_call_grammar
from service.config import ModelServingConfig
from service.engine.async_engine import AsyncEngine, paced
from service.engine.config import StructuredOutput, TokenLogprob
from service.engine.core import EngineSpec
from service.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from service.engine.faults import FaultKind
from service.engine.grammar_check import closed_schema, json_options
from service.engine.inspector import AttentionInspector
from service.engine.request import Delta, GenerationParams
from service.metrics import ServingMetrics
from service.process import lower_priority, process_stats
from service.protocol import (
    AttentionMap,
    AttentionRequest,
    ChatMessage,
    Chunk,
    GenerateRequest,
    Refusal,
    TokenizeRequest,
    TokenizerInfo,
    Tokens,
    Tool,
    ToolCallPiece,
)

log = logging.getLogger("ray.serve")  # Serve writes it to the replica logs


def resolve_device(config: ModelServingConfig) -> tuple[str, WeightType]:
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if config.quantization is not None:
        return device, config.quantization
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, dtype_name)


def generation_params(request: GenerateRequest) -> GenerationParams:
    """The engine's parameters. The prompt is scored when echo comes with logprobs, or alone
    (max_tokens 0), when its token count is all the answer needs besides its text."""
    scores_prompt = request.echo and (request.logprobs is not None or request.max_tokens == 0)
    return GenerationParams(
        max_tokens=request.max_tokens,
        sampling=request.sampling,
        stop=request.stop,
        beam_size=request.beam_size,
        n_best=request.n_best,
        length_penalty=request.length_penalty,
        logprobs=request.logprobs,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        speculate=request.speculate,
        prompt_logprobs=(request.logprobs or 0) if scores_prompt else None,
        structured=request.structured,
    )


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (a tool call's arguments as an object, as transformers passes them)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def template_function(tool: Tool) -> FunctionTool:
    return FunctionTool(tool.name, tool.description, json.loads(tool.parameters))


def template_tool(tool: Tool) -> dict[str, Any]:
    return template_function(tool).as_template_tool()


def with_tool_calls(answer: Chunk, parser: ToolCallParser) -> Chunk:
    """The chunk with the text of the tool calls it writes taken out, and the pieces of those calls
    added, a call's id on its first (the last chunk also gets what the parser held back)."""
    content, pieces = parser.feed(answer.text)
    if answer.finish_reason is not None:
        rest, more = parser.close()
        content, pieces = content + rest, pieces + more
    tool_calls = tuple(ToolCallPiece(p.index, p.arguments, None if p.name is None else call_id(parser.format), p.name) for p in pieces)
    return replace(answer, text=content, tool_calls=tool_calls)


def token_text(tokenizer: TextTokenizer, scored: TokenLogprob) -> TokenLogprob:
    """A logprob with its token and alternatives as their text (OpenAI's `tokens`)."""

    def text(token: int | str) -> str:
        return token if isinstance(token, str) else tokenizer.piece_bytes(token).decode("utf-8", errors="replace")

    return TokenLogprob(text(scored.token), scored.logprob, tuple((text(t), logprob) for t, logprob in scored.top))


def chunk(delta: Delta, tokenizer: TextTokenizer, request: GenerateRequest, echo: str | None = None) -> Chunk:
    """The engine's delta as the wire's chunk; `echo`: the prompt's text, for the first chunk."""
    return Chunk(
        delta.text,
        delta.finish_reason,
        tuple(delta.alternatives or ()),
        delta.prompt_tokens,
        delta.completion_tokens,
        tuple(token_text(tokenizer, s) for s in delta.logprobs or ()),
        echo,
        tuple(token_text(tokenizer, s) for s in delta.prompt_logprobs or ()) if request.logprobs is not None else (),
        error=delta.error if delta.finish_reason == "constraint" else None,  # an internal error's text stays in the log
    )


class ModelDeployment:
    """A Serve replica holding one AsyncEngine; `generate` follows service/protocol.py."""

    def __init__(self, config: ModelServingConfig) -> None:
        self.config = config
        device, dtype = resolve_device(config)
        self.metrics = ServingMetrics(config.name)
        spec = EngineSpec(config.checkpoint, config.engine, device, dtype, config.fault_injection, config.torch_threads)
        self.engine = AsyncEngine(spec, on_step=self.metrics.record_step)  # the engine steps in a process of its own
        lower_priority(config.replica_niceness)  # below the engine's process, started at this one's
        self.model = self.engine.info
        self.inspector = AttentionInspector(config.checkpoint, device)
        blocks = self.model.kv_blocks
        log.info(
            "%s ready on %s (%s), KV cache %.1f MB (%s), context %d tokens",
            config.name, device, dtype, self.model.kv_cache_bytes / 1e6,
            f"{blocks[0]} blocks of {blocks[1]} tokens" if blocks else f"{self.model.n_slots} slots", self.model.max_len,
        )  # fmt: skip

    def _request_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's ids: as sent (checked against the vocabulary), or from its text or chat."""
        if request.prompt_ids is None:
            return self._prompt_ids(request.text, request.messages, tools=request.tools)
        vocab_size = self.model.tokenizer.vocab_size
        if any(not 0 <= i < vocab_size for i in request.prompt_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", "prompt")
        return list(request.prompt_ids)

    def _prompt_ids(
        self, text: str, messages: tuple[ChatMessage, ...] | None, add_special_tokens: bool = True, tools: tuple[Tool, ...] = ()
    ) -> list[int]:
        """A prompt's ids: text as the engine reads a prompt (with the special tokens the model's
        tokenizer adds, when add_special_tokens), or a chat (with its tools) rendered by the model's
        template (InvalidRequestError when it has none, or when it refuses the messages) and encoded as it is."""
        if messages is None:
            return self.model.encode_prompt(text) if add_special_tokens else self.model.tokenizer.encode(text)
        tokenizer = self.model.tokenizer
        if tokenizer.chat_template is None:
            raise InvalidRequestError(f"the model {self.config.name} has no chat template; use /v1/completions", "messages")
        try:
            rendered = tokenizer.render_chat([template_message(m) for m in messages], tools=[template_tool(t) for t in tools] or None)
        except ChatTemplateError as error:  # the template's own refusal (raise_exception) or error: the request's fault
            raise InvalidRequestError(str(error), "messages") from None
        return tokenizer.encode(rendered)

    def _tool_calls(self, request: GenerateRequest) -> tuple[ToolCallParser | None, StructuredOutput | None]:
        """A chat with tools: the parser of the calls in its reply, in the format the model's chat
        template asks for, and the grammar that forces a call when tool_choice asks for one."""
        if not request.tools:
            return None, request.structured
        format = tool_call_format(self.model.tokenizer.chat_template or "")
        if format is None:  # under every tool_choice, "none" too: the tools would be rendered as the template sees fit
            message = f"the model {self.config.name}'s chat template does not render tools in a tool-call format this server parses"
            raise InvalidRequestError(message + " (Hermes, Qwen3-Coder, Mistral, DeepSeek V3, Llama 3.1 JSON, pythonic)", "tools")
        if request.tool_choice == "none":
            return None, request.structured
        declared = {t.name: json.loads(t.parameters) for t in request.tools}
        if request.tool_choice == "auto" and request.tool_name is None:
            return ToolCallParser(format, declared), request.structured
        if request.structured is not None:
            raise InvalidRequestError("a forced tool call cannot also take response_format or structured_outputs", "tool_choice")
        tools = [
            FunctionTool(t.name, t.description, closed_schema(json.loads(t.parameters), t.strict))
            for t in request.tools
            if request.tool_name in (None, t.name)
        ]
        parallel = request.parallel_tool_calls and request.tool_name is None
        try:
            grammar = forced_call_grammar(format, tools, parallel, json_options(None))
        except ValueError as error:
            raise InvalidRequestError(str(error), "tools") from None
        return ToolCallParser(format, declared, stream_arguments=True), StructuredOutput("lark", grammar, "tool_choice")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Chunk | Refusal]:
        try:
            prompt_ids = self._request_ids(request)
            parser, structured = self._tool_calls(request)
            stream = await self.engine.submit(prompt_ids, replace(generation_params(request), structured=structured))
        except InvalidRequestError as error:
            self.metrics.record_failure("validation")
            yield Refusal("invalid", str(error), error.param)
            return
        except QueueFullError as error:
            self.metrics.record_failure("overloaded")
            yield Refusal("overloaded", str(error))
            return
        except EngineDeadError as error:
            self.metrics.record_failure("internal")
            yield Refusal("unavailable", str(error))
            return
        interval_s = self.config.stream_interval_ms / 1000 if request.stream else None
        tokenizer = self.model.tokenizer
        echo = (request.text if request.prompt_ids is None else tokenizer.decode(prompt_ids)) if request.echo else None
        async for delta in paced(stream, interval_s):
            answer = chunk(delta, tokenizer, request, echo)
            yield answer if parser is None else with_tool_calls(answer, parser)
            echo = None

    async def attention(self, request: AttentionRequest) -> AttentionMap | Refusal:
        """Attention weights of one input (a private model copy, off the step loop's thread)."""
        try:
            source, target, weights = await asyncio.to_thread(self.inspector.attention, request.text, request.target)
        except InvalidRequestError as error:
            return Refusal("invalid", str(error), error.param)
        return AttentionMap(source, target, weights.tolist())

    async def tokenize(self, request: TokenizeRequest) -> Tokens | Refusal:
        try:
            ids = self._prompt_ids(request.text, request.messages, request.add_special_tokens)
        except InvalidRequestError as error:
            return Refusal("invalid", str(error), error.param)
        pieces = tuple(self.model.tokenizer.piece_bytes(i).decode("utf-8", errors="replace") for i in ids)
        return Tokens(tuple(ids), pieces, self.model.max_len)

    async def tokenizer_info(self) -> TokenizerInfo:
        tokenizer = self.model.tokenizer

        def special(token_id: int | None) -> str | None:
            """The token's text when encoding it gives the token back (a client encodes it to find its id)."""
            text = tokenizer.token_text(token_id) if token_id is not None else ""
            return text if text and tokenizer.encode(text) == [token_id] else None

        return TokenizerInfo(
            type(tokenizer).__name__,
            special(self.model.eos_id),
            special(self.model.bos_id),  # a translator's decoder starts from its own start id instead
            special(self.model.pad_id),
            self.model.max_len,
            tokenizer.chat_template,
        )

    async def detokenize(self, ids: tuple[int, ...]) -> str | Refusal:
        vocab_size = self.model.tokenizer.vocab_size
        if any(not 0 <= i < vocab_size for i in ids):
            return Refusal("invalid", f"token ids must be in [0, {vocab_size})", "tokens")
        return self.model.tokenizer.decode(list(ids))

    async def ready(self) -> bool:
        return self.engine.alive

    async def stats(self) -> dict[str, Any]:
        """The engine's state, for tests and debugging."""
        counters = self.engine.counters
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "running": self.engine.num_running(),
            "waiting": self.engine.num_waiting(),
            "free_slots": self.engine.num_free_slots(),
            "open_streams": self.engine.num_streams(),  # submitted here, not yet finished or left
            "steps": counters.steps,
            "batch_size_sum": counters.batch_size_sum,
            "max_batch_size": counters.max_batch_size,
            "finished": dict(counters.finished),
            **process_stats(),
            "engine_process": process_stats(self.engine.pid),
        }

    def inject_fault(
        self,
        kind: FaultKind,
        steps: int = 1,
        stall_s: float | None = None,
        release_file: str | None = None,
        open_counts: str | None = None,
    ) -> str:
        """For fault tests, refused unless the config runs the engine through a FaultInjectingRunner:
        each of the next `steps` engine steps raises ("error"), or first stalls ("stall"): stall_s
        seconds (None: forever, a wedged loop that check_health reports and Serve replaces), or
        until release_file exists. Given open_counts (a folder), this replica writes the number of
        requests open here to the file <open_counts>/<its id> after each one arrives, until armed
        again. Returns this replica's id."""
        if not self.config.fault_injection:
            raise PermissionError("fault injection is off for this deployment")
        replica = str(serve.get_replica_context().replica_id.unique_id)
        count_file = None if open_counts is None else Path(open_counts) / replica
        self.engine.arm_fault(kind, steps, stall_s, Path(release_file) if release_file is not None else None, count_file)
        return replica

    def check_health(self) -> None:
        """Serve restarts the replica when this raises: the loop died or is wedged in a step."""
        if not self.engine.alive:
            raise RuntimeError("engine loop is not running")
        timeout = self.config.heartbeat_timeout_s
        if time.monotonic() - self.engine.last_heartbeat > timeout:
            raise RuntimeError(f"engine loop has not completed a step in {timeout:.0f} s")
