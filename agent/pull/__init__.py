"""Pulls: the only code that speaks HTTP.

``engine`` (the API: pull_version, resolve_latest), ``options`` (PullOptions, a pull's
settings; its progress is ``agent.status.PullProgress``), ``plan`` (pure: what to fetch, copy
or keep), ``transfer`` (the streams), ``http`` (requests, one Session per stream),
``goodput`` (the floor under a request's pace), ``progress`` (how the CLI shows a pull),
``worker`` (the daemon's pulls, one scheduler job per model) and ``node_pulls`` (what the
worker's steps do on this node). Partial files and their piece journals are the store's
(``agent.store.partial``).
"""
