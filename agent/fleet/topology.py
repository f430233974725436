"""The fleet description ``wagent plan --fleet`` simulates: clusters, their links, their cache
nodes and the origin's egress. Frozen dataclasses, and a loader that reports every problem as
``file:line: message``, as the policy's does (it is the same walk: ``agent.policy.build``).

::

    version: 1
    origin: {egress: 10gbit}
    clusters:
      dc1:
        link: 100gbit            # the cluster's uplink: what it fetches from the origin crosses it
        node_link: 25gbit
        nodes: {inference: 200, evaluation: 40, training: 800}
        cache: {nodes: 1, egress: 25gbit}

Every key is documented in ``policies/topology/fleet-topology.example.yaml``. Rates are bits per
second here, as in the policy.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

import yaml

from agent.policy import Issue
from agent.policy.build import NO_VALUE, Builder, ComposeError, PolicyTooLarge, compose
from agent.policy.model import rate_field

SCHEMA_VERSION = 1
MAX_NODES = 2_000_000           # a plan keeps a few hundred bytes per node
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


class TopologyError(Exception):
    """A fleet description that can't be used; ``issues`` lists every problem with its line."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass(frozen=True)
class Origin:
    egress: int = field(metadata={"unit": "rate"})     # all the origin sends, every client


@dataclass(frozen=True)
class NodeGroup:
    """The nodes of one role in a cluster; ``inference: 200`` is short for ``{count: 200}``."""

    role: str = field(metadata={"key": True})
    count: int = field(default=0, metadata={"min": 0})
    link: int | None = rate_field(None)                 # None: the cluster's node_link


@dataclass(frozen=True)
class Cache:
    """A cluster's cache nodes (the policy's ``cache_role``); the cluster's nodes fetch from
    them once they hold the version, spread evenly over them."""

    nodes: int = field(default=1, metadata={"min": 1})
    egress: int | None = rate_field(None)               # what each serves; None: its link
    link: int | None = rate_field(None)                 # each one's own link; None: node_link


@dataclass(frozen=True)
class Cluster:
    name: str = field(metadata={"key": True})
    node_link: int = field(metadata={"unit": "rate"})   # each node's link (its download cap)
    count: int = field(default=1, metadata={"min": 1})  # identical clusters: NAME-1..NAME-count
    link: int | None = rate_field(None)                 # uplink from the origin; None: no limit
    nodes: tuple[NodeGroup, ...] = ()
    cache: Cache | None = None

    def link_of(self, group: NodeGroup) -> int:
        return group.link if group.link is not None else self.node_link

    @property
    def cache_link(self) -> int:
        return (self.cache.link if self.cache is not None and self.cache.link is not None
                else self.node_link)

    @property
    def cache_egress(self) -> int:
        return (self.cache.egress if self.cache is not None and self.cache.egress is not None
                else self.cache_link)


@dataclass(frozen=True)
class Topology:
    origin: Origin
    version: int = field(default=SCHEMA_VERSION, metadata={"choices": (SCHEMA_VERSION,)})
    # Goodput over link rate: TCP/IP and Ethernet headers take about 5% of a link at 1500-byte
    # frames. Applied to every link rate below (not to the policy's pulls.rate, a goodput cap).
    efficiency: float = field(default=0.95, metadata={"min": 0.1, "max": 1.0})
    clusters: tuple[Cluster, ...] = ()
    path: str = field(default="", metadata={"yaml": False})

    def expanded(self) -> list[tuple[str, Cluster]]:
        """(name, cluster) for every cluster, ``count`` copies named NAME-1..NAME-count."""
        out = []
        for c in self.clusters:
            if c.count == 1:
                out.append((c.name, c))
            else:
                out += [(f"{c.name}-{k}", c) for k in range(1, c.count + 1)]
        return out

    @property
    def nodes(self) -> int:
        """Every node, cache nodes included."""
        return sum(c.count * (sum(g.count for g in c.nodes)
                              + (c.cache.nodes if c.cache else 0)) for c in self.clusters)


def load_topology(path: str | os.PathLike[str]) -> Topology:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TopologyError([Issue(path, 0, f"can't read the fleet description: "
                                            f"{e.strerror or e}")]) from e
    return parse_topology(data, path)


def parse_topology(data: bytes | str, path: str = "<fleet>") -> Topology:
    """The fleet description in ``data``; raises TopologyError listing every problem."""
    try:
        node = compose(data.encode() if isinstance(data, str) else data)
    except ComposeError as e:
        raise TopologyError([Issue(path, e.line, str(e))]) from e
    if node is None:
        raise TopologyError([Issue(path, 1, "the fleet description is empty; start it with "
                                            f"'version: {SCHEMA_VERSION}'")])
    _expand_counts(node)
    b = Builder(path)
    try:
        topo = b.build(Topology, node, "")
    except (PolicyTooLarge, RecursionError) as e:
        raise TopologyError([Issue(path, 1, f"the fleet description is too large: {e}")]) \
            from None
    if topo is not NO_VALUE:
        _check(topo, b)
    if topo is NO_VALUE or b.issues:
        raise TopologyError(sorted({Issue(*i) for i in b.issues},
                                   key=lambda i: (i.line, i.message)))
    return dataclasses.replace(topo, path=path)


def _expand_counts(root: yaml.Node) -> None:
    """``nodes: {inference: 200}`` -> ``{inference: {count: 200}}``, in place, lines kept.

    The loader's walk wants a mapping per keyed entry; people want to write a number. Every
    ``nodes`` mapping in the document is rewritten, those under ``x-`` anchors too, so that
    merge keys (``<<: *defaults``) see the same form.
    """
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack += node.value
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if (isinstance(key, yaml.ScalarNode) and key.value == "nodes"
                        and isinstance(value, yaml.MappingNode)):
                    value.value = [
                        (k, yaml.MappingNode("tag:yaml.org,2002:map", [(yaml.ScalarNode(
                            "tag:yaml.org,2002:str", "count", v.start_mark, v.end_mark), v)],
                            v.start_mark, v.end_mark))
                        if isinstance(v, yaml.ScalarNode) and not v.tag.endswith(":null")
                        else (k, v)
                        for k, v in value.value]
                stack.append(value)


def _check(t: Topology, b: Builder) -> None:
    """The rules that tie keys together."""
    if not t.clusters:
        b.error(b.line_of("clusters"), "clusters: describe at least one cluster")
    names: dict[str, str] = {}
    for c in t.clusters:
        where = f"clusters.{c.name}"
        line = b.line_of(where)
        if not _NAME.match(c.name):
            b.error(line, f"{where}: a cluster name is letters, digits and . _ + - (it names "
                          "the nodes the plan hashes)")
        for name, _ in Topology(t.origin, clusters=(c,)).expanded():
            if name in names:
                b.error(line, f"{where}: the name {name!r} is also made by clusters."
                              f"{names[name]}; rename one")
            names[name] = c.name
        if not any(g.count for g in c.nodes) and c.cache is None:
            b.error(line, f"{where}: no nodes; give nodes: {{ROLE: COUNT, ...}}")
        for g in c.nodes:
            if not _NAME.match(g.role):
                b.error(b.line_of(f"{where}.nodes.{g.role}", line),
                        f"{where}.nodes: {g.role!r} is not a role name")
    if t.nodes > MAX_NODES:
        b.error(1, f"{t.nodes} nodes in all; a plan holds at most {MAX_NODES}")
