"""Errors Flint reports to users.

Every error a user can cause (bad input file, bad plan field, unknown device
name, ...) is a :class:`FlintError` whose message names what is wrong and
where. Command-line tools print the message and exit non-zero; they never
show a Python traceback for a ``FlintError``.
"""


class FlintError(Exception):
    """Base of every error Flint reports to a user."""


def run_cli(prog: str, fn, *args) -> int:
    """Run a command-line entry point: a :class:`FlintError` prints
    ``<prog>: error: <message>`` and returns 1; any other exception is a bug
    and prints one line (its traceback with ``FLINT_TRACEBACK=1``)."""
    import os
    import sys

    try:
        return fn(*args)
    except FlintError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if os.environ.get("FLINT_TRACEBACK"):
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {e}\n"
              "(this is a bug in Flint; set FLINT_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        return 2


def remark(message: str) -> None:
    """Tell the user something that is not an error (e.g. a pass found nothing to do): one line on stderr."""
    import sys

    print(f"remark: {message}", file=sys.stderr)
