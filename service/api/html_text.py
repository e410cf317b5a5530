"""HTML in, HTML out: the text is translated, the markup is kept.

The document is parsed with the standard library's HTML parser into markup (kept verbatim) and
text nodes. Consecutive text nodes joined only by inline tags (`<b>`, `<a href=...>`, `<i>`, ...)
form one block of plain text, so a sentence that runs through inline tags is translated whole.
Each sentence's translation is then shared out over the text nodes the sentence ran through, in
proportion to how many of the sentence's words each held, word by word (punctuation alone in a
node stays put): every tag stays where it was,
with the same nesting and attributes. `<script>`, `<style>`, `<code>`, `<pre>` and `<textarea>`
are left untouched, as are comments and declarations. Entities are decoded for the translator
and written back escaped (`&amp;`, `&lt;`, `&nbsp;`), so the output is well-formed where the
input was.
"""

import html
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser

from service.api.sentences import Span

INLINE_TAGS = frozenset(
    {"a", "abbr", "b", "bdi", "bdo", "cite", "data", "dfn", "em", "font", "i", "kbd", "mark", "q", "s", "samp", "small", "span"}
    | {"strong", "sub", "sup", "time", "u", "var"}
)
UNTRANSLATED_TAGS = frozenset({"script", "style", "code", "pre", "textarea"})


@dataclass
class TextNode:
    raw: str  # as written in the document
    value: str  # entities decoded


@dataclass
class HtmlDocument:
    """parts: markup (str) and text nodes in document order; blocks: the parts indices of each
    block's text nodes."""

    parts: list[str | TextNode] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)

    @classmethod
    def parse(cls, document: str) -> "HtmlDocument":
        parser = _Parser()
        parser.feed(document)
        parser.close()
        parser.end_block()
        return parser.document

    def block_texts(self) -> list[str]:
        """The plain text of each block (what the translator sees)."""
        return ["".join(self._node(i).value for i in block) for block in self.blocks]

    def render(self, translations: Sequence[Sequence[tuple[Span, str]]]) -> str:
        """The document with each block's sentences (spans of its plain text) replaced by their
        translations; translations has one list per block."""
        rendered: dict[int, str] = {}
        for block, sentences in zip(self.blocks, translations, strict=True):
            rendered.update(self._render_block(block, sentences))
        return "".join(part if isinstance(part, str) else rendered.get(i, part.raw) for i, part in enumerate(self.parts))

    def _node(self, index: int) -> TextNode:
        node = self.parts[index]
        assert isinstance(node, TextNode)
        return node

    def _render_block(self, block: list[int], sentences: Sequence[tuple[Span, str]]) -> dict[int, str]:
        """New text of each node of the block that a sentence runs through."""
        nodes = [self._node(i) for i in block]
        offsets = [0]
        for node in nodes:
            offsets.append(offsets[-1] + len(node.value))
        replacements: list[list[tuple[int, int, str]]] = [[] for _ in nodes]  # per node: (start, end, text), local
        for span, translation in sentences:
            pieces = []  # (node, local start, local end) of the sentence's non-blank text in each node it runs through
            for k, node in enumerate(nodes):
                start, end = max(span.start, offsets[k]) - offsets[k], min(span.end, offsets[k + 1]) - offsets[k]
                if start < end and node.value[start:end].strip():
                    text = node.value[start:end]
                    start += len(text) - len(text.lstrip())
                    end -= len(text) - len(text.rstrip())
                    pieces.append((k, start, end))
            texts = [nodes[k].value[start:end] for k, start, end in pieces]
            weights = [word_count(t) for t in texts]
            if len(pieces) > 1:
                # Punctuation alone in a node (the "." after </a>) stays where it was, once.
                if weights[-1] == 0 and translation.endswith(texts[-1]):
                    translation = translation[: -len(texts[-1])].rstrip()
                if weights[0] == 0 and translation.startswith(texts[0]):
                    translation = translation[len(texts[0]) :].lstrip()
            shares = share_words(translation, weights)
            for (k, start, end), share, text, weight in zip(pieces, shares, texts, weights, strict=True):
                replacements[k].append((start, end, text if weight == 0 and len(pieces) > 1 else share))
        rendered = {}
        for k, node_replacements in enumerate(replacements):
            if node_replacements:
                out, position = [], 0
                for start, end, text in node_replacements:
                    out += [escape(nodes[k].value[position:start]), escape(text)]
                    position = end
                out.append(escape(nodes[k].value[position:]))
                rendered[block[k]] = "".join(out)
        return rendered


def share_words(translation: str, weights: Sequence[int]) -> list[str]:
    """translation cut between words into len(weights) consecutive pieces sized by weight. Pieces
    of weight 0 get nothing; the others get at least one word each, earlier ones first, while
    words last. One weight: the translation unchanged."""
    if len(weights) == 1:
        return [translation]
    targets = [i for i, w in enumerate(weights) if w > 0] or [0]
    words, total = translation.split(), sum(weights[i] for i in targets) or 1
    bounds, cumulative = [0], 0
    for j, i in enumerate(targets[:-1], start=1):
        cumulative += weights[i]
        low = min(bounds[-1] + 1, len(words))  # this piece gets a word if any is left
        high = max(len(words) - (len(targets) - j), low)  # and leaves one for each later piece
        bounds.append(min(max(round(len(words) * cumulative / total), low), high))
    bounds.append(len(words))
    shares = [""] * len(weights)
    for i, (a, b) in zip(targets, itertools.pairwise(bounds), strict=True):
        shares[i] = " ".join(words[a:b])
    return shares


def word_count(text: str) -> int:
    """Words with a letter or digit (a lone "." or quote is not one)."""
    return sum(any(c.isalnum() for c in word) for word in text.split())


def escape(text: str) -> str:
    return html.escape(text, quote=False).replace("\xa0", "&nbsp;")


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.document = HtmlDocument()
        self.block: list[int] = []
        self.untranslated_depth = 0  # inside <script>, <code>, ...

    def end_block(self) -> None:
        if self.block:
            self.document.blocks.append(self.block)
            self.block = []

    def markup(self, raw: str, inline: bool) -> None:
        if not inline:
            self.end_block()
        self.document.parts.append(raw)

    def text(self, raw: str, value: str) -> None:
        parts = self.document.parts
        if self.untranslated_depth:
            parts.append(raw)
        elif self.block and self.block[-1] == len(parts) - 1:
            last = self.document._node(len(parts) - 1)
            last.raw, last.value = last.raw + raw, last.value + value
        else:
            parts.append(TextNode(raw, value))
            self.block.append(len(parts) - 1)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.markup(self.get_starttag_text() or f"<{tag}>", tag in INLINE_TAGS and not self.untranslated_depth)
        self.untranslated_depth += tag in UNTRANSLATED_TAGS

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.markup(self.get_starttag_text() or f"<{tag}/>", tag in INLINE_TAGS and not self.untranslated_depth)

    def handle_endtag(self, tag: str) -> None:
        if tag in UNTRANSLATED_TAGS and self.untranslated_depth:
            self.untranslated_depth -= 1
        self.markup(f"</{tag}>", tag in INLINE_TAGS and not self.untranslated_depth)

    def handle_data(self, data: str) -> None:
        self.text(data, data)

    def handle_entityref(self, name: str) -> None:
        raw = f"&{name};"
        self.text(raw, html.unescape(raw))

    def handle_charref(self, name: str) -> None:
        raw = f"&#{name};"
        self.text(raw, html.unescape(raw))

    def handle_comment(self, data: str) -> None:
        self.markup(f"<!--{data}-->", inline=False)

    def handle_decl(self, decl: str) -> None:
        self.markup(f"<!{decl}>", inline=False)

    def handle_pi(self, data: str) -> None:
        self.markup(f"<?{data}>", inline=False)

    def unknown_decl(self, data: str) -> None:
        self.markup(f"<![{data}]>", inline=False)
