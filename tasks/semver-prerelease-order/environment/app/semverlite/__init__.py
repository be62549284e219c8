"""semverlite: parse and compare semantic versions."""
from .version import Version, parse
from .ranges import satisfies

__all__ = ["Version", "parse", "satisfies"]
