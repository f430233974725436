"""Where an ``s3://BUCKET/PREFIX`` source's objects are on HTTP: pure, no botocore.

A source ``s3://models/fleet`` with ``endpoint: http://minio:9000`` keeps version ``v4`` of
``llama`` at ``http://minio:9000/models/fleet/llama/v4/`` (path addressing, what MinIO, Ceph RGW
and SeaweedFS answer by default); without an endpoint it is AWS, virtual-host addressed:
``https://models.s3.eu-west-1.amazonaws.com/fleet/llama/v4/``. The pull engine then fetches those
URLs as it fetches any source's, the requests signed (``agent.s3.auth``).

>>> http_base("s3://models/fleet", "http://minio:9000", None, "auto")
'http://minio:9000/models/fleet'
>>> http_base("s3://models/fleet", None, "eu-west-1", "auto")
'https://models.s3.eu-west-1.amazonaws.com/fleet'
>>> split_s3("s3://models/a/b/")
('models', 'a/b')
"""

from __future__ import annotations

import re
from urllib.parse import quote, urlsplit

SCHEME = "s3://"
ADDRESSING = ("auto", "path", "virtual")
# S3's rules for a bucket's name (general purpose buckets): 3-63 of a-z 0-9 . -, starting and
# ending with a letter or digit, not an IPv4 address.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


class S3AddressError(ValueError):
    """An ``s3://`` URL or endpoint that names no bucket S3 could hold."""


def is_s3(url: str) -> bool:
    return url[:5].lower() == SCHEME


def split_s3(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at either end) of ``s3://BUCKET[/PREFIX]``."""
    if not is_s3(url):
        raise S3AddressError(f"{url!r} is not an s3://BUCKET/PREFIX URL")
    rest = url[len(SCHEME):]
    bucket, _, prefix = rest.partition("/")
    if "?" in rest or "#" in rest:
        raise S3AddressError(f"{url!r}: an s3:// source is a bucket and a prefix, without "
                             "?query or #fragment")
    if not _BUCKET.match(bucket) or _IPV4.match(bucket) or ".." in bucket:
        raise S3AddressError(f"{url!r}: {bucket!r} is not a bucket name (3-63 of a-z, 0-9, "
                             "'.', '-', starting and ending with a letter or digit)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise S3AddressError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return bucket, prefix


def check_endpoint(endpoint: str) -> None:
    """An endpoint is an http(s) URL with a host, and at most a path (a gateway's mount)."""
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise S3AddressError(f"endpoint {endpoint!r} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise S3AddressError(f"endpoint {endpoint!r} must be an http:// or https:// URL with a "
                             "host, e.g. http://minio.storage:9000")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise S3AddressError(f"endpoint {endpoint!r} must have no user, ?query or #fragment "
                             "(credentials come from the AWS chain or the source's file)")


def aws_endpoint(region: str | None) -> str:
    return f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com"


def virtual_host(bucket: str, endpoint: str | None, addressing: str) -> bool:
    """Whether the bucket goes into the host name. ``auto``: on AWS (no endpoint) when the
    name is a DNS label TLS can cover (no dots); path style on any other endpoint, which is
    what self-hosted stores answer without a wildcard DNS name."""
    if addressing == "virtual":
        return True
    if addressing == "path":
        return False
    return endpoint is None and "." not in bucket


def http_base(url: str, endpoint: str | None, region: str | None, addressing: str) -> str:
    """The HTTP(S) URL that ``{url}/{model}/...`` objects are under."""
    bucket, prefix = split_s3(url)
    base = (endpoint or aws_endpoint(region)).rstrip("/")
    tail = ("/" + quote(prefix, safe="/")) if prefix else ""
    if virtual_host(bucket, endpoint, addressing):
        parts = urlsplit(base)
        return f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path}{tail}"
    return f"{base}/{bucket}{tail}"


def object_key(url: str, *parts: str) -> str:
    """The key of ``{url}/{parts...}`` inside its bucket (what publish writes)."""
    _, prefix = split_s3(url)
    return "/".join(p for p in (prefix, *parts) if p)
