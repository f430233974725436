"""Who this node is (a stable id for the schedule's hash) and which role it plays.

The id is ``/etc/machine-id`` (stable across reboots and renames, unique per install), else the
hostname. The role is the content of ``/etc/wagent/role`` when that file exists and is not empty
(config management's override), else the first role in the policy whose host patterns match the
hostname (fnmatch, case-insensitive, in the policy's order), else the policy's ``default_role``.
Paths and the hostname are parameters so tests use their own.
"""

from __future__ import annotations

import fnmatch
import socket
from dataclasses import dataclass
from pathlib import Path

from agent.policy.model import Policy

MACHINE_ID = Path("/etc/machine-id")
ROLE_OVERRIDE = Path("/etc/wagent/role")


@dataclass(frozen=True)
class Identity:
    node_id: str
    hostname: str
    role: str
    role_source: str        # for status: "override /etc/wagent/role", "hosts 'gpu-*'", "default"
    warning: str | None = None  # e.g. an override naming a role the policy doesn't define


def node_id(machine_id: Path = MACHINE_ID, hostname: str | None = None) -> str:
    """The machine id, else the hostname."""
    try:
        text = machine_id.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        text = ""
    return text or (hostname if hostname is not None else socket.gethostname())


def role_for(policy: Policy, hostname: str,
             override: Path = ROLE_OVERRIDE) -> tuple[str, str]:
    """(role, why) for a node named ``hostname`` under ``policy``."""
    try:
        forced = override.read_text(encoding="utf-8").strip()
    except OSError:
        forced = ""
    if forced:
        return forced, f"override {override}"
    name = hostname.lower()
    for role in policy.roles:
        for pattern in role.hosts:
            if fnmatch.fnmatchcase(name, pattern.lower()):
                return role.name, f"hosts {pattern!r}"
    return policy.default_role, "default"


def identify(policy: Policy, hostname: str | None = None, machine_id: Path = MACHINE_ID,
             override: Path = ROLE_OVERRIDE) -> Identity:
    """This node's identity under ``policy``."""
    host = hostname if hostname is not None else socket.gethostname()
    role, why = role_for(policy, host, override)
    warning = None
    known = {r.name for r in policy.roles} | set(policy.waves.order) | {policy.default_role}
    if policy.cache_role is not None:
        known.add(policy.cache_role)
    if role not in known:
        warning = (f"role {role!r} ({why}) is not in the policy: no windows, and it pulls after "
                   f"the last wave")
    return Identity(node_id(machine_id, host), host, role, why, warning)
