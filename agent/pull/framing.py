"""What a response's status and headers say: its framing checked to the byte, Retry-After read.

Pure functions of a status, a reason and the headers (a case-insensitive mapping, as requests
gives them); each raises the ``agent.pull.errors`` exception the pull acts on. A range response
is checked to the byte: status 206 (a 200 is a full body, refused unless the whole file was asked
for), no ``Content-Encoding``, a ``Content-Range`` naming exactly the bytes asked for (and the
manifest's file size), a ``Content-Length`` of exactly that many bytes.

>>> check_range(206, {"Content-Range": "bytes 0-9/100", "ETag": '"a"'}, "u", 0, 10, None, 100)
'"a"'
"""

from __future__ import annotations

import email.utils
import re
from collections.abc import Mapping

from agent.pull.errors import ChangedError, FetchError, NoRangesError
from agent.redact import redact

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds (RFC 9110 10.2.3): delay-seconds,
    or an HTTP-date read against the response's own ``Date`` (the server's clock against
    itself: no clock of this node, so no skew); None when absent or unreadable.

    >>> retry_after({"Retry-After": "120"})
    120.0
    >>> retry_after({"Retry-After": "Wed, 21 Oct 2026 07:28:30 GMT",
    ...              "Date": "Wed, 21 Oct 2026 07:28:00 GMT"})
    30.0
    """
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(min(int(value[:9]), 10**8))
    try:
        when = email.utils.parsedate_to_datetime(value)
        now = email.utils.parsedate_to_datetime(headers.get("Date") or "")
        return max(0.0, (when - now).total_seconds())
    except (TypeError, ValueError, IndexError):
        return None


def status_error(status: int, reason: str | None, headers: Mapping[str, str],
                 url: str) -> FetchError:
    """A response whose status is not the one asked for; a busy source says when to return."""
    after = retry_after(headers) if status in (429, 503) else None
    told = f" (Retry-After {after:.0f} s)" if after is not None else ""
    return FetchError(f"{redact(url)}: HTTP {status} {reason}{told}", after, status)


def content_length(headers: Mapping[str, str]) -> int | None:
    value = headers.get("Content-Length", "").strip()
    return int(value) if value.isdigit() and len(value) < 20 else None


def check_range(status: int, headers: Mapping[str, str], url: str, offset: int, size: int,
                etag: str | None, total: int | None, reason: str | None = None) -> str | None:
    """The response's ETag, once its status and framing are those of bytes
    [offset, offset+size) of a file of ``total`` bytes (None: unknown), asked for with
    If-Range ``etag`` (None: without)."""
    new_etag = headers.get("ETag")
    if status == 200:
        if etag and new_etag != etag:
            raise ChangedError(f"{redact(url)} changed on the source (ETag {etag} -> "
                               f"{new_etag})", new_etag)
        if offset == 0 and total is not None and size == total:
            # The request covers the whole file: the whole file is the answer, still
            # checked to the byte (its length here, every piece's hash as it lands).
            length = headers.get("Content-Length")
            if length is not None and length.strip() != str(size):
                raise FetchError(f"{redact(url)}: Content-Length {length} for a file of "
                                 f"{size} bytes")
            return new_etag
        raise NoRangesError(f"{redact(url)}: answered 200 (the whole file) to a Range "
                            "request: this source ignores Range, and wagent fetches "
                            "pieces; serve byte ranges (206) from it, or remove it")
    if status != 206:
        raise status_error(status, reason, headers, url)
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        # Despite "Accept-Encoding: identity": these would be bytes of a compressed
        # stream, not of the file; say so rather than report a hash mismatch.
        raise FetchError(f"{redact(url)}: sent Content-Encoding {encoding} for a byte "
                         "range; the source must serve files uncompressed (e.g. nginx: "
                         "gzip off for them)")
    if etag and new_etag and new_etag != etag:
        raise ChangedError(f"{redact(url)} changed on the source (ETag {etag} -> "
                           f"{new_etag})", new_etag)
    m = _CONTENT_RANGE.match(headers.get("Content-Range", ""))
    if not m or int(m.group(1)) != offset or int(m.group(2)) != offset + size - 1:
        raise FetchError(f"{redact(url)}: Content-Range "
                         f"{headers.get('Content-Range')!r} is not the range asked "
                         f"for (bytes {offset}-{offset + size - 1})")
    if total is not None and m.group(3) not in ("*", str(total)):
        raise FetchError(f"{redact(url)}: the source's file has {m.group(3)} bytes, the "
                         f"manifest says {total}: it serves another version of the file")
    length = headers.get("Content-Length")
    if length is not None and length.strip() != str(size):
        raise FetchError(f"{redact(url)}: Content-Length {length} for a range of {size} "
                         "bytes")
    return new_etag
