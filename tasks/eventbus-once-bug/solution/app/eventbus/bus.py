"""EventBus: handlers are called in subscription order; a handler may unsubscribe itself or others."""
from collections import defaultdict


class EventBus:
    def __init__(self):
        self._handlers = defaultdict(list)

    def subscribe(self, topic, handler):
        """Register handler for topic; returns a callable that unsubscribes it."""
        self._handlers[topic].append(handler)
        return lambda: self.unsubscribe(topic, handler)

    def unsubscribe(self, topic, handler):
        handlers = self._handlers.get(topic, [])
        if handler in handlers:
            handlers.remove(handler)

    def publish(self, topic, payload=None):
        """Call every handler subscribed to topic (at the time of publishing); return how many ran."""
        count = 0
        for handler in list(self._handlers.get(topic, [])):
            handler(payload)
            count += 1
        return count

    def handler_count(self, topic):
        return len(self._handlers.get(topic, []))
