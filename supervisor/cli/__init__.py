"""The `mlxsup` command line: commands.py (serve and the client commands), service.py (launchd and
systemd), exits.py (the error type and exit statuses every command shares)."""

from supervisor.cli.commands import main

__all__ = ["main"]
