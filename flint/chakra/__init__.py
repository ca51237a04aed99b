"""Chakra execution-trace I/O: write per-rank ET files, read any ET trace back, check it.

- :func:`write_trace` — a :class:`flint.trace.Trace` to ``<prefix>.<rank>.et`` + comm-group JSON.
- :func:`read_trace` — any Chakra trace directory (Flint's, chakra_converter's, other generators') to a Trace.
- :func:`check_trace` — cycles, dangling deps, group membership, cross-rank collective order, send/recv matching.
- :mod:`flint.chakra.inspect` — ``flint inspect DIR``; :mod:`flint.chakra.astra_sim` — run ASTRA-sim on a trace.

Format facts and pitfalls: ``../shared/CHAKRA.md``.
"""

from flint.chakra.check import Problem, check_trace
from flint.chakra.reader import ReadNodeTable, read_trace
from flint.chakra.wire import TraceError
from flint.chakra.writer import WriteStats, write_trace

__all__ = ["Problem", "ReadNodeTable", "TraceError", "WriteStats", "check_trace", "read_trace", "write_trace"]
