"""Errors Flint reports to users.

Every error a user can cause (bad input file, bad plan field, unknown device
name, ...) is a :class:`FlintError` whose message names what is wrong and
where. Command-line tools print the message and exit non-zero; they never
show a Python traceback for a ``FlintError``.
"""


class FlintError(Exception):
    """Base of every error Flint reports to a user."""
