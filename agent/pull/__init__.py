"""Pulls: the only code that speaks HTTP.

``engine`` (the API: pull_version, resolve_latest, PullOptions), ``plan`` (pure: what to fetch,
copy or keep), ``transfer`` (the streams), ``goodput`` (a stream's floor), ``progress`` (how the
CLI shows a pull), ``worker`` and ``node_pulls`` (the daemon's pulls).

HTTP, one room per concern: ``client`` (requests to one source, one Session per stream),
``connections`` (the owner's deadline watchdog and pull sockets' registry, handed to every
client), ``deadlines`` (the watchdog thread, no HTTP), ``framing`` (a response's status and
headers checked, Retry-After), ``small_body`` (a manifest's body, bounded, gzip decoded),
``credentials``, ``errors``, and ``urllib3_adapter`` (every private member of urllib3 wagent
uses). Only ``client`` and ``urllib3_adapter`` import requests; only ``urllib3_adapter``
imports urllib3.
"""
