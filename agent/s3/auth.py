"""An s3:// source's credentials and region, and requests signed with them (SigV4, by botocore).

The only module that imports botocore, and only when an s3:// source is used: a node without one
never loads it. Signing is botocore's (``S3SigV4Auth``), never code of ours; what is ours is where
the credentials come from and what may be said about them:

- the standard chain (the AWS_* environment variables, the shared credentials and config files,
  with the source's ``profile``; then a container's or an instance's role), as the AWS CLI has it;
- or the file the source's ``credentials`` names, in the shared credentials format, which must be
  readable only by root and the user wagent runs as: a file others can read is refused, naming it.

No secret reaches a message: errors name the file or the profile, never a key; botocore's own
debug log (which prints the string it signs, session token included) is held at WARNING.

    auth = S3Auth.of(source)                       # resolves once
    headers = auth.sign("GET", url, {"Range": "bytes=0-9"})
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

from agent.policy.model import Source
from agent.s3.address import split_s3

DEFAULT_REGION = "us-east-1"


class S3AuthError(Exception):
    """Credentials that can't be had or may not be used (never shows a secret); the pull
    treats it as it treats any source's unreadable credentials."""


def check_private(path: str, uid: int | None = None, gid: int | None = None) -> None:
    """Refuse a credentials file that anyone but root and the service user (``uid``, ``gid``:
    this process's by default) could read or replace."""
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    try:
        st = os.stat(path)
    except OSError as e:
        raise S3AuthError(f"credentials file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise S3AuthError(f"credentials file {path}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    owners = {0, uid}
    if st.st_uid not in owners:
        raise S3AuthError(f"credentials file {path}: owned by uid {st.st_uid}; only root or "
                          f"the service user (uid {uid}) may own it")
    if mode & 0o007:
        raise S3AuthError(f"credentials file {path}: others may read it (mode {mode:04o}); "
                          f"make it readable by root and the service user only, e.g. chmod 600 "
                          f"(or 640 with group {gid})")
    if mode & 0o070 and st.st_gid not in {0, gid}:
        raise S3AuthError(f"credentials file {path}: group {st.st_gid} may read it (mode "
                          f"{mode:04o}); only root's or the service user's group (gid {gid}) may")


def _quiet_botocore() -> None:
    # botocore.auth logs the canonical request and the string to sign at DEBUG, session token
    # included: never let a root logger at DEBUG carry that into the journal.
    for name in ("botocore", "boto3", "s3transfer"):
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class _Resolved:
    credentials: Any        # botocore Credentials (refreshable ones refresh themselves), or None
    region: str
    where: str              # where they came from, for messages: a file, a profile, the chain


class S3Auth:
    """One s3:// source's credentials and region, resolved once; ``sign`` is thread-safe."""

    def __init__(self, source: Source) -> None:
        split_s3(source.url)
        _quiet_botocore()
        self.source = source
        self._resolved = _resolve(source)

    @property
    def region(self) -> str:
        return self._resolved.region

    @property
    def where(self) -> str:
        return self._resolved.where

    @property
    def anonymous(self) -> bool:
        return self._resolved.credentials is None

    def sign(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with the SigV4 ones added (Authorization, X-Amz-Date,
        X-Amz-Content-SHA256, X-Amz-Security-Token); unchanged when anonymous."""
        creds = self._resolved.credentials
        if creds is None:
            return headers
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.exceptions import BotoCoreError
        try:
            frozen = creds.get_frozen_credentials()     # refreshes expiring ones
        except BotoCoreError as e:
            raise S3AuthError(f"the credentials ({self.where}) could not be refreshed: "
                              f"{type(e).__name__}") from None
        request = AWSRequest(method=method, url=url, headers=dict(headers))
        S3SigV4Auth(frozen, "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def client(self, *, streams: int = 8) -> Any:
        """A botocore S3 client for this source (publishing): the same credentials, region,
        endpoint and addressing; botocore's standard retries (throttling backs off)."""
        import botocore.session
        from botocore.config import Config
        options: dict[str, Any] = {
            "s3": {"addressing_style": self.source.addressing},
            "retries": {"max_attempts": 6, "mode": "standard"},
            "max_pool_connections": max(10, streams * 2),
            "connect_timeout": 10, "read_timeout": 120,
            "user_agent_extra": "wagent"}
        # botocore >= 1.36 adds CRC checksums (and aws-chunked bodies) that many self-hosted
        # stores refuse; ask for them only where required. 1.29 knows neither option.
        if "request_checksum_calculation" in Config.OPTION_DEFAULTS:
            options["request_checksum_calculation"] = "when_required"
            options["response_checksum_validation"] = "when_required"
        session = botocore.session.Session()
        creds = self._resolved.credentials
        frozen = creds.get_frozen_credentials() if creds is not None else None
        kwargs: dict[str, Any] = {}
        if frozen is None:
            from botocore import UNSIGNED
            options["signature_version"] = UNSIGNED
        else:
            kwargs = {"aws_access_key_id": frozen.access_key,
                      "aws_secret_access_key": frozen.secret_key,
                      "aws_session_token": frozen.token}
        return session.create_client(
            "s3", region_name=self.region, endpoint_url=self.source.endpoint,
            verify=self.source.ca_bundle or True, config=Config(**options), **kwargs)


class S3Auths:
    """Each s3:// source's ``S3Auth``, resolved on first use, shared by the pull's streams; a
    source's credentials file is read again once it changed (keys rotated under a running
    daemon take effect at its next request, without a restart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[Source, tuple[tuple[int, ...] | None, S3Auth]] = {}

    def of(self, source: Source) -> S3Auth:
        stamp = _stamp(source.credentials) if source.credentials else None
        with self._lock:
            known = self._known.get(source)
            if known is None or known[0] != stamp:
                known = self._known[source] = (stamp, S3Auth(source))
            return known[1]


def _stamp(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid, st.st_gid)


def _resolve(source: Source) -> _Resolved:
    import botocore.session
    from botocore.exceptions import BotoCoreError

    try:
        session = botocore.session.Session(profile=source.profile)
        if source.credentials:
            from botocore.credentials import SharedCredentialProvider
            check_private(source.credentials)
            profile = source.profile or "default"
            where = f"file {source.credentials}, [{profile}]"
            creds = SharedCredentialProvider(creds_filename=source.credentials,
                                             profile_name=profile).load()
            if creds is None:
                raise S3AuthError(f"credentials file {source.credentials}: no [{profile}] "
                                  "section with aws_access_key_id and aws_secret_access_key")
        else:
            where = (f"the AWS chain, profile {source.profile}" if source.profile
                     else "the AWS chain")
            creds = session.get_credentials()
            if creds is not None:
                method = getattr(creds, "method", "")
                where = f"{where}: {method}" if method else where
        region = source.region or session.get_config_variable("region") or DEFAULT_REGION
    except S3AuthError:
        raise
    except BotoCoreError as e:
        # ProfileNotFound, a config file that doesn't parse, ...: botocore's words name the
        # profile or file, never a key.
        raise S3AuthError(f"credentials for {source.url}: {e}") from None
    return _Resolved(creds, region, where)
