"""`wagent store ls|verify|gc|pin|unpin`: the store on this node, read and tended by hand.

None needs the daemon. ``ls`` lists models and versions with their sizes, which is current, pins
and last use, and the versions that miss a file; ``verify`` re-hashes every file of the published
versions (exit 1 naming each bad file) and removes each blob whose bytes are wrong, so that no
version serves it and the next pull fetches it again; ``verify --repair`` pulls those versions
again at once, from ``--source`` or the policy's sources; ``gc`` removes blobs no version
references, what crashes left and partial files no pull holds (``--dry-run`` only says what would
go); ``pin``/``unpin`` keep a version from eviction beside the policy's pins.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent.commands import add_store_arguments, existing_store
from agent.manifest import ManifestError
from agent.policy import PolicyError, load_policy
from agent.policy.model import Pulls, Source
from agent.pull.connections import Connections
from agent.pull.engine import PullError, PullOptions, pull_version
from agent.store import Store, StoreError, pointers, space
from agent.store.verify import Checker, Problem, versions
from agent.units import format_duration, format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="list, verify, clean and pin the store's versions",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="store_action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("ls", help="models and versions: size, current, pins, last use")
    ls.set_defaults(func=run_ls)
    ver = actions.add_parser("verify", help="re-hash published files; exit 1 naming each bad "
                                            "one; a damaged blob is removed")
    ver.add_argument("target", nargs="?", metavar="MODEL[/VERSION]")
    ver.add_argument("--repair", action="store_true",
                     help="pull the versions with a bad or missing file again (from --source, "
                          "else the policy's sources)")
    ver.add_argument("--source", action="append", default=[], metavar="URL",
                     help="a source base URL for --repair (repeatable; default: the policy's)")
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


def _store(args: argparse.Namespace) -> Store | None:
    return existing_store(args, f"store {args.store_action}")


def _out(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else text)


def run_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    if store is None:
        return 1
    pins = pointers.pins(store)
    now = time.time()
    models = []
    for model in store.model_names():
        try:
            current = pointers.current(store, model)
            vs = store.versions(model)
        except ManifestError:
            continue
        complete = {v.version for v in vs}
        incomplete = [{"version": m.version, "missing": store.missing(m),
                       "current": m.version == pointers.current_target(store, model)}
                      for m in store.every_manifest()
                      if m.model == model and m.version not in complete]
        models.append({"model": model, "current": current, "versions": [
            {"version": v.version, "size": v.size, "published": v.published,
             "last_used": v.last_used, "current": v.version == current,
             "pinned": v.version in pins.get(model, set()), "path": str(v.path)} for v in vs],
            "incomplete": incomplete})
    doc = {"store": str(store.root), "used_bytes": store.usage(), "models": models}
    lines = [f"store {store.root}: {format_size(doc['used_bytes'])} used"]
    for m in models:
        lines.append(f"{m['model']}:")
        for v in m["versions"]:
            marks = [w for w, on in (("current", v["current"]), ("pinned", v["pinned"])) if on]
            lines.append(f"  {v['version']:<24} {format_size(v['size']):>10}  used "
                         f"{format_duration(max(0.0, now - v['last_used']))} ago"
                         + (f"  ({', '.join(marks)})" if marks else ""))
        for v in m["incomplete"]:
            lines.append(f"  {v['version']:<24} incomplete: {len(v['missing'])} file(s) missing, "
                         "pull it again" + ("  (current: serving a missing file)"
                                            if v["current"] else ""))
    if not models:
        lines.append("no complete version")
    _out(args, doc, "\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    if store is None:
        return 1
    model, _, version = (args.target or "").partition("/")
    checker = Checker(store, remove=True)
    checked, bad = [], []
    for m in versions(store, model or None, version or None):
        checked.append(f"{m.model}/{m.version}")
        bad += checker.verify(m)
    if args.target and not checked:
        print(f"wagent store verify: no version {args.target} in {store.root}", file=sys.stderr)
        return 1
    # A version with a wrong whole-file sha256 (every piece right) is the manifest's fault:
    # pulling again would bring the same bytes.
    broken = sorted({(p.model, p.version) for p in bad if p.blob is not None or
                     "whole file's sha256" not in p.why})
    repaired: list[str] = []
    unrepaired: list[dict[str, str]] = []
    if args.repair and broken:
        repaired, unrepaired = _repair(args, store, broken)
    doc = {"store": str(store.root), "checked": checked,
           "bad": [{"model": p.model, "version": p.version, "path": p.path, "why": p.why,
                    "blob": p.blob, "removed": p.removed} for p in bad],
           "repaired": repaired, "unrepaired": unrepaired}
    lines = [f"{p.model}/{p.version}/{p.path}: {p.why}"
             + (f"; its blob {p.blob[:12]} was removed" if p.removed and p.blob else "")
             for p in bad]
    lines.append(f"{len(checked)} version(s) checked, {len(bad)} bad file(s)")
    if args.repair:
        lines += [f"repaired {v}: pulled again and verified" for v in repaired]
        lines += [f"not repaired {u['version']}: {u['why']}" for u in unrepaired]
    elif broken:
        lines.append(_incomplete_hint(store, broken))
    _out(args, doc, "\n".join(lines))
    left = {f"{p.model}/{p.version}" for p in bad} - set(repaired)
    return 1 if left else 0


def _incomplete_hint(store: Store, broken: list[tuple[str, str]]) -> str:
    """What a removed blob means for its versions, and how they become whole again."""
    current = [f"{m}/{v}" for m, v in broken if pointers.current_target(store, m) == v]
    names = ", ".join(f"{m}/{v}" for m, v in broken)
    text = (f"incomplete until pulled again: {names} (the daemon pulls the version it follows "
            "at its next poll; by hand: wagent pull SOURCE/MODEL/VERSION --store "
            f"{store.root}, or wagent store verify --repair)")
    if current:
        text += (f"; current, and missing a file meanwhile: {', '.join(current)} (wagent wait "
                 "MODEL returns once it is whole)")
    return text


def _repair(args: argparse.Namespace, store: Store, broken: list[tuple[str, str]]
            ) -> tuple[list[str], list[dict[str, str]]]:
    """Pull each broken version again (only what is missing is fetched), then verify it."""
    sources = [Source(u) for u in args.source]
    pulls = Pulls()
    if not sources:
        try:
            policy = load_policy(args.policy)
            sources, pulls = list(policy.sources), policy.pulls
        except (PolicyError, OSError) as e:
            why = (f"the store records no source and the policy {args.policy} gives none "
                   f"({str(e).splitlines()[0]}): give --source URL")
            return [], [{"version": f"{m}/{v}", "why": why} for m, v in broken]
    options = PullOptions.from_policy(pulls)
    connections = Connections()         # the repairs' watchdog and sockets (no backoff loop)
    repaired, unrepaired = [], []
    for model, version in broken:
        name = f"{model}/{version}"
        try:
            pull_version(sources, model, version, store, options=options,
                         connections=connections)
        except (PullError, StoreError) as e:
            unrepaired.append({"version": name, "why": str(e)})
            continue
        m = store.installed(model, version)
        left: list[Problem] = Checker(store, remove=True).verify(m) if m is not None else []
        if m is None or left:
            why = "; ".join(f"{p.path}: {p.why}" for p in left) or "still incomplete"
            unrepaired.append({"version": name, "why": why})
        else:
            repaired.append(name)
    return repaired, unrepaired


def run_gc(args: argparse.Namespace) -> int:
    store = _store(args)
    if store is None:
        return 1
    try:
        removed = space.gc(store, time.time(), dry_run=args.dry_run)
    except (space.BusyError, StoreError) as e:     # StoreError: a store others could change
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
    if store is None:
        return 1
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
