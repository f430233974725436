"""The import layers, read from the source (an AST walk, nothing imported): who may use whom.

    shaping            the kernel side: plan, reconcile, render, observed, state, netlink, shaper
      ↑
    agent.yielding     controller, detectors, backoff loop, pull sockets' windows, token bucket
      ↑
    agent.pull, agent.application, agent.commands, ...   everything else

The policy's values (``agent.policy.model``), the units and the durable write (``agent.durable``)
are shared leaves: any room may read them, and they import nothing but each other, so they can
never close a cycle. Imports inside functions count too: a late import is still a dependency.
Each failure names the file and line of the import that breaks the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "shaping")
# agent.s3.address: what an s3:// source's URL means (the policy's Source and shaping's ports
# read it), pure
SHARED = frozenset({"agent.policy.model", "agent.units", "agent.durable", "agent.s3.address"})
# Third-party libraries that live behind one adapter each (DEVELOPERS.md).
ADAPTERS = {
    "pyroute2": ("shaping.netlink",),
    "requests": ("agent.pull.client", "agent.pull.urllib3_adapter"),
    "urllib3": ("agent.pull.urllib3_adapter",),
    "apscheduler": ("agent.scheduler",),
    "pyfuse3": ("agent.mount.fuse_server",),
    "trio": ("agent.mount.fuse_server",),
}


@dataclass(frozen=True)
class Import:
    source: str      # the importing module, dotted
    target: str      # the module imported (a name imported from a package resolved to its module)
    where: str       # "path:line"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(modules: dict[str, Path]) -> Iterator[Import]:
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(name, alias.name, where)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: resolved against the importing package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join([*pkg, base] if base else pkg)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    yield Import(name, sub if sub in modules else base, where)


def _project(target: str) -> bool:
    return target.split(".")[0] in PACKAGES


def _room(module: str) -> str:
    """``shaping`` is one room; in ``agent`` each subpackage or module is one, shared leaves too."""
    if module in SHARED or module.split(".")[0] == "shaping":
        return module if module in SHARED else "shaping"
    return ".".join(module.split(".")[:2])


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _all() -> list[Import]:
    return list(_imports(_modules()))


def _report(bad: list[Import], rule: str) -> str:
    lines = dict.fromkeys(f"  {i.where}: {i.source} imports {i.target}" for i in bad)
    return rule + ":\n" + "\n".join(lines)


def test_the_walk_sees_the_imports_it_judges() -> None:
    # Control: the walk finds the edges the rules below are about, so an empty result means
    # "nothing breaks the rule", not "nothing was read".
    edges = {(_room(i.source), _room(i.target)) for i in _all() if _project(i.target)}
    assert ("agent.yielding", "shaping") in edges
    assert ("agent.pull", "agent.yielding") in edges
    assert ("shaping", "agent.policy.model") in edges


def test_shaping_imports_only_the_shared_values() -> None:
    bad = [i for i in _all() if _inside(i.source, "shaping") and _project(i.target)
           and not _inside(i.target, "shaping") and i.target not in SHARED]
    assert not bad, _report(bad, "shaping/ is the kernel side, below yielding: it may import "
                                 f"only itself and {sorted(SHARED)}")


def test_yielding_imports_only_shaping_and_the_shared_values() -> None:
    bad = [i for i in _all() if _inside(i.source, "agent.yielding") and _project(i.target)
           and not _inside(i.target, "agent.yielding") and not _inside(i.target, "shaping")
           and i.target not in SHARED]
    assert not bad, _report(bad, "agent/yielding/ sits between shaping and the pulls: it may "
                                 f"import only itself, shaping and {sorted(SHARED)} (the pulls "
                                 "hand it their sockets, it never reaches for them)")


def test_the_shared_values_are_leaves() -> None:
    bad = [i for i in _all() if i.source in SHARED and _project(i.target)
           and i.target not in SHARED]
    assert not bad, _report(bad, "a shared value module imports only other shared ones, so it "
                                 "can't close a cycle between rooms")


def test_third_party_adapters_stay_in_their_module() -> None:
    bad = [i for i in _all() if i.target.split(".")[0] in ADAPTERS
           and not any(_inside(i.source, home) for home in ADAPTERS[i.target.split(".")[0]])]
    assert not bad, _report(bad, "a library is imported only by its adapter "
                                 f"({ {k: list(v) for k, v in ADAPTERS.items()} })")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of rooms, first == last), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_cycle_between_rooms() -> None:
    graph: dict[str, set[str]] = {}
    first: dict[tuple[str, str], Import] = {}
    for i in _all():
        if not _project(i.target):
            continue
        a, b = _room(i.source), _room(i.target)
        if a != b:
            graph.setdefault(a, set()).add(b)
            first.setdefault((a, b), i)
    cycle = _cycle(graph)
    assert cycle is None, _report([first[e] for e in zip(cycle, cycle[1:], strict=False)],
                                  "the rooms import each other in a cycle "
                                  + " -> ".join(cycle))


def test_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
