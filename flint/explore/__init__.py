"""Design-space exploration: ``flint explore space.toml``.

A declarative space (:mod:`flint.explore.space`) over workload axes (model,
batch, sequence length, plan degrees and order, microbatches, activation
checkpointing, scheduling passes) and system axes (device, network,
per-dimension bandwidth and latency, degraded NICs, stragglers) is pruned by
constraints (:mod:`flint.explore.constraints`), evaluated point by point
through one function per stage (:mod:`flint.explore.stages`: capture ->
passes -> lower -> estimate, with a content-addressed capture cache,
:mod:`flint.explore.cache`), chosen by a strategy and run by an executor
(:mod:`flint.explore.runner`: grid, random, Optuna; local processes or Ray),
stored in SQLite (:mod:`flint.explore.store`) and reported as tables and
plots (:mod:`flint.explore.report`).
"""

from flint.explore.space import Space, SpaceError, load_space, point_id

__all__ = ["Space", "SpaceError", "load_space", "point_id"]
