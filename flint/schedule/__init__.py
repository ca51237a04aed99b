"""Scheduling support shared by every scheduling pass: the invariant checker.

Scheduling passes (``passes/``) reorder, regroup or re-stream communication;
:func:`check_schedule_invariants` is the one check that they kept the same
work, dependencies and bytes. Their tests call it.
"""

from flint.schedule.invariants import ScheduleInvariantError, check_schedule_invariants, describe_op

__all__ = ["ScheduleInvariantError", "check_schedule_invariants", "describe_op"]
