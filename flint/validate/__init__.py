"""Validation against real execution traces: does Flint's graph match what actually executes?

``flint validate`` (:func:`flint.validate.cli.main`) runs a real small training
step with ``torch.distributed`` on CPU (gloo, one process per rank on
loopback) for each recipe, records PyTorch's execution trace, converts it with
Chakra's ``chakra_converter PyTorch``, and compares it with Flint's capture of
the same model, recipe and world size, per operator class and per rank.

Modules, in pipeline order:

- :mod:`~flint.validate.realrun` / :mod:`~flint.validate.worker` — the real run
  (free port, timeouts, "rank R failed: ..." errors, cleanup) and one rank of it.
- :mod:`~flint.validate.classify` — executed operator names -> ATen targets ->
  :func:`flint.capture.opclass.classify_aten` (the one classifier); counting and
  byte rules.
- :mod:`~flint.validate.executed` — per-rank counts (and measured durations)
  of a host execution trace; cross-check against the converted Chakra trace.
- :mod:`~flint.validate.compare` — Flint's counts for the same case, rows
  Flint / executed.
- :mod:`~flint.validate.expected` — known differences and their reasons.
- :mod:`~flint.validate.imported` — the converted real trace as a
  :class:`flint.trace.Trace` with collectives as collectives, for
  :func:`flint.sim.simulate`.
- :mod:`~flint.validate.run` — one case end to end; :mod:`~flint.validate.report`
  — docs/validation.md and the chart.

Nothing heavy is imported here: rank processes import this package too.
"""
