"""The policy: the fleet's YAML file as frozen dataclasses.

``model`` (the dataclasses, their defaults and units), ``build`` (the walk from YAML nodes to
them, keeping every value's line), ``rules`` (checks that tie keys together), ``loading``
(``load_policy``, ``check_policy``: every problem as ``file:line: message``) and ``document``
(the effective policy as plain data, what ``wagent policy show`` prints).
"""

from agent.policy.loading import Issue, PolicyError, check_policy, load_policy, parse_policy
from agent.policy.model import Policy

__all__ = ["Issue", "Policy", "PolicyError", "check_policy", "load_policy", "parse_policy"]
