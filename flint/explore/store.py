"""Results of a sweep in SQLite: one row per point, append-only evaluation log.

Tables (Flint's; Optuna's study tables live in the same file, see
:mod:`flint.explore.strategies`):

``flint_explore``  ``key, value``: the format marker (``format =
                   flint-explore``, ``version``); a file without it that has
                   other tables is someone else's database and is refused.
``points``         one row per point: ``point_id`` (hash of the inputs),
                   ``inputs`` (JSON), ``status`` (``ok``, ``error``,
                   ``pruned``), ``constraint_name``, ``error``, ``outputs``
                   (JSON), ``capture_hit``, ``eval_s``, ``run_id``,
                   ``created_at``, and the main objectives as columns.
``evaluations``    one row per evaluation actually performed (``point_id,
                   run_id``): a resumed run never evaluates a stored point
                   again, which this table lets anyone check.
``runs``           one row per ``flint explore`` invocation.

Each point is committed as soon as it is known, so an interrupted run loses
only the points in flight; the next run skips every stored point. A file
that is not SQLite, is damaged, or belongs to something else is refused and
left untouched.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from flint.errors import FlintError

FORMAT = "flint-explore"
VERSION = "1"
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS flint_explore (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (run_id INTEGER PRIMARY KEY AUTOINCREMENT, space TEXT, space_hash TEXT,
    strategy TEXT, started_at REAL, finished_at REAL, evaluated INTEGER, args TEXT);
CREATE TABLE IF NOT EXISTS points (point_id TEXT PRIMARY KEY, space_hash TEXT, inputs TEXT NOT NULL,
    status TEXT NOT NULL, constraint_name TEXT, error TEXT, outputs TEXT, capture_hit INTEGER, eval_s REAL,
    run_id INTEGER, created_at REAL, iteration_time_us REAL, peak_memory_bytes REAL, gpus INTEGER);
CREATE TABLE IF NOT EXISTS evaluations (id INTEGER PRIMARY KEY AUTOINCREMENT, point_id TEXT NOT NULL,
    run_id INTEGER, at REAL);
"""


class StoreError(FlintError):
    """The results database cannot be used (foreign, damaged, unreadable); it is left as it was."""


def _check_file(path: Path) -> bool:
    """True if ``path`` exists and is non-empty; refuse a file that is not SQLite."""
    if not path.exists():
        return False
    if path.is_dir():
        raise StoreError(f"{path}: is a directory, not a results database")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise StoreError(f"{path}: cannot read: {e.strerror}") from None
    if not head:
        return False
    if head != _SQLITE_MAGIC:
        raise StoreError(f"{path}: not a SQLite database (refusing to overwrite it; give another --db)")
    return True


class Store:
    """The results database of ``flint explore`` (module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        existed = _check_file(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=60)
            self.db.execute("PRAGMA busy_timeout = 60000")
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if existed and tables:
                if "flint_explore" not in tables:
                    raise StoreError(f"{self.path}: a SQLite database of something else (tables "
                                     f"{', '.join(sorted(tables)[:6])}); refusing to write into it, give another --db")
                marker = dict(self.db.execute("SELECT key, value FROM flint_explore"))
                if marker.get("format") != FORMAT:
                    raise StoreError(f"{self.path}: not a flint explore database (format {marker.get('format')!r})")
                if marker.get("version") != VERSION:
                    raise StoreError(f"{self.path}: flint explore database version {marker.get('version')}, "
                                     f"this Flint reads version {VERSION}")
                ok = self.db.execute("PRAGMA quick_check").fetchone()[0]
                if ok != "ok":
                    raise StoreError(f"{self.path}: damaged database ({ok}); refusing to write into it")
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO flint_explore VALUES ('format', ?)", (FORMAT,))
            self.db.execute("INSERT OR IGNORE INTO flint_explore VALUES ('version', ?)", (VERSION,))
            self.db.commit()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.path}: damaged or unreadable database ({e}); refusing to overwrite it") from None

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the same file (Optuna's RDB storage)."""
        return f"sqlite:///{self.path.resolve()}"

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ runs

    def start_run(self, space: str, space_hash: str, strategy: str, args: Mapping[str, Any]) -> int:
        cur = self.db.execute("INSERT INTO runs (space, space_hash, strategy, started_at, evaluated, args) "
                              "VALUES (?, ?, ?, ?, 0, ?)", (space, space_hash, strategy, time.time(),
                                                            json.dumps(args, sort_keys=True, default=str)))
        self.db.commit()
        return int(cur.lastrowid)

    def finish_run(self, run_id: int, evaluated: int) -> None:
        self.db.execute("UPDATE runs SET finished_at = ?, evaluated = ? WHERE run_id = ?",
                        (time.time(), evaluated, run_id))
        self.db.commit()

    # ---------------------------------------------------------------- points

    def known(self, ids: Iterable[str]) -> set[str]:
        """The ids among ``ids`` that are stored (evaluated, failed or pruned)."""
        ids = list(ids)
        out: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            q = f"SELECT point_id FROM points WHERE point_id IN ({','.join('?' * len(chunk))})"
            out.update(r[0] for r in self.db.execute(q, chunk))
        return out

    def get(self, pid: str) -> dict | None:
        row = self.db.execute("SELECT * FROM points WHERE point_id = ?", (pid,)).fetchone()
        if row is None:
            return None
        return self._row(row)

    def _row(self, row) -> dict:
        cols = [d[0] for d in self.db.execute("SELECT * FROM points LIMIT 0").description]
        d = dict(zip(cols, row))
        d["inputs"] = json.loads(d["inputs"])
        d["outputs"] = json.loads(d["outputs"]) if d["outputs"] else None
        return d

    def put_pruned(self, rows: Iterable[tuple[str, Mapping[str, Any], str, str]], space_hash: str, run_id: int) -> None:
        """Store pruned points: ``(point_id, inputs, constraint, reason)``."""
        now = time.time()
        self.db.executemany(
            "INSERT OR IGNORE INTO points (point_id, space_hash, inputs, status, constraint_name, error, run_id, "
            "created_at) VALUES (?, ?, ?, 'pruned', ?, ?, ?, ?)",
            [(pid, space_hash, json.dumps(inp, sort_keys=True), c, reason, run_id, now) for pid, inp, c, reason in rows])
        self.db.commit()

    def put_result(self, pid: str, inputs: Mapping[str, Any], result: Mapping[str, Any], space_hash: str,
                   run_id: int) -> None:
        """Store one evaluated point (and log the evaluation) in one transaction."""
        out = result.get("outputs") or {}
        now = time.time()

        def num(k):
            v = out.get(k)
            return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v

        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO points (point_id, space_hash, inputs, status, constraint_name, error, outputs, "
                "capture_hit, eval_s, run_id, created_at, iteration_time_us, peak_memory_bytes, gpus) "
                "VALUES (?, ?, ?, ?, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (pid, space_hash, json.dumps(inputs, sort_keys=True), result["status"], result.get("error"),
                 json.dumps(out, sort_keys=True) if result.get("outputs") is not None else None,
                 None if result.get("capture_hit") is None else int(bool(result["capture_hit"])),
                 result.get("eval_s"), run_id, now, num("iteration_time_us"), num("peak_memory_bytes"), num("gpus")))
            self.db.execute("INSERT INTO evaluations (point_id, run_id, at) VALUES (?, ?, ?)", (pid, run_id, now))

    def rows(self, ids: Iterable[str] | None = None) -> Iterator[dict]:
        """Stored points (all, or those in ``ids``), in insertion order."""
        if ids is None:
            for row in self.db.execute("SELECT * FROM points ORDER BY rowid"):
                yield self._row(row)
            return
        ids = list(ids)
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            q = f"SELECT * FROM points WHERE point_id IN ({','.join('?' * len(chunk))}) ORDER BY rowid"
            for row in self.db.execute(q, chunk):
                yield self._row(row)

    def evaluation_counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT point_id, COUNT(*) FROM evaluations GROUP BY point_id"))
