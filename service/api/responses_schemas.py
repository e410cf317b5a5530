"""The OpenAI Responses API's bodies (`POST /v1/responses`): the request, validated at the edge as
the other routes' (service/api/schemas.py), the response object and its stream's events."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.json_schema import SkipJsonSchema

from decoding.sampling_params import SamplingParams
from service.api.schemas import FiniteFloat, JSONSchemaFormat, ResponseModel, StrictModel, Text


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer's text, sent back
    text: Text
    model_config = ConfigDict(extra="ignore")  # e.g. annotations and logprobs of an output_text


class InputMessage(StrictModel):
    """A message: the user's (or the system's, a developer's) or an earlier answer of the assistant."""

    model_config = ConfigDict(extra="ignore")  # id and status of an output message sent back
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made, sent back with its output."""

    model_config = ConfigDict(extra="ignore")  # id, status
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr
    arguments: StrictStr  # a JSON object's text


class FunctionCallOutputItem(StrictModel):
    model_config = ConfigDict(extra="ignore")  # id, status
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: Text


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionToolBody(StrictModel):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: StrictBool | None = None  # as in chat completions' tools (docs/api.md)


class BuiltInToolBody(StrictModel):
    """OpenAI's hosted tools (web_search, file_search, ...): named so that the 400 can say they are not served."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: StrictStr


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJSONObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(JSONSchemaFormat):
    type: Literal["json_schema"]


class TextOptions(StrictModel):
    format: TextFormatText | TextFormatJSONObject | TextFormatJSONSchema = TextFormatText(type="text")
    verbosity: Literal["medium"] | None = None  # the only one a model without that control has


class ResponsesRequest(StrictModel):
    """OpenAI `POST /v1/responses`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"input": "Hello!", "max_output_tokens": 16},
                {"input": [{"role": "user", "content": "Hello!"}], "instructions": "Be brief.", "max_output_tokens": 16, "stream": True},
            ]
        }
    )

    model: StrictStr | None = None  # omitted: the first generator
    input: Text | list[InputItem]
    instructions: Text | None = None  # a system message before the input (not carried to a response that continues this one)
    tools: list[FunctionToolBody | BuiltInToolBody] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None  # none given: "auto" with tools
    parallel_tool_calls: StrictBool = True
    text: TextOptions | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: FiniteFloat = Field(SamplingParams.temperature, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    stream: StrictBool = False
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None  # accepted, not used
    # Accepted only as they change nothing here (a 400 names them otherwise).
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    truncation: Literal["disabled", "auto"] | None = None


class OutputText(ResponseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(ResponseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(ResponseModel):
    cached_tokens: int


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorDetail(ResponseModel):
    code: str
    message: str


class ResponseObject(ResponseModel):
    """A response: its output items (text as a message, each tool call as a function_call) and usage."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    error: ResponseErrorDetail | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseStreamEvent(ResponseModel):
    """One event of a streamed response: `event: <type>` and `data: <this as JSON>`, numbered in
    order by sequence_number from 0; the fields each type carries are OpenAI's for it."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject | SkipJsonSchema[None] = None
    output_index: int | SkipJsonSchema[None] = None
    item: OutputItem | SkipJsonSchema[None] = None
    item_id: str | SkipJsonSchema[None] = None
    content_index: int | SkipJsonSchema[None] = None
    part: OutputText | SkipJsonSchema[None] = None
    delta: str | SkipJsonSchema[None] = None
    text: str | SkipJsonSchema[None] = None
    arguments: str | SkipJsonSchema[None] = None
    name: str | SkipJsonSchema[None] = None
    logprobs: list[Any] | SkipJsonSchema[None] = None
