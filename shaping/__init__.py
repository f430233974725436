"""Kernel-side shaping (HTB via pyroute2), traffic detectors and the backoff controller."""
