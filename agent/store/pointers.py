"""What points into the store from outside a version: the current version of each model, and the
versions an operator pinned.

``{store}/models/{model}/current`` is a relative symlink to the version this node serves: the
one path an inference server loads (as the Hugging Face cache's ``refs/main``). It is switched
atomically (a new link renamed over the old one, then the model directory fsynced) and only to a
version that is complete, so a reader that resolves it once sees one whole version.

``{store}/pins.json`` holds the pins made with ``wagent store pin``: eviction keeps them beside the
policy's pins, and never removes the current version either.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid

from agent.durable import fsync_dir, write_atomic
from agent.manifest import check_name
from agent.store.layout import FILE_MODE, Store, StoreError

CURRENT = "current"
PINS_FILE = "pins.json"


def current(store: Store, model: str) -> str | None:
    """The version ``current`` names, if it is a link to a complete version."""
    target = current_target(store, model)
    return target if target is not None and store.installed(model, target) is not None else None


def current_target(store: Store, model: str) -> str | None:
    """The version ``current`` names, complete or not (one that lost a blob still is the
    one an inference server opens)."""
    try:
        target = os.readlink(store.model_dir(model) / CURRENT)
    except (OSError, ValueError):
        return None
    try:
        return check_name("version", target)
    except ValueError:
        return None


def set_current(store: Store, model: str, version: str) -> bool:
    """Point ``current`` at a complete version; returns whether it changed.

    Under the store lock (shared, as a pull): no eviction removes the version between the check
    and the switch, and no clean takes the new link (``.current-*``) for a crash's leftover
    before it is renamed into place."""
    check_name("version", version)
    with store.pull_lock():
        if store.installed(model, version) is None:
            raise StoreError(f"{model}/{version} is not complete in the store {store.root}: "
                             "pull it first")
        model_dir = store.model_dir(model)
        link = model_dir / CURRENT
        with contextlib.suppress(OSError):
            if os.readlink(link) == version:
                return False
        if os.path.isdir(link) and not os.path.islink(link):
            raise StoreError(f"{link} is a directory, not the current pointer (a version an "
                             f"older wagent published under the name {CURRENT!r}, which the "
                             "store doesn't list, verify or keep): remove it by hand")
        for attempt in range(3):
            tmp = model_dir / f".current-{uuid.uuid4().hex[:8]}"
            os.symlink(version, tmp)
            try:
                os.replace(tmp, link)
                break
            except FileNotFoundError:
                # Our new link taken by an older wagent's clean that ran beside us: make
                # another one.
                if attempt == 2:
                    raise
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        fsync_dir(model_dir)
    return True


def pins(store: Store) -> dict[str, set[str]]:
    """model -> versions pinned by hand (``wagent store pin``)."""
    try:
        doc = json.loads((store.root / PINS_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {m: {v for v in vs if isinstance(v, str)} for m, vs in doc.items()
            if isinstance(m, str) and isinstance(vs, list)}


def pin(store: Store, model: str, version: str, on: bool = True) -> bool:
    """Pin (or unpin) a version; returns whether anything changed."""
    check_name("model", model)
    check_name("version", version)
    with store.usage_lock():
        now = pins(store)
        versions = now.setdefault(model, set())
        if (version in versions) == on:
            return False
        if on:
            versions.add(version)
        else:
            versions.discard(version)
        doc = {m: sorted(vs) for m, vs in sorted(now.items()) if vs}
        store.ensure()
        write_atomic(store.root / PINS_FILE, (json.dumps(doc, indent=1) + "\n").encode(),
                     mode=FILE_MODE)
    return True


def kept(store: Store) -> dict[str, set[str]]:
    """What eviction must keep beyond the policy's rules: pins by hand and current versions."""
    out = pins(store)
    for model in store.model_names():
        v = current(store, model)
        if v is not None:
            out.setdefault(model, set()).add(v)
    return out
