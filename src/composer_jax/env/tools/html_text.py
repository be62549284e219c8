"""Readable text out of an HTML page, with the standard library's `html.parser` only.

Used by the page reader (`env/tools/web_search.py`: fetched pages, and `--docs-dir` pages of the offline
documentation index). Script, style and other non-content elements are dropped; block elements
(paragraphs, headings, list items, table rows, `<br>`) end a line, so the text keeps the page's
paragraphs; runs of blank lines and spaces are collapsed. Not a renderer: no CSS, no layout.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

_SKIP = {"script", "style", "noscript", "template", "svg", "head", "iframe", "object"}
_BLOCK = {
    "p", "div", "section", "article", "main", "header", "footer", "aside", "nav", "br", "hr", "li", "ul",
    "ol", "dl", "dt", "dd", "tr", "table", "pre", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6",
    "form", "figure", "figcaption", "details", "summary",
}  # fmt: skip
_LINE = {"br", "li", "tr", "dt", "dd"}  # these end a line; other blocks end a paragraph
_BR, _PARA = "\x00", "\x01"  # break markers, resolved once the whole page is read
_VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class _TextParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title_parts: list[str] = []
        self._skip = 0  # depth inside skipped elements
        self._in_title = False
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in _SKIP and tag not in _VOID:
            self._skip += 1
        if tag == "pre":
            self._pre += 1
        if tag in _BLOCK:
            self.parts.append(_BR if tag in _LINE else _PARA)
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6") and not self._skip:
            self.parts.append("#" * int(tag[1]) + " ")
        elif tag == "li" and not self._skip:
            self.parts.append("- ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in _SKIP and self._skip:
            self._skip -= 1
        if tag == "pre" and self._pre:
            self._pre -= 1
        if tag in _BLOCK:
            self.parts.append(_BR if tag in _LINE else _PARA)

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title_parts.append(data)
        elif not self._skip:
            if self._pre:
                self.parts.append(data)
                return
            text = re.sub(r"\s+", " ", data)
            if not self.parts or self.parts[-1][-1:] in (_BR, _PARA):
                text = text.lstrip()  # a line's leading space is markup's, not the text's
            if text:
                self.parts.append(text)


def html_to_text(html: str) -> tuple[str, str]:
    """(title, text) of an HTML document; title is "" when the page has none."""
    parser = _TextParser()
    parser.feed(html)
    parser.close()
    joined = re.sub(
        r"[ \t]*[\x00\x01](?:\s*[\x00\x01])*\n?",
        lambda m: "\n\n" if _PARA in m.group(0) else "\n",
        "".join(parser.parts),
    )
    text = "\n".join(line.rstrip() for line in joined.splitlines()).strip("\n")
    title = re.sub(r"\s+", " ", "".join(parser.title_parts)).strip()
    return title, text
