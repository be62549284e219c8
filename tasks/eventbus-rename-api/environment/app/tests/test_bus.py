from eventbus import EventBus


def test_publish():
    bus, seen = EventBus(), []
    bus.subscribe("a", seen.append)
    assert bus.publish("a", 1) == 1
    assert seen == [1]
