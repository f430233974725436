"""URLs fit for messages, logs and status: no credentials, no signed-URL secrets.

Kept apart from ``agent.pull.client`` (which imports requests) so that the policy checker can use
it.

>>> redact("http://user:p@ss@[::1]:8080/m/v1/manifest.json?X-Amz-Signature=abc&part=1")
'http://[::1]:8080/m/v1/manifest.json?X-Amz-Signature=***&part=1'
"""

from __future__ import annotations

import re

# Everything from "//" to the last "@" before the query or fragment is userinfo: a password may
# hold "@" (and, unencoded, "/"); an "@" in a path of ours is always percent-encoded.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*:)?//[^?#]*@")
# Query (or matrix) parameters whose names say they carry a secret: S3/GCS/Azure signatures and
# credentials, tokens, keys, passwords.
_SECRET_PARAM = re.compile(
    r"([?&;][^=&#;]*(?:token|signature|sig|secret|passw|pwd|key|credential|auth|session)"
    r"[^=&#;]*=)[^&#;]*", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` without user:password, and with the values of secret-looking query parameters
    (``X-Amz-Signature``, ``token``, ``sig``, ...) replaced by ``***``."""
    m = _USERINFO.match(url)
    if m:
        url = (m.group(1) or "") + "//" + url[m.end():]
    return _SECRET_PARAM.sub(r"\1***", url)
