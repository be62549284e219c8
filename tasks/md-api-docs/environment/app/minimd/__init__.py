"""minimd: a deliberately small Markdown-to-HTML renderer."""
from .blocks import parse_blocks
from .inline import render_inline
from .render import to_html

__all__ = ["to_html", "render_inline", "parse_blocks"]
