"""Who the peers are: the policy's ``peers.hosts``, resolved, and which of them is this node.

A name stands for every address it resolves to (one DNS name per cluster can list its nodes).
A node is the entry whose address it can bind: an address of its own, whatever the hostname
says (nothing to configure per node, and a fleet keeps one policy). The list is sorted, so every
node of the cluster sees the same one (``agent.peers.swarm`` needs that, not a coordinator).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Sequence

from agent.peers.swarm import Swarm

log = logging.getLogger(__name__)


def resolve(hosts: Sequence[str]) -> tuple[str, ...]:
    """Every address of every entry, sorted; an entry that doesn't resolve is left out (and
    logged): one bad name must not take the cluster's other peers away."""
    out: set[str] = set()
    for h in hosts:
        try:
            infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as e:
            log.warning("peers.hosts: %s does not resolve (%s); left out", h, e)
            continue
        out.update(str(info[4][0]) for info in infos)
    return tuple(sorted(out))


def is_local(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with contextlib.closing(socket.socket(family, socket.SOCK_DGRAM)) as s:
        try:
            s.bind((address, 0))
        except OSError as e:
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EINVAL):
                log.debug("binding %s: %s", address, e)
            return False
    return True


def swarm(hosts: Sequence[str], port: int, degree: int) -> Swarm | None:
    """This node's swarm, or None when it is not among the peers (it then asks none: a node
    outside the list would be asked by nobody, and its requests would break the trees'
    load), or when it is alone."""
    peers = resolve(hosts)
    mine = [p for p in peers if is_local(p)]
    if not mine or len(peers) < 2:
        return None
    return Swarm(peers, mine[0], port, degree)
