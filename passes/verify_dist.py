"""`verify-dist`: check that `dist` communication is well formed before scheduling."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.ir import dist


class DistVerifyError(VerifyException):
    """A `verify-dist` failure; ``op`` is the offending operation."""

    def __init__(self, op: Operation, message: str):
        super().__init__(message)
        self.op = op


def _check_futures(op: Operation) -> None:
    """Every future is waited for exactly once, and used by nothing else."""
    futures = []
    if isinstance(op, dist.CollectiveOp | dist.RecvOp) and op.is_async:
        futures.append(op.result)
    if isinstance(op, dist.SendOp | dist.BarrierOp) and op.token is not None:
        if not (isinstance(op, dist.SendOp) and isinstance(op.parent_op(), dist.StepsOp) and not op.token.uses):
            futures.append(op.token)  # (a `dist.steps` body's sends complete with the steps' token)
    if isinstance(op, dist.StepsOp):
        futures.append(op.token)
    for f in futures:
        waits = [u.operation for u in f.uses if isinstance(u.operation, dist.WaitOp)]
        others = [u.operation for u in f.uses if not isinstance(u.operation, dist.WaitOp)]
        if others:
            raise DistVerifyError(others[0], f"'{others[0].name}' op uses the future of '{op.name}' before a 'dist.wait'")
        if not waits:
            raise DistVerifyError(op, f"'{op.name}' op starts asynchronously but no 'dist.wait' completes it")
        if len(waits) > 1:
            raise DistVerifyError(waits[1], f"'dist.wait' op waits a second time on the future of '{op.name}'")


def _check_wait(op: dist.WaitOp) -> None:
    owner = op.future.owner
    if not isinstance(owner, dist.DistCommOp | dist.StepsOp):
        raise DistVerifyError(op, "'dist.wait' op waits on a future that no 'dist' communication op started")


def _check_p2p(fn: Operation) -> None:
    """SPMD matching: a send at offset k needs a recv at offset -k with the same tag and type."""
    sends: Counter = Counter()
    recvs: Counter = Counter()
    first: dict = {}
    for op in fn.walk():
        if isinstance(op, dist.SendOp | dist.RecvOp):
            n = op.group_size()
            axis = op.axes()[0]
            t = op.input.type if isinstance(op, dist.SendOp) else (
                op.result.type.value_type if isinstance(op.result.type, dist.FutureType) else op.result.type)
            for i in range(dist.steps_of(op)):
                if isinstance(op, dist.SendOp):
                    key = (op.grid.string_value(), axis, op.offset_at(i) % n, op.tag_at(i), t)
                    sends[key] += 1
                else:
                    key = (op.grid.string_value(), axis, (-op.offset_at(i)) % n, op.tag_at(i), t)
                    recvs[key] += 1
                first.setdefault(key, op)
    for key in sorted(set(sends) | set(recvs), key=str):
        if sends[key] != recvs[key]:
            grid, axis, k, tag, t = key
            raise DistVerifyError(
                first[key],
                f"'{first[key].name}' op has no matching peer: {sends[key]} send(s) at offset {k} and "
                f"{recvs[key]} recv(s) at offset {-k} on axis {axis} of @{grid} with tag {tag} and type {t}",
            )


@dataclass(frozen=True)
class VerifyDistPass(ModulePass):
    """Fail with a diagnostic on malformed `dist` communication; change nothing.

    Checks, in program order:
    - every `dist` op's grid exists and its axes are in range (the op
      verifiers, run again so the check holds even with --disable-verify);
    - every asynchronous start is completed by exactly one ``dist.wait``, and
      its future has no other use; every wait waits on a `dist` op;
    - ``check-p2p`` (default true): within each function, sends and recvs
      pair up SPMD-wise (offset k with offset -k, same axis, tag and type),
      so the exchange cannot leave a rank waiting forever.

    An analysis: the module is left unchanged.
    """

    name = "verify-dist"

    check_p2p: bool = True

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for inner in op.walk():
            if isinstance(inner, dist.DistCommOp):
                try:
                    inner.verify_()
                except VerifyException as e:
                    raise DistVerifyError(inner, str(e)) from None
            if isinstance(inner, dist.WaitOp):
                _check_wait(inner)
            _check_futures(inner)
        if self.check_p2p:
            for fn in op.walk():
                if isinstance(fn, func.FuncOp):
                    _check_p2p(fn)
