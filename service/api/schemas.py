"""Request bodies, validated at the edge (strict types: `true` is not a number, NaN is not a float),
and the responses every route documents in the OpenAPI schema."""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.alias_generators import to_camel
from pydantic.json_schema import SkipJsonSchema

from decoding.sampling_params import SamplingParams

FiniteFloat = Annotated[float, Field(allow_inf_nan=False, strict=False)]


def _encodable(text: str) -> str:
    """Lone surrogates (valid JSON escapes, invalid Unicode) are refused before any tokenizer sees them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string is not valid Unicode (lone surrogate)") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s or len(s) > 64 for s in stops):
        raise ValueError("stop takes at most 4 non-empty strings of at most 64 characters")
    return stops


Stop = Annotated[Text | list[Text] | None, AfterValidator(_stop_strings)]  # validated into a list


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    if bias is None:
        return None
    if len(bias) > 300 or not all(key.isdigit() and -100 <= value <= 100 for key, value in bias.items()):
        raise ValueError("logit_bias maps at most 300 token ids (as strings) to biases from -100 to 100")
    return bias


LogitBias = Annotated[dict[StrictStr, FiniteFloat] | None, AfterValidator(_logit_bias)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


MAX_CHOICES = 8  # n: samples per request (times the prompts of a batch), each one engine request
MAX_LOGPROBS = 5  # top alternatives per token, as OpenAI's legacy completions allow
MAX_CHAT_LOGPROBS = 20  # as OpenAI's chat completions allow


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage (tokens so far) on every chunk


class JSONSchemaFormat(StrictModel):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # the output's JSON schema
    strict: StrictBool | None = None  # OpenAI's: every property an object schema lists is required (docs/api.md)


class TextFormat(StrictModel):
    type: Literal["text"]


class JSONObjectFormat(StrictModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")  # a JSON schema (or its text)
    regex: StrictStr | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None  # EBNF: GBNF (llama.cpp's) or Lark
    json_object: StrictBool | None = None
    # vLLM's JSON whitespace options: none at all, or this regular expression where JSON allows
    # whitespace (default: one optional space)
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: StrictStr | None = Field(None, max_length=200)


class SamplingRequest(StrictModel):
    """The fields completions and chat completions share: how to sample, how to stream, what
    the output must follow. Fields that would change the output but are not supported are in
    NEUTRAL, accepted only at their neutral value and rejected otherwise, naming the field."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: StrictStr | None = None  # omitted: the first generator (as vLLM serves its one model)
    temperature: FiniteFloat = Field(SamplingParams.temperature, ge=0.0, le=2.0)  # OpenAI's default, 1.0
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM extension; 0 or -1: no limit
    min_p: FiniteFloat = Field(0.0, ge=0.0, le=1.0)  # vLLM extension; 0: no limit
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)  # independent samples (seed + i each, when a seed is given)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # with stream only (as vLLM: a 400 otherwise)
    stop: Stop = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's, on the generated tokens
    frequency_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat = Field(1.0, gt=0.0, le=2.0)  # vLLM's (transformers'), on the prompt's and generated tokens
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM's: no eos, and no stop string ending, within this many tokens (at most max_tokens)
    ignore_eos: StrictBool = False  # vLLM's: an eos does not end the completion
    speculative_decoding: StrictBool = True  # ours: false turns the server's speculative decoding off for this request
    logit_bias: LogitBias = None  # OpenAI's: token id (as a string) -> added to its logit, -100 to 100
    response_format: ResponseFormat | None = None  # OpenAI's: json_object, or json_schema
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, regex, choice, grammar or json_object
    user: StrictStr | None = None  # accepted, not used (it does not change the output)
    max_tokens: StrictInt | None = Field(None, ge=0)  # None: what the context allows (vLLM's)

    def unsupported_field(self) -> str | None:
        """The first field set to a value this server does not implement."""
        return next((name for name, allowed in self.NEUTRAL.items() if getattr(self, name) not in allowed), None)


class CompletionRequest(SamplingRequest):
    """OpenAI `POST /v1/completions`."""

    # The examples (on every request model) are in the schema, and the schema fuzzing sends them.
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"prompt": "ROMEO:", "max_tokens": 16},
                {"prompt": "ROMEO:", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}},
                {"prompt": "ROMEO: What light", "max_tokens": 0, "echo": True, "logprobs": 1},
                {"prompt": "Is it night?", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}},
            ]
        }
    )
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {"best_of": (None, 1), "suffix": (None,)}

    # A prompt as text or token ids, or a batch of them (each prompt's n choices in turn).
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0 with echo: the prompt alone
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, with this many top alternatives
    echo: StrictBool = False  # the prompt before the completion (with logprobs: its tokens' too)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionCallBody(StrictModel):
    name: StrictStr
    arguments: StrictStr  # a JSON object's text


class ToolCallBody(StrictModel):
    """A call an assistant made, sent back in a later request's history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessageBody(StrictModel):
    """One message of a chat; content as a string or as text parts (joined). An assistant's may
    have tool_calls instead of content; a tool's answers the call tool_call_id names."""

    model_config = ConfigDict(extra="ignore")  # e.g. refusal: null, as clients send them back
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str | None:
        return self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)


class FunctionDefinition(StrictModel):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: StrictBool | None = None  # OpenAI's: a forced call gives every listed argument (docs/api.md)


class ToolBody(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: StrictStr


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """OpenAI `POST /v1/chat/completions`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16},
                {
                    "messages": [{"role": "user", "content": "A person, as JSON"}],
                    "max_tokens": 32,
                    "response_format": {"type": "json_object"},
                },
            ]
        }
    )

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False  # each content token's logprob
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_CHAT_LOGPROBS)  # with logprobs: the most likely tokens too
    tools: list[ToolBody] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # none given: "auto" with tools
    parallel_tool_calls: StrictBool = True


class TokenizeBody(StrictModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages rendered by the model's template."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"prompt": "ROMEO:"}]})
    model: StrictStr | None = None
    prompt: Text | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: StrictBool = True  # a plain prompt's (ignored for messages: the template writes them)
    return_token_strs: StrictBool = False


class DetokenizeBody(StrictModel):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [40, 41]}]})
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=100_000)


class TranslateRequest(StrictModel):
    """`POST /v1/translate`."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"text": "A dog runs.", "alternatives": 1}, {"text": "A dog. A cat.", "stream": True}]}
    )
    text: Text | list[Text]
    # The translator by its languages (when `model` is not given): none sent, the first served;
    # "auto" detects the source among the languages served (text in another one is a 400).
    source_lang: StrictStr | None = None
    target_lang: StrictStr | None = None
    format: Literal["text", "html"] = "text"
    model: StrictStr | None = None
    beam_size: StrictInt | None = Field(None, ge=1, le=8)
    alternatives: StrictInt = Field(0, ge=0, le=7)
    length_penalty: FiniteFloat = Field(1.0, ge=0.0, le=2.0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    stream: StrictBool = False
    # Per sentence, the best output's cross-attention weights [layer][head][target][source].
    return_attention: StrictBool = False


class AttentionRequestBody(StrictModel):
    """`POST /v1/attention`: the generator's self-attention over a text."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"text": "ROMEO: What light"}]})
    text: Text = Field(min_length=1)
    model: StrictStr | None = None


class LibreTranslateRequest(StrictModel):
    """LibreTranslate `POST /translate` (JSON or form); unknown fields are ignored, as LibreTranslate does."""

    model_config = ConfigDict(
        extra="ignore", allow_inf_nan=False, json_schema_extra={"examples": [{"q": "A dog runs.", "source": "auto", "alternatives": 1}]}
    )

    q: Text | list[Text]
    source: StrictStr = "auto"
    target: StrictStr | None = None  # none: the first translator's target
    format: Literal["text", "html"] = "text"
    alternatives: int = Field(0, ge=0, le=7)
    api_key: StrictStr | None = None


class DetectRequest(StrictModel):
    """LibreTranslate `POST /detect` (JSON or form)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, json_schema_extra={"examples": [{"q": "A dog runs in the park."}]})

    q: Text
    api_key: StrictStr | None = None


# Responses. Models forbid fields they do not declare, so a route that answers something else fails
# its tests rather than documenting less than it sends. A field that defaults to None without None
# in its schema is left out of the answer when not set (the routes use response_model_exclude_unset).

Finish = Literal["stop", "length"]  # how an answer ends (a failure or a timeout is an error status or event)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CamelModel(ResponseModel):
    """LibreTranslate's field names (camelCase) on the wire."""

    model_config = ConfigDict(alias_generator=to_camel)


class OpenAIErrorDetail(ResponseModel):
    message: str
    type: str
    param: str | None  # the request field at fault
    code: int | None  # the HTTP status


class OpenAIError(ResponseModel):
    """The error body under /v1 (OpenAI's envelope), and the event that ends a failed stream."""

    error: OpenAIErrorDetail


class LibreTranslateError(ResponseModel):
    """The error body outside /v1: `{"error": "<message>"}`, as LibreTranslate answers."""

    error: str


class Health(ResponseModel):
    status: Literal["ok"]


class Readiness(ResponseModel):
    status: Literal["ready", "not ready"]


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # Beyond OpenAI's card (as vLLM adds max_model_len): what the model does, and a translator's languages.
    kind: Literal["translator", "generator"]
    source_lang: str | None
    target_lang: str | None


class ModelList(ResponseModel):
    """`GET /v1/models`."""

    object: Literal["list"]
    data: list[ModelCard]


class TokenUsage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int


class Usage(TokenUsage):
    total_tokens: int


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy logprobs: per token of the choice's text (the prompt's first, with echo),
    its text, its logprob (None for a prompt's first token), the top alternatives with the token
    itself, and where it starts in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str  # in a stream, the text since the previous event
    logprobs: CompletionLogprobs | None
    finish_reason: Finish | None  # None on a stream's events before its last text


class CompletionFields(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]


class CompletionResponse(CompletionFields):
    """`POST /v1/completions` without `stream`."""

    usage: Usage


class CompletionChunk(CompletionFields):
    """One event of a streamed completion. With `stream_options.include_usage` a last one has no
    choices and the usage; with `continuous_usage_stats` every one has the usage so far."""

    usage: Usage | SkipJsonSchema[None] = None


ChatFinish = Literal["stop", "length", "tool_calls"]  # "tool_calls": the model called tools (tool_choice auto or required)


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"]
    content: str | None  # None when the reply is tool calls alone
    tool_calls: list[ToolCallOut] | SkipJsonSchema[None] = None  # the calls the model made, when it made any


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]  # the most likely tokens at its position, most likely first


class ChatLogprobs(ResponseModel):
    """OpenAI's chat logprobs: one entry per token of the content (in a stream, of the event's)."""

    content: list[ChatTokenLogprob]


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


class ChatCompletionResponse(ResponseModel):
    """`POST /v1/chat/completions` without `stream`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(ResponseModel):
    name: str | SkipJsonSchema[None] = None  # on the call's first event only
    arguments: str  # the next fragment of its arguments (the fragments join to the arguments)


class ToolCallDelta(ResponseModel):
    """A streamed tool call's piece: its id, type and name on its first event, then its arguments
    in fragments as they are written (a forced call), or in one fragment once the call parses
    (tool_choice auto)."""

    index: int  # the call's place among the choice's calls
    id: str | SkipJsonSchema[None] = None
    type: Literal["function"] | SkipJsonSchema[None] = None
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | SkipJsonSchema[None] = None  # on each choice's first event only
    content: str | SkipJsonSchema[None] = None
    tool_calls: list[ToolCallDelta] | SkipJsonSchema[None] = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish | None


class ChatCompletionChunk(ResponseModel):
    """One event of a streamed chat: each choice's role first, then its content deltas, then its
    finish reason; with include_usage a last event with no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | SkipJsonSchema[None] = None


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | SkipJsonSchema[None] = None


class TokenizerInfoResponse(ResponseModel):
    """vLLM's `GET /tokenizer_info`: a special token's text only where encoding it gives the token back."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    model_max_length: int
    chat_template: str | None


class DetokenizeResponse(ResponseModel):
    prompt: str


class CrossAttention(ResponseModel):
    """The translator's attention: weights[layer][head][target token][source token]."""

    source_tokens: list[str]
    target_tokens: list[str]
    layers: int
    heads: int
    weights: list[list[list[list[float]]]]


class TranslatedSentence(ResponseModel):
    source: tuple[int, int]  # where the sentence is in its text: [start, end)
    text: str
    alternatives: list[str]
    finish_reason: Finish
    attention: CrossAttention | SkipJsonSchema[None] = None  # with return_attention


class Translation(ResponseModel):
    text: str
    alternatives: list[str]
    finish_reason: Finish  # "length" when any sentence was cut by max_tokens
    sentences: list[TranslatedSentence]


class TranslateResponse(ResponseModel):
    """`POST /v1/translate` without `stream`: one translation per text, in order."""

    model: str
    translations: list[Translation]
    usage: Usage


class TranslateChunk(ResponseModel):
    """One event of a streamed translation; the last has the finish reason and the usage."""

    text: str
    finish_reason: Finish | None
    usage: TokenUsage | SkipJsonSchema[None] = None


class SelfAttention(ResponseModel):
    """`POST /v1/attention`: weights[layer][head][i][j], how much token i attends to token j."""

    model: str
    tokens: list[str]
    layers: int
    heads: int
    weights: list[list[list[list[float]]]]


class DetectedLanguage(ResponseModel):
    confidence: float  # percent
    language: str


class LibreTranslateResponse(CamelModel):
    """LibreTranslate's `/translate`: for a list `q`, every field is a list aligned with it."""

    translated_text: str | list[str]
    alternatives: list[str] | list[list[str]] | SkipJsonSchema[None] = None  # with alternatives > 0
    detected_language: DetectedLanguage | list[DetectedLanguage] | SkipJsonSchema[None] = None  # with source "auto"


class Language(ResponseModel):
    code: str
    name: str
    targets: list[str]


class LanguageName(ResponseModel):
    code: str
    name: str


class FrontendLanguages(ResponseModel):
    source: LanguageName
    target: LanguageName


class FrontendSettings(CamelModel):
    """LibreTranslate's `/frontend/settings`."""

    char_limit: int
    frontend_timeout: int
    api_keys: bool
    key_required: bool
    suggestions: bool
    files_translation: bool
    supported_files_format: list[str]
    language: FrontendLanguages


ERROR_DESCRIPTIONS = {
    400: "Invalid request; under /v1 `error.param` names the field",
    401: "API keys are configured and the request has no valid `Authorization: Bearer` key",
    403: "The request's API key is wrong",
    404: "Unknown model",
    413: "Body too large",
    429: "The model's queue is full; retry after `Retry-After` seconds",
    500: "Internal error (no details)",
    503: "The service is overloaded, no replica is available or the request timed out; retry after `Retry-After` seconds",
}


def error_responses(body: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses` for its error statuses, each with the error body it sends."""
    return {status: {"model": body, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


# The statuses of the /v1 routes that run a model, from the route, its model and the middleware.
MODEL_ERRORS = error_responses(OpenAIError, 400, 401, 404, 413, 429, 500, 503)


def inlined_schema(model: type[BaseModel]) -> dict[str, Any]:
    """model's JSON schema as sent, with its definitions inlined: a schema to embed by value."""
    schema = model.model_json_schema(mode="serialization")
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    return inline(schema)


def event_stream(event: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `responses` entry of a route that answers with server-sent events when asked to stream:
    each event is `data: <event as JSON>`, an error event (OpenAIError) if the stream fails after
    its start, and the last is `data: [DONE]`."""
    frame = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [inlined_schema(event), inlined_schema(OpenAIError)]},
    }
    schema = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, frame]}}}
    description = "The answer as JSON; with `stream: true`, server-sent events"
    return {200: {"description": description, "content": {"text/event-stream": {"schema": schema}}}}
