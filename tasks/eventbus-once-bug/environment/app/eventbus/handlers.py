"""Handler helpers."""


def once(bus, topic, handler):
    """Subscribe handler so that it runs for the first published event only."""
    def wrapper(payload):
        unsubscribe()
        handler(payload)

    unsubscribe = bus.subscribe(topic, wrapper)
    return unsubscribe
