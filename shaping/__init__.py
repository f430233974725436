"""Kernel-side shaping (HTB through pyroute2), training-traffic detectors and the backoff controller."""
