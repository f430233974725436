"""The daemon's side of ``wagent mount``: which versions are shown, to which directories, and
the FUSE server that shows them.

The root CLI (``agent.commands.mount``) does what needs root; this does the rest, from the
control socket's threads:

1. ``mount`` (model, version or none, the directory): the version is chosen (the one the policy
   wants now when none is given), its manifest read (from the store, or from the sources), and it
   appears under the mount's root as ``MODEL@VERSION`` (``agent.mount.tree``). From then on the
   worker pulls it at once, whatever its wave's slot (``WorkerDeps.mounted``), and eviction keeps
   it (``NodePulls.mounted``). The answer says whether a FUSE server runs; if none does, the CLI
   mounts the root and sends its descriptor:
2. ``serve_fuse`` (the descriptor, passed with SCM_RIGHTS): the FUSE server starts on it.
   The CLI then bind-mounts ``ROOT/MODEL@VERSION`` onto the directory.
3. ``umount`` (the directory): the CLI has removed the bind; the version is shown no longer
   once no directory shows it. The answer says how many are left: at none, the CLI unmounts the
   root and the server ends.

A version complete in the store when it is first mounted needs no server: ``mount`` answers with
its view (``agent.store.views``, hard links to its blobs) and the CLI binds that instead, so
engines read the store's files at the disk's speed. Its view goes with its last directory.

A restart keeps the mount: the descriptor goes to systemd's fd store as soon as it is served
(``keep_fd``), the versions shown and their directories to ``{state_dir}/mounts.json``; the next
process gets the descriptor back (``adopt``), shows the same versions under the same inode
numbers and takes the mount over (``agent.mount.fuse_server.fake_init``). Readers wait meanwhile;
none gets an error.

The daemon never reads its own mount: the reader (``agent.mount.reader``) reads the store's
files, and the unit's ``PrivateMounts`` hides the mount from the daemon's namespace anyway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.blob_id import blob_id
from agent.control import ControlError
from agent.durable import write_atomic
from agent.manifest import Manifest, Piece, check_name, published_ts
from agent.mount.reader import Reader
from agent.mount.tree import Tree, Version, entry_name
from agent.policy.model import Model, Policy
from agent.pull.demand import Demand
from agent.status import PullInfo
from agent.store import Store, StoreError
from agent.store.views import drop_stale, drop_view, make_view

log = logging.getLogger(__name__)

MAX_ERRORS = 5                   # recent read errors kept for status
STATE_FILE = "mounts.json"       # in the policy's state_dir
FD_NAME = "wagent-fuse"          # the descriptor's name in systemd's fd store


@dataclass
class Shown:
    """A version shown under the mount's root, and the directories it is bound onto."""

    model: str
    version: str
    size: int
    since: float
    dirs: set[str] = field(default_factory=set)
    # the store's view bound instead of the FUSE mount (a version complete when first mounted,
    # ``agent.store.views``); None: shown by the FUSE server
    view: str | None = None


@dataclass(frozen=True)
class MountDeps:
    """What the mounts need of the daemon's parts (``agent.application`` wires them)."""

    policy: Callable[[], Policy]
    store: Callable[[], Store]
    demand: Demand
    # the model's pull as status shows it (its version, state, error), None if unknown
    pull_info: Callable[[str], PullInfo | None]
    # "latest" resolved for a model, now (a request to the sources)
    resolve: Callable[[Model], str]
    # a version's manifest: the store's when installed, else the sources'
    manifest: Callable[[Model, str], Manifest]
    wake: Callable[[str], None]             # the model's worker job should look again now
    clock: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


class Mounts:
    def __init__(self, deps: MountDeps) -> None:
        self.deps = deps
        self.lock = threading.Lock()          # the tree and ``shown``
        self.tree = Tree()
        self.shown: dict[str, Shown] = {}     # MODEL@VERSION -> what shows it
        self.errors: deque[tuple[float, str]] = deque(maxlen=MAX_ERRORS)
        self.reader = Reader(deps.store, deps.demand,
                             lambda: deps.policy().mounts.read_deadline, self._why_not,
                             deps.monotonic)
        self.server: Any = None               # agent.mount.fuse_server.FuseServer, once served
        # hands the served descriptor to systemd's fd store (agent.notify.store_fd): False when
        # none listens, and a restart then loses the mount (said in the journal)
        self.keep_fd: Callable[[int], bool] = lambda fd: False

    # -- the control calls -------------------------------------------------------------------
    def mount(self, args: Mapping[str, Any]) -> dict[str, Any]:
        model_name = _text(args, "model")
        directory = _text(args, "dir")
        if not os.path.isabs(directory):
            raise ControlError(f"{directory}: the directory must be an absolute path", "usage")
        try:
            check_name("model", model_name)
        except ValueError as e:
            raise ControlError(str(e), "usage") from None
        model = next((m for m in self.deps.policy().models if m.name == model_name), None)
        if model is None:
            known = ", ".join(m.name for m in self.deps.policy().models) or "none"
            raise ControlError(f"unknown model {model_name!r}: the policy has {known}",
                               "not_found")
        version = self._version(model, args.get("version"))
        try:
            manifest = self.deps.manifest(model, version)
        except Exception as e:
            raise ControlError(f"{model.name} {version}: its manifest can't be read: {e}",
                               "not_found") from None
        view = self._view_for(model.name, version)
        name = self._show(model, version, manifest, [directory], view)
        if view is not None:
            log.info("mount: %s shown at %s from the store (complete: a bind of its view %s)",
                     name, directory, view)
            return {"entry": name, "model": model.name, "version": version, "view": view,
                    "serving": self.serving()}
        log.info("mount: %s shown at %s", name, directory)
        self.deps.demand.wish(read_ahead(manifest))
        self.deps.wake(model.name)
        return {"entry": name, "model": model.name, "version": version,
                "serving": self.serving()}

    def _view_for(self, model: str, version: str) -> str | None:
        """The store's view to bind when the version is complete there and not shown by the
        FUSE server already (one way per version: its directories read alike); else None."""
        with self.lock:
            shown = self.shown.get(entry_name(model, version))
        store = self.deps.store()
        if shown is not None:
            if shown.view is not None:
                # links a failed verification took out come back once the version is whole
                with contextlib.suppress(OSError, StoreError):
                    make_view(store, model, version)
            return shown.view
        if store.installed(model, version) is None:
            return None
        try:
            return str(make_view(store, model, version))
        except (OSError, StoreError) as e:   # the FUSE mount serves it as well, slower
            log.warning("mount: no view of %s@%s in the store (%s): the FUSE mount serves it",
                        model, version, e)
            return None

    def serve_fuse(self, fds: Iterable[int]) -> dict[str, Any]:
        """Starts the FUSE server on the first descriptor (the others are closed)."""
        fds = list(fds)
        try:
            if not fds:
                raise ControlError("serve_fuse needs the /dev/fuse descriptor (SCM_RIGHTS)",
                                   "usage")
            if self.serving():
                raise ControlError("a FUSE server runs already", "busy")
            self._serve(fds[0], taking_over=False)
            try:
                kept = self.keep_fd(fds[0])
            except OSError as e:
                log.warning("mount: systemd's fd store refused the mount's descriptor (%s)", e)
                kept = False
            if not kept:
                log.warning("mount: no fd store (FileDescriptorStoreMax= under systemd): the "
                            "mount dies with this process; readers then get ENOTCONN")
            return {"serving": True}
        finally:
            for fd in fds:
                os.close(fd)

    def adopt(self, fd: int | None) -> None:
        """After a restart: the versions shown before are shown again, those bound from the
        store's views always, those of the FUSE mount when its descriptor came back from the
        fd store (``fd``; same inodes), and the mount is taken over: its readers go on. Views
        no mount shows any more are removed."""
        try:
            saved = self._load()
            for model_name, version, dirs, viewed in saved:
                if not viewed and fd is None:
                    log.warning("mount: %s@%s was shown by the FUSE mount, whose descriptor "
                                "didn't come back (no fd store): not shown again",
                                model_name, version)
                    continue
                try:
                    check_name("model", model_name)
                    check_name("version", version)
                except ValueError as e:
                    log.error("mount: %s: %s", self._state_path(), e)
                    continue
                model = next((m for m in self.deps.policy().models if m.name == model_name),
                             None)
                if model is None:
                    log.warning("mount: %s@%s is no longer in the policy: not shown again",
                                model_name, version)
                    continue
                try:
                    view = str(make_view(self.deps.store(), model_name, version)) \
                        if viewed else None
                    self._show(model, version, self.deps.manifest(model, version), dirs, view)
                except Exception as e:
                    log.error("mount: %s@%s can't be shown again: %s", model_name, version, e)
                    continue
                self.deps.wake(model.name)
            with self.lock:
                self._save_locked()
                keep = {n for n, s in self.shown.items() if s.view is not None}
            for gone in drop_stale(self.deps.store(), keep):
                log.info("mount: removed the view %s: no mount shows it", gone)
            if fd is not None:
                self._serve(fd, taking_over=True)
                log.info("mount: took over the mount (%d versions shown)", len(self.shown))
        except Exception as e:
            log.error("mount: taking over the mount failed: %s", e)
        finally:
            if fd is not None:
                os.close(fd)

    def _serve(self, fd: int, *, taking_over: bool) -> None:
        from agent.mount.fuse_server import FuseServer  # pyfuse3: only once a mount comes
        server = FuseServer(fd, self.tree, self.lock, self.reader, self._read_error,
                            taking_over=taking_over)
        try:
            server.start()
        except Exception as e:
            raise ControlError(f"serving the mount failed: {e}", "internal") from None
        self.server = server
        log.info("mount: serving the FUSE mount")

    def umount(self, args: Mapping[str, Any]) -> dict[str, Any]:
        directory = _text(args, "dir")
        unviewed: Shown | None = None
        with self.lock:
            name = next((n for n, s in self.shown.items() if directory in s.dirs), None)
            if name is not None:
                shown = self.shown[name]
                shown.dirs.discard(directory)
                if not shown.dirs:
                    del self.shown[name]
                    if shown.view is not None:
                        unviewed = shown
                    else:
                        v = self.tree.versions[name]
                        self.tree.remove(name)
                        self.deps.demand.forget({blob_id(f) for f in v.manifest.files})
                self._save_locked()
            # the FUSE mount's directories: at none, the CLI unmounts its root
            left = sum(len(s.dirs) for s in self.shown.values() if s.view is None)
        if unviewed is not None:
            try:
                drop_view(self.deps.store(), unviewed.model, unviewed.version)
            except OSError as e:         # the next start removes it
                log.warning("umount: the view of %s stays until the next start: %s", name, e)
        if name is not None:
            log.info("umount: %s no longer shown at %s", name, directory)
        return {"entry": name, "left": left}

    def _show(self, model: Model, version: str, manifest: Manifest, dirs: list[str],
              view: str | None = None) -> str:
        try:
            published = published_ts(manifest.published)
        except (TypeError, ValueError):
            published = self.deps.clock()
        name = entry_name(model.name, version)
        with self.lock:
            for shown in self.shown.values():
                for d in dirs:
                    if d in shown.dirs:
                        raise ControlError(f"{d} shows {shown.model}@{shown.version} "
                                           "already (wagent umount it first)", "busy")
            if view is None:
                self.tree.add(Version(model.name, version, manifest, published))
            shown = self.shown.setdefault(name, Shown(model.name, version, manifest.size,
                                                      self.deps.clock(), view=view))
            shown.dirs.update(dirs)
            self._save_locked()
        return name

    def _state_path(self) -> Path:
        return Path(self.deps.policy().state_dir) / STATE_FILE

    def _save_locked(self) -> None:
        doc = {"shown": [{"model": s.model, "version": s.version, "dirs": sorted(s.dirs),
                          "view": s.view is not None} for s in self.shown.values()]}
        try:
            write_atomic(self._state_path(), json.dumps(doc, indent=1).encode(), mode=0o600)
        except OSError as e:   # the mount works on; a restart would not show it again
            log.error("mount: saving %s failed: %s", self._state_path(), e)

    def _load(self) -> list[tuple[str, str, list[str], bool]]:
        """(model, version, directories, whether bound from the store's view)"""
        try:
            doc = json.loads(self._state_path().read_text())
            return [(str(e["model"]), str(e["version"]), [str(d) for d in e["dirs"]],
                     e.get("view") is True)
                    for e in doc["shown"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("mount: %s unreadable (%s): no version shown again", self._state_path(),
                      e)
            return []

    # -- for the worker, eviction and status ---------------------------------------------------
    def serving(self) -> bool:
        return self.server is not None and self.server.alive()

    def mounted(self, model: Model, version: str) -> bool:
        with self.lock:
            return entry_name(model.name, version) in self.shown

    def versions(self) -> dict[str, set[str]]:
        with self.lock:
            out: dict[str, set[str]] = {}
            for s in self.shown.values():
                out.setdefault(s.model, set()).add(s.version)
            return out

    def status(self) -> dict[str, Any]:
        store = self.deps.store()
        with self.lock:
            shown = list(self.shown.values())
        rows = []
        for s in shown:
            info = self.deps.pull_info(s.model)
            installed = store.installed(s.model, s.version) is not None
            done = s.size if installed else (
                info.bytes_done if info is not None and info.version == s.version else 0)
            rows.append({"model": s.model, "version": s.version, "dirs": sorted(s.dirs),
                         "from": "store" if s.view is not None else "fuse",
                         "since": s.since, "bytes_total": s.size, "bytes_verified": done,
                         "complete": installed,
                         "pull": info.state if info is not None else None})
        server = self.server
        return {"serving": self.serving(), "mounts": rows,
                "reads": server.reads if server is not None else 0,
                "read_errors": server.read_errors if server is not None else 0,
                "bytes_read": self.reader.bytes_read,
                "waiting": self.deps.demand.waiting, "wanted": self.deps.demand.wanted,
                "errors": [{"at": at, "error": e} for at, e in self.errors]}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.reader.close()

    # -- helpers --------------------------------------------------------------------------------
    def _version(self, model: Model, asked: object) -> str:
        """The version to show: the one asked for, or the one the policy wants now. A version
        neither wanted nor in the store would never come: refused."""
        wanted = model.version
        if wanted == "latest":
            info = self.deps.pull_info(model.name)
            wanted = info.version if info is not None and info.version else None
            if wanted is None:
                try:
                    wanted = self.deps.resolve(model)
                except Exception as e:
                    raise ControlError(f"{model.name}: which version `latest` names is not "
                                       f"known yet: {e}", "not_found") from None
        if asked is None or asked == "":
            return wanted
        if not isinstance(asked, str):
            raise ControlError("version must be text", "usage")
        try:
            check_name("version", asked)
        except ValueError as e:
            raise ControlError(str(e), "usage") from None
        if asked != wanted and self.deps.store().installed(model.name, asked) is None:
            raise ControlError(f"{model.name}@{asked} is neither the version the policy wants "
                               f"now ({wanted}) nor in the store, so nothing would pull it; "
                               f"mount {model.name}@{wanted}, or pull {asked} first "
                               "(wagent pull)", "not_found")
        return asked

    def _why_not(self, entry: str) -> str:
        model = entry.split("@", 1)[0]
        info = self.deps.pull_info(model)
        if info is None:
            return "the model is no longer in the policy"
        why = f"its pull is {info.state}"
        if info.error:
            why += f": {info.error}"
        return why

    def _read_error(self, message: str) -> None:
        # The kernel retries a failed read on every fault: the journal hears each reason once
        # in a row, status keeps the last few with their times.
        with self.lock:
            again = bool(self.errors) and self.errors[-1][1] == message
            self.errors.append((self.deps.clock(), message))
        if not again:
            log.error("mount: %s", message)


def warm() -> None:
    """Loads the FUSE server's modules (pyfuse3 and trio: 0.15 s here) in a thread of their own
    at the daemon's start, so the first ``wagent mount``, which an engine's start waits on,
    doesn't. Without pyfuse3 the first mount says so."""
    def load() -> None:
        try:
            import agent.mount.fuse_server  # noqa: F401
        except ImportError as e:
            log.debug("mount: the FUSE server can't load: %s", e)
    threading.Thread(target=load, name="warm-fuse", daemon=True).start()


def read_ahead(m: Manifest) -> list[tuple[str, Piece]]:
    """What engines read first, in that order: the small files (config, tokenizer, the
    shards' index) whole, then the first piece of each safetensors shard (its header: where
    every tensor lies). The rest follows the reads themselves.

    >>> from agent.manifest import FileEntry, Manifest, Piece
    >>> f = lambda p, n: FileEntry(p, n, "0" * 64, tuple(Piece(o, 1, "1" * 64) for o in range(n)))
    >>> m = Manifest("m", "v", "", (f("a.safetensors", 3), f("config.json", 1)))
    >>> [(p.offset) for _, p in read_ahead(m)]
    [0, 0]
    """
    small = [(blob_id(f), p) for f in m.files if not f.path.endswith(".safetensors")
             for p in f.pieces]
    headers = [(blob_id(f), f.pieces[0]) for f in m.files
               if f.path.endswith(".safetensors") and f.pieces]
    return small + headers


def _text(args: Mapping[str, Any], key: str) -> str:
    v = args.get(key)
    if not isinstance(v, str) or not v:
        raise ControlError(f"{key!r} must be given as text", "usage")
    return v
