"""The command line's one error type and its exit statuses: a leaf, imported by every command module.

Every failure a command meets becomes a CliError: a one-line message on stderr and a non-zero
exit (2 bad usage, an unknown model or a start that cannot succeed; 3 no daemon running).
"""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_NO_DAEMON = 3


class CliError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
