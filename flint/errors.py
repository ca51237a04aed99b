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
    and prints one line (its traceback with ``FLINT_TRACEBACK=1``); a reader
    that closed stdout (``| head``) ends the command quietly with 141."""
    import os
    import sys

    try:
        code = fn(*args)
        sys.stdout.flush()  # a reader that went away surfaces here, not at the interpreter's exit
        return code
    except FlintError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as e:
        if not _stdout_reader_gone():  # another pipe (a worker's): a bug, reported as one
            return _internal_error(prog, e)
        # as a shell tool killed by SIGPIPE (128 + 13); stdout to /dev/null so the final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        return _internal_error(prog, e)


def _internal_error(prog: str, e: Exception) -> int:
    import os
    import sys

    if os.environ.get("FLINT_TRACEBACK"):
        raise e
    print(f"{prog}: internal error: {type(e).__name__}: {e}\n"
          "(this is a bug in Flint; set FLINT_TRACEBACK=1 to see the traceback)", file=sys.stderr)
    return 2


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on the writing end)."""
    import select
    import sys

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (stdout captured in-process)
        return False


def remark(message: str) -> None:
    """Tell the user something that is not an error (e.g. a pass found nothing to do): one line on stderr."""
    import sys

    print(f"remark: {message}", file=sys.stderr)
