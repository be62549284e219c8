class RateLimited(Exception):
    """Raised by acquire() when no capacity is left; retry_after is in seconds."""

    def __init__(self, retry_after: float):
        super().__init__(f"rate limited, retry after {retry_after:.3f}s")
        self.retry_after = retry_after
