"""Pulls: the only code that speaks HTTP.

``engine`` (the API: pull_version, resolve_latest), ``options`` (PullOptions, a pull's
settings; its progress is ``agent.status.PullProgress``), ``plan`` (pure: what to fetch, copy
or keep), ``transfer`` (the streams), ``goodput`` (the floor under a request's pace),
``progress`` (how the CLI shows a pull), ``worker`` (the daemon's pulls, one scheduler job per
model) and ``node_pulls`` (what the worker's steps do on this node). Partial files and their
piece journals are the store's (``agent.store.partial``).

HTTP, one room per concern: ``client`` (requests to one source, one Session per stream),
``connections`` (the owner's deadline watchdog and pull sockets' registry, handed to every
client), ``deadlines`` (the watchdog thread, no HTTP), ``framing`` (a response's status and
headers checked, Retry-After), ``small_body`` (a manifest's body, bounded, gzip decoded),
``credentials``, ``errors``, and ``urllib3_adapter`` (every private member of urllib3 wagent
uses). Only ``client`` and ``urllib3_adapter`` import requests; only ``urllib3_adapter``
imports urllib3.
"""
