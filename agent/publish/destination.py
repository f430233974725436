"""Where ``wagent publish`` writes a version: what every destination must do, atomically.

Two kinds: a local directory that an nginx origin serves (``agent.publish.local``) and an
s3:// bucket (``agent.s3.upload``). Keys are the origin layout's paths below the source base:
``{model}/{version}/{path}``, ``{model}/{version}/manifest.json``, ``{model}/latest``. Every
write is whole or absent to a reader: an object store's PUT (and a multipart upload's
completion) is; a directory's is a temporary file renamed over the name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.manifest import FileEntry

# the bytes a part (or a file's copy) has sent since the last call; called from the workers
Sent = Callable[[int], None]


class PublishError(Exception):
    """A publish that can't go on: the message names the destination and the cause."""


@dataclass(frozen=True)
class Present:
    """What the destination holds under a key: its size, and the sha256 it was written with
    when wagent wrote it (None: unknown, e.g. written by another tool)."""

    size: int
    sha256: str | None


@dataclass(frozen=True)
class Job:
    """One unit of upload work that a worker runs: ``run`` sends its bytes; ``done`` is called
    once every job of the file ran (completes a multipart upload)."""

    run: Callable[[Sent], None]
    size: int


class Destination(Protocol):
    def name(self, key: str) -> str:
        """The key as messages show it (credentials never in it)."""

    def read(self, key: str, limit: int) -> bytes | None:
        """A small object's bytes (a manifest, ``latest``), None when absent."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` at once (readers see the old bytes or these)."""

    def file_jobs(self, key: str, path: Path, entry: FileEntry) -> tuple[list[Job],
                                                                         Callable[[], None]]:
        """The jobs that upload ``path`` (``entry``: its size and sha256) under ``key``, and
        what completes it once they all ran (each job resumable: a job whose bytes are already
        there returns at once). The file appears under ``key`` only on completion."""

    def close(self) -> None: ...
