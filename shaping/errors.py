"""Errors of the shaping layer, worded for the person who has to fix them."""

from __future__ import annotations

NET_ADMIN_HINT = (
    "wagent needs the CAP_NET_ADMIN capability to change traffic control: run it as root, or "
    "grant the capability (systemd: AmbientCapabilities=CAP_NET_ADMIN; by hand: "
    "setpriv --reuid=wagent --inh-caps +net_admin --ambient-caps +net_admin wagent ...)"
)


class ShapingError(Exception):
    """Shaping can't be set up or read; the message names the interface or setting and the fix.
    ``code``: the kernel's errno, when the kernel refused."""

    code: int | None = None


class PlanError(ShapingError):
    """The policy's shaping section can't be turned into a tc tree (bad rate, port, interface)."""
