"""The one error type every step module raises for bad input.

The command-line entry points turn it into a single line on stderr and exit status 2, so a user sees
which file or key is wrong and why, never a traceback."""

import sys
from functools import wraps


class NvgError(Exception):
    """Bad input: the message names the file (or config key), the field and the problem."""


def exits_cleanly(main):
    """Wrap a CLI entry point: an NvgError becomes one line on stderr and exit code 2."""

    @wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except NvgError as e:
            print(f"nvg: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    return run
