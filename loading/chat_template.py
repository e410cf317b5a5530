"""Chat templates (a tokenizer_config.json's chat_template or a chat_template.jinja file) rendered as
transformers' apply_chat_template(messages, tokenize=False) renders them: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, the loop controls, the globals raise_exception,
strftime_now and namespace, a tojson that keeps non-ASCII text, and the tokenizer's named special
tokens (bos_token, eos_token, ...) as variables. Templates come from the model's folder: the
sandbox keeps them from reaching Python's internals.
"""

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loading.tokenizer import ChatTemplateError

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | ..., "content": str, ...}
__all__ = ["ChatTemplateError", "Message", "compile_chat_template", "render_chat_template"]


class _Generation(Extension):
    """{% generation %}...{% endgeneration %}, which marks assistant text for training masks:
    rendered as its body alone, as transformers does when it does not track those spans."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not compile (line {error.lineno}: {error.message})") from None


def render_chat_template(
    template: jinja2.Template,
    messages: list[Message],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation as the model's prompt text (its special tokens written as text); tools:
    OpenAI's `tools` entries, for the template's `tools` variable."""
    try:
        return template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"the chat template refused the messages: {error}") from None
