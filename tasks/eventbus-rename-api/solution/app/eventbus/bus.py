"""EventBus: handlers are called in subscription order; a handler may unsubscribe itself or others."""
import warnings
from collections import defaultdict


class EventBus:
    def __init__(self):
        self._handlers = defaultdict(list)

    def on(self, topic, handler):
        """Register handler for topic; returns a callable that unsubscribes it."""
        self._handlers[topic].append(handler)
        return lambda: self.off(topic, handler)

    def off(self, topic, handler):
        handlers = self._handlers.get(topic, [])
        if handler in handlers:
            handlers.remove(handler)

    def emit(self, topic, payload=None):
        """Call every handler subscribed to topic (at the time of emitting); return how many ran."""
        count = 0
        for handler in list(self._handlers.get(topic, [])):
            handler(payload)
            count += 1
        return count

    def handler_count(self, topic):
        return len(self._handlers.get(topic, []))

    # Deprecated names (remove in the next release).
    def subscribe(self, topic, handler):
        warnings.warn("EventBus.subscribe is deprecated; use EventBus.on", DeprecationWarning, stacklevel=2)
        return self.on(topic, handler)

    def unsubscribe(self, topic, handler):
        warnings.warn("EventBus.unsubscribe is deprecated; use EventBus.off", DeprecationWarning, stacklevel=2)
        return self.off(topic, handler)

    def publish(self, topic, payload=None):
        warnings.warn("EventBus.publish is deprecated; use EventBus.emit", DeprecationWarning, stacklevel=2)
        return self.emit(topic, payload)
