"""Load and validate a policy file: YAML in, a frozen ``Policy`` or every problem with its line out.

>>> policy = load_policy("policies/fleet.example.yaml")          # raises PolicyError
>>> [str(i) for i in check_policy("bad.yaml")]                     # never raises
['bad.yaml:12: unknown key 'straems' in pulls; did you mean 'streams'?']

The walk from YAML to dataclasses lives in ``agent.policy.build`` (driven by the dataclasses of
``agent.policy.model``); the rules that tie several keys together in ``agent.policy.rules``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import NamedTuple

from agent.policy import rules
from agent.policy.build import NO_VALUE, Builder, ComposeError, PolicyTooLarge, compose
from agent.policy.model import DEFAULT_WAVES, SCHEMA_VERSION, Policy


class Issue(NamedTuple):
    """One problem in a policy file. ``line`` is 1-based; 0 when the file itself is the problem."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        if self.line <= 0:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}: {self.message}"


class PolicyError(Exception):
    """A policy that can't be used; ``issues`` lists every problem as (file, line, message)."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """The policy in file ``path``; raises PolicyError listing every problem."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PolicyError([Issue(path, 0, f"can't read the policy: {e.strerror or e}")]) from e
    return parse_policy(data, path)


def check_policy(path: str | os.PathLike[str]) -> list[Issue]:
    """Every problem in the policy file ``path``; an empty list when it is clean."""
    try:
        load_policy(path)
    except PolicyError as e:
        return e.issues
    return []


def parse_policy(data: bytes | str, path: str = "<policy>") -> Policy:
    """The policy in ``data`` (the file's bytes), named ``path`` in messages."""
    raw = data.encode() if isinstance(data, str) else data
    digest = hashlib.sha256(raw).hexdigest()
    try:
        node = compose(raw)
    except ComposeError as e:
        raise PolicyError([Issue(path, e.line, str(e))]) from e
    if node is None:
        raise PolicyError([Issue(path, 1, f"the policy is empty; start it with "
                                          f"'version: {SCHEMA_VERSION}'")])
    b = Builder(path)
    try:
        policy = b.build(Policy, node, "")
    except (PolicyTooLarge, RecursionError) as e:
        why = str(e) if isinstance(e, PolicyTooLarge) else "values nest too deep (a recursive " \
            "alias?)"
        raise PolicyError([Issue(path, 1, f"the policy is too large: {why}")]) from None
    if policy is NO_VALUE:
        raise PolicyError([Issue(*i) for i in b.issues])
    if "waves.order" not in b.lines and policy.roles:
        policy = dataclasses.replace(
            policy, waves=dataclasses.replace(policy.waves, order=_default_order(policy)))
    rules.check(policy, b)
    if b.issues:
        issues = sorted({Issue(*i) for i in b.issues}, key=lambda i: (i.line, i.message))
        raise PolicyError(issues)
    return dataclasses.replace(policy, path=path, sha256=digest)


def _default_order(p: Policy) -> tuple[str, ...]:
    """Without ``waves.order``: the conventional roles the policy has (and the default role), in
    the conventional order, then its other roles in file order. An unused conventional name
    would only delay the waves after it by a gap."""
    names = {r.name for r in p.roles} | {p.default_role}
    conventional = tuple(r for r in DEFAULT_WAVES if r in names and r != p.cache_role)
    extra = tuple(r.name for r in p.roles
                  if r.name not in DEFAULT_WAVES and r.name != p.cache_role)
    if p.default_role not in conventional + extra + (p.cache_role,):
        extra += (p.default_role,)
    return conventional + extra


