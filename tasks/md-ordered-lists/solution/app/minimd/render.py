"""Render parsed blocks to HTML."""
from .blocks import parse_blocks
from .inline import render_inline


def render_block(block) -> str:
    kind = block[0]
    if kind == "heading":
        level = block[1]
        return f"<h{level}>{render_inline(block[2])}</h{level}>"
    if kind == "para":
        return f"<p>{render_inline(block[1])}</p>"
    if kind == "ul":
        items = "".join(f"<li>{render_inline(item)}</li>" for item in block[1])
        return f"<ul>{items}</ul>"
    if kind == "ol":
        start, items = block[1], block[2]
        attr = "" if start == 1 else f' start="{start}"'
        return f"<ol{attr}>" + "".join(f"<li>{render_inline(item)}</li>" for item in items) + "</ol>"
    raise ValueError(f"unknown block kind {kind!r}")


def to_html(text: str, wrap: str | None = None) -> str:
    """Render a Markdown document; blocks joined by newlines, optionally inside <wrap>...</wrap>."""
    body = "\n".join(render_block(b) for b in parse_blocks(text))
    if wrap:
        return f"<{wrap}>\n{body}\n</{wrap}>"
    return body
