"""What a failed request raises: the pull tries another source, or waits, or gives the file up.

    FetchError        one request failed (network, status, framing); ``retry_after`` when the
                      source asked to be left alone for a while
    ChangedError      the file changed on the source (its ETag is not the one recorded)
    NoRangesError     the source answers Range requests with the whole file
"""

from __future__ import annotations


class FetchError(Exception):
    """One request failed (network, status, framing); the pull may try another source.

    ``retry_after``: the seconds the source asked to be left alone (a 503 or 429 with
    ``Retry-After``), which the pull honours before it asks that source again."""

    def __init__(self, message: str, retry_after: float | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status          # the HTTP status, when an answer came


class ChangedError(FetchError):
    """The file changed on the source (its ETag is not the one recorded)."""

    def __init__(self, message: str, etag: str | None) -> None:
        super().__init__(message)
        self.etag = etag


class NoRangesError(FetchError):
    """The source answers Range requests with the whole file: no use for pieces."""
