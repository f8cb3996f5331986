"""The command line's exit codes and its one argument error.

Shared by ``kvhit/cli.py`` (parsing, checks) and ``kvhit/commands.py`` (the
work), so neither imports the other at module level.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CODES",
    "EXIT_INTERNAL",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_USAGE",
    "ArgumentError",
]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

EXIT_CODES = """\
exit codes:
  0  success
  1  a backend disagreed with the reference loop (the requests are printed)
  2  bad arguments (the message names the argument)
  3  an internal error (its traceback is printed)"""


class ArgumentError(ValueError):
    """A bad command-line argument, found by a check or by the first read of
    a file it names (a trace). ``kvhit`` prints ``argument ARG: message``
    after the subcommand's usage and exits 2, with no traceback."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}")
        self.argument = argument
