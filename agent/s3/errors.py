"""An S3 error response in words: what went wrong and what to do, never a secret.

S3 answers a failed request with an XML ``<Error><Code>..</Code><Message>..</Message></Error>``
document. The code says the cause; the message is the server's and may quote what it was sent
(a signature's string to sign names the access key), so it is never shown; nor are the request's
headers. ``explain`` returns the words and whether the request may be retried (and after how
long): throttling backs off, a bad credential or a missing bucket does not get better by asking
again at once.

>>> explain(404, b"<Error><Code>NoSuchBucket</Code></Error>", {}, "s3://m/p").words
's3://m/p: no such bucket (NoSuchBucket): check the bucket name and the endpoint'
>>> explain(503, b"<Error><Code>SlowDown</Code></Error>", {}, "s3://m/p").retry_after
1.0
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Read the code with a pattern, not an XML parser: an error body is untrusted input, and a
# pattern can't be made to expand entities or fetch anything.
_CODE = re.compile(rb"<Code>\s*([A-Za-z0-9.\-_]{1,64})\s*</Code>")
_ERROR = re.compile(rb"<Error\b")

# What each code means to a node operator. Codes not here are shown as they come, with the
# status; they come from the server, so a bounded token, never its message.
_WORDS = {
    "NoSuchBucket": "no such bucket: check the bucket name and the endpoint",
    "NoSuchKey": "no such key: the object is not in the bucket (not published yet?)",
    "AccessDenied": "access denied: the credentials may not read (or write) this bucket or "
                    "prefix",
    "AllAccessDisabled": "access denied: all access to this object has been disabled",
    "InvalidAccessKeyId": "the access key is not known to this endpoint: check the "
                          "credentials (and that the endpoint is the store they belong to)",
    "SignatureDoesNotMatch": "bad signature: the secret key does not match the access key",
    "RequestTimeTooSkewed": "this node's clock is more than 15 minutes off the store's: the "
                            "signature's time is refused; fix the clock (NTP)",
    "RequestExpired": "the request's signature expired: this node's clock may be off; fix "
                      "the clock (NTP)",
    "ExpiredToken": "the credentials expired: refresh their session token",
    "TokenRefreshRequired": "the credentials expired: refresh their session token",
    "InvalidToken": "the session token is malformed or invalid: refresh the credentials",
    "AuthorizationHeaderMalformed": "the signature names another region: set the source's "
                                    "region to the bucket's",
    "PermanentRedirect": "the bucket is in another region or must be addressed through "
                         "another endpoint: set the source's region (or endpoint)",
    "SlowDown": "throttled (SlowDown): the store asks for fewer requests; backing off",
    "ServiceUnavailable": "the store is unavailable for now; backing off",
    "InternalError": "the store failed internally; retrying",
    "PreconditionFailed": "the object changed on the store (its ETag no longer matches)",
    "InvalidRange": "the range asked for is outside the object: it is not the manifest's file",
}
_RETRY = {"SlowDown": 1.0, "ServiceUnavailable": 1.0, "InternalError": 0.5,
          "RequestTimeout": 0.5}


@dataclass(frozen=True)
class S3Failure:
    words: str
    code: str | None                # None: the answer was not an S3 error document
    retry_after: float | None       # the wait before asking this source again


def code_of(body: bytes) -> str | None:
    """The ``<Code>`` of an S3 error document, None if ``body`` is not one."""
    if not _ERROR.search(body[:4096]):
        return None
    m = _CODE.search(body)
    return m.group(1).decode("ascii") if m else None


def explain(status: int, body: bytes, headers: Mapping[str, str], where: str,
            after: float | None = None, *, head: bool = False) -> S3Failure:
    """``where`` (the object, redacted) and the cause in words; ``after``: the answer's own
    Retry-After, which wins over the code's default wait; ``head``: the answer to a HEAD,
    which S3 sends without a body (any other answer of S3's has its error document)."""
    code = code_of(body)
    if code is None:
        if status in (500, 502, 503, 504):
            # A gateway or load balancer in front of the store; worth another try.
            return S3Failure(f"{where}: HTTP {status} without an S3 error document (a proxy "
                             "or load balancer in front of the store?)", None, after or 1.0)
        if head and not body and status in (403, 404, 412, 416):
            # HEAD answers carry no body: the status alone says it.
            word = {403: "access denied", 404: "no such key", 412: "the object changed",
                    416: "bad range"}[status]
            return S3Failure(f"{where}: HTTP {status} ({word})", None, after)
        return S3Failure(f"{where}: HTTP {status} without an S3 error document: is the "
                         "endpoint an S3 API (and not a website or another server)?", None,
                         after)
    words = _WORDS.get(code)
    text = f"{where}: {words}" if words else f"{where}: HTTP {status} {code}"
    if words and f"({code})" not in words:
        head, sep, tail = words.partition(":")
        text = f"{where}: {head} ({code}){sep}{tail}"
    retry = after if after is not None else _RETRY.get(code)
    return S3Failure(text, code, retry)
