"""What a cache node announces: ``{store}/models/{model}/latest``, naming the newest version it
holds completely, so that its cluster polls it instead of the origin.

A cache node's store is served by nginx as it is (packaging/nginx/wagent-cache.conf), so its
``models/`` tree is a source with the origin's layout; all it lacked was ``{model}/latest``.
Written here, after a pull has published a version (the store made the version durable before
that), the cluster's nodes learn of a version from their cache, when the cache can serve every
byte of it: they no longer learn it from the origin early and fall back to the origin for a
version their cache doesn't hold yet, and the origin sees one poller per cache node.

The rules:

* only a version the store holds completely (``Store.installed``) is announced;
* never backwards: a version published before the one announced (the manifests' ``published``)
  doesn't replace it while that one is still complete; a rollback is a new version;
* atomically and durably: a new file is written aside (``.tmp-latest-*``, which nginx never
  serves: the site refuses dot files, and the store's cleaning removes it after a crash),
  fsynced, renamed over ``latest``, then the directory fsynced. All of it through a descriptor of
  the model directory opened without following a symlink: nothing is written outside the store.

A cache node must not learn of versions from its own announcement: ``latest_sources`` drops the
sources marked ``cache: true`` (the cache tier) from the ones a cache node polls. A policy that
lists its cache without the mark (as policies were written before the key existed) must not stall
the cluster either, so the announcement says who wrote it: a second line
``wagent-announced-by NODE_ID`` (readers of ``latest`` take its first line only, so every reader
of the origin layout still reads it). A node that polls a ``latest`` carrying its own id reads
its own store back through nginx and polls past it (``parse_latest``, used by the pull engine's
``resolve_latest``), saying so in the journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Sequence

from agent.manifest import ManifestError, check_name, published_ts
from agent.policy.model import Source
from agent.store import Store

log = logging.getLogger(__name__)

LATEST = "latest"
ANNOUNCED_BY = "wagent-announced-by"
FILE_MODE = 0o644
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def latest_text(version: str, announcer: str | None = None) -> bytes:
    """The contents of a ``latest`` file naming ``version``, written by node ``announcer``."""
    text = f"{version}\n"
    if announcer:
        text += f"{ANNOUNCED_BY} {announcer}\n"
    return text.encode()


def parse_latest(raw: bytes) -> tuple[str, str | None]:
    """A ``latest`` file's version (its first line, checked as a version name) and the node
    that announced it, if a wagent cache node did. Raises ManifestError for a bad name."""
    lines = [line.strip() for line in raw.decode("utf-8", "replace").strip().splitlines()]
    version = check_name("version", lines[0] if lines else "")
    announcer = next((line.split(None, 1)[1].strip() for line in lines[1:]
                      if line.startswith(ANNOUNCED_BY + " ")), None)
    return version, announcer or None


def announce(root: str | os.PathLike[str], model: str, version: str,
             announcer: str | None = None) -> bool:
    """Point ``{model}/latest`` at ``version`` if the store at ``root`` holds it completely and
    it is not older than the version announced now. Returns whether ``latest`` changed.
    ``announcer`` (this node's id) is written beside the version, so that this node recognises
    its own announcement when a policy lists its store as an ordinary source."""
    store = Store(root)
    check_name("model", model)
    check_name("version", version)
    m = store.installed(model, version)
    if m is None:
        log.warning("not announcing %s/%s: the store %s doesn't hold it completely", model,
                    version, store.root)
        return False
    fd = _open_model_dir(store, model)
    try:
        # One announcement at a time per model (the daemon and a `wagent pull` by hand).
        fcntl.flock(fd, fcntl.LOCK_EX)
        current, by = _read_latest_and_announcer(fd)
        if current == version and by == announcer:
            return False
        if current is not None:
            held = store.installed(model, current)
            if held is not None and _newer(held.published, current, m.published, version):
                log.info("not announcing %s/%s: %s, published later, stays announced", model,
                         version, current)
                return False
        _write_latest(fd, latest_text(version, announcer))
    finally:
        os.close(fd)
    log.info("announcing %s/%s: %s/latest names it", model, version, model)
    return True


def latest_sources(sources: Sequence[Source], cache_node: bool) -> tuple[Source, ...]:
    """The sources a node polls for ``latest``: all of them, but a cache node skips the cache
    tier (``cache: true``), whose ``latest`` is its own announcement, or its peers', which
    would never name a version the tier doesn't hold yet. With only cache sources, all."""
    if not cache_node:
        return tuple(sources)
    rest = tuple(s for s in sources if not getattr(s, "cache", False))
    return rest or tuple(sources)


def _newer(pub_a: str, name_a: str, pub_b: str, name_b: str) -> bool:
    """Whether version a was published after version b (by name when the times tie)."""
    try:
        ta, tb = published_ts(pub_a), published_ts(pub_b)
    except (ValueError, TypeError):
        ta = tb = 0.0
    return (ta, name_a) > (tb, name_b)


def _open_model_dir(store: Store, model: str) -> int:
    """A descriptor of ``models/{model}``, reached without following a symlink."""
    fd = os.open(store.root / "models", _DIR)
    try:
        for part in check_name("model", model).split("/"):
            nfd = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_latest_and_announcer(dir_fd: int) -> tuple[str | None, str | None]:
    try:
        fd = os.open(LATEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None, None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(4096)
    try:
        return parse_latest(raw)
    except (ManifestError, ValueError):
        return None, None


def _write_latest(dir_fd: int, text: bytes) -> None:
    tmp = f".tmp-{LATEST}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), FILE_MODE)       # readable by nginx, whatever the umask
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.rename(tmp, LATEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)                                 # the rename survives a power cut
