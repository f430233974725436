"""A cache tells its cluster that it started a version: each node polls at once.

A node learns of a version at its next poll of ``latest`` (``poll_interval``, 5 minutes by
default, each node at its own phase). Behind a cache with peers, the cluster streams a version
from the moment the cache starts it (``agent.peers.catalog``: the cache names the version in
flight as ``latest``), so the poll is the longest wait of a rollout: a 100 GB version crosses a
100 Gbit/s link in 8 s, and its last node heard of it up to 300 s after the cache. So the cache,
as it starts offering a version, asks every peer (``peers.hosts``) to look now
(``GET /.wagent/look/{model}`` on its piece server, ``agent.peers.server``); each polls its
sources at once, within its waves' windows as ever. A peer that doesn't answer learns at its
next poll, as before: the message is a hint, never the only way.

    told = tell(urls, "llama", connections)      # how many peers said they look
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

from agent.policy.model import Source
from agent.pull.client import Client, url_for
from agent.pull.connections import Connections
from agent.pull.deadlines import Timeouts
from agent.pull.errors import FetchError

log = logging.getLogger(__name__)

# A peer on the cluster's own switch answers in a millisecond; one that is down must not hold
# the others' hint, and it polls anyway.
TIMEOUTS = Timeouts(connect=1.0, read=2.0)
AT_ONCE = 16                # peers asked side by side (a cluster of hundreds: a few round trips)


def tell(urls: Sequence[str], model: str, connections: Connections) -> int:
    """Asks each peer at ``urls`` (a piece server's base URL) to look for a new version of
    ``model`` now; returns how many said they do (the others: down, or not pulling the
    model)."""
    if not urls:
        return 0
    side = connections.side()

    def one(url: str) -> bool:
        source = Source(url=url)
        client = Client(source, TIMEOUTS, connections=side)
        try:
            client.get_small(url_for(source, ".wagent", "look", model), 1024)
        except FetchError as e:
            log.debug("telling %s of %s: %s", url, model, e)
            return False
        finally:
            client.close()
        return True

    with concurrent.futures.ThreadPoolExecutor(min(AT_ONCE, len(urls)),
                                               thread_name_prefix="tell") as pool:
        return sum(pool.map(one, urls))
