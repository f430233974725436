"""`wagent store ls|verify|gc|pin|unpin`: the store on this node, read and tended by hand.

None needs the daemon. ``ls`` lists models and versions with their sizes, which is current, pins
and last use; ``verify`` re-hashes every file of the published versions (exit 1 naming each bad
file); ``gc`` removes blobs no version references, what crashes left and partial files no pull
holds (``--dry-run`` only says what would go); ``pin``/``unpin`` keep a version from eviction
beside the policy's pins.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent.commands import add_store_arguments, store_root
from agent.manifest import ManifestError
from agent.store import Store, StoreError, pointers, space
from agent.store.verify import verify, versions
from agent.units import format_duration, format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="list, verify, clean and pin the store's versions",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="store_action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("ls", help="models and versions: size, current, pins, last use")
    ls.set_defaults(func=run_ls)
    ver = actions.add_parser("verify", help="re-hash published files; exit 1 naming each bad one")
    ver.add_argument("target", nargs="?", metavar="MODEL[/VERSION]")
    ver.set_defaults(func=run_verify)
    gc = actions.add_parser("gc", help="remove unreferenced blobs, crash leftovers and stale "
                                       "partial files")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.set_defaults(func=run_gc)
    for name, on in (("pin", True), ("unpin", False)):
        a = actions.add_parser(name, help=f"{name} a version (eviction keeps pinned versions)")
        a.add_argument("model")
        a.add_argument("version")
        a.set_defaults(func=run_pin, on=on)
    for a in actions.choices.values():
        add_store_arguments(a)
        a.add_argument("--json", action="store_true", help="JSON for scripts")


def _store(args: argparse.Namespace) -> Store:
    return Store(store_root(args))


def _out(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else text)


def run_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    pins = pointers.pins(store)
    now = time.time()
    models = []
    for model in store.model_names():
        try:
            current = pointers.current(store, model)
            vs = store.versions(model)
        except ManifestError:
            continue
        models.append({"model": model, "current": current, "versions": [
            {"version": v.version, "size": v.size, "published": v.published,
             "last_used": v.last_used, "current": v.version == current,
             "pinned": v.version in pins.get(model, set()), "path": str(v.path)} for v in vs]})
    doc = {"store": str(store.root), "used_bytes": store.usage(), "models": models}
    lines = [f"store {store.root}: {format_size(doc['used_bytes'])} used"]
    for m in models:
        lines.append(f"{m['model']}:")
        for v in m["versions"]:
            marks = [w for w, on in (("current", v["current"]), ("pinned", v["pinned"])) if on]
            lines.append(f"  {v['version']:<24} {format_size(v['size']):>10}  used "
                         f"{format_duration(max(0.0, now - v['last_used']))} ago"
                         + (f"  ({', '.join(marks)})" if marks else ""))
    if not models:
        lines.append("no complete version")
    _out(args, doc, "\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    model, _, version = (args.target or "").partition("/")
    checked, bad = [], []
    for m in versions(store, model or None, version or None):
        checked.append(f"{m.model}/{m.version}")
        bad += verify(store, m)
    doc = {"store": str(store.root), "checked": checked,
           "bad": [{"model": p.model, "version": p.version, "path": p.path, "why": p.why}
                   for p in bad]}
    if args.target and not checked:
        print(f"wagent store verify: no version {args.target} in {store.root}", file=sys.stderr)
        return 1
    text = "\n".join([f"{p.model}/{p.version}/{p.path}: {p.why}" for p in bad]
                     + [f"{len(checked)} version(s) checked, {len(bad)} bad file(s)"])
    _out(args, doc, text)
    return 1 if bad else 0


def run_gc(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        removed = space.gc(store, time.time(), dry_run=args.dry_run)
    except space.BusyError as e:
        print(f"wagent store gc: {e}", file=sys.stderr)
        return 1
    total = sum(r.size for r in removed)
    doc = {"store": str(store.root), "dry_run": args.dry_run, "bytes": total,
           "removed": [{"kind": r.kind, "name": r.name, "size": r.size} for r in removed]}
    verb = "would remove" if args.dry_run else "removed"
    text = "\n".join([f"{verb} {r.kind} {r.name} ({format_size(r.size)})" for r in removed]
                     + [f"{verb} {len(removed)} item(s), {format_size(total)}"])
    _out(args, doc, text)
    return 0


def run_pin(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        changed = pointers.pin(store, args.model, args.version, on=args.on)
    except (ManifestError, StoreError, OSError) as e:
        print(f"wagent store: {e}", file=sys.stderr)
        return 1
    word = "pinned" if args.on else "unpinned"
    _out(args, {"model": args.model, "version": args.version, "pinned": args.on,
                "changed": changed},
         f"{args.model}/{args.version} {word}" + ("" if changed else " already"))
    return 0
