"""The moving part of a pull: N streams fetching planned requests into partial files.

Each stream is a thread with its own HTTP session per source. It takes the next request (a run of
consecutive pieces of one file) from a shared queue, streams the body in chunks, pays the shared
token bucket per chunk, pwrites each chunk at its offset, hashes the bytes as they arrive and, at
each piece boundary, checks the piece's sha256 and hands the piece to ``Landing``, whose thread
syncs and journals it while the stream reads on (``agent.pull.landing`` says why). A failure
(connection, timeout, status, framing, hash, or a goodput under the floor) moves the rest of the
request to the next source; after every source has failed, the stream backs off (exponential,
with jitter) and goes round again, a bounded number of times. A file whose last piece lands is
moved into blobs/ by the landing thread. The thread that runs the transfer also watches every
request's goodput (``goodput.Meter``: time waiting for the bucket doesn't count) and breaks the
connection of one that trickles under the floor.

Bytes are written before their piece is verified, so one writer owns a piece's bytes at a time:
the stream holding its request (which retries it on the next source), or the copier, which hands a
piece it could not copy to the streams. Verified pieces are never discarded: the pieces' sha256
are the authority on bytes, an ETag only a hint (a source whose ETags disagree is sent no more
If-Range). Pieces copied from local blobs are verified too (read back from the partial): a blob
that rotted on disk is fetched instead.

With peers (``agent.peers``, the cluster's nodes serving each other), a few streams take the
piece ``picker.pick`` chooses from what the neighbours' have-maps list (followed by a thread
per neighbour, ``_watch_peer``): from a neighbour that holds it, or, for the pieces this node
fetches first in its cluster, from the sources. A piece the cache can't send yet is put aside
(``deferred``) rather than waited for on a stream.

Descriptors follow the work, not the version: a stream opens the part file and journal of the
file its request is for and closes them when the request ends (``Partial.opened``), the copier
keeps one partial file and a few local blobs open, so a version of any number of files is pulled
within a small limit of open files.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

from agent import hashing
from agent.manifest import Piece
from agent.policy.model import Source
from agent.pull.client import Client, url_for
from agent.pull.connections import Connections
from agent.pull.credentials import CredentialsError
from agent.pull.demand import Demand
from agent.pull.errors import ChangedError, FetchError, NoRangesError
from agent.pull.goodput import Arrivals, Meter
from agent.pull.landing import Landing
from agent.pull.options import PullOptions
from agent.pull.picker import SOURCES, pick
from agent.pull.plan import Copy, RangeRequest, near_end, take_next, take_piece
from agent.pull.stream_count import StreamCount
from agent.pull.swarm import Peers
from agent.redact import redact
from agent.store import Store
from agent.store.partial import Partial
from agent.units import format_size
from agent.yielding.ratelimit import TokenBucket

log = logging.getLogger(__name__)
# A neighbour that failed a request (down, a broken answer) is not asked again for this long
# by this pull, and its have-map is forgotten until it answers again.
PEER_SKIP = 3.0
# A piece nobody offers once the swarm has stood still for peers.wait / ORPHAN_STEPS is fetched
# from the sources by the next in line after its root, then the one after (agent.pull.picker).
ORPHAN_STEPS = 5
PEER_BUSY = 0.1            # a neighbour sending others pieces (429) is asked again after this
HAVE_LIMIT = 4 << 20       # a have-map's size at most (bits per piece, per file)
HAVE_RETRY = 1.0           # a neighbour whose have-map failed is asked again after this
HAVE_IDLE = 15.0           # a have-map stream silent this long is dead (it beats every 5 s)
# The longest Retry-After honoured: a source that asks for more is asked again after this, so
# a pull still fails within its rounds (``retries``) rather than sleeping on a server's word;
# the daemon's stall limit (agent.pull.node_pulls) allows for it.
RETRY_AFTER_CAP = 120.0
# The longest the other streams stop reading, at a time, while a reader's piece is fetched.
URGENT_HOLD = 1.0
# What one receive typically brings (a few segments at a capped stream's pace, up to a 64 KiB
# GRO aggregate): the grain the stream count measures goodput in.
RECEIVE_GRAIN = 64 * 1024
# How often the stream count is given the bytes so far: its windows are a quarter second.
CHOOSE_EVERY = 0.05


class PullError(Exception):
    """A pull that failed; the message says why and what to do. Verified pieces are kept."""


class StoreFull(PullError):
    """The store's file system is full: the pull gave back what it could and failed."""


FREE_SPACE_HINT = ("run `wagent store gc` (unreferenced blobs, leftovers, stale partial files), "
                   "unpin or evict old versions, then pull again; verified pieces are kept")


class PullStopped(PullError):
    """The pull was asked to stop; partial files are kept for the next pull."""


class _Mismatch(FetchError):
    """A piece's bytes don't hash to the manifest's sha256."""


@dataclass
class FileState:
    blob: str                       # its blob id (agent.blob_id): the key of files and requests
    sha256: str                     # the publisher's claim, checked only with verify_files
    size: int
    path: str                       # the first manifest path with this content, for URLs
    pieces: tuple[Piece, ...]
    partial: Partial
    remaining: int

    @functools.cached_property
    def index(self) -> dict[int, int]:
        """A piece's offset -> its number in the file (its place in line for the sources is
        counted from it, ``agent.peers.swarm``)."""
        return {p.offset: i for i, p in enumerate(self.pieces)}


class Transfer:
    """The streams of one pull of ``model``/``version``. ``options``: the pull's, with the
    streams and request size this pull uses (``agent.pull.engine`` sets them)."""

    def __init__(self, sources: Sequence[Source], store: Store, model: str, version: str,
                 files: dict[str, FileState], requests: Sequence[RangeRequest],
                 copies: Sequence[tuple[str, Copy]], options: PullOptions,
                 bucket: TokenBucket | None, stop: threading.Event,
                 on_file: Callable[[FileState, int], None],
                 clock: Callable[[], float] = time.monotonic, *,
                 connections: Connections, demand: Demand | None = None,
                 peers: Peers | None = None) -> None:
        # The policy's sources, then (when the cluster's nodes serve each other) every peer.
        # With peers, each piece is chosen by what the neighbours hold (``picker.pick``) and
        # fetched from one of them, or (the pieces this node roots) from the sources in order.
        self.sources = list(sources)
        self.own_sources = len(self.sources)
        self.peers = peers
        if peers is not None:
            self.sources += [Source(url) for url in peers.urls]
        # neighbour (index into peers.urls) -> the pieces its have-map lists (under cond)
        self.holds: dict[int, set[tuple[str, int]]] = {}
        self.peer_free_at: dict[int, float] = {}   # neighbour -> when it may be asked again
        self.peer_asked: dict[int, float] = {}     # neighbour -> when it was last asked
        self.chosen: dict[int, int | None] = {}    # stream -> the neighbour its piece is from
        # bytes received by kind of source: "peer", "cache", "origin" (under cond)
        self.fetched_by: dict[str, int] = {}
        # Pieces the cache is fetching still, or can't send yet (it sends one at a time to
        # its cluster): put aside rather than waited for on a stream, (when to ask again, the
        # request); and when each was first put aside and how often: after ``peer_wait`` the
        # next source is asked (under cond).
        self.deferred: list[tuple[float, RangeRequest]] = []
        self.deferred_since: dict[tuple[str, int], tuple[float, int]] = {}
        self.peer_wait = options.peer_wait
        # the last time a neighbour's have-map grew or a piece landed here: a piece nobody
        # offers is fetched from the sources once the swarm has stood still for peer_wait
        self.progressed = clock()
        self.store = store
        self.model = model
        self.version = version
        self.files = files
        self.queue = collections.deque(requests)
        self.copies = list(copies)
        self.s = options
        self.bucket = bucket
        self.stop = stop
        self.on_file = on_file
        self.clock = clock
        self.connections = connections      # the watchdog and sockets' registry of its clients
        self.meters: set[Meter] = set()       # requests whose bodies are being read (under cond)
        # Sources whose ETags were seen to disagree (index -> what was seen): they are sent no
        # If-Range any more, their pieces' sha256 alone judge their bytes (under cond).
        self.etags_ignored: dict[int, str] = {}
        # Sources that ignore Range (index -> why): skipped for the rest of the pull (under cond).
        self.no_ranges: dict[int, str] = {}
        self.cond = threading.Condition()
        self.active = 0
        self.error: PullError | None = None
        self.fetched = 0                  # body bytes received, whatever became of them
        self.reused = 0
        self.streams_busy = 0
        self.verified = 0                 # bytes of pieces verified (or copied) in this pull
        self.in_flight = 0                # bytes received of pieces not verified yet
        self.files_done = 0
        # Readers of a lazy mount wait here for pieces (``agent.pull.demand``): what they want
        # goes first in the queue (``want``), and they hear of every piece that lands.
        self.demand = demand
        self.moved: set[tuple[str, int]] = set()     # pieces put first for a reader (under cond)
        # ...those pieces, each a request of its own, with whether a reader waits for it (else
        # read-ahead): every stream takes these first, and one more stream takes only these, so
        # a reader never waits for the requests in flight to end (seconds each: about 1/64 of
        # the version over one stream's rate); only a piece a reader waits for is boosted
        self.urgent: collections.deque[tuple[RangeRequest, bool]] = collections.deque()
        # the streams (thread ids) fetching a piece a reader waits for, and what each stream
        # fetches now: while any fetches such a piece, the other streams stop reading (their
        # windows close within a round trip), so the piece comes at the link's rate, not at one
        # stream's share of it; a piece already in flight when a reader asks is boosted so too
        self.boosted: set[int] = set()
        self.fetching_now: dict[int, RangeRequest] = {}
        self.receiving_now: dict[int, tuple[str, int]] = {}   # stream -> the piece it receives
        # How many streams run (under cond): all of ``streams``, or as many as measuring what
        # each adds says (``agent.pull.stream_count``); a stream numbered at or past it ends
        # after its request, and one is started for each number under it not running.
        # Judged on the bytes each receive brings (``arrivals``), not on whole chunks: a chunk
        # is a megabyte, seconds of one capped stream, and a window of them is off by one.
        self.chooser = StreamCount(options.streams, grain=RECEIVE_GRAIN) if options.adaptive \
            else None
        self.arrivals = Arrivals()
        self._local = threading.local()   # .arrived: this stream's counter in ``arrivals``
        self.target = self.chooser.count if self.chooser is not None else options.streams
        self.streams_why = self.chooser.reason if self.chooser is not None else \
            f"{options.streams} (peers: a piece at a time from each neighbour)" \
            if peers is not None else \
            f"{options.streams} (fixed: pulls.adaptive_streams is off)"
        self._running: set[int] = set()
        self._landing: Landing[FileState] | None = None     # while ``run`` runs
        self._disturbances = 0            # the bucket's, at the last ``_choose``

    # -- orchestration --------------------------------------------------------------------------
    def run(self, tick: Callable[[], None], interval: float = 0.5) -> None:
        if self.demand is None:
            self._run(tick, interval)
            return
        self.demand.attach(self, list(self.files))
        try:
            self._run(tick, interval)
        finally:
            self.demand.detach(self)

    def want(self, blob: str, piece: Piece, waiting: bool = True) -> bool:
        """For a mount's reader (``agent.pull.demand``): True when ``piece`` of ``blob`` is
        verified in its partial file; else the piece is taken out of its queued request into
        ``urgent`` (the rest of that request first in the queue: readers mostly read on), and
        False. A piece a stream is fetching already, or the copier will copy, is left where
        it is. ``waiting``: a reader waits for it (not read-ahead)."""
        with self.cond:
            f = self.files.get(blob)
            if f is None:
                return False
            if piece.offset in f.partial.done:
                return True
            if (blob, piece.offset) in self.moved:
                if waiting:              # read ahead, now waited for: first, and it stops
                    for i, (req, waited) in enumerate(self.urgent):     # the others too
                        if not waited and req.blob == blob \
                                and req.pieces[0].offset == piece.offset:
                            del self.urgent[i]
                            self.urgent.appendleft((req, True))
                            break
                    else:
                        self._boost_locked(blob, piece.offset)
                return False
            self.moved.add((blob, piece.offset))
            req = take_piece(self.queue, blob, piece.offset)
            if req is None and waiting:
                self._boost_locked(blob, piece.offset)
            if req is not None:
                # a piece a reader waits for goes before any read-ahead (an engine's next
                # tensor must not wait behind every shard's header)
                if waiting:
                    self.urgent.appendleft((req, True))
                else:
                    self.urgent.append((req, False))
                self.cond.notify_all()
            return False

    def fetching(self, blob: str, offset: int) -> bool:
        """For a peer's request (``agent.peers.server``): a stream is receiving this piece
        now (not merely holding a request that reaches it later: that can take as long as
        the request's other pieces)."""
        with self.cond:
            return (blob, offset) in self.receiving_now.values()

    def verified_pieces(self, blob: str) -> frozenset[int]:
        """For a neighbour's have-map (``agent.peers.server``): pieces verified and journaled."""
        with self.cond:
            f = self.files.get(blob)
            return frozenset(f.partial.done) if f is not None else frozenset()

    def _boost_locked(self, blob: str, offset: int) -> None:
        """The stream fetching this piece now (if one is) goes on alone (``_yield_to_urgent``)."""
        for tid, r in self.fetching_now.items():
            if r.blob == blob and r.pieces[0].offset <= offset <= r.pieces[-1].offset:
                self.boosted.add(tid)
                return

    def _run(self, tick: Callable[[], None], interval: float) -> None:
        workers = [self._stream_thread(i) for i in range(self.target)]
        if self.demand is not None:
            workers.append(threading.Thread(target=self._stream, args=(-1, True),
                                            name="pull-urgent", daemon=True))
        copier = threading.Thread(target=self._copy_all, name="pull-copy", daemon=True)
        landing = self._landing = Landing(self._piece_done, self._landing_failed)
        watching = threading.Event()
        if self.peers is not None:
            for n in self.peers.neighbors:
                threading.Thread(target=self._watch_peer, args=(n, watching),
                                 name=f"pull-have-{n}", daemon=True).start()
        try:
            self._run_threads(tick, interval, workers, copier)
        finally:
            watching.set()
            landing.close()       # every verified piece is journaled, even when the pull failed
        if self.error is not None:
            raise self.error
        if self.stop.is_set() and any(f.remaining for f in self.files.values()):
            raise PullStopped("pull stopped; the pieces already verified are kept for the next "
                              "pull")

    def _run_threads(self, tick: Callable[[], None], interval: float,
                     workers: list[threading.Thread], copier: threading.Thread) -> None:
        # Files whose pieces were all journaled already: before any stream can touch them.
        for f in list(self.files.values()):
            if f.remaining == 0:
                try:
                    with f.partial.opened():
                        self._finish_file(f)
                except OSError as e:
                    self._fail(self._os_error(e, f.path))
                except PullError as e:
                    self._fail(e)
        with self.cond:
            self.active += 1              # the copier, so streams don't leave before it ends
        copier.start()
        for w in workers:
            w.start()
        threads = [copier, *workers]
        # Watch goodput several times per window, so a trickle is cut soon after it shows.
        step = interval
        if self.s.floor.enabled:
            step = min(interval, max(0.05, self.s.floor.average_over / 5))
        if self.chooser is not None:
            step = min(step, CHOOSE_EVERY)
        per_tick = max(1, round(interval / step))
        try:
            rounds = 0
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(step)
                self._watch()
                threads += self._choose()
                rounds += 1
                if rounds % per_tick == 0:
                    tick()
        except BaseException:
            # Ctrl-C or a failing tick: the caller closes the partials next, so no thread may
            # still hold their file descriptors (a reused fd number would take its writes).
            self._fail(PullError("pull interrupted; verified pieces are kept"))
            for t in threads:
                t.join()
            raise

    def _stream_thread(self, index: int) -> threading.Thread:
        with self.cond:
            self._running.add(index)
        return threading.Thread(target=self._stream, args=(index,), name=f"pull-{index}",
                                daemon=True)

    def _choose(self) -> list[threading.Thread]:
        """The stream count, measured again (``chooser``); the streams it adds, started."""
        if self.chooser is None:
            return []
        held = self.bucket is not None and self.bucket.rate_binds
        rate = self.bucket.rate if self.bucket is not None else None
        # The backoff moved the bucket's rate, or the fast path cut the streams for a burst:
        # goodput then says what the yielding allowed, not what the path carries (a pull
        # cut to nothing by a training flow would "grow" its count as the flow ended).
        disturbances = self.bucket.disturbances if self.bucket is not None else 0
        yielded, self._disturbances = disturbances != self._disturbances, disturbances
        with self.cond:
            received = self.arrivals.total
            if self.error is not None or self.stop.is_set() or not (self.queue or self.active):
                return []
            # Near the end fewer requests are left than streams: what they carry then says
            # nothing of the path, so the count is not judged on it.
            starved = near_end(self.queue, self.target)
        count = self.chooser.step(self.clock(), received, held, starved=starved or yielded,
                                  cap=rate / 8 if rate is not None else None)
        with self.cond:
            if count != self.target:
                log.info("%s/%s: %d streams: %s", self.model, self.version, count,
                         self.chooser.reason)
            self.target, self.streams_why = count, self.chooser.reason
            missing = [i for i in range(count) if i not in self._running]
            self.cond.notify_all()         # streams past the count end
        started = [self._stream_thread(i) for i in missing]
        for t in started:
            t.start()
        return started

    def _watch(self) -> None:
        """Abandon the requests whose source sends under the goodput floor."""
        with self.cond:
            meters = list(self.meters)
        for m in meters:
            if m.abandoned or (v := m.verdict()) is None:
                continue
            rate, span = v
            why = (f"source {m.source} sent at most {format_size(rate)}/s for {span:.3g} s on "
                   f"{m.what} (the floor is {format_size(self.s.floor.min_rate)}/s); trying the "
                   "next source")
            log.warning("%s", why)
            m.cut(why)

    def _fail(self, error: PullError) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def _next(self, index: int, urgent_only: bool = False) -> RangeRequest | None:
        """The next request: a reader's first (``urgent``), then the planned ones (with
        peers, the one ``_pick_locked`` chooses); only a reader's for the stream that serves
        nothing else. None once the work has run out, or for stream ``index`` once the count
        (``target``) is at or under it."""
        with self.cond:
            while True:
                while True:
                    wake = self._undefer_locked()
                    if not (self.error is None and not self.stop.is_set()
                            and not self.urgent and (
                                (not self.queue and (self.active > 0 or self.deferred))
                                or (urgent_only and (self.queue or self.active > 0)))
                            and (urgent_only or index < self.target)):
                        break
                    self.cond.wait(min(0.2, wake))
                if self.error is not None or self.stop.is_set() or (
                        not urgent_only and index >= self.target):
                    self._running.discard(index)
                    return None
                if self.urgent:
                    req, waited = self.urgent.popleft()
                    if waited:
                        self.boosted.add(threading.get_ident())
                elif self.queue and not urgent_only and self.peers is not None:
                    picked = self._pick_locked()
                    if picked is None:
                        # Nothing a neighbour offers yet, nothing this node roots: wait for
                        # a have-map to change (notified), a deferred request's time or a
                        # busy neighbour's.
                        now = self.clock()
                        free = [t - now for t in self.peer_free_at.values() if t > now]
                        self.cond.wait(min([1.0, self._undefer_locked(), *free]))
                        continue
                    req = picked
                elif self.queue and not urgent_only:
                    req = take_next(self.queue, self.target)
                else:
                    self._running.discard(index)
                    return None
                self.fetching_now[threading.get_ident()] = req
                self.active += 1
                return req

    def _pick_locked(self) -> RangeRequest | None:
        """With peers: the queued request ``picker.pick`` chooses, taken out of the queue, its
        source remembered for the stream (``chosen``); None when none can go now."""
        assert self.peers is not None
        peers = self.peers
        needed = [(r.blob, r.pieces[0].offset) for r in self.queue]
        now = self.clock()
        choice = pick(needed, self.holds,
                      free=lambda n: self.peer_free_at.get(n, 0.0) <= now
                      and n not in self.chosen.values(),
                      rank=lambda p: None if SOURCES in self.chosen.values()
                      else peers.rank(p[0], self.files[p[0]].index[p[1]]),
                      waited=now - self.progressed, patience=self.peer_wait / ORPHAN_STEPS,
                      last_asked=self.peer_asked)
        if choice is None:
            return None
        (blob, offset), source = choice
        for k, r in enumerate(self.queue):
            if r.blob == blob and r.pieces[0].offset == offset:
                del self.queue[k]
                self.chosen[threading.get_ident()] = source
                return r
        return None

    def _undefer_locked(self) -> float:
        """Deferred requests whose time has come go first in the queue; returns the seconds
        until the next one's."""
        if not self.deferred:
            return 1.0
        now = self.clock()
        ready = [r for at, r in self.deferred if at <= now]
        if ready:
            self.deferred = [(at, r) for at, r in self.deferred if at > now]
            self.queue.extendleft(reversed(ready))
        return max(0.005, min((at for at, _ in self.deferred), default=now + 1.0) - now)

    def _defer(self, req: RangeRequest, limit: float) -> bool:
        """Put a request aside whose parents are fetching it still (or are about to); False
        once it has waited ``limit`` (the sources are asked then)."""
        key = (req.blob, req.pieces[0].offset)
        now = self.clock()
        with self.cond:
            since, times = self.deferred_since.get(key, (now, 0))
            if now - since >= limit:
                return False
            self.deferred_since[key] = (since, times + 1)
            # 20 ms, doubling to 0.5 s: soon after the parent has it, without asking a
            # thousand times a second
            self.deferred.append((now + min(0.1, 0.01 * 2 ** times), req))
            self.cond.notify_all()
        return True

    def _release(self) -> None:
        with self.cond:
            self.active -= 1
            self.fetching_now.pop(threading.get_ident(), None)
            self.chosen.pop(threading.get_ident(), None)
            self.receiving_now.pop(threading.get_ident(), None)
            self.boosted.discard(threading.get_ident())
            self.cond.notify_all()

    def _yield_to_urgent(self) -> None:
        """A stream on planned work waits while a reader's piece is fetched, up to
        ``URGENT_HOLD`` at a time (a source slow on that piece doesn't stop the pull)."""
        me = threading.get_ident()
        if not self.boosted or me in self.boosted:
            return
        deadline = self.clock() + URGENT_HOLD
        with self.cond:
            while self.boosted and me not in self.boosted and not self.stop.is_set() \
                    and self.error is None:
                left = deadline - self.clock()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.05))

    # -- local copies ---------------------------------------------------------------------------
    def _copy_all(self) -> None:
        """Copy the planned pieces from local blobs. The copies come file by file, so one
        partial file is open at a time, and the source blobs, mostly in the same order, are
        kept open a few at a time (a version of thousands of files must not open thousands)."""
        try:
            with contextlib.ExitStack() as current, BlobFiles(self.store) as blobs:
                open_file = ""
                for sha, c in self.copies:
                    if self.stop.is_set() or self.error is not None:
                        return
                    f = self.files[sha]
                    if open_file != sha:
                        current.close()
                        current.enter_context(f.partial.opened())
                        open_file = sha
                    src = blobs.fd(c.blob)
                    good = copy_range(src, f.partial.fd, c.blob_offset, c.piece.offset,
                                      c.piece.size) == c.piece.size \
                        and hashing.fd_range_sha256(f.partial.fd, c.piece.offset,
                                                    c.piece.size) == c.piece.sha256
                    if not good:
                        self._fetch_instead(f, c)
                        continue
                    with self.cond:
                        self.reused += c.piece.size
                    self._landed_by(f, c.piece, 0)
        except PullError as e:
            self._fail(e)
        except OSError as e:
            self._fail(self._os_error(e, "copying local pieces"))
        finally:
            self._release()

    def _fetch_instead(self, f: FileState, c: Copy) -> None:
        log.warning("local blob %s does not hold the bytes its manifest says at %d (+%d): it is "
                    "damaged; fetching the piece for %s instead", c.blob, c.blob_offset,
                    c.piece.size, f.path)
        with self.cond:
            self.queue.append(RangeRequest(f.blob, (c.piece,)))
            self.cond.notify_all()

    # -- streams --------------------------------------------------------------------------------
    def _stream(self, index: int, urgent_only: bool = False) -> None:
        clients: dict[int, Client] = {}
        preferred = 0
        if self.chooser is not None:
            self._local.arrived = self.arrivals.adder()
        try:
            while (req := self._next(index, urgent_only)) is not None:
                try:
                    preferred = self._fetch(req, clients, preferred)
                except PullError as e:
                    self._fail(e)
                except CredentialsError as e:
                    self._fail(PullError(str(e)))
                except OSError as e:
                    self._fail(self._os_error(e, self.files[req.blob].path))
                except Exception as e:  # a bug must fail the pull, not hang it
                    log.exception("pull stream %d", index)
                    self._fail(PullError(f"internal error in stream {index}: {e!r}"))
                finally:
                    self._release()
        finally:
            for c in clients.values():
                c.close()

    def _fetch(self, req: RangeRequest, clients: dict[int, Client], preferred: int) -> int:
        # The file's part file and journal are open while this request is worked on, and no
        # longer: a stream holds one file's descriptors at a time, whatever the version holds.
        with self.files[req.blob].partial.opened():
            return self._fetch_open(req, clients, preferred)

    def _fetch_open(self, req: RangeRequest, clients: dict[int, Client], preferred: int) -> int:
        f = self.files[req.blob]
        # Landed pieces leave from the front: a deque, as a request may hold thousands.
        pieces = collections.deque(req.pieces)
        if self.peers is not None:
            with self.cond:
                peer = self.chosen.get(threading.get_ident(), SOURCES)
            if peer is not SOURCES:
                self._fetch_peer(peer, req, f, pieces, clients)
                return preferred
        failures: list[str] = []
        rounds = 0
        # the cache is fetching the piece itself (503: asked again for up to peer_wait) or is
        # sending another piece (429: asked again for as long as that takes)
        pending: float | None = None
        own = self.own_sources
        while pieces:
            before = len(pieces)
            asked = 0.0       # the longest Retry-After a busy source gave in this round
            order = [(preferred + k) % own for k in range(own)]
            with self.cond:
                order = [i for i in order if i not in self.no_ranges]
                if not order:
                    # One message for the pull, not one per piece and retry.
                    raise PullError("; ".join(self.no_ranges.values()))
            for i in order:
                if not pieces:
                    return i
                if pending is not None and self._defer(RangeRequest(req.blob, tuple(pieces)),
                                                       pending):
                    pieces.clear()         # asked again later, from the queue
                    return preferred
                if self.stop.is_set() or self.error is not None:
                    return preferred
                client = self._client(clients, i)
                try:
                    with self.cond:
                        self.streams_busy += 1
                    try:
                        self._fetch_from(i, client, f, pieces)
                    finally:
                        with self.cond:
                            self.streams_busy -= 1
                    if not pieces or self.stop.is_set():
                        return i
                except NoRangesError as e:
                    with self.cond:
                        first = i not in self.no_ranges
                        self.no_ranges[i] = str(e)
                    if first:
                        log.warning("%s", e)
                except FetchError as e:
                    if self.sources[i].cache and e.status in (429, 503) \
                            and e.retry_after is not None:
                        # The cache is fetching the piece, or sending another: asked again
                        # soon, not the origin, unless that takes peers.wait.
                        log.debug("the cache can't send it yet: %s", e)
                        pending = math.inf if e.status == 429 else self.peer_wait
                        continue
                    log.info("piece fetch failed, trying the next source: %s", e)
                    failures.append(str(e))
                    asked = max(asked, min(e.retry_after or 0.0, RETRY_AFTER_CAP))
            if len(pieces) < before:
                continue                  # pieces landed this round: not a failed round
            if pending is not None and self._defer(RangeRequest(req.blob, tuple(pieces)),
                                                   pending):
                pieces.clear()
                return preferred
            rounds += 1
            if rounds > self.s.retries:
                raise PullError(f"{f.path}: bytes {pieces[0].offset}+ failed on every source "
                                f"{rounds} times; last errors: {'; '.join(failures[-3:])}")
            delay = min(self.s.backoff_cap, self.s.backoff_base * 2 ** (rounds - 1))
            # A busy source (503/429) said when to come back: not before, lest a storm of
            # retries burn the pull's rounds in seconds; jittered upwards only.
            wait = max(delay * random.uniform(0.5, 1.5), asked * random.uniform(1.0, 1.1))
            if self.stop.wait(wait):
                return preferred
        return preferred

    def _client(self, clients: dict[int, Client], i: int) -> Client:
        client = clients.get(i)
        if client is None:
            # With the stop event: a stop cuts the request in flight at once.
            client = clients[i] = Client(self.sources[i], self.s.timeouts,
                                         connections=self.connections, stop=self.stop)
        return client

    def _fetch_peer(self, n: int, req: RangeRequest, f: FileState,
                    pieces: collections.deque[Piece], clients: dict[int, Client]) -> None:
        """A piece from neighbour ``n``, which listed it (``pick``). Whatever fails, the
        piece goes back in the queue and ``n``'s state says why: sending to another node
        (429: asked again in a moment), the piece not there after all (503/404: its listing
        forgets it), down or failing (left alone for ``PEER_SKIP``)."""
        i = self.own_sources + n
        now = self.clock()
        try:
            with self.cond:
                self.streams_busy += 1
                self.peer_asked[n] = now
            try:
                self._fetch_from(i, self._client(clients, i), f, pieces)
            finally:
                with self.cond:
                    self.streams_busy -= 1
        except FetchError as e:
            log.debug("neighbour %s: %s", self.sources[i].url, e)
            with self.cond:
                if e.status == 429:
                    self.peer_free_at[n] = self.clock() + PEER_BUSY
                elif e.status in (404, 503):
                    have = self.holds.get(n)
                    if have is not None and pieces:
                        have.discard((f.blob, pieces[0].offset))
                else:
                    self.peer_free_at[n] = self.clock() + PEER_SKIP
                    self.holds.pop(n, None)
        finally:
            if pieces and not self.stop.is_set():
                with self.cond:
                    self.queue.appendleft(RangeRequest(req.blob, tuple(pieces)))
                    self.cond.notify_all()
                pieces.clear()

    # -- neighbours' have-maps (peers) ----------------------------------------------------------
    def _watch_peer(self, n: int, stop: threading.Event) -> None:
        """Follows neighbour ``n``'s have-map for this version (a stream of lines, one at each
        change): which of the pieces this pull needs it holds verified. Nothing is trusted
        from it but as a hint of where to ask: every piece is still verified here."""
        i = self.own_sources + n
        url = url_for(self.sources[i], ".wagent", "have", self.model, self.version)
        client = Client(self.sources[i], self.s.timeouts, connections=self.connections.side(),
                        stop=stop)
        try:
            while not stop.is_set():
                try:
                    lines = 0
                    for line in client.lines(url, HAVE_LIMIT, HAVE_IDLE):
                        lines += 1
                        have = _have_pieces(json.loads(line)["have"], self.files)
                        with self.cond:
                            if not have <= self.holds.get(n, set()):
                                self.progressed = self.clock()
                            self.holds[n] = have
                            self.cond.notify_all()
                    if lines < 2:         # a stream ends after a minute, not at once
                        raise FetchError(f"{url}: the have-map stream ended at once")
                except (FetchError, CredentialsError, ValueError, KeyError, TypeError,
                        AttributeError) as e:
                    log.debug("neighbour %s's have-map: %s", self.sources[i].url, e)
                    with self.cond:
                        self.holds.pop(n, None)
                    stop.wait(HAVE_RETRY)
        finally:
            client.close()

    def _fetch_from(self, si: int, client: Client, f: FileState,
                    pieces: collections.deque[Piece]) -> None:
        source = self.sources[si]
        offset = pieces[0].offset
        size = sum(p.size for p in pieces)
        url = url_for(source, self.model, self.version, f.path)
        chunk = self.bucket.chunk_size(self.s.chunk) if self.bucket else self.s.chunk
        chunk = self.s.floor.max_read(chunk)
        key = redact(source.url)          # the journal is no place for credentials
        with self.cond:
            trusted = si not in self.etags_ignored
        etag = f.partial.etags.get(key) if trusted else None
        meter = Meter(self.s.floor, self.clock, key, f"{f.path} bytes {offset}+{size}") \
            if self.s.floor.enabled else None
        arrived = getattr(self._local, "arrived", None)
        try:
            pause = self.bucket.paused if self.bucket is not None else None
            # a reader leaves bytes in its socket during a cut only where cuts can come: the
            # wait for them is a system call more per receive
            wait_cut = functools.partial(self.bucket.wait_cut, self.stop) \
                if self.bucket is not None and self.bucket.cuts else None
            new_etag, body = client.ranged(url, offset, size, etag, chunk, total=f.size,
                                           meter=meter, pause=pause, arrived=arrived,
                                           wait_cut=wait_cut)
        except ChangedError as e:
            # Not the ETag recorded for the file: it changed, or the source is backends with
            # an ETag each for the same bytes. The pieces' sha256 tell which, so this costs no
            # verified piece: the request goes again, without If-Range.
            self._ignore_etags(si, f"{f.path}: ETag {etag} -> {e.etag}")
            new_etag, body = client.ranged(url, offset, size, None, chunk, total=f.size,
                                           meter=meter, pause=pause, arrived=arrived,
                                           wait_cut=wait_cut)
        if new_etag and not etag and trusted:
            # Another stream may have recorded the file's ETag since this request left.
            known = f.partial.record_etag(key, new_etag)
            if known != new_etag:
                self._ignore_etags(si, f"{f.path}: ETag {known} -> {new_etag}")
        if meter is not None:
            with self.cond:
                self.meters.add(meter)
        kind = "peer" if si >= self.own_sources else "cache" if source.cache else "origin"
        try:
            self._receive(url, f, body, pieces, offset, kind)
        except _Mismatch as e:
            with self.cond:
                seen = self.etags_ignored.get(si)
            if seen is None:
                raise
            raise FetchError(f"{e}, and the source's ETags changed ({seen}): the file changed "
                             "on the source; pull again for the current manifest") from None
        finally:
            if meter is not None:
                with self.cond:
                    self.meters.discard(meter)
            body.close()

    def _receive(self, url: str, f: FileState, body: Generator[memoryview, None, None],
                 pieces: collections.deque[Piece], pos: int, kind: str = "origin") -> None:
        piece = pieces[0]
        h = hashlib.sha256()
        left = piece.size
        pending = 0             # bytes received that no verified piece accounts for yet
        me = threading.get_ident()
        with self.cond:
            self.receiving_now[me] = (f.blob, piece.offset)
        try:
            for data in body:
                n = len(data)
                self._yield_to_urgent()
                if self.bucket is not None:
                    self.bucket.consume(n, self.stop)
                with self.cond:
                    self.fetched += n
                    self.fetched_by[kind] = self.fetched_by.get(kind, 0) + n
                    self.in_flight += n
                pending += n
                f.partial.write(pos, data)
                pos += n
                view = memoryview(data)
                while view:
                    take = min(len(view), left)
                    h.update(view[:take])
                    view = view[take:]
                    left -= take
                    if left:
                        continue
                    if h.hexdigest() != piece.sha256:
                        raise _Mismatch(f"{redact(url)}: bytes {piece.offset}+{piece.size} do "
                                        "not match their sha256 in the manifest")
                    pending -= piece.size
                    self._landed_by(f, piece, piece.size)
                    pieces.popleft()
                    if pieces:
                        piece, h, left = pieces[0], hashlib.sha256(), pieces[0].size
                        with self.cond:
                            self.receiving_now[me] = (f.blob, piece.offset)
                if self.stop.is_set() or self.error is not None:
                    return
        finally:
            with self.cond:
                self.in_flight -= pending
                self.receiving_now.pop(me, None)

    def _ignore_etags(self, si: int, seen: str) -> None:
        """Source ``si`` gave two ETags for one file: no more If-Range to it (every answer
        would be the whole file), and no verified piece discarded on its word."""
        with self.cond:
            if si in self.etags_ignored:
                return
            self.etags_ignored[si] = seen
        log.warning("source %s: ETags disagree (%s), a file that changed or backends with their "
                    "own ETags for the same bytes; ignoring its ETags, every piece is still "
                    "verified against the manifest", redact(self.sources[si].url), seen)

    def _landed_by(self, f: FileState, piece: Piece, received: int) -> None:
        """A verified piece, to be synced and journaled (``_piece_done``) off this thread."""
        assert self._landing is not None
        self._landing.put(f, piece, received)

    def _landing_failed(self, f: FileState, e: Exception) -> None:
        if isinstance(e, PullError):
            self._fail(e)
        elif isinstance(e, OSError):
            self._fail(self._os_error(e, f.path))
        else:
            log.error("landing pieces of %s", f.path, exc_info=e)
            self._fail(PullError(f"internal error landing pieces of {f.path}: {e!r}"))

    def _piece_done(self, f: FileState, piece: Piece, received: int = 0) -> None:
        """``received``: the piece's bytes counted in flight until now (0 for a copy)."""
        with self.cond:
            self.in_flight -= received
            if piece.offset in f.partial.done:
                return                    # landed twice: count it once
            f.partial.record_piece(piece.offset, piece.size, piece.sha256)
            self.progressed = self.clock()
            self.verified += piece.size
            f.remaining -= 1
            last = f.remaining == 0
        if self.demand is not None:
            self.demand.landed()
        if last:
            self._finish_file(f)

    def _finish_file(self, f: FileState) -> None:
        if {p.offset for p in f.pieces} != set(f.partial.done):
            raise PullError(f"{f.path}: internal error: finished with pieces missing")
        part = f.partial.finish()
        if self.s.verify_files:
            got = hashing.file_sha256(part)
            if got != f.sha256:
                os.unlink(part)
                f.partial.drop_journal()
                raise PullError(f"{f.path}: every piece verified but the whole file's sha256 is "
                                f"{got}, not {f.sha256}: the manifest is inconsistent; rebuild it "
                                "with 'wagent manifest build'")
        # The journal goes only once the file is a blob: a crash in between leaves either a
        # resumable partial (all pieces journaled) or a blob and a stale journal, never a
        # complete part file without its journal (which would be fetched again in full).
        self.store.add_blob(part, f.blob, f.size)
        if self.demand is not None:
            self.demand.landed()
        f.partial.drop_journal()
        with self.cond:
            self.files_done += 1
            done = self.files_done
        self.on_file(f, done)

    def _os_error(self, e: OSError, what: str) -> PullError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFull(f"no space left in the store {self.store.root} while writing "
                             f"{what}: {FREE_SPACE_HINT}")
        return PullError(f"{what}: {e.strerror or e} ({e.filename or self.store.root})")


class BlobFiles:
    """Local blobs open for reading, the ``keep`` most recently used at most."""

    def __init__(self, store: Store, keep: int = 4) -> None:
        self.store = store
        self.keep = keep
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()

    def fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        fd = os.open(self.store.blob_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        self._fds[name] = fd
        while len(self._fds) > self.keep:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> BlobFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_range(src: int, dst: int, src_offset: int, dst_offset: int, size: int) -> int:
    """Copy bytes between files inside the kernel when it can (copy_file_range), else pread.

    Returns the bytes copied: fewer than ``size`` when the source ends early.
    """
    left = size
    try:
        while left:
            n = os.copy_file_range(src, dst, left, src_offset, dst_offset)
            if n == 0:
                return size - left
            left, src_offset, dst_offset = left - n, src_offset + n, dst_offset + n
        return size
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while left:
        data = os.pread(src, min(left, 4 * 2**20), src_offset)
        if not data:
            return size - left
        view = memoryview(data)
        while view:
            n = os.pwrite(dst, view, dst_offset)
            view, dst_offset = view[n:], dst_offset + n
        left, src_offset = left - len(data), src_offset + len(data)
    return size


def _have_pieces(have: object, files: dict[str, FileState]) -> set[tuple[str, int]]:
    """A neighbour's have-map (blob id -> hex bitmap, ``agent.peers.server``) as the pieces
    of this pull's files it lists."""
    if not isinstance(have, dict):
        raise ValueError("a have-map is an object")
    out: set[tuple[str, int]] = set()
    for blob, hexbits in have.items():
        f = files.get(blob)
        if f is None:
            continue
        bits = bytes.fromhex(hexbits)
        for i, p in enumerate(f.pieces):
            if i // 8 < len(bits) and bits[i // 8] & (0x80 >> (i % 8)):
                out.add((blob, p.offset))
    return out
