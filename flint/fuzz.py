"""Fuzzing Flint's commands with malformed input (tests/test_fuzz.py, bench/fuzz.py).

A *case* is one mutated input (IR text, a trace directory, a plan or
config TOML) fed to one command, run in-process through the command's
``main()`` with stdout/stderr captured and a wall-clock limit. The property
every case must hold (:func:`check_outcome`):

- exit 0 (the input happened to be fine), or exit non-zero with a message
  on stderr that names where the problem is (a file path, ``line:col``, a
  rank, a node, a plan field or a command-line option) -- never the CLI's
  last-resort ``internal error`` and never a Python traceback;
- within the time limit (no hang);
- a failed run leaves no output file or directory behind, and no temporary
  debris beside it.

Mutators are deterministic functions of a :class:`random.Random`, so a
failing case is reproduced from its seed. The harness needs
``mlc-chakra`` (Chakra's protobuf schema) for record-level trace mutations.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

# -- seeds ------------------------------------------------------------------------

#: A small step exercising every dialect feature the pipeline reads: a schedule with a
#: repeated block, a grid, async and sync collectives, broadcast, send/recv, roles.
SEED_IR = """\
builtin.module attributes {flint.schedule = [["embed", 1], ["block", 3]]} {
  shard.grid @mesh(shape = 2x2)
  func.func @embed(%x: tensor<8x64xbf16> {flint.role = "input"}, %w: tensor<64x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.mm.default"(%x, %w) phase = "fwd" module = "embed" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %0 : tensor<8x64xbf16>
  }
  func.func @block(%h: tensor<8x64xbf16>, %w_shard: tensor<32x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = dist.all_gather %w_shard on @mesh grid_axes = [0] gather_dim = 0 : tensor<32x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %1 = aten.op "aten.relu.default"(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %w = dist.wait %0 : tensor<64x64xbf16>
    %2 = aten.op "aten.view.default"(%1) args = {size = [8, 64]} : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %3 = aten.op "aten.mm.default"(%2, %w) phase = "fwd" module = "layers.0" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %4 = dist.all_reduce %3 on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
    %5 = dist.broadcast %4 on @mesh grid_axes = [0] root = 0 : tensor<8x64xbf16> -> tensor<8x64xbf16>
    dist.send %5 to @mesh grid_axes = [0] offset = 1 tag = 7 : tensor<8x64xbf16>
    %6 = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 7 : tensor<8x64xbf16>
    %7 = aten.op "aten.add.Tensor"(%6, %3) phase = "fwd" : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    func.return %7 : tensor<8x64xbf16>
  }
}
"""

#: The same step lowered by hand to a chakra.graph (what `lower-to-chakra` writes).
SEED_CHAKRA_IR = """\
builtin.module {
  shard.grid @mesh(shape = 2x2)
  chakra.graph @step {
    %e = chakra.comp "embed" flops = 65536 bytes = 10240 duration_us = 1.5
    %r:1 = chakra.repeat 3 (%e) {
    ^bb0(%c: !chakra.node):
      %ag = chakra.coll all_gather "ag" on @mesh grid_axes = [0] bytes = 4096
      %m = chakra.comp "mm" flops = 65536 bytes = 10240 duration_us = 2.0 data(%c, %ag)
      %ar = chakra.coll all_reduce "ar" on @mesh grid_axes = [1] bytes = 1024 data(%m) ctrl(%ag)
      %s = chakra.send "send" on @mesh grid_axes = [0] offset = 1 tag = 7 bytes = 1024 data(%ar)
      %v = chakra.recv "recv" on @mesh grid_axes = [0] offset = -1 tag = 7 bytes = 1024
      chakra.yield %m
    }
  }
}
"""

SEED_PLAN = """\
dp_replicate = 2
dp_shard = -1
tp = 2
sp = true
"""

_INTS = (0, -1, 1, 2, 3, 7, 32767, 32768, 40000, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64,
         10**9, 10**30, -(2**31), -(2**63), -5)
_TYPES = ("tensor<?x64xbf16>", "tensor<*xbf16>", "i32", "f32", "tensor<8x64xi1>", "tensor<0x64xbf16>",
          "tensor<9223372036854775807x64xbf16>", "tensor<8x64xcomplex<f32>>", "memref<8x64xbf16>", "!chakra.node",
          "!dist.future<tensor<8x64xbf16>>", "none", "tensor<8xbf16>", "tensor<8x64x1x1x1x1xbf16>")
_WORDS = ("embed", "block", "missing", "@mesh", "@nowhere", "%0", "%9", "%x", "data(%m)", "ctrl(%e)", "fwd", "bwd",
          "\"aten.mm.default\"", "\"aten.nonexistent.default\"", "1.0e400", "nan", "-inf", "[]", "[0, 0]", "[5]",
          "{}", "\"\"", "\"\\xff\"", "all_to_all", "barrier", "reduce")
_BAD_BYTES = (b"\xff", b"\xfe\xff", b"\x80", b"\xc3\x28", b"\x00", b"\xed\xa0\x80", b"\xf4\x90\x80\x80")


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def mutate_text(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One random mutation of an IR/TOML text: ``(new bytes, mutation class)``."""
    kind = rng.choice(("delete_line", "truncate", "swap_tokens", "dup_line", "int", "int", "type", "word",
                       "non_utf8", "swap_lines", "deep_nesting", "schedule"))
    lines = _lines(data)
    if kind == "delete_line" and len(lines) > 1:
        del lines[rng.randrange(len(lines))]
        return b"\n".join(lines), kind
    if kind == "truncate":
        return data[: rng.randrange(len(data) + 1)], kind
    if kind == "dup_line":
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
        return b"\n".join(lines), kind
    if kind == "swap_lines" and len(lines) > 2:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return b"\n".join(lines), kind
    if kind == "swap_tokens":
        toks = re.split(rb"(\s+)", data)
        words = [i for i, t in enumerate(toks) if t.strip()]
        if len(words) > 1:
            i, j = rng.choice(words), rng.choice(words)
            toks[i], toks[j] = toks[j], toks[i]
        return b"".join(toks), kind
    if kind == "int":
        nums = list(re.finditer(rb"(?<![A-Za-z_%#@.])-?\d+(?![\d.])", data))
        if nums:
            m = rng.choice(nums)
            return data[: m.start()] + str(rng.choice(_INTS)).encode() + data[m.end():], kind
        return data, kind
    if kind == "type":
        ts = list(re.finditer(rb"tensor<[^<>]*>|!chakra\.node|i64|f64", data))
        if ts:
            m = rng.choice(ts)
            return data[: m.start()] + rng.choice(_TYPES).encode() + data[m.end():], kind
        return data, kind
    if kind == "word":
        toks = list(re.finditer(rb"[^\s(),:=]+", data))
        if toks:
            m = rng.choice(toks)
            return data[: m.start()] + rng.choice(_WORDS).encode() + data[m.end():], kind
        return data, kind
    if kind == "non_utf8":
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.choice(_BAD_BYTES) + data[i:], kind
    if kind == "deep_nesting":
        depth = rng.choice((200, 2000, 20000))
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.choice((b"[", b"(", b"{", b"tensor<")) * depth + data[i:], kind
    if kind == "schedule":
        repl = rng.choice((b'[["nowhere", 1]]', b'[["embed", 1000000000]]', b'[]', b'[["block", 0]]',
                           b'[[1, "embed"]]', b'"embed"', b'[["embed"]]', b'[["embed", 1], ["block", 18446744073709551616]]'))
        return re.sub(rb"flint\.schedule = \[.*?\]\]", b"flint.schedule = " + repl.replace(b"\\", b"\\\\"), data, count=1), kind
    return data, kind


# -- trace mutations ----------------------------------------------------------------

def write_seed_trace(directory: Path, prefix: str = "trace") -> Path:
    """Emit :data:`SEED_IR` (4 ranks) into ``directory``; returns ``directory / prefix``."""
    from flint.tools.flint_cli import main

    src = Path(directory).parent / "seed.mlir"
    src.write_text(SEED_IR)
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["emit", str(src), "-o", str(directory), "--prefix", prefix])
    if rc != 0:
        raise RuntimeError("emitting the fuzz seed trace failed")
    return Path(directory) / prefix


def _read_records(path: Path):
    from chakra.schema.protobuf import et_def_pb2 as pb
    from chakra.src.third_party.utils.protolib import decodeMessage

    with open(path, "rb") as f:
        meta = pb.GlobalMetadata()
        decodeMessage(f, meta)
        nodes = []
        while True:
            n = pb.Node()
            if not decodeMessage(f, n):
                break
            nodes.append(n)
    return meta, nodes


def _write_records(path: Path, meta, nodes) -> None:
    from chakra.src.third_party.utils.protolib import encodeMessage

    with open(path, "wb") as f:
        encodeMessage(f, meta)
        for n in nodes:
            encodeMessage(f, n)


def _set_attr(node, name: str, value: int) -> None:
    for a in node.attr:
        if a.name == name:
            a.ClearField(a.WhichOneof("value")) if a.WhichOneof("value") else None
            a.int64_val = value
            return
    a = node.attr.add()
    a.name = name
    a.int64_val = value


def mutate_trace(prefix: Path, rng: random.Random) -> str:
    """Mutate the trace at ``prefix`` (``DIR/PREFIX``) in place; returns the mutation class."""
    directory, name = prefix.parent, prefix.name
    files = sorted(directory.glob(f"{name}.*.et"), key=lambda p: int(p.name.split(".")[-2]))
    groups = directory / f"{name}.comm_groups.json"
    if not files:
        return "no-files"
    kind = rng.choice(("truncate", "bit_flip", "missing_rank", "missing_last_rank", "groups_json", "groups_rank",
                       "groups_huge", "cycle", "self_dep", "dangling", "comm_type", "node_type", "negative",
                       "huge_int", "delete_node", "duplicate_id", "pg_name", "peer", "zero_record"))
    f = rng.choice(files)
    if kind == "truncate":
        b = f.read_bytes()
        f.write_bytes(b[: rng.randrange(len(b))])
    elif kind == "bit_flip":
        b = bytearray(f.read_bytes())
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(b))
    elif kind == "zero_record":
        b = f.read_bytes()
        i = rng.randrange(len(b))
        f.write_bytes(b[:i] + b"\x00" + b[i:])
    elif kind == "missing_rank":
        f.unlink()
    elif kind == "missing_last_rank":
        files[-1].unlink()
    elif kind == "groups_json":
        text = groups.read_text()
        groups.write_text(rng.choice((text[: rng.randrange(len(text) + 1)], "[]", "{\"0\": [0]}", "{\"1\": \"x\"}",
                                      "{\"a\": [0]}", "{\"1\": [0, 0]}", "{\"1\": [-1]}", "null", "\xff")))
    elif kind == "groups_rank":
        groups.write_text(re.sub(r"\[(\d+)", lambda m: f"[{rng.choice((99, 4, 1000000))}", groups.read_text(), count=1))
    elif kind == "groups_huge":
        n = rng.choice((10**5, 10**7))
        groups.write_text('{"1": [' + ", ".join(map(str, range(n))) + "]}" if n <= 10**5 else
                          '{"1": [' + "0, " * (n - 1) + "0]}")
    else:
        try:
            meta, nodes = _read_records(f)
        except Exception:  # noqa: BLE001 - an earlier mutation already broke this file
            return kind + "(on a broken file)"
        if not nodes:
            return kind
        n = rng.choice(nodes)
        ids = [x.id for x in nodes]
        if kind == "cycle" and len(nodes) > 1:
            a, b = rng.sample(nodes, 2)
            a.data_deps.append(b.id)
            b.data_deps.append(a.id)
        elif kind == "self_dep":
            (n.data_deps if rng.random() < 0.5 else n.ctrl_deps).append(n.id)
        elif kind == "dangling":
            n.data_deps.append(max(ids) + rng.choice((1, 1000, 2**40)))
        elif kind == "comm_type":
            _set_attr(n, "comm_type", rng.choice((99, -1, 2**31 - 1, 12)))
        elif kind == "node_type":
            n.type = rng.choice((99, 0, 1, 2, 3, 4, 5, 6, 7, 8))
        elif kind == "negative":
            _set_attr(n, rng.choice(("num_ops", "tensor_size", "comm_size", "comm_tag", "comm_src", "comm_dst")),
                      rng.choice((-1, -5, -(2**63))))
        elif kind == "huge_int":
            _set_attr(n, rng.choice(("num_ops", "tensor_size", "comm_size", "comm_tag", "comm_src", "comm_dst")),
                      rng.choice((2**31, 2**62, 2**63 - 1, 10**18)))
            if rng.random() < 0.5:
                n.duration_micros = rng.choice((2**63, 2**64 - 1, 10**15))
        elif kind == "delete_node":
            nodes.remove(n)
        elif kind == "duplicate_id" and len(nodes) > 1:
            rng.choice([x for x in nodes if x is not n]).id = n.id
        elif kind == "pg_name":
            for a in n.attr:
                if a.name == "pg_name":
                    a.string_val = rng.choice(("0", "-3", "x", "999", "99999999999999999999", ""))
        elif kind == "peer":
            _set_attr(n, rng.choice(("comm_src", "comm_dst")), rng.choice((4, 99, -1, 2**40)))
        _write_records(f, meta, nodes)
    return kind


# -- running a case -------------------------------------------------------------------

@dataclass
class Outcome:
    command: str
    argv: list[str]
    code: int | None
    stdout: str
    stderr: str
    seconds: float
    problem: str | None = None  # why the case violates the property, None when it holds

    def describe(self) -> str:
        return (f"{self.command} {' '.join(self.argv)} -> exit {self.code} in {self.seconds:.1f} s: {self.problem}\n"
                f"stderr: {self.stderr[-2000:]}")


class _Timeout(BaseException):
    pass


def _entry(command: str) -> Callable[[list[str]], int]:
    if command == "flint-opt":
        from flint.tools.flint_opt import main as opt_main

        return opt_main
    from flint.tools.flint_cli import main as cli_main

    return lambda argv: cli_main([command, *argv])


def warm_up() -> None:
    """Import what commands import lazily (torch's FLOP registry), so the time limit measures work, not imports
    (and never interrupts an import half-way)."""
    from flint.cost import flops

    flops._fc()
    flops._schema("aten", "mm", "default")


def run_command(command: str, argv: Sequence[str], *, timeout_s: float = 30.0) -> Outcome:
    """Run ``flint <command> argv`` (or ``flint-opt argv``) in-process; SIGALRM bounds it.

    Call :func:`warm_up` once first."""
    out, err = io.StringIO(), io.StringIO()
    fn = _entry(command)
    code: int | None

    def alarm(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = fn(list(argv))
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:  # noqa: BLE001 - an uncaught exception is what the property forbids
                import traceback

                code = 2
                err.write("Traceback (most recent call last): uncaught " + "".join(
                    traceback.format_exception(e)[-3:]))
    except _Timeout:
        code = None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(command, list(argv), code, out.getvalue(), err.getvalue(), time.perf_counter() - t0)


#: What a located message contains: a path, file:line:col, a rank, node, record, field, option or op.
_LOCATED = re.compile(r"(\.mlir|\.et\b|\.json|\.toml|\.py\b|\bmodel:|:\d+:\d+|\brank \d|\bnode\b|\brecord\b|plan field|--[a-z]|"
                      r"'[a-z_]+\.[a-z_]+' op|\bop\b|comm group|trace|director|\bline \d)")


def check_outcome(o: Outcome, outputs: Sequence[Path] = ()) -> Outcome:
    """Set ``o.problem`` when the case breaks the property (module docstring)."""
    if o.code is None:
        o.problem = "hang (time limit)"
    elif "internal error" in o.stderr or "Traceback (most recent call last)" in o.stderr:
        o.problem = "internal error"
    elif o.code != 0:
        msg = o.stderr.strip() or (o.stdout.strip() if o.command == "inspect" and o.code == 1 else "")
        if not msg:
            o.problem = "non-zero exit without a message"
        elif not _LOCATED.search(msg):
            o.problem = "message does not say where"
        else:
            for p in outputs:
                if p.exists():
                    o.problem = f"failed run left output {p}"
                    break
    if o.problem is None:
        for p in outputs:
            parent = p.parent
            if parent.is_dir():
                debris = [q.name for q in parent.iterdir() if q.name.startswith(f".{p.name}.")]
                if debris:
                    o.problem = f"temporary debris left beside {p}: {debris}"
                    break
    return o


# -- the case families ------------------------------------------------------------------

def ir_case(rng: random.Random, work: Path) -> list[Outcome]:
    """One mutated IR file through flint-opt (verify + lower), estimate and emit."""
    chakra_seed = rng.random() < 0.4
    seed = (SEED_CHAKRA_IR if chakra_seed else SEED_IR).encode()
    data, kind = seed, ""
    for _ in range(rng.choice((1, 1, 2, 3))):
        data, k = mutate_text(data, rng)
        kind = f"{kind}+{k}" if kind else k
    src = work / "in.mlir"
    src.write_bytes(data)
    outs = []
    opt_out = work / "opt_out.mlir"
    emit_out = work / "emitted"
    for command, argv, produced in (
        ("flint-opt", [str(src), "-p", "canonicalize-dist" if chakra_seed else "canonicalize-dist,verify-dist,lower-to-chakra",
                       "-o", str(opt_out)], [opt_out]),
        ("estimate", [str(src), "--network", "ring"], []),
        ("emit", [str(src), "-o", str(emit_out)], [emit_out]),
    ):
        for p in produced:
            _remove(p)
        o = run_command(command, argv)
        o.argv.append(f"[mutation {kind}]")
        outs.append(check_outcome(o, produced if o.code else ()))
    return outs


def trace_case(rng: random.Random, work: Path, pristine: Path) -> list[Outcome]:
    """One mutated copy of the seed trace through inspect, estimate, simulate and import-trace."""
    tdir = work / "trace"
    _remove(tdir)
    shutil.copytree(pristine.parent, tdir)
    prefix = tdir / pristine.name
    kind = mutate_trace(prefix, rng)
    if rng.random() < 0.3:
        kind += "+" + mutate_trace(prefix, rng)
    out_ir = work / "imported.mlir"
    _remove(out_ir)
    outs = []
    for command, argv, produced in (
        ("inspect", [str(prefix)], []),
        ("estimate", [str(prefix), "--network", "ring"], []),
        ("simulate", [str(prefix), "--network", "ring"], []),
        ("import-trace", [str(prefix), "-o", str(out_ir)], [out_ir]),
    ):
        o = run_command(command, argv)
        o.argv.append(f"[mutation {kind}]")
        outs.append(check_outcome(o, produced if o.code else ()))
    flagged = outs[0].code != 0
    for o in outs[1:3]:
        if flagged and o.code == 0 and o.problem is None:
            o.problem = "estimates a trace that inspect rejects"
    return outs


_CONFIG_FILES = {"device": "devices/h100-sxm.toml", "network": "networks/dgx-h100.toml",
                 "calibration": "devices/calibration/h100-sxm.toml"}


def config_case(rng: random.Random, work: Path) -> list[Outcome]:
    """A mutated plan, device, network or calibration TOML."""
    root = Path(__file__).resolve().parent
    what = rng.choice(("plan", "device", "network", "calibration"))
    seed = SEED_PLAN.encode() if what == "plan" else (root / _CONFIG_FILES[what]).read_bytes()
    data, kind = seed, ""
    for _ in range(rng.choice((1, 2))):
        data, k = _mutate_toml(data, rng)
        kind = f"{kind}+{k}" if kind else k
    cfg = work / f"{what}.toml"
    cfg.write_bytes(data)
    src = work / "seed.mlir"
    if not src.exists():
        src.write_text(SEED_IR)
    if what == "plan":
        from flint.plan import Plan
        from flint.errors import FlintError

        o = Outcome("plan", [str(cfg), f"[mutation {kind}]"], 0, "", "", 0.0)
        t0 = time.perf_counter()
        try:
            Plan.load(str(cfg), world_size=8).mesh()
        except FlintError as e:
            o.code, o.stderr = 1, f"flint: error: {e}"
        except Exception as e:  # noqa: BLE001 - what the property forbids
            o.code, o.stderr = 2, f"internal error: {type(e).__name__}: {e}"
        o.seconds = time.perf_counter() - t0
        return [check_outcome(o)]
    flag = {"device": "--device", "network": "--network", "calibration": "--calibration"}[what]
    argv = [str(src), flag, str(cfg)] + (["--network", "ring"] if what != "network" else [])
    o = run_command("estimate", argv)
    o.argv.append(f"[mutation {kind}]")
    return [check_outcome(o)]


_TOML_VALUES = ("0", "-1", "-1e9", "nan", "inf", "-inf", "2.5", "1e400", "\"x\"", "[]", "true", "{}",
                "9223372036854775808", "1e-300", "[1, \"a\"]")


def _mutate_toml(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if rng.random() < 0.6:
        vals = list(re.finditer(rb"(?m)^(\s*[A-Za-z0-9_.\"-]+\s*=\s*)(.+)$", data))
        if vals:
            m = rng.choice(vals)
            return data[: m.start(2)] + rng.choice(_TOML_VALUES).encode() + data[m.end(2):], "toml_value"
    return mutate_text(data, rng)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def campaign(n_cases: int, seed: int = 0, *, families: Sequence[str] = ("ir", "trace", "config"),
             work: Path | None = None, on_case: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``n_cases`` random cases; returns every outcome (``problem`` set on failures)."""
    rng = random.Random(seed)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="flint-fuzz-")) if own else Path(work)
    try:
        warm_up()
        pristine = write_seed_trace(work / "pristine")
        outcomes: list[Outcome] = []
        for i in range(n_cases):
            fam = families[i % len(families)]
            case_dir = work / "case"
            _remove(case_dir)
            case_dir.mkdir()
            case_rng = random.Random(rng.getrandbits(64))
            if fam == "ir":
                got = ir_case(case_rng, case_dir)
            elif fam == "trace":
                got = trace_case(case_rng, case_dir, pristine)
            else:
                got = config_case(case_rng, case_dir)
            for o in got:
                if on_case:
                    on_case(o)
            outcomes.extend(got)
        return outcomes
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
