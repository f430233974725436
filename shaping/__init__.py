"""Kernel-side shaping: the tc plan, reconcile, render, observed state, netlink (pyroute2), Shaper.

A library below yielding (``agent.yielding`` moves the caps it applies); it reads the policy's
values (``agent.policy.model``) and imports nothing else of wagent but ``agent.durable``.
"""
