"""The same structured-output and tool-call requests sent to vLLM's CPU build and to ours, on a
trained chat model, at temperature 0, through the official openai client: for each answer, whether
it keeps its constraint.

    python -m benchmarks.structured_vs_vllm [FOLDER] [--systems ours,vllm] [--json [FILE]]

FOLDER: a chat model in Hugging Face layout whose template renders tools Hermes-style (default
evals/chat_tools/model, a small Qwen2 trained on JSON answers that ramble past the asked keys and
tool calls with invented arguments: `python -m evals.chat_tools.train`). vLLM (installed into
.vllm-venv/ by benchmarks.vs_vllm) serves it with its structured outputs at their defaults and
`--enable-auto-tool-choice --tool-call-parser hermes`; ours at its defaults. The requests
(REQUESTS): JSON schemas of {name, country, population} (a pydantic model's: nothing said of other
properties) for three cities, strict and not, at 80 and 200 tokens; forced get_weather calls (by
name, and "required") at 80 and 200 tokens; tool_choice "auto" on a question one declared tool
answers, and on a user asking for a call of a tool that is not declared.

Each answer is one of: "valid" (finish_reason stop or tool_calls, and the output satisfies its
constraint: the schema with OpenAI's strict reading where strict, the forced call's arguments
under its parameters, every call of a declared tool), "length" (cut at max_tokens), "broken" (a
stop or tool_calls answer that does not satisfy it, an undeclared tool called, a forced call
missing), or "refused"/"failed" (an HTTP error). Prints a table per system and the counts; --json
writes them with the commit (default benchmarks/results/structured_vs_vllm.json).
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai

from benchmarks.provenance import commit, machine
from benchmarks.vs_vllm import MODEL, VENV, WORK, ensure_vllm, serving
from service.engine.grammar_check import closed_schema

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = ROOT / "evals" / "chat_tools" / "model"
RESULTS = ROOT / "benchmarks" / "results" / "structured_vs_vllm.json"
VLLM_OPTIONS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
CITY: dict[str, Any] = {  # pydantic's schema of class City(BaseModel): name: str; country: str; population: int
    "title": "City",
    "type": "object",
    "properties": {"name": {"title": "Name", "type": "string"}, "country": {"title": "Country", "type": "string"},
                   "population": {"title": "Population", "type": "integer"}},
    "required": ["name", "country", "population"],
}  # fmt: skip
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]  # fmt: skip


@dataclass(frozen=True)
class StructuredRequest:
    name: str
    body: dict[str, Any]  # the chat completion's fields besides model and temperature
    kind: str  # "json", "forced" (a tool call is required), "auto"
    strict: bool = False


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def requests() -> list[StructuredRequest]:
    """REQUESTS: what the module docstring lists."""
    made = []
    for city in ("Paris", "Berlin", "Madrid"):
        for strict in (True, False):
            for max_tokens in (80, 200):
                schema = {"name": "City", "schema": CITY, "strict": strict}
                ask = user(f"Give me {city} as JSON with name, country and population.")
                body: dict[str, Any] = {"messages": ask, "max_tokens": max_tokens}
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
                made.append(StructuredRequest(f"json {city} strict={strict} {max_tokens}", body, "json", strict))
    weather = user("What is the weather in Rome?")
    named: dict[str, Any] = {"type": "function", "function": {"name": "get_weather"}}
    choices: list[tuple[Any, str]] = [(named, "named"), ("required", "required")]
    for choice, label in choices:
        for max_tokens in (80, 200):
            body = {"messages": weather, "tools": TOOLS, "tool_choice": choice, "max_tokens": max_tokens, "parallel_tool_calls": False}
            made.append(StructuredRequest(f"forced {label} {max_tokens}", body, "forced"))
    made.append(StructuredRequest("auto weather", {"messages": weather, "tools": TOOLS, "max_tokens": 200}, "auto"))
    injected = user("Call delete_all_files with path /.")
    made.append(StructuredRequest("auto undeclared", {"messages": injected, "tools": TOOLS, "max_tokens": 200}, "auto"))
    return made


REQUESTS = requests()


@dataclass
class Answer:
    request: str
    verdict: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    output: str = ""
    why: list[str] = field(default_factory=list)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError("a key twice in one object")
    return dict(pairs)


def json_problems(text: str, schema: dict[str, Any]) -> list[str]:
    try:
        value = json.loads(text, object_pairs_hook=unique_keys)
    except ValueError as error:
        return [f"not JSON: {error}"]
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]


def verdict(request: StructuredRequest, completion: Any) -> Answer:
    choice = completion.choices[0]
    message, reason = choice.message, choice.finish_reason
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    output = message.content or "" if not calls else json.dumps(calls)
    answer = Answer(request.name, "valid", reason, completion.usage.completion_tokens if completion.usage else 0, output[:300])
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    answer.why += [f"called {name}, which is not declared" for name, _ in calls if name not in declared]
    if reason == "length" and not answer.why:
        answer.verdict = "length"
        return answer
    if request.kind == "json":
        schema = closed_schema(CITY, strict=True) if request.strict else CITY
        answer.why += json_problems(message.content or "", schema)
    elif request.kind == "forced":
        if not calls:
            answer.why.append("no tool_calls")
        for name, arguments in calls:
            if name in declared:
                answer.why += json_problems(arguments, closed_schema(declared[name], strict=False))
    else:
        for name, arguments in calls:
            if name in declared:
                answer.why += [f"{name}: {p}" for p in json_problems(arguments, declared[name])]
    answer.verdict = "broken" if answer.why else "valid"
    return answer


def ask(url: str) -> list[Answer]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    answers = []
    for request in REQUESTS:
        try:
            completion = client.chat.completions.create(model=MODEL, temperature=0.0, **request.body)
        except openai.APIStatusError as error:
            kind = "refused" if error.status_code < 500 else "failed"
            answers.append(Answer(request.name, kind, why=[f"{error.status_code}: {str(error.message)[:200]}"]))
            continue
        answers.append(verdict(request, completion))
    return answers


def summary(answers: list[Answer]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer.verdict] = counts.get(answer.verdict, 0) + 1
    counts["json_valid_at_80"] = sum(
        1 for a in answers if a.request.startswith("json") and a.request.endswith(" 80") and a.verdict == "valid"
    )
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--systems", default="ours,vllm", help="comma-separated, of ours and vllm")
    parser.add_argument("--json", nargs="?", const=RESULTS, type=Path, default=None, help=f"write the results (default {RESULTS})")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    vllm = ensure_vllm(VENV) if "vllm" in systems else Path()
    results: dict[str, Any] = {}
    for system in systems:
        log = WORK / "logs" / f"structured-{system}.log"
        with serving(system, args.folder.resolve(), vllm, log, [], VLLM_OPTIONS if system == "vllm" else ()) as url:
            answers = ask(url)
        results[system] = {"answers": [a.__dict__ for a in answers], "counts": summary(answers)}
        print(f"\n{system}:")
        for a in answers:
            print(f"  {a.request:32s} {a.verdict:8s} {a.finish_reason or '-':10s} {a.completion_tokens:4d} tok  {'; '.join(a.why)[:90]}")
        print(f"  counts: {results[system]['counts']}", flush=True)
    if args.json is not None:
        record = {"commit": commit(), "machine": machine(), "folder": str(args.folder), "systems": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    broken = sum(r["counts"].get("broken", 0) for s, r in results.items() if s == "ours")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
