"""Running a sweep: strategies choose points, constraints prune them, executors evaluate them.

Strategies
----------
``grid``    every point of the space.
``random``  ``samples`` distinct points drawn with ``seed`` (the same draw on
            every run, so a rerun resumes the same sample).
``optuna``  guided multi-objective search (Optuna's NSGA-II sampler over the
            axes as categorical parameters) minimizing the space's objectives
            (default iteration time, peak memory, GPU count) for ``samples``
            trials. The study lives in the results database itself (Optuna's
            RDB storage on the same SQLite file), named after the space and
            its hash, so an interrupted search resumes with its history; a
            point Optuna proposes again is answered from the stored row.

Every strategy skips stored points (a repeated run evaluates nothing) and
prunes with :mod:`flint.explore.constraints` before evaluating.

Executors
---------
``local`` (default): ``--jobs 1`` evaluates in this process; more jobs use a
pool of worker processes (spawned). ``ray``: tasks on an existing Ray
cluster (``ray.init(address=...)``); the workers must see the capture cache
directory (one machine, or a shared file system). Points are sent in chunks
grouped by captured program and device, so a worker lowers a trace once and
simulates many system variants on it; results are stored as chunks finish.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from flint.errors import FlintError
from flint.explore import constraints as cons
from flint.explore.space import Space, point_id
from flint.explore.stages import Workload, evaluate_chunk
from flint.explore.store import Store

EXECUTORS = ("local", "ray")


@dataclass
class RunOptions:
    strategy: str | None = None
    samples: int | None = None
    seed: int | None = None
    jobs: int = 1
    executor: str = "local"
    address: str | None = None
    cache_root: str | None = None
    progress: bool = True
    limit: int | None = None  # evaluate at most this many new points, then stop


@dataclass
class RunSummary:
    strategy: str
    candidates: list[str]                  # point ids the strategy chose (stored or not)
    evaluated: int = 0                     # evaluated by this run
    reused: int = 0                        # already stored, not evaluated again
    pruned: Counter = field(default_factory=Counter)   # constraint -> points it removed (all candidates)
    cache_hits: int = 0
    errors: int = 0
    wall_s: float = 0.0
    run_id: int = 0
    stopped_early: bool = False


# ------------------------------------------------------------------ executors


class _Executor:
    """Evaluates chunks ``[(pid, point), ...]``; yields ``[(pid, result), ...]`` as chunks finish."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self._pool = None
        if opts.executor == "ray":
            self._init_ray()
        elif opts.jobs > 1:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(max_workers=opts.jobs, mp_context=mp.get_context("spawn"))

    def _init_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise FlintError("--executor ray needs the 'ray' package (pip install ray)") from None
        if not self.opts.address:
            raise FlintError("--executor ray needs --address HOST:PORT of an existing Ray cluster "
                             "(e.g. the address `ray start --head` prints)")
        if not ray.is_initialized():
            try:
                ray.init(address=self.opts.address, logging_level="ERROR", log_to_driver=False)
            except Exception as e:
                raise FlintError(f"--address {self.opts.address}: cannot connect to a Ray cluster: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        self._ray = ray
        self._remote = ray.remote(num_cpus=1)(evaluate_chunk)

    def run(self, chunks: list[list[tuple[str, dict]]]):
        root = self.opts.cache_root
        if self.opts.executor == "ray":
            pending = [self._remote.remote(c, root) for c in chunks]
            while pending:
                done, pending = self._ray.wait(pending, num_returns=1)
                for ref in done:
                    yield self._ray.get(ref)
        elif self._pool is not None:
            from concurrent.futures import as_completed

            futs = [self._pool.submit(evaluate_chunk, c, root) for c in chunks]
            for f in as_completed(futs):
                yield f.result()
        else:
            for c in chunks:
                yield evaluate_chunk(c, root)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _chunks(items: list[tuple[str, dict]], jobs: int, size: int = 24) -> list[list[tuple[str, dict]]]:
    """Chunks of points that share a captured program and device (as many as the workers can use)."""
    groups: dict[tuple, list] = defaultdict(list)
    for pid, p in items:
        try:
            key = (Workload.of(p).key, p.get("workload.passes", ""), p["system.device"], p.get("system.calibration"))
        except FlintError:
            key = ("invalid",)
        groups[key].append((pid, p))
    n = sum(len(g) for g in groups.values())
    size = max(1, min(size, -(-n // max(jobs, 1))))
    out = []
    for g in groups.values():
        out.extend(g[i:i + size] for i in range(0, len(g), size))
    return out


# ------------------------------------------------------------------ the run


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="pt", desc="explore", dynamic_ncols=True, smoothing=0.1)
        self.hits = self.errors = self.done = 0

    def update(self, result: Mapping[str, Any]) -> None:
        self.done += 1
        self.hits += bool(result.get("capture_hit"))
        self.errors += result["status"] == "error"
        if self.bar is not None:
            self.bar.set_postfix_str(f"cache hits {self.hits}/{self.done}, errors {self.errors}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _evaluate(store: Store, space: Space, run_id: int, todo: list[tuple[str, dict]], opts: RunOptions,
              summary: RunSummary, ex: "_Executor", on_result: Callable[[str, dict], None] | None = None) -> None:
    if not todo:
        return
    if opts.limit is not None:
        room = max(opts.limit - summary.evaluated, 0)
        if room < len(todo):
            todo, summary.stopped_early = todo[:room], True
    if not todo:
        return
    prog = _Progress(len(todo), opts.progress)
    inputs = dict(todo)
    try:
        for results in ex.run(_chunks(todo, opts.jobs)):
            for pid, res in results:
                store.put_result(pid, inputs[pid], res, space.text_hash, run_id)
                summary.evaluated += 1
                summary.cache_hits += bool(res.get("capture_hit"))
                summary.errors += res["status"] == "error"
                prog.update(res)
                if on_result is not None:
                    on_result(pid, res)
    finally:
        prog.close()


def _prune(store: Store, space: Space, run_id: int, points: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Store the points a constraint removes; return the rest."""
    keep, pruned = [], []
    for pid, p in points:
        why = cons.check(p, space.constraints)
        if why is None:
            keep.append((pid, p))
        else:
            pruned.append((pid, p, why[0], why[1]))
    store.put_pruned(pruned, space.text_hash, run_id)
    return keep


def _refuse_if_all_pruned(space: Space, points: list[tuple[str, dict]]) -> None:
    """Raise naming the constraints when none of ``points`` survives (nothing is stored then)."""
    counts: Counter = Counter()
    example: dict[str, str] = {}
    for _, p in points:
        why = cons.check(p, space.constraints)
        if why is None:
            return
        counts[why[0]] += 1
        example.setdefault(why[0], why[1])
    parts = "; ".join(f"constraint '{c}' removed {n} (e.g. {example[c]})" for c, n in counts.most_common())
    raise FlintError(f"{space.source}: the constraints exclude every point of the space ({len(points)} points): {parts}")


def run_space(space: Space, store: Store, opts: RunOptions) -> RunSummary:
    """Run ``space`` with ``opts`` into ``store`` (module docstring)."""
    strategy = opts.strategy or space.strategy
    if strategy not in ("grid", "random", "optuna"):
        raise FlintError(f"--strategy: unknown strategy '{strategy}'; known: grid, random, optuna")
    if opts.executor not in EXECUTORS:
        raise FlintError(f"--executor: unknown executor '{opts.executor}'; known: {', '.join(EXECUTORS)}")
    if opts.jobs < 1:
        raise FlintError(f"--jobs must be at least 1, got {opts.jobs}")
    if opts.executor == "ray" and not opts.address:
        raise FlintError("--executor ray needs --address HOST:PORT of an existing Ray cluster "
                         "(e.g. the address `ray start --head` prints)")
    t0 = time.perf_counter()
    seed = space.seed if opts.seed is None else opts.seed
    samples = opts.samples or space.samples
    if strategy == "optuna":
        return _run_optuna(space, store, opts, seed, samples or min(space.size, 50), t0)
    if strategy == "grid":
        points = [(point_id(p), p) for p in space.grid()]
    else:
        n = min(samples or min(space.size, 50), space.size)
        idx = random.Random(seed).sample(range(space.size), n)
        points = [(point_id(p), p) for p in (space.point_at(i) for i in idx)]
    known = store.known(pid for pid, _ in points)
    fresh = [(pid, p) for pid, p in points if pid not in known]
    if not known:
        _refuse_if_all_pruned(space, fresh)
    run_id = store.start_run(space.name, space.text_hash, strategy, {"samples": samples, "seed": seed})
    summary = RunSummary(strategy, [pid for pid, _ in points], reused=len(known), run_id=run_id)
    todo = _prune(store, space, run_id, fresh)
    if todo:
        ex = _Executor(opts)
        try:
            _evaluate(store, space, run_id, todo, opts, summary, ex)
        finally:
            ex.close()
    for row in store.rows(summary.candidates):
        if row["status"] == "pruned":
            summary.pruned[row["constraint_name"]] += 1
    store.finish_run(run_id, summary.evaluated)
    summary.wall_s = time.perf_counter() - t0
    return summary


# ------------------------------------------------------------------ optuna


def objective_values(outputs: Mapping[str, Any], objectives: Iterable[str]) -> list[float]:
    """The (minimized) objective values of a point's outputs."""
    vals = []
    for o in objectives:
        vals.append(-float(outputs["mfu"]) if o == "neg_mfu" else float(outputs[o]))
    return vals


def _encode(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, list) else v


def _run_optuna(space: Space, store: Store, opts: RunOptions, seed: int, samples: int, t0: float) -> RunSummary:
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = {a.name: CategoricalDistribution([_encode(v) for v in a.values]) for a in space.axes if len(a.values) > 1}
    fixed = {a.name: a.values[0] for a in space.axes if len(a.values) == 1}
    decode = {a.name: {_encode(v): v for v in a.values} for a in space.axes}
    name = f"flint-explore:{space.name}:{space.text_hash}:{'/'.join(space.objectives)}"
    try:
        study = optuna.create_study(study_name=name, storage=store.url, load_if_exists=True,
                                    directions=["minimize"] * len(space.objectives),
                                    sampler=optuna.samplers.NSGAIISampler(seed=seed, population_size=
                                                                          max(4, min(20, samples // 3))))
    except Exception as e:
        raise FlintError(f"{store.path}: cannot open the Optuna study in the results database: {e}") from None
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        study.tell(t.number, state=TrialState.FAIL)  # left running by an interrupted run
    run_id = store.start_run(space.name, space.text_hash, "optuna", {"samples": samples, "seed": seed})
    summary = RunSummary("optuna", [], run_id=run_id)
    for t in study.get_trials(deepcopy=False):
        pid = t.user_attrs.get("point_id")
        if pid and pid not in summary.candidates:
            summary.candidates.append(pid)
    summary.reused = len(summary.candidates)
    if not dists and not store.known([point_id(fixed)]):
        _refuse_if_all_pruned(space, [(point_id(fixed), fixed)])
    # `samples` distinct points (Optuna may propose a point again: answered from the store, not counted)
    target = min(samples, space.size)
    max_trials = len(study.trials) + 10 * samples
    batch = max(1, opts.jobs)
    prog_opts = RunOptions(**{**opts.__dict__, "progress": False})
    bar = _Progress(max(target - len(summary.candidates), 0), opts.progress)
    seen_ok = False
    ex = None
    try:
        while len(summary.candidates) < target and len(study.trials) < max_trials and not summary.stopped_early:
            trials = [study.ask(dists) for _ in range(min(batch, target - len(summary.candidates)))]
            todo: dict[str, dict] = {}
            waiting: list[tuple[Any, str]] = []
            for trial in trials:
                point = dict(fixed)
                point.update({k: decode[k][v] for k, v in trial.params.items()})
                point = {a.name: point[a.name] for a in space.axes}
                pid = point_id(point)
                trial.set_user_attr("point_id", pid)
                new = pid not in summary.candidates
                if new:
                    summary.candidates.append(pid)
                row = store.get(pid)
                if row is None and pid not in todo:
                    why = cons.check(point, space.constraints)
                    if why is not None:
                        store.put_pruned([(pid, point, why[0], why[1])], space.text_hash, run_id)
                        row = store.get(pid)
                    else:
                        todo[pid] = point
                if row is not None:
                    _tell(study, trial, row, space.objectives)
                    seen_ok |= row["status"] != "pruned"
                    if new:
                        bar.update({"status": row["status"], "capture_hit": False})
                else:
                    waiting.append((trial, pid))
            if todo:
                seen_ok = True
                ex = ex or _Executor(opts)
                _evaluate(store, space, run_id, list(todo.items()), prog_opts, summary, ex,
                          on_result=lambda pid, res: bar.update(res))
            for trial, pid in waiting:
                row = store.get(pid)
                if row is None:  # --limit stopped before this point
                    study.tell(trial, state=TrialState.FAIL)
                    summary.candidates.remove(pid)
                else:
                    _tell(study, trial, row, space.objectives)
            if not seen_ok and len(summary.candidates) >= min(target, 4 * len(space.axes) + 8):
                _refuse_if_all_pruned(space, [(pid, store.get(pid)["inputs"]) for pid in summary.candidates])
    finally:
        bar.close()
        if ex is not None:
            ex.close()
    for row in store.rows(summary.candidates):
        if row["status"] == "pruned":
            summary.pruned[row["constraint_name"]] += 1
    store.finish_run(run_id, summary.evaluated)
    summary.wall_s = time.perf_counter() - t0
    return summary


def _tell(study, trial, row: Mapping[str, Any], objectives) -> None:
    from optuna.trial import TrialState

    if row["status"] == "ok":
        study.tell(trial, objective_values(row["outputs"], objectives))
    elif row["status"] == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def study_point_ids(store: Store, space: Space) -> list[str]:
    """Point ids of every finished trial of the space's Optuna study (all runs)."""
    import optuna

    name = f"flint-explore:{space.name}:{space.text_hash}:{'/'.join(space.objectives)}"
    try:
        study = optuna.load_study(study_name=name, storage=store.url)
    except KeyError:
        return []
    out = []
    for t in study.get_trials(deepcopy=False):
        pid = t.user_attrs.get("point_id")
        if pid and pid not in out:
            out.append(pid)
    return out
