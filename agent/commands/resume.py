"""`wagent resume`: pulls may start again after `wagent pause`."""

from __future__ import annotations

import argparse

from agent.commands.pause import _add


def register(sub: argparse._SubParsersAction) -> None:
    _add(sub, "resume", "resume pulling after `wagent pause`")
