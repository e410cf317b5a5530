"""Request bodies, validated at the edge. Strict types: `true` is not a number, NaN is not a float."""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from service.protocol import DEFAULT_TEMPERATURE

FiniteFloat = Annotated[float, Field(allow_inf_nan=False, strict=False)]


def _encodable(text: str) -> str:
    """Lone surrogates (valid JSON escapes, invalid Unicode) are refused before any tokenizer sees them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the string is not valid Unicode (lone surrogate)") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage (tokens so far) on every chunk


class CompletionRequest(StrictModel):
    """OpenAI `POST /v1/completions`. Fields that would change the output but are not supported
    are accepted only at their neutral value and rejected otherwise, naming the field."""

    model: StrictStr | None = None  # omitted: the generator (as vLLM serves its one model)
    prompt: Text | list[Text]
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: FiniteFloat = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM extension; 0 or -1: no limit
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    repetition_penalty: FiniteFloat = 1.0
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    best_of: StrictInt | None = None
    logit_bias: dict[str, Any] | None = None
    suffix: StrictStr | None = None
    user: StrictStr | None = None  # accepted, not used (it does not change the output)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings of at most 64 characters")
        return stops

    def unsupported_field(self) -> str | None:
        """The first field set to a value this server does not implement."""
        return next((name for name, allowed in NEUTRAL_VALUES.items() if getattr(self, name) not in allowed), None)


# Fields accepted for compatibility only at values that leave the output unchanged.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (None, 1),
    "logprobs": (None,),
    "echo": (False,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "logit_bias": (None,),
    "suffix": (None,),
}


class TranslateRequest(StrictModel):
    """`POST /v1/translate`."""

    text: Text | list[Text]
    source_lang: Literal["en", "auto"] = "en"  # auto: text detected as another language is a 400
    target_lang: Literal["de"] = "de"
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

    text: Text = Field(min_length=1)
    model: StrictStr | None = None


class LibreTranslateRequest(StrictModel):
    """LibreTranslate `POST /translate` (JSON or form); unknown fields are ignored, as LibreTranslate does."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    q: Text | list[Text]
    source: StrictStr = "auto"
    target: StrictStr = "de"
    format: Literal["text", "html"] = "text"
    alternatives: int = Field(0, ge=0, le=7)
    api_key: StrictStr | None = None


class DetectRequest(StrictModel):
    """LibreTranslate `POST /detect` (JSON or form)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    q: Text
    api_key: StrictStr | None = None
