"""Pulls: the only code that speaks HTTP.

``engine`` (the API: pull_version, resolve_latest), ``options`` (PullOptions, a pull's
settings; its progress is ``agent.status.PullProgress``), ``plan`` (pure: what to fetch, copy
or keep), ``transfer`` (the streams), ``http`` (requests, one Session per stream),
``journal`` (partial files and their piece journals), ``progress`` (how the CLI shows a pull).
"""
