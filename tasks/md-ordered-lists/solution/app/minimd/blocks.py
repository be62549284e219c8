"""Block structure: headings, paragraphs, bullet and numbered lists."""
import re

_HEADING = re.compile(r"(#{1,6})\s+(.*)")
_BULLET = re.compile(r"[-*]\s+(.*)")
_NUMBERED = re.compile(r"(\d{1,9})[.)]\s+(.*)")


def parse_blocks(text: str) -> list:
    """Split Markdown text into blocks: ("heading", level, text), ("para", text), ("ul", [items]),
    ("ol", start, [items])."""
    blocks = []
    para = []

    def flush():
        if para:
            blocks.append(("para", " ".join(para)))
            para.clear()

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            flush()
            continue
        m = _HEADING.fullmatch(line)
        if m:
            flush()
            blocks.append(("heading", len(m.group(1)), m.group(2).strip()))
            continue
        m = _BULLET.fullmatch(line)
        if m:
            flush()
            if blocks and blocks[-1][0] == "ul":
                blocks[-1][1].append(m.group(1))
            else:
                blocks.append(("ul", [m.group(1)]))
            continue
        m = _NUMBERED.fullmatch(line)
        if m:
            flush()
            if blocks and blocks[-1][0] == "ol":
                blocks[-1][2].append(m.group(2))
            else:
                blocks.append(("ol", int(m.group(1)), [m.group(2)]))
            continue
        para.append(line)
    flush()
    return blocks
