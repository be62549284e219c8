"""retry(): call fn until it succeeds, retrying on the given exceptions."""
import time

from .backoff import Backoff


class RetryError(Exception):
    def __init__(self, attempts, last):
        super().__init__(f"gave up after {attempts} attempts: {last!r}")
        self.attempts, self.last = attempts, last


def retry(fn, *, attempts=3, on=(Exception,), backoff=None, sleep=time.sleep):
    """Call fn() up to `attempts` times; sleep backoff.delay(n) before retry n; raise RetryError at the end.

    Exceptions not in `on` propagate immediately."""
    if attempts < 1:
        raise ValueError("attempts must be >= 1")
    backoff = backoff or Backoff()
    last = None
    for n in range(1, attempts + 1):
        try:
            return fn()
        except on as exc:
            last = exc
            if n < attempts:
                sleep(backoff.delay(n))
    raise RetryError(attempts, last) from last
