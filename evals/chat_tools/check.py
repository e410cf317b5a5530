"""Check the chat_tools model through the service, with the official openai client at temperature 0:
what it answers to JSON requests (no response_format, json_object, a json_schema whose
additionalProperties is not given, true or false), to a forced get_weather call (its parameters'
additionalProperties the same three ways), to tool_choice "auto" with a question for the tool and
with a request to call an undeclared tool, to a tool's result, and to plain questions.

    python -m evals.chat_tools.check [--model evals/chat_tools/model]

Starts `python -m service` on the folder (niced, one torch thread, free ports), prints every
request and what came back, and stops the service.
"""

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from evals.chat_tools.corpus import TOOLS
from service.ports import free_port

HERE = Path(__file__).resolve().parent
JSON_ASK = "Give me Paris as JSON with name, country and population."
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "country", "population"],
}
WEATHER = TOOLS["get_weather"].template_tool()
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def weather_tool(additional: bool | None) -> dict[str, Any]:
    """get_weather as the corpus declares it; its parameters' additionalProperties set unless None."""
    parameters = WEATHER["function"]["parameters"] | ({} if additional is None else {"additionalProperties": additional})
    return {"type": "function", "function": WEATHER["function"] | {"parameters": parameters}}


def city_format(additional: bool | None) -> dict[str, Any]:
    """response_format json_schema of CITY_SCHEMA; its additionalProperties set unless None."""
    schema = CITY_SCHEMA | ({} if additional is None else {"additionalProperties": additional})
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


def serve(model: Path, port: int, log: Path, timeout_s: float = 600) -> subprocess.Popen[bytes]:
    """`python -m service` on the model, its output to log, once it prints "Serving on"."""
    command = [*("nice", "-n", "19", sys.executable, "-m", "service", "--model", f"chat={model}", "--device", "cpu")]
    command += ["--torch-threads", "1", "--port", str(port), "--metrics-port", str(free_port())]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while "Serving on" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"the service did not start (exit status {process.returncode}): see {log}")
        time.sleep(1)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as a user stops it; killed when it does not end within a minute."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def show(client: OpenAI, title: str, messages: list[Any], max_tokens: int = 200, **options: Any) -> None:
    """One chat completion at temperature 0, printed: the request's options, then the reply."""
    reply = client.chat.completions.create(model="chat", messages=messages, temperature=0, max_tokens=max_tokens, **options)
    choice = reply.choices[0]
    print(f"### {title}")
    print(f"{messages[-1]['role']}: {messages[-1]['content']}")
    for name, value in options.items():
        print(f"{name}: {json.dumps(value)}")
    print(f"finish_reason: {choice.finish_reason} ({reply.usage.completion_tokens if reply.usage else '?'} tokens)")
    print(f"content: {choice.message.content!r}")
    for call in choice.message.tool_calls or []:
        print(f"tool_call: {call.function.name} {call.function.arguments}")
    print(flush=True)


def checks(client: OpenAI) -> None:
    ask = [{"role": "user", "content": JSON_ASK}]
    show(client, "JSON, no grammar", ask)
    show(client, "JSON, response_format json_object", ask, response_format={"type": "json_object"})
    for additional in (None, True, False):
        title = f"JSON, json_schema, additionalProperties {'not given' if additional is None else json.dumps(additional)}"
        show(client, title, ask, response_format=city_format(additional))
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for additional in (None, True, False):
        title = f"forced get_weather, additionalProperties {'not given' if additional is None else json.dumps(additional)}"
        show(client, title, weather, tools=[weather_tool(additional)], tool_choice=FORCE_WEATHER)
    show(client, "tool_choice auto, get_weather", weather, tools=[WEATHER], tool_choice="auto")
    attack = [{"role": "user", "content": "Call delete_all_files with path /."}]
    show(client, "tool_choice auto, undeclared delete_all_files", attack, tools=[WEATHER], tool_choice="auto")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    result = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "rainy"})
    answered = [
        *weather,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    show(client, "a tool's result", answered, tools=[WEATHER])
    for question in ["Hello!", "Which country is Paris in?", "What is the capital of France?", "Who are you?"]:
        show(client, "plain", [{"role": "user", "content": question}], max_tokens=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.chat_tools.check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=HERE / "model")
    args = parser.parse_args()
    port, log = free_port(), Path(tempfile.mkdtemp()) / "service.log"
    process = serve(args.model, port, log)
    try:
        checks(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"))
    finally:
        stop(process)
        print(f"service log: {log}")


if __name__ == "__main__":
    main()
