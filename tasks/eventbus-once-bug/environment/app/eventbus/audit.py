"""Audit log: records every event published on the watched topics."""


class AuditLog:
    def __init__(self, bus, topics):
        self.entries = []
        for topic in topics:
            bus.subscribe(topic, lambda payload, t=topic: self.entries.append((t, payload)))
