"""retrying: retry calls with exponential backoff."""
from .backoff import Backoff
from .retry import RetryError, retry

__all__ = ["Backoff", "retry", "RetryError"]
