"""Sentence spans of a text, and the text rebuilt around their translations.

The translator was trained on single captions, so it is given single sentences. Splitting is
lossless: every non-whitespace character of the text lies in exactly one span, the spans are in
order, and whatever lies between them (spaces, line breaks, blank lines) is kept verbatim when
the translations are joined. Sentence boundaries come from `sentencex` (it handles abbreviations,
decimals, quotes, ellipses and lists, and returns pieces that concatenate back to the input);
a line break always ends a sentence, so lines (list items, verse, addresses) stay lines. A
sentence longer than `max_chars` is cut further at a clause boundary, else between words, else
between characters: never truncated.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

import sentencex

# A clause ends after one of these marks when whitespace follows.
CLAUSE_END = re.compile(r"[,;:\u2013\u2014)](?=\s)")
WHITESPACE = re.compile(r"\s+")
LINE = re.compile(r"[^\r\n]+")


@dataclass(frozen=True)
class Span:
    """text[start:end]: one sentence (or piece of a long one), no whitespace at either end."""

    start: int
    end: int


def split_sentences(text: str, max_chars: int) -> list[Span]:
    """The sentences of text in order, each at most max_chars long (max_chars >= 1)."""
    spans: list[Span] = []
    position = 0
    for piece in sentencex.segment("en", text):
        start = text.index(piece, position)  # sentencex returns consecutive substrings of text
        position = start + len(piece)
        for line in LINE.finditer(piece):
            stripped = line.group().strip()
            if stripped:
                first = start + line.start() + line.group().index(stripped)
                spans.extend(_bounded(text, first, first + len(stripped), max_chars))
    return spans


def _bounded(text: str, start: int, end: int, max_chars: int) -> list[Span]:
    """[start, end) cut into spans of at most max_chars: after the last clause mark that leaves a
    piece of at least a quarter of the limit, else at the last whitespace, else at max_chars."""
    spans = []
    while end - start > max_chars:
        window = text[start : start + max_chars + 1]  # a cut right after the limit keeps the piece whole
        clause_ends = [m.end() for m in CLAUSE_END.finditer(window) if m.end() >= max_chars // 4 and m.end() <= max_chars]
        spaces = [m.start() for m in WHITESPACE.finditer(window) if m.start() > 0]
        cut = clause_ends[-1] if clause_ends else (spaces[-1] if spaces else max_chars)
        spans.append(Span(start, start + len(text[start : start + cut].rstrip())))
        start += cut
        while text[start].isspace():
            start += 1
    spans.append(Span(start, end))
    return spans


def join_translations(text: str, spans: Sequence[Span], translations: Sequence[str]) -> str:
    """text with each span replaced by its translation; everything between spans kept as is."""
    pieces, position = [], 0
    for span, translation in zip(spans, translations, strict=True):
        pieces += [text[position : span.start], translation]
        position = span.end
    pieces.append(text[position:])
    return "".join(pieces)
