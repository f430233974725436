"""A small document's body (manifest, ``latest``) read whole, decoded, and bounded.

The body is read raw and inflated here in bounded steps: urllib3 1.26 inflates a whole read at
once (a 2 MB gzip bomb grew to 4 GB). No HTTP library here: the caller passes the raw read.

>>> import gzip, io
>>> read_small(io.BytesIO(gzip.compress(b"v7")).read, "gzip", "u", 100)
b'v7'
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from agent.pull.errors import FetchError
from agent.redact import redact

READ_SIZE = 64 * 1024            # bytes read at a time


def read_small(read: Callable[[int], bytes], content_encoding: str | None, url: str,
               limit: int) -> bytes:
    """The body ``read`` (raw bytes, at most n a call, b"" at its end) returns, decoded as its
    ``Content-Encoding`` says, refused beyond ``limit`` bytes."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("identity", ""):
        inflater = None
    elif encoding in ("gzip", "x-gzip", "deflate"):
        inflater = Inflater()
    else:
        raise FetchError(f"{redact(url)}: sent Content-Encoding {encoding!r}, which wagent does "
                         "not decode; serve it uncompressed (or gzip)")
    out = bytearray()
    received = 0
    while data := read(READ_SIZE):
        received += len(data)
        if inflater is not None:
            try:
                data = inflater.feed(data, limit + 1 - len(out))
            except zlib.error as e:
                raise FetchError(f"{redact(url)}: its {encoding} body can't be decoded ({e})"
                                 ) from None
        out += data
        if len(out) > limit or received > limit:
            raise FetchError(f"{redact(url)}: larger than {limit} bytes")
    if inflater is not None and inflater.truncated:
        raise FetchError(f"{redact(url)}: its {encoding} body ends half way")
    return bytes(out)


class Inflater:
    """gzip or zlib decoding (either header, detected) that never produces more than it is
    asked for; gzip members may follow one another, as urllib3 accepts."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(zlib.MAX_WBITS | 32)
        self._fed = False               # the current member has had input

    @property
    def truncated(self) -> bool:
        return self._fed and not self._d.eof

    def feed(self, data: bytes, room: int) -> bytes:
        """What ``data`` decodes to, at most ``room`` bytes (more would be refused anyway)."""
        out = bytearray()
        while data and len(out) < room:
            self._fed = True
            out += self._d.decompress(data, room - len(out))
            if self._d.eof:
                data = self._d.unused_data
                self._d, self._fed = zlib.decompressobj(zlib.MAX_WBITS | 32), False
            else:
                data = self._d.unconsumed_tail
        return bytes(out)
