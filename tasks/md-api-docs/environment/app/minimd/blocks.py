"""Block structure: headings, paragraphs, bullet lists."""
import re

_HEADING = re.compile(r"(#{1,6})\s+(.*)")
_BULLET = re.compile(r"[-*]\s+(.*)")


def parse_blocks(text: str) -> list:
    """Split Markdown text into blocks: ("heading", level, text), ("para", text), ("ul", [items])."""
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
        para.append(line)
    flush()
    return blocks
