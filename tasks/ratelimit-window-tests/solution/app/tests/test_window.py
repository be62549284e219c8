from ratelimit import ManualClock, SlidingWindowLog


def make(limit=3, window=10.0):
    clock = ManualClock()
    return SlidingWindowLog(limit, window, clock=clock), clock


def test_allows_up_to_limit():
    w, _ = make()
    assert [w.hit("a") for _ in range(4)] == [True, True, True, False]


def test_denied_hits_are_not_recorded():
    w, clock = make(limit=2, window=10)
    assert w.hit("a") and w.hit("a")
    for _ in range(5):
        clock.advance(1)
        assert not w.hit("a")
    clock.advance(5)  # first two hits are now exactly 10 s old
    assert w.hit("a") and w.hit("a")
    assert not w.hit("a")


def test_hit_exactly_window_old_expires():
    w, clock = make(limit=1, window=5)
    assert w.hit("k")
    clock.advance(4.999)
    assert not w.hit("k")
    clock.advance(0.001)
    assert w.hit("k")


def test_keys_independent():
    w, _ = make(limit=1)
    assert w.hit("a")
    assert w.hit("b")
    assert not w.hit("a")
    assert not w.hit("b")


def test_count():
    w, clock = make(limit=5, window=10)
    w.hit("a")
    clock.advance(3)
    w.hit("a"); w.hit("a")
    assert w.count("a") == 3
    assert w.count("b") == 0
    clock.advance(7)
    assert w.count("a") == 2
    clock.advance(3)
    assert w.count("a") == 0
