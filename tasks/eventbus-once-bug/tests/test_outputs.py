from eventbus import EventBus, once


def test_once_does_not_skip_next():
    bus, seen = EventBus(), []
    once(bus, "t", lambda p: seen.append(("once", p)))
    bus.subscribe("t", lambda p: seen.append(("always", p)))
    assert bus.publish("t", 1) == 2
    assert bus.publish("t", 2) == 1
    assert seen == [("once", 1), ("always", 1), ("always", 2)]


def test_many_once_handlers():
    bus, seen = EventBus(), []
    for i in range(5):
        once(bus, "t", lambda p, i=i: seen.append(i))
    assert bus.publish("t") == 5
    assert seen == [0, 1, 2, 3, 4]
    assert bus.handler_count("t") == 0


def test_unsubscribe_other_during_publish_still_runs_this_time():
    bus, seen = EventBus(), []
    unsub_b = None

    def a(p):
        seen.append("a")
        unsub_b()

    bus.subscribe("t", a)
    unsub_b = bus.subscribe("t", lambda p: seen.append("b"))
    bus.publish("t")
    bus.publish("t")
    assert seen == ["a", "b", "a"]


def test_subscribe_during_publish_sees_only_later_events():
    bus, seen = EventBus(), []

    def adder(p):
        seen.append(("adder", p))
        bus.subscribe("t", lambda q: seen.append(("late", q)))

    once(bus, "t", adder)
    bus.publish("t", 1)
    bus.publish("t", 2)
    assert seen == [("adder", 1), ("late", 2)]
