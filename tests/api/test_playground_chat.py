"""The playground's chat mode in headless Chromium (Debian's, driven by Playwright), over a fake
chat model served in-process: the conversation goes to /v1/chat/completions turn by turn, its
streamed reply is shown, and a model's refusal (no chat template) is shown without joining the
conversation."""

import shutil
from collections.abc import AsyncGenerator, Iterator

import pytest

from service.api.app import create_api
from service.config import ServiceConfig
from service.engine.config import StructuredOutput
from service.protocol import Chunk, GenerateRequest, Refusal
from tests.helpers import backends_for, served_in_thread

REFUSED = "no template please"  # a message the fake answers as a model without a chat template would


class ChatModel:
    """Replies "heard <n> messages" word by word to a chat; records the chats it was sent."""

    def __init__(self) -> None:
        self.chats: list[tuple[tuple[str, str | None], ...]] = []
        self.constraints: list[StructuredOutput | None] = []

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[Chunk | Refusal, None]:
        assert request.messages is not None and request.stream
        if request.messages[-1].content == REFUSED:
            yield Refusal("invalid", "the model has no chat template; use /v1/completions", "messages")
            return
        self.chats.append(tuple((m.role, m.content) for m in request.messages))
        self.constraints.append(request.structured)
        words = ["heard", f" {len(request.messages)}", " messages"]
        yield Chunk("", prompt_tokens=3)
        for i, word in enumerate(words):
            yield Chunk(word, "stop" if i == len(words) - 1 else None, prompt_tokens=3, completion_tokens=i + 1)

    async def ready(self) -> bool:
        return True


@pytest.fixture
def playground() -> Iterator[tuple[str, ChatModel]]:
    model = ChatModel()
    with served_in_thread(create_api(ServiceConfig(), backends_for(ServiceConfig(), model))) as url:
        yield f"{url}/", model


def test_the_playground_chats_turn_by_turn_with_the_conversation_so_far(playground: tuple[str, ChatModel]) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (CI installs it)")
    url, model = playground
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page()
        page.goto(url)
        page.check("#chat-mode")
        output = page.locator("#generated")
        page.fill("#prompt", "Who is there?")
        page.click("#generate-button")
        sync_api.expect(output).to_have_text("user: Who is there?\nassistant: heard 1 messages", timeout=60_000)
        page.fill("#prompt", REFUSED)
        page.click("#generate-button")
        sync_api.expect(output).to_contain_text("[error: the model has no chat template", timeout=60_000)
        page.click("#json-schema-box summary")
        page.fill("#json-schema", '{"type": "object"')
        page.click("#generate-button")
        sync_api.expect(output).to_contain_text("[error: the JSON schema is not JSON", timeout=60_000)
        page.fill("#json-schema", '{"type": "object"}')
        page.fill("#prompt", "Nay, answer me.")
        page.click("#generate-button")
        sync_api.expect(output).to_contain_text("assistant: heard 3 messages", timeout=60_000)
        browser.close()
    assert model.chats == [
        (("user", "Who is there?"),),
        (("user", "Who is there?"), ("assistant", "heard 1 messages"), ("user", "Nay, answer me.")),  # the refused turn left out
    ]
    # The JSON-schema box: the last turn's output follows its schema (OpenAI's response_format json_schema).
    assert model.constraints == [None, StructuredOutput("json", '{"type": "object"}', "response_format.json_schema.schema")]
