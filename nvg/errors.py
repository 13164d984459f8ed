"""The one error type every step module raises for bad input.

The command-line entry points turn it into a single line on stderr and exit status 2, so a user sees
which file or key is wrong and why, never a traceback."""

import errno
import sys
from functools import wraps


class NvgError(Exception):
    """Bad input: the message names the file (or config key), the field and the problem."""


def exits_cleanly(main):
    """Wrap a CLI entry point: an NvgError, a full disk or too little memory becomes one line on stderr
    and exit code 2 (the outputs' temporary files are already gone: `nvg.atomic.atomic_path`)."""

    @wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except NvgError as e:
            message = str(e)
        except MemoryError as e:  # numpy names the size it could not allocate
            message = f"out of memory: {e or 'an allocation failed'}"
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            message = f"{e.filename or 'an output'}: no space left on device"
        print(f"nvg: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    return run
