"""What a fleet does with a new version, worked out before it is published (``wagent plan``).

``waves`` simulates the policy's schedule alone: N nodes, a fixed pull time, when each wave
starts and ends. ``topology`` is the fleet description (clusters, links, cache nodes, the
origin's egress) and its loader; ``simulate`` runs a version through that fleet: each node's slot
from ``agent.schedule`` as the daemon computes it, its source (its cluster's cache once the cache
holds the version, else the origin), and max-min fair sharing of every link, event by event;
``swarm`` what changes where a cluster's nodes serve each other (the policy's ``peers``).
``report`` turns a result into the table and the JSON ``wagent plan`` prints. All of it is pure.
"""
