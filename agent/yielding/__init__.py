"""Yielding to training traffic: what moves the pulls' rate while they run.

``controller`` (pure AIMD: readings in, a rate out), ``detect`` (the training-traffic detectors
and their pacing), ``backoff`` (the loop: detectors → controller → the three levers),
``sockets`` (the pull sockets' receive windows and their TCP_INFO) with ``base_rtt`` (the
paths' base round trip), ``ratelimit`` (the pulls' token bucket), ``runtime`` (the kernel's
caps joined to the loop for the daemon and ``wagent pull --policy``).

Imports go one way: yielding uses the kernel side (``shaping``: plan, shaper, observed, state),
never the reverse, and it speaks no HTTP (``agent.pull`` registers its sockets here);
``tests/unit/test_import_layers.py`` keeps it so.
"""
