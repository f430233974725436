"""One module per CLI subcommand; each exposes ``register(subparsers)`` and sets ``func``.

``func(args) -> int`` returns the exit code: 0 success, 1 a failure the command reports,
2 a usage error (argparse's own), 3 for ``status`` when the daemon is not running.
"""
