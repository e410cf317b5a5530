"""What crosses Ray between the HTTP layer and a model replica: typed, plain dataclasses (no Ray,
no FastAPI, no torch, so the ingress never loads a tensor library).

A replica's `generate(GenerateRequest)` is a stream that yields exactly one of:

- one `Refusal` and nothing else: the request was never admitted (nothing was computed);
- one or more `Chunk`s in order; only the last has `finish_reason` set. The first comes as soon as
  the request is admitted (its text may be empty). A streamed request gets its text as it is made
  (at most one chunk per stream interval), a request that is not streamed gets the rest in one
  last chunk. Beam search (beam_size > 1) sends all its text in the last chunk, with the
  `alternatives`. finish_reason "error" ends a request that failed inside the engine, "timeout"
  one that passed its deadline in the queue or in total (EngineConfig), "constraint" one whose output
  could not satisfy its structured output (`Chunk.error` says why); each frees its slots.

Closing the stream early cancels the request; it stops using the model within one step.
"""

from dataclasses import dataclass, field, replace
from typing import Literal

from decoding.sampling_params import SamplingParams
from service.engine.config import FinishReason, StructuredOutput, TokenLogprob

# invalid: the request can never be served as asked (HTTP 400); overloaded: the replica's queue is
# full, retry later (429); unavailable: the replica's engine is not running (503).
RefusalKind = Literal["invalid", "overloaded", "unavailable"]


# tools: "none" generates freely and returns text; "auto" lets the model call tools (parsed from its
# reply); "required" (or GenerateRequest.tool_name) constrains the reply to calls (to that function).
ToolChoice = Literal["none", "auto", "required"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ToolCallPiece:
    """A piece of a reply's tool call as it streams: the call's index in the reply, its id and name
    on its first piece, and the next fragment of its arguments' JSON text (a call's fragments
    join to its arguments). A call given whole is one piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def joined_calls(earlier: tuple[ToolCallPiece, ...], later: tuple[ToolCallPiece, ...]) -> tuple[ToolCallPiece, ...]:
    """The pieces of both, each call's consecutive pieces joined into one."""
    calls = list(earlier)
    for piece in later:
        if calls and calls[-1].index == piece.index:
            calls[-1] = replace(calls[-1], arguments=calls[-1].arguments + piece.arguments)
        else:
            calls.append(piece)
    return tuple(calls)


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, as its template reads it (an assistant's tool calls, a tool's result)."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a "tool" message: the call it answers


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's `tools` entry)."""

    name: str
    description: str | None
    parameters: str  # the JSON schema of its arguments (an object's), as JSON text
    strict: bool = False  # OpenAI's: a forced call gives every listed argument


@dataclass(frozen=True)
class GenerateRequest:
    """One generation or one sentence to translate."""

    text: str  # the prompt, or the source sentence
    # A chat instead of text: rendered by the replica with its model's chat template (with the
    # assistant's turn opened), encoded without adding special tokens, as transformers does.
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None  # None: the model's default for this input (decided by the engine)
    # Temperature (1.0 by default, as OpenAI's; translation asks for GREEDY or beam search), top-k,
    # top-p, seed, penalties and logit bias, as the engine applies them.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_tokens: int = 0  # service/engine/request.py GenerationParams
    ignore_eos: bool = False
    speculate: bool = True  # False: no speculative decoding for this request (the engine's GenerationParams.speculate)
    stop: tuple[str, ...] = ()
    beam_size: int = 1
    n_best: int = 1  # hypotheses returned by beam search: the best and n_best - 1 alternatives
    length_penalty: float = 1.0
    stream: bool = False  # chunks as tokens are made (paced), rather than the rest at the end
    prompt_ids: tuple[int, ...] | None = None  # the prompt as token ids, read as they are (instead of text)
    # Each generated token's logprob with this many top alternatives (None: none); with echo, the
    # prompt's text on the first chunk, and its tokens' logprobs too when logprobs is set.
    # max_tokens 0 is allowed with echo: the prompt alone.
    logprobs: int | None = None
    echo: bool = False
    structured: StructuredOutput | None = None  # the output follows this grammar (JSON schema, regex, choices, EBNF)
    tools: tuple[Tool, ...] = ()  # a chat's: rendered by the model's chat template, calls parsed from the reply
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # the one function the reply must call
    parallel_tool_calls: bool = True

    def seeded(self, seed: int) -> "GenerateRequest":
        """The same request sampling with this seed."""
        return replace(self, sampling=replace(self.sampling, seed=seed))


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk; never splits a character
    finish_reason: FinishReason | None = None  # set on the last chunk only
    alternatives: tuple[str, ...] = ()  # beam search's next best, on the last chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far
    # With GenerateRequest.logprobs: one per token this chunk's text came from (tokens as their text).
    logprobs: tuple[TokenLogprob, ...] = ()
    echo: str | None = None  # with GenerateRequest.echo, on the first chunk: the prompt's text
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with echo and logprobs, on the first chunk (the first token's is None)
    tool_calls: tuple[ToolCallPiece, ...] = ()  # pieces of calls written in this chunk (their text is not in `text`)
    error: str | None = None  # with finish_reason "constraint": why the output could not go on, for the client

    def followed_by(self, later: "Chunk") -> "Chunk":
        """This chunk and the next one of the same stream, as one."""
        return Chunk(
            self.text + later.text,
            later.finish_reason,
            later.alternatives,
            later.prompt_tokens or self.prompt_tokens,
            later.completion_tokens,
            self.logprobs + later.logprobs,
            self.echo if self.echo is not None else later.echo,
            self.prompt_logprobs or later.prompt_logprobs,
            joined_calls(self.tool_calls, later.tool_calls),
            later.error,
        )


@dataclass(frozen=True)
class Refusal:
    kind: RefusalKind
    message: str  # for the client; never echoes the input
    param: str | None = None  # the request field at fault, for "invalid"


class ReplicaLostError(Exception):
    """The replica streaming a request was lost (its process or node died) after part of the
    answer had gone to the client: the request was not finished, and may be sent again."""


@dataclass(frozen=True)
class TokenizeRequest:
    """Token ids of a prompt as the model's engine would read it (vLLM's /tokenize)."""

    text: str = ""
    messages: tuple[ChatMessage, ...] | None = None  # a chat, rendered by the model's template
    add_special_tokens: bool = True  # the special tokens a plain prompt gets (e.g. a Llama's bos)


@dataclass(frozen=True)
class Tokens:
    ids: tuple[int, ...]
    pieces: tuple[str, ...]  # each token's text
    max_model_len: int  # the serving context: prompt and output together


@dataclass(frozen=True)
class TokenizerInfo:
    """What a client's own tokenizer needs of the model's (vLLM's /tokenizer_info): a special
    token's text only where encoding that text gives the token back (None otherwise)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    model_max_length: int  # the serving context
    chat_template: str | None


@dataclass(frozen=True)
class AttentionRequest:
    """Attention weights of one input, from the model's explicit attention path."""

    text: str  # the generator: the text; the translator: the source sentence
    target: str | None = None  # the translator: the translation to explain (as the engine returned it)


@dataclass(frozen=True)
class AttentionMap:
    """weights[layer][head][i][j]: how much attending token i looked at token j; each row sums to 1.
    The translator: target tokens (the translation, then end of sentence) over source tokens
    (ending with end of sentence). The generator: the text's tokens over themselves, causal."""

    source_tokens: tuple[str, ...]
    target_tokens: tuple[str, ...]
    weights: list[list[list[list[float]]]]
