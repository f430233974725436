"""`wagent publish`'s steps, in the order nodes need them: files, then the manifest, then latest.

A node that finds ``{model}/{version}/manifest.json`` fetches every file it names, and a node
that follows ``{model}/latest`` learns of a version only when ``latest`` names it; so the files go
first (in parallel, each atomically), the manifest once they all are there, ``latest`` last. An
interruption leaves what a node never reads (files without their manifest) and a run again sends
only what is missing. A version already published with other bytes is refused: nodes may hold
it, and a version's name means its bytes.

Every byte sent is checked against the manifest's pieces on the way, from the bytes in memory
(``agent.publish.pieces``): a byte that wasn't verified is never published, and a file that
changed since the build fails its publish before its manifest goes up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from agent.manifest import MANIFEST_NAME, Manifest, ManifestError, parse, to_json
from agent.publish.destination import Destination, Job, PublishError
from agent.status import PullProgress

MANIFEST_LIMIT = 64 << 20       # what a node reads of a manifest
TICK = 0.5                      # progress reports, as a pull's


@dataclass(frozen=True)
class PublishResult:
    model: str
    version: str
    files: int
    bytes_total: int
    bytes_sent: int             # sent now (the rest was there already)
    seconds: float
    already: bool               # the version was published before (same bytes)
    latest: bool                # ``latest`` names it now


def local_manifest(directory: Path, build: Callable[[], Manifest]) -> tuple[Manifest, bool]:
    """The version's manifest: DIR's own (its files' sizes checked here, their bytes piece by
    piece as they are sent: ``agent.publish.pieces``), or one built now (``build`` writes
    it); (manifest, built)."""
    path = directory / MANIFEST_NAME
    if not path.exists():
        return build(), True
    m = parse(path.read_bytes(), str(path))
    for f in m.files:
        full = directory / f.path
        try:
            size = full.stat().st_size
        except OSError as e:
            raise PublishError(f"{full}: {e.strerror} (the manifest names it)") from None
        if size != f.size:
            raise PublishError(f"{full}: {size} bytes, the manifest says {f.size}: the files "
                               "changed since the build; build the manifest again")
    return m, False


def same_files(a: Manifest, b: Manifest) -> bool:
    """Same files, same bytes (the publication time may differ: a rebuilt manifest)."""
    return (a.model, a.version, a.files) == (b.model, b.version, b.files)


def publish(directory: Path, m: Manifest, dest: Destination, *, latest: bool = True,
            streams: int = 8, progress: Callable[[PullProgress], None] | None = None,
            clock: Callable[[], float] = time.monotonic) -> PublishResult:
    started = clock()
    prefix = f"{m.model}/{m.version}"
    manifest_key = f"{prefix}/{MANIFEST_NAME}"
    raw = dest.read(manifest_key, MANIFEST_LIMIT)
    already = raw is not None
    if raw is not None:
        try:
            there = parse(raw, dest.name(manifest_key))
        except ManifestError as e:
            raise PublishError(f"{dest.name(manifest_key)} is there but unusable ({e}); "
                               "remove it by hand if nothing uses it") from None
        if not same_files(there, m):
            raise PublishError(f"{dest.name(prefix)} is already published with other bytes: "
                               "nodes may hold it, and a version's name means its bytes; "
                               "publish these files under a new version name")
        m = there                               # its publication time stands
    files = Uploads(m, progress, clock, started)
    for f in m.files:
        jobs, complete = dest.file_jobs(f"{prefix}/{f.path}", directory / f.path, f)
        files.add(f.path, f.size, jobs, complete)
    files.run(streams)
    if not already:
        dest.put_bytes(manifest_key, to_json(m))
    if latest:
        dest.put_bytes(f"{m.model}/latest", f"{m.version}\n".encode())
    files.report("done")
    return PublishResult(m.model, m.version, len(m.files), m.size, files.sent,
                         clock() - started, already, latest)


class Uploads:
    """The files' jobs run on ``streams`` workers; a file is completed by the worker that ran
    its last job; progress reported as a pull's."""

    def __init__(self, m: Manifest, progress: Callable[[PullProgress], None] | None,
                 clock: Callable[[], float], started: float) -> None:
        self.m = m
        self.progress = progress
        self.clock = clock
        self.started = started
        self.lock = threading.Lock()
        self.sent = 0               # bytes sent now
        self.done = 0               # bytes there: kept or sent, of completed jobs
        self.kept = 0               # bytes that were there already
        self.files_done = 0
        self.active = 0
        self.samples: list[tuple[float, int]] = []
        self.work: list[tuple[str, Job]] = []
        self.left: dict[str, int] = {}
        self.completes: dict[str, Callable[[], None]] = {}

    def add(self, path: str, size: int, jobs: list[Job], complete: Callable[[], None]) -> None:
        kept = size - sum(j.size for j in jobs)
        self.done += kept
        self.kept += kept
        if not jobs:
            complete()
            self.files_done += 1
            return
        self.left[path] = len(jobs)
        self.completes[path] = complete
        self.work += [(path, j) for j in jobs]

    def run(self, streams: int) -> None:
        self.report("start")
        if not self.work:
            return
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True,
                                  name="publish-progress")
        ticker.start()
        # Largest first: the last worker to finish is not the one left with a big file.
        self.work.sort(key=lambda w: -w[1].size)
        pool = ThreadPoolExecutor(max_workers=max(1, streams), thread_name_prefix="publish")
        try:
            futures: list[Future[None]] = [pool.submit(self._one, p, j) for p, j in self.work]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in finished:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            ticker.join()

    def _one(self, path: str, job: Job) -> None:
        with self.lock:
            self.active += 1
        try:
            job.run(self._sent)
        finally:
            with self.lock:
                self.active -= 1
        with self.lock:
            self.done += job.size
            self.left[path] -= 1
            last = self.left[path] == 0
        if last:
            self.completes[path]()
            with self.lock:
                self.files_done += 1
            self.report("file", path)

    def _sent(self, n: int) -> None:
        with self.lock:
            self.sent += n

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(TICK):
            self.report("progress")

    def report(self, event: str, file: str | None = None) -> None:
        if self.progress is None:
            return
        now = self.clock()
        with self.lock:
            self.samples = [s for s in self.samples if now - s[0] < 5.0] + [(now, self.sent)]
            t0, b0 = self.samples[0]
            rate = (self.sent - b0) / (now - t0) if now > t0 else 0.0
            p = PullProgress(self.m.model, self.m.version, event, self.m.size,
                             self.done if event != "done" else self.m.size, self.sent,
                             self.kept, rate,
                             self.active, self.files_done, len(self.m.files),
                             now - self.started, file)
        self.progress(p)
