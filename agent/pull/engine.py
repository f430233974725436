"""Pull one model version into the store: the API the daemon and ``wagent pull`` call.

>>> # pull_version([Source("http://origin:8080")], "llama", "v7", Store("/var/cache/wagent"),
>>> #              options=PullOptions(streams=8), bucket=TokenBucket(None))

Steps: check the store can be written (no symlinks on the way); tidy what crashes left (once per
pull start); return at once if the version is installed (a second pull transfers nothing); fetch
the manifest from the first source that serves a valid one (unless the caller fetched it already:
the daemon reads it earlier for the publication time); plan against the store (pieces in the
file's partial journal are kept, pieces in any local blob are copied, the rest fetched); run the
transfer; publish the version atomically.

A pull's settings are one value, :class:`agent.pull.options.PullOptions`, handed on to the
transfer; its progress reports are :class:`agent.status.PullProgress`, the value status shows
(both importable from here).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from agent.announce import parse_latest
from agent.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    check_name,
    parse,
)
from agent.policy.model import Source
from agent.pull import plan as planning
from agent.pull.client import Client, url_for
from agent.pull.connections import Connections
from agent.pull.credentials import CredentialsError
from agent.pull.demand import Demand
from agent.pull.errors import FetchError
from agent.pull.options import PullOptions
from agent.pull.swarm import Peers
from agent.pull.transfer import (
    FREE_SPACE_HINT,
    FileState,
    PullError,
    PullStopped,
    StoreFull,
    Transfer,
)
from agent.redact import redact
from agent.status import PullProgress
from agent.store import Store, StoreError, space
from agent.store.partial import Claims, Partial, PartialBusy
from agent.units import format_size
from agent.yielding.ratelimit import TokenBucket

T = TypeVar("T")
# Streams of a pull with peers (agent.peers.swarm): one at most fetching from the sources (held
# by the cache until it has the piece), the others from neighbours, a piece each at a time.
# Six, not three: a piece crosses a socket whose window the backoff keeps to a millisecond of
# the link (at least four segments), so one stream carries a window per round trip and a
# reader's wakeup, and the link fills only with several (agent.peers.swarm, the table).
PEER_STREAMS = 6

__all__ = ["PullError", "PullOptions", "PullProgress", "PullResult", "PullStopped", "StoreFull",
           "fetch_manifest", "pull_version", "resolve_latest"]

log = logging.getLogger(__name__)
MIN_REQUEST = 2**20
PLANNED_ADAPTIVE = 8   # streams a chosen count's requests are sized for


@dataclass(frozen=True)
class PullResult:
    model: str
    version: str
    bytes_fetched: int
    bytes_reused: int
    bytes_total: int
    files: int
    seconds: float
    path: Path


# The longest wait between two asks of a busy source for a manifest or ``latest``: the node's
# caller (the daemon's poll) asks again later anyway.
SMALL_RETRY_CAP = 5.0


def _first_answer(sources: Sequence[Source], options: PullOptions, what: str,
                  ask: Callable[[Client, Source], T], connections: Connections) -> T:
    """``ask`` each source in order and return the first answer; a source that can't be used
    (credentials, HTTP, a bad document) adds its reason to the error if none answers."""
    errors = []
    for source in sources:
        try:
            client = Client(source, options.timeouts, connections=connections)
        except CredentialsError as e:
            errors.append(str(e))
            continue
        try:
            for attempt in range(options.retries + 1):
                try:
                    return ask(client, source)
                except FetchError as e:
                    # A source that asks to be left alone for a while (503 SlowDown, 429 with
                    # Retry-After) is a busy one, not a broken one: wait as asked, ask again.
                    if e.retry_after is None or attempt == options.retries:
                        raise
                    time.sleep(min(e.retry_after, SMALL_RETRY_CAP))
        except (FetchError, ManifestError) as e:
            errors.append(str(e))
        finally:
            client.close()
    raise PullError(f"{what}: " + "; ".join(errors) if errors else "no sources configured")


def resolve_latest(sources: Sequence[Source], model: str, options: PullOptions, *,
                   self_id: str | None = None,
                   on_self: Callable[[str], None] | None = None,
                   connections: Connections) -> str:
    """The version named by ``{source}/{model}/latest`` on the first source that answers.

    A ``latest`` that node ``self_id`` announced itself (``agent.announce``) is this node's own
    store read back through its nginx, whatever the policy calls that source: it can never name
    a version this node lacks, so it is passed over, and ``on_self`` is told why.

    ``connections``: the caller's (``agent.pull.connections``): the daemon's, or the command's."""
    check_name("model", model)

    def ask(client: Client, source: Source) -> str:
        url = url_for(source, model, "latest")
        version, announcer = parse_latest(client.get_small(url, 4096))
        if self_id is not None and announcer == self_id:
            why = (f"{redact(url)} is this node's own announcement (the source serves this "
                   f"node's store): polled past it; mark that source `cache: true` in the "
                   f"policy")
            if on_self is not None:
                on_self(why)
            raise ManifestError(why)
        return version

    return _first_answer(sources, options, f"no source named the latest version of {model}", ask,
                         connections)


def fetch_manifest(sources: Sequence[Source], model: str, version: str,
                   options: PullOptions, *, connections: Connections
                   ) -> tuple[bytes, Manifest]:
    """The manifest of ``model``/``version`` (its bytes, parsed) from the first source that
    serves a valid one naming that model and version. ``connections`` as for
    :func:`resolve_latest`."""
    def ask(client: Client, source: Source) -> tuple[bytes, Manifest]:
        url = url_for(source, model, version, MANIFEST_NAME)
        raw = client.get_small(url, MAX_MANIFEST_BYTES)
        m = parse(raw, redact(url))
        _check_names(m, model, version, redact(url))
        return raw, m

    return _first_answer(sources, options, f"no usable manifest for {model}/{version}", ask,
                         connections)


def _check_names(m: Manifest, model: str, version: str, where: str) -> None:
    if (m.model, m.version) != (model, version):
        raise ManifestError(f"{where}: names {m.model}/{m.version}, not {model}/{version}")


def pull_version(sources: Sequence[Source], model: str, version: str, store: Store, *,
                 options: PullOptions | None = None, bucket: TokenBucket | None = None,
                 progress: Callable[[PullProgress], None] | None = None,
                 stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 manifest: tuple[bytes, Manifest] | None = None,
                 connections: Connections, demand: Demand | None = None,
                 peers: Peers | None = None,
                 offer: Callable[[Manifest, bytes], AbstractContextManager[None]] | None = None
                 ) -> PullResult:
    """``manifest``: the version's manifest (its bytes, parsed) as :func:`fetch_manifest`
    returned it, when the caller has it already; else it is fetched here.

    ``connections``: the watchdog and pull sockets' registry its requests use (the daemon's or
    the CLI's, whose backoff loop clamps those sockets). ``demand``: where a lazy mount's readers
    wait for pieces (``agent.pull.demand``), the daemon's. ``peers``: the cluster's nodes that
    serve each other, asked for each piece before the sources (``agent.peers``); ``offer``:
    serves this version to them while it is pulled (``agent.peers.catalog.Catalog.offering``)."""
    options = options or PullOptions()
    stop = stop or threading.Event()
    started = clock()
    if not sources:
        raise PullError("no sources: give a URL or list sources in the policy")
    try:
        check_name("model", model)
        if version == "latest":
            version = resolve_latest(sources, model, options, connections=connections)
        check_name("version", version)
        store.check_writable(model, version)
        # Every start tidies what a crash or an abandoned version left (never what a pull holds).
        space.clean(store, wall_clock())
        try:
            with store.pull_lock():
                m = store.installed(model, version)
                if m is not None:
                    store.touch(model, version, wall_clock())
                    return PullResult(model, version, 0, 0, m.size, len(m.files),
                                      clock() - started, store.version_dir(model, version))
                if manifest is None:
                    raw, m = fetch_manifest(sources, model, version, options,
                                            connections=connections)
                else:
                    raw, m = manifest
                    _check_names(m, model, version, "the manifest given")
                with offer(m, raw) if offer is not None else contextlib.nullcontext():
                    return _pull(sources, m, raw, store, options, bucket, progress, stop,
                                 clock, wall_clock, started, connections, demand, peers)
        except _GaveBack as e:
            raise StoreFull(str(e)) from None    # given back already at this start: once
        except StoreFull as e:
            # The disk filled after this start's check (a preallocation, the transfer). Outside
            # the pull lock, the crash leftovers can go too. Partial files of other versions
            # give their space back; this version's stay for the next try.
            wanted = set(planning.distinct_files(m))
            freed = sum(r.size for r in space.clean(store, wall_clock(),
                                                   wanted=wanted.__contains__))
            if freed:
                raise StoreFull(f"{e} (freed {format_size(freed)} of stale partial files since)"
                                ) from None
            raise
    except (ManifestError, StoreError) as e:
        raise PullError(str(e)) from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"no space left in the store {store.root}: {e.strerror}") from None
        raise PullError(f"store {store.root}: {e.strerror or e} ({e.filename or ''})") from None


def _pull(sources: Sequence[Source], m: Manifest, raw: bytes, store: Store,
          options: PullOptions, bucket: TokenBucket | None,
          progress: Callable[[PullProgress], None] | None, stop: threading.Event,
          clock: Callable[[], float], wall_clock: Callable[[], float],
          started: float, connections: Connections, demand: Demand | None,
          peers: Peers | None = None) -> PullResult:
    blobs = store.blob_sizes()
    distinct = planning.distinct_files(m)
    # One descriptor claims every partial file of the pull; each file is opened only while a
    # stream or the copier works on it (agent.store.partial).
    claims = Claims(store.partial)
    partials: dict[str, Partial] = {}
    try:
        for bid, (f, _) in distinct.items():
            if blobs.get(bid) != f.size:
                partials[bid] = Partial(store.partial, bid, f.size, durable=options.durable,
                                        claims=claims)
        p = planning.plan(m, blobs, store.piece_index() if partials else {},
                          {bid: part.done for bid, part in partials.items()})
        for fp in p.files:
            partials[fp.blob].keep_only({piece.offset for piece in fp.done})
        _reserve(store, m, [partials[fp.blob] for fp in p.files], wall_clock())
    except BaseException as e:
        # What this pull made and never used goes: a failed start takes nothing, and never
        # leaves a file per manifest entry behind on every try.
        for part in partials.values():
            if part.created and not part.done:
                with contextlib.suppress(OSError):
                    part.discard()
            part.close()
        claims.close()
        if isinstance(e, PartialBusy):
            raise PullError(str(e)) from None
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(f"no space left in the store {store.root} for {m.model}/{m.version} "
                            f"({format_size(m.size)}): {FREE_SPACE_HINT}") from None
        raise
    files = {fp.blob: FileState(fp.blob, distinct[fp.blob][0].sha256, fp.size, fp.paths[0],
                                fp.pieces, partials[fp.blob], len(fp.copies) + len(fp.fetch))
             for fp in p.files}
    copies = [(fp.blob, c) for fp in p.files for c in fp.copies]
    streams = max(1, options.streams)
    # About 8 requests per stream, and single pieces at the end, so that the streams finish
    # together rather than one of them finishing a long request alone. A chosen count is
    # planned for as if 8 ran: it mostly settles at a few (one request per round trip would
    # cost a long path its rate if requests were cut for the most), and its last requests
    # come a piece at a time anyway.
    planned = min(streams, PLANNED_ADAPTIVE) if options.adaptive else streams
    request_size = max(1, min(options.request_size, options.piece_size,
                              max(MIN_REQUEST, p.bytes_fetch // (8 * planned))))
    if peers is not None:
        # A piece is chosen by what the neighbours hold (agent.pull.picker), from whoever
        # holds it: one piece per request, few streams (agent.peers.swarm).
        request_size = 1
        options = replace(options, adaptive=False)
        streams = min(PEER_STREAMS, streams)
    options = replace(options, streams=streams, request_size=request_size)
    requests = planning.requests_for(p, request_size, tail=2 * planned)
    transfer = Transfer(sources, store, m.model, m.version, files, requests,
                        copies, options, bucket, stop,
                        on_file=lambda f, n: emit("file", f.path), clock=clock,
                        connections=connections, demand=demand, peers=peers)
    base_done = p.bytes_present + p.bytes_done
    window: list[tuple[float, int]] = []
    emit_lock = threading.Lock()
    broken: list[bool] = []

    def emit(event: str, path: str | None = None) -> None:
        # One call at a time, each from a fresh snapshot: the callback needn't be thread-safe
        # and never sees the figures go backwards.
        with emit_lock:
            if progress is None or broken:
                return
            now = clock()
            with transfer.cond:
                fetched, reused = transfer.fetched, transfer.reused
                busy, verified = transfer.streams_busy, transfer.verified
                landed, in_flight = transfer.files_done, transfer.in_flight
                chosen, why = transfer.target, transfer.streams_why
                by_source = dict(transfer.fetched_by)
            window.append((now, fetched))
            while len(window) > 2 and now - window[0][0] > 3.0:
                window.pop(0)
            span = now - window[0][0]
            rate = (fetched - window[0][1]) / span if span > 0 else 0.0
            try:
                progress(PullProgress(
                    m.model, m.version, event, p.bytes_total, base_done + verified, fetched,
                    reused, rate, busy, len(p.present) + landed, len(distinct), now - started,
                    path, max(0, in_flight), chosen, why, by_source))
            except Exception:
                # Progress is for show: a display that fails must not fail the pull.
                broken.append(True)
                log.exception("progress callback failed; no more progress for %s/%s",
                              m.model, m.version)

    try:
        emit("start")
        transfer.run(tick=lambda: emit("progress"))
    finally:
        for part in partials.values():
            part.close()
        claims.close()
    for bid, (f, _) in distinct.items():
        if not store.has_blob(bid, f.size):
            raise PullStopped("pull stopped before every file landed") if stop.is_set() \
                else PullError(f"{f.path} did not land in the store (internal error)")
    try:
        path = store.publish(m, raw, wall_clock())
    except OSError as e:
        raise PullError(f"publishing {m.model}/{m.version} in {store.root}: "
                        f"{e.strerror or e}") from None
    emit("done")
    log.info("pulled %s/%s: %d bytes fetched, %d reused", m.model, m.version,
             transfer.fetched, transfer.reused)
    return PullResult(m.model, m.version, transfer.fetched, transfer.reused, p.bytes_total,
                      len(m.files), clock() - started, path)


class _GaveBack(StoreFull):
    """No room even after the space of the partial files this pull doesn't want was given
    back: the store is not cleaned a second time for the same pull start."""


def _reserve(store: Store, m: Manifest, partials: Sequence[Partial], now: float) -> None:
    """Preallocate every partial file of the pull, or none: the free space is checked first
    (a manifest claiming more than the disk holds takes nothing), after giving back the space
    of partial files that no pull holds and this one doesn't want."""
    need = sum(part.unallocated() for part in partials)
    if need > store.free_bytes():
        wanted = {part.name for part in partials}
        space.clean(store, now, wanted=wanted.__contains__)
        free = store.free_bytes()
        if need > free:
            raise _GaveBack(f"no space left in the store {store.root} for {m.model}/"
                            f"{m.version}: it needs {format_size(need)} more, "
                            f"{format_size(free)} are free; {FREE_SPACE_HINT}")
    for part in partials:
        part.preallocate()

