"""Translation of real text, shared by `/v1/translate` and LibreTranslate's `/translate`.

Every text is split into sentences (service/api/sentences.py); every sentence becomes one engine
request, so they batch with each other and with other clients' sentences at every decode step.
The translations are joined back around the text's own whitespace; HTML documents have only
their text translated (service/api/html_text.py).
"""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from service.api.backend import ModelBackend, final_chunk, open_stream
from service.api.errors import APIError
from service.api.html_text import HtmlDocument
from service.api.sentences import Span, join_translations, split_sentences
from service.config import ServiceConfig
from service.protocol import Chunk, GenerateRequest

TextFormat = Literal["text", "html"]


@dataclass(frozen=True)
class SentenceTranslation:
    span: Span  # where the sentence is in its text
    result: Chunk  # the whole translation: text, alternatives (beam search's next best), usage


@dataclass(frozen=True)
class TextTranslation:
    """One text (or one HTML document) translated sentence by sentence."""

    text: str
    alternatives: list[str]  # alternative i of the text: alternative i of each sentence that has one
    sentences: list[SentenceTranslation]

    @property
    def finish_reason(self) -> str:
        """ "length" when any sentence was cut by max_tokens: the response says so."""
        return "length" if any(s.result.finish_reason == "length" for s in self.sentences) else "stop"


def joined(text: str, sentences: Sequence[SentenceTranslation], alternative: int | None = None) -> str:
    """text rebuilt around its sentences' translations (alternative i where a sentence has one)."""

    def pick(s: SentenceTranslation) -> str:
        alternatives = s.result.alternatives
        return alternatives[alternative] if alternative is not None and alternative < len(alternatives) else s.result.text

    return join_translations(text, [s.span for s in sentences], [pick(s) for s in sentences])


def usage(translations: Sequence[TextTranslation]) -> dict[str, int]:
    prompt_tokens = sum(s.result.prompt_tokens for t in translations for s in t.sentences)
    completion_tokens = sum(s.result.completion_tokens for t in translations for s in t.sentences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def check_size(texts: list[str], config: ServiceConfig, param: str) -> None:
    """The request's limits on items and characters, on the texts as sent."""
    if not texts:
        raise APIError(400, f"{param} must not be an empty list", param)
    if len(texts) > config.max_batch_texts:
        raise APIError(400, f"{param} has {len(texts)} items; the limit is {config.max_batch_texts}", param)
    for i, text in enumerate(texts):
        if not text.strip():
            raise APIError(400, f"{param} item {i} is empty" if len(texts) > 1 else f"{param} is empty", param)
    characters = sum(len(t) for t in texts)
    if characters > config.max_translate_chars:
        raise APIError(400, f"{param} has {characters} characters; the limit is {config.max_translate_chars} per request", param)


def split_texts(texts: list[str], config: ServiceConfig, param: str) -> list[list[Span]]:
    """The sentences of each text, with the request's limit on sentences checked on the whole."""
    spans = [split_sentences(t, config.max_sentence_chars) for t in texts]
    sentences = sum(len(s) for s in spans)
    if sentences > config.max_translate_sentences:
        raise APIError(400, f"{param} has {sentences} sentences; the limit is {config.max_translate_sentences} per request", param)
    return spans


def plain_text(document: str, text_format: TextFormat) -> str:
    """What the translator would see of a document."""
    return document if text_format == "text" else "\n".join(HtmlDocument.parse(document).block_texts())


async def translate_texts(
    backend: ModelBackend, config: ServiceConfig, texts: list[str], spans: list[list[Span]], template: GenerateRequest
) -> list[TextTranslation]:
    """Each text translated sentence by sentence: up to `sentences_in_flight` sentences of the
    request in the engine at once (a long text must not fill a replica's queue by itself). The
    first refusal or failure cancels the rest and is raised."""
    sentences = [text[s.start : s.end] for text, text_spans in zip(texts, spans, strict=True) for s in text_spans]
    window = asyncio.Semaphore(config.sentences_in_flight)

    async def translate_one(sentence: str) -> Chunk:
        async with window:
            stream = await open_stream(backend, replace(template, text=sentence), config.retry_after_seconds)
            return await final_chunk(stream, "translation", config.retry_after_seconds)

    tasks = [asyncio.ensure_future(translate_one(s)) for s in sentences]
    try:
        results = iter(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # one sentence failed: the others stop using the model
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    translations = []
    for text, text_spans in zip(texts, spans, strict=True):
        done = [SentenceTranslation(span, next(results)) for span in text_spans]
        n_alternatives = max((len(s.result.alternatives) for s in done), default=0)
        alternatives = [joined(text, done, i) for i in range(n_alternatives)]
        translations.append(TextTranslation(joined(text, done), alternatives, done))
    return translations


async def translate_documents(
    backend: ModelBackend, config: ServiceConfig, documents: list[str], text_format: TextFormat, template: GenerateRequest, param: str
) -> list[TextTranslation]:
    """Texts, or HTML documents whose text is translated and markup kept. Limits are checked on
    the documents as sent (items, characters: `check_size`, called first) and on what is
    translated (sentences)."""
    if text_format == "text":
        return await translate_texts(backend, config, documents, split_texts(documents, config, param), template)
    parsed = [HtmlDocument.parse(d) for d in documents]
    blocks = [b for doc in parsed for b in doc.block_texts()]
    translated = iter(await translate_texts(backend, config, blocks, split_texts(blocks, config, param), template))
    results = []
    for doc in parsed:
        done = [next(translated) for _ in doc.blocks]
        html = doc.render([[(s.span, s.result.text) for s in block.sentences] for block in done])
        results.append(TextTranslation(html, [], [s for block in done for s in block.sentences]))
    return results
