"""eventbus: synchronous in-process publish/subscribe."""
from .bus import EventBus
from .handlers import once

__all__ = ["EventBus", "once"]
