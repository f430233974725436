"""An s3:// bucket as a publish destination, over botocore's S3 client.

Small files go in one PUT; a file larger than a part goes up as a multipart upload whose parts
the publish's workers send in parallel (with every other file's). Both are atomic on S3: the
object appears whole when the PUT or the upload's completion returns, never before. Each object
carries the sha256 of the manifest's entry as user metadata (``x-amz-meta-wagent-sha256``), so
that a publish run again keeps what is there (same size, same sha256) and resumes a multipart
upload left unfinished: the parts already sent whose size and MD5 ETag match the file's bytes
are kept, the others sent again. Errors are S3's in words (``agent.s3.errors``).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.manifest import FileEntry, Piece
from agent.policy.model import Source
from agent.publish.destination import Job, Present, PublishError, Sent
from agent.publish.pieces import group, read_verified
from agent.s3.address import object_key, split_s3
from agent.s3.auth import S3Auth
from agent.s3.errors import explain

PART = 16 << 20             # boto3's is 8 MiB; larger parts, fewer requests, same parallelism
MAX_PARTS = 10_000          # S3's limit
META = "wagent-sha256"


def part_size(size: int) -> int:
    """The least size of a part of a file of ``size`` bytes: ``PART``, or larger (whole MiB)
    when the file would need more than S3's 10,000 parts."""
    need = -(-size // MAX_PARTS)
    return max(PART, -(-need // (1 << 20)) * (1 << 20))


class S3Destination:
    def __init__(self, source: Source, *, streams: int = 8) -> None:
        self.source = source
        self.bucket, _ = split_s3(source.url)
        self.auth = S3Auth(source)
        self.client = self.auth.client(streams=streams)
        self._lock = threading.Lock()

    def name(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def key(self, relative: str) -> str:
        return object_key(self.source.url, relative)

    # -- reads -----------------------------------------------------------------------------
    def read(self, key: str, limit: int) -> bytes | None:
        try:
            r = self._call("GetObject", key, Bucket=self.bucket, Key=self.key(key))
        except _Missing:
            return None
        with r["Body"] as body:
            return body.read(limit + 1)

    def present(self, key: str) -> Present | None:
        try:
            r = self._call("HeadObject", key, Bucket=self.bucket, Key=self.key(key))
        except _Missing:
            return None
        return Present(int(r["ContentLength"]), (r.get("Metadata") or {}).get(META))

    # -- writes ----------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        self._call("PutObject", key, Bucket=self.bucket, Key=self.key(key), Body=data,
                   ContentType="text/plain" if key.endswith("/latest") else
                   "application/json")

    def file_jobs(self, key: str, path: Path, entry: FileEntry
                  ) -> tuple[list[Job], Callable[[], None]]:
        found = self.present(key)
        if found is not None and found.size == entry.size and found.sha256 == entry.sha256:
            return [], lambda: None
        if entry.size <= PART:
            return [Job(lambda sent: self._put_file(key, path, entry, sent), entry.size)], \
                lambda: None
        return self._multipart(key, path, entry)

    def _put_file(self, key: str, path: Path, entry: FileEntry, sent: Sent) -> None:
        data = read_verified(path, 0, entry.size, entry.pieces)
        self._call("PutObject", key, Bucket=self.bucket, Key=self.key(key), Body=data,
                   Metadata={META: entry.sha256})
        sent(len(data))

    def _multipart(self, key: str, path: Path, entry: FileEntry
                   ) -> tuple[list[Job], Callable[[], None]]:
        # Parts are runs of whole pieces: each part's pieces are checked from its own bytes.
        bounds = [(n + 1, off, size, pieces) for n, (off, size, pieces)
                  in enumerate(group(entry.pieces, part_size(entry.size)))]
        if len(bounds) > MAX_PARTS:
            raise PublishError(f"{path}: {len(bounds)} parts, more than S3's {MAX_PARTS}: "
                               "build the manifest with larger pieces")
        upload, kept = self._resume(key, path, bounds)
        if upload is None:
            upload = self._call("CreateMultipartUpload", key, Bucket=self.bucket,
                                Key=self.key(key), Metadata={META: entry.sha256})["UploadId"]
        etags: dict[int, str] = dict(kept)

        def send(number: int, offset: int, length: int, pieces: tuple[Piece, ...],
                 sent: Sent) -> None:
            data = read_verified(path, offset, length, pieces)
            r = self._call("UploadPart", key, Bucket=self.bucket, Key=self.key(key),
                           UploadId=upload, PartNumber=number, Body=data)
            with self._lock:
                etags[number] = r["ETag"]
            sent(length)

        def complete() -> None:
            parts = [{"PartNumber": n, "ETag": etags[n]} for n, _, _, _ in bounds]
            self._call("CompleteMultipartUpload", key, Bucket=self.bucket, Key=self.key(key),
                       UploadId=upload, MultipartUpload={"Parts": parts})

        jobs = [Job(lambda sent, n=n, o=o, s=s, ps=ps: send(n, o, s, ps, sent), s)
                for n, o, s, ps in bounds if n not in kept]
        return jobs, complete

    def _resume(self, key: str, path: Path,
                bounds: list[tuple[int, int, int, tuple[Piece, ...]]]
                ) -> tuple[str | None, dict[int, str]]:
        """An unfinished upload of ``key`` left by an interrupted publish, and its parts whose
        bytes are the file's (size and MD5 ETag); (None, {}) when there is none to resume."""
        r = self._call("ListMultipartUploads", key, Bucket=self.bucket, Prefix=self.key(key))
        uploads = [u for u in r.get("Uploads", []) if u.get("Key") == self.key(key)]
        if not uploads:
            return None, {}
        upload = max(uploads, key=lambda u: u.get("Initiated") or 0)["UploadId"]
        listed = self._call("ListParts", key, Bucket=self.bucket, Key=self.key(key),
                            UploadId=upload)
        runs = {n: (o, s, ps) for n, o, s, ps in bounds}
        kept = {}
        for p in listed.get("Parts", []):
            n, etag = int(p["PartNumber"]), p.get("ETag", "")
            if n not in runs or int(p.get("Size", -1)) != runs[n][1]:
                break
            # S3's part ETag is the MD5 of its bytes (without SSE-KMS): a part whose ETag is
            # the MD5 of these verified bytes holds them.
            data = read_verified(path, *runs[n])
            if etag.strip('"') != hashlib.md5(data, usedforsecurity=False).hexdigest():
                break
            kept[n] = etag
        else:
            return upload, kept
        # A part that is not this file's: the upload was of other bytes (the file changed
        # since), and its metadata names their sha256; start again rather than mix them.
        self._call("AbortMultipartUpload", key, Bucket=self.bucket, Key=self.key(key),
                   UploadId=upload)
        return None, {}

    def _call(self, op: str, key: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError
        method = getattr(self.client, _snake(op))
        try:
            return method(**kwargs)
        except ClientError as e:
            meta = e.response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 0)
            code = e.response.get("Error", {}).get("Code") or ""
            if op in ("GetObject", "HeadObject") and (status == 404 or code in
                                                      ("NoSuchKey", "404", "NotFound")):
                if code != "NoSuchBucket":
                    raise _Missing() from None
            body = f"<Error><Code>{code}</Code></Error>".encode() if code and \
                not code.isdigit() else b""
            # botocore parsed the document already: its code is all that is left of it.
            raise PublishError(explain(status, body, {}, self.name(key),
                                       head=not body).words) from None
        except BotoCoreError as e:
            # EndpointConnectionError, NoCredentialsError, ...: botocore's words name the
            # endpoint or the missing credentials, never a key.
            raise PublishError(f"{self.name(key)}: {e}") from None

    def close(self) -> None:
        self.client.close()


class _Missing(Exception):
    pass


def _snake(op: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in op).lstrip("_")

