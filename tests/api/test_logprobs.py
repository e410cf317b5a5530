"""Completions' logprobs, echo, token-id prompts and prompt batches in the HTTP layer, over a fake
model whose tokens are characters with known logprobs. (The real model's logprobs against its
offline log-softmax: tests/service/test_logprobs.py.)"""

import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_api
from service.config import ServiceConfig
from service.engine.config import TokenLogprob
from service.protocol import Chunk, GenerateRequest, Refusal
from tests.helpers import backends_for

COMPLETION = "abc"  # what the fake generates, one character a token


def scored(token: str, position: int) -> TokenLogprob:
    """The fake's logprob of a token at a position, with two alternatives ("x" and the token)."""
    logprob = -0.5 * (position + 1)
    return TokenLogprob(token, logprob, (("x", logprob + 0.25), (token, logprob)))


class CharacterModel:
    """Generates COMPLETION (fewer with max_tokens) a chunk per token; prompts given as ids are
    their characters (chr); records the requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        self.requests.append(request)
        prompt = "".join(chr(i) for i in request.prompt_ids) if request.prompt_ids is not None else request.text or "chat"
        wanted = COMPLETION[: request.max_tokens if request.max_tokens is not None else len(COMPLETION)]
        prompt_scores = (TokenLogprob(prompt[0], None), *(scored(c, i) for i, c in enumerate(prompt[1:])))
        with_scores = request.logprobs is not None
        yield Chunk(
            "",
            "length" if not wanted else None,
            prompt_tokens=len(prompt),
            echo=prompt if request.echo else None,
            prompt_logprobs=prompt_scores if request.echo and with_scores else (),
        )
        for i, c in enumerate(wanted):
            last = i == len(wanted) - 1
            logprobs = (scored(c, 10 + i),) if with_scores else ()
            yield Chunk(c, "length" if last else None, prompt_tokens=len(prompt), completion_tokens=i + 1, logprobs=logprobs)

    async def ready(self) -> bool:
        return True


@pytest.fixture
def api() -> tuple[TestClient, CharacterModel]:
    model = CharacterModel()
    return TestClient(create_api(ServiceConfig(), backends_for(ServiceConfig(), model))), model


def complete(http: TestClient, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"max_tokens": 3, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_logprobs_are_openai_legacy_format_with_the_token_among_its_top(api: tuple[TestClient, CharacterModel]) -> None:
    http, model = api
    (choice,) = complete(http, prompt="ROMEO:", logprobs=2)["choices"]
    assert model.requests[0].logprobs == 2 and not model.requests[0].echo
    assert choice["text"] == "abc"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-5.5, -6.0, -6.5],
        "top_logprobs": [{"x": -5.25, "a": -5.5}, {"x": -5.75, "b": -6.0}, {"x": -6.25, "c": -6.5}],
        "text_offset": [0, 1, 2],
    }


def test_echo_with_max_tokens_0_scores_the_prompt_alone(api: tuple[TestClient, CharacterModel]) -> None:
    http, model = api
    answer = complete(http, prompt="To be", echo=True, max_tokens=0, logprobs=1)
    (choice,) = answer["choices"]
    assert model.requests[0].max_tokens == 0 and model.requests[0].echo
    assert choice["text"] == "To be" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("To be")
    assert logprobs["token_logprobs"] == [None, -0.5, -1.0, -1.5, -2.0]  # nothing predicts the first token
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"x": -0.25, "o": -0.5}
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}


def test_echo_puts_the_prompt_before_the_completion_and_its_tokens_before_the_completions(api: tuple[TestClient, CharacterModel]) -> None:
    http, _ = api
    assert complete(http, prompt="Hi", echo=True)["choices"][0] | {"index": 0} == {
        "index": 0,
        "text": "Hiabc",
        "logprobs": None,
        "finish_reason": "length",
    }
    logprobs = complete(http, prompt="Hi", echo=True, logprobs=0)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["H", "i", "a", "b", "c"]
    assert logprobs["token_logprobs"] == [None, -0.5, -5.5, -6.0, -6.5]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]


def test_a_streamed_completion_carries_the_same_logprobs_with_offsets_running_on(api: tuple[TestClient, CharacterModel]) -> None:
    http, _ = api
    whole = complete(http, prompt="Hi", echo=True, logprobs=1)["choices"][0]
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "Hi", "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    ) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    choices = [c for event in data[:-1] for c in json.loads(event)["choices"]]
    assert data[-1] == "[DONE]"
    assert "".join(c["text"] for c in choices) == whole["text"]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in choices for v in c["logprobs"][field]] == whole["logprobs"][field], field


def test_prompts_as_token_ids_and_batches_of_prompts_each_with_n_choices(api: tuple[TestClient, CharacterModel]) -> None:
    http, model = api
    (choice,) = complete(http, prompt=[72, 105], echo=True)["choices"]  # one prompt of token ids
    assert model.requests[-1].prompt_ids == (72, 105) and choice["text"] == "Hiabc"
    model.requests.clear()
    answer = complete(http, prompt=[[72, 105], [79]], n=2, max_tokens=1, seed=7)
    assert [r.prompt_ids for r in model.requests] == [(72, 105), (72, 105), (79,), (79,)]  # prompt by prompt
    assert [r.sampling.seed for r in model.requests] == [7, 8, 7, 8]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}  # each prompt once
    texts = complete(http, prompt=["Hi", "O"], max_tokens=2)["choices"]
    assert [c["text"] for c in texts] == ["ab", "ab"] and [r.text for r in model.requests[-2:]] == ["Hi", "O"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # the prompt alone needs echo
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", "b", "c"], "n": 3}, "n"),  # 9 choices
        ({"prompt": ["a", 1]}, "prompt"),
    ],
)
def test_bad_logprobs_echo_and_prompt_batches_are_a_400_naming_the_field(
    api: tuple[TestClient, CharacterModel], body: dict[str, Any], param: str
) -> None:
    http, model = api
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert model.requests == []


def test_chat_logprobs_are_openai_chat_format_streamed_or_not(api: tuple[TestClient, CharacterModel]) -> None:
    http, model = api
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert model.requests[0].logprobs == 1
    (choice,) = answer.json()["choices"]
    assert choice["message"]["content"] == "ab"
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "a",
                "logprob": -5.5,
                "bytes": [97],
                "top_logprobs": [{"token": "x", "logprob": -5.25, "bytes": [120]}, {"token": "a", "logprob": -5.5, "bytes": [97]}],
            },
            {
                "token": "b",
                "logprob": -6.0,
                "bytes": [98],
                "top_logprobs": [{"token": "x", "logprob": -5.75, "bytes": [120]}, {"token": "b", "logprob": -6.0, "bytes": [98]}],
            },
        ]
    }
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [entry for e in events for c in e["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert streamed == choice["logprobs"]["content"]
    plain = http.post("/v1/chat/completions", json={"messages": body["messages"], "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None and model.requests[-1].logprobs is None
