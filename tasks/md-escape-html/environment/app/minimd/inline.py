"""Inline markup: `code`, **strong**, *em*, [text](url)."""
import re

_CODE = re.compile(r"`([^`]+)`")
_STRONG = re.compile(r"\*\*(.+?)\*\*")
_EM = re.compile(r"\*(.+?)\*")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def render_inline(text: str) -> str:
    """Render one line of inline markup to HTML. Code spans are literal (no markup inside)."""
    out = []
    pos = 0
    for m in _CODE.finditer(text):
        out.append(_format(text[pos:m.start()]))
        out.append("<code>" + m.group(1) + "</code>")
        pos = m.end()
    out.append(_format(text[pos:]))
    return "".join(out)


def _format(text: str) -> str:
    text = _LINK.sub(lambda m: f'<a href="{m.group(2)}">{m.group(1)}</a>', text)
    text = _STRONG.sub(r"<strong>\1</strong>", text)
    text = _EM.sub(r"<em>\1</em>", text)
    return text
