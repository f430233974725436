"""A source's credentials, read from a file: the Authorization header a request carries.

The file holds one line, ``bearer TOKEN`` or ``basic USER:PASSWORD``; its content is never logged
nor put in an error message.

>>> # read_credentials("/etc/wagent/origin.token")  -> "Bearer s3cr3t"
"""

from __future__ import annotations

import base64


class CredentialsError(Exception):
    """A credentials file that can't be read or parsed (its content is never shown)."""


def read_credentials(path: str) -> str:
    """The Authorization header value from a credentials file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise CredentialsError(f"credentials file {path}: {e.strerror}") from None
    kind, _, secret = text.partition(" ")
    secret = secret.strip()
    if kind.lower() == "bearer" and secret:
        return f"Bearer {secret}"
    if kind.lower() == "basic" and ":" in secret:
        return "Basic " + base64.b64encode(secret.encode()).decode()
    raise CredentialsError(f"credentials file {path}: expected one line 'bearer TOKEN' or "
                           "'basic USER:PASSWORD'")
