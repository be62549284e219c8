from eventbus import EventBus


def test_publish():
    bus, seen = EventBus(), []
    bus.on("a", seen.append)
    assert bus.emit("a", 1) == 1
    assert seen == [1]
