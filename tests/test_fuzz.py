"""Malformed input never ends in an internal error, a hang or a partial output.

Two layers:
- one regression test per failure class measured in issue 16, asserting the
  located message the class now gets at its root (a verifier rule, a reader
  record check, a config validator, a limit);
- a bounded hypothesis fuzz run (fixed seed, ~60 cases, well under a minute)
  of mutated IR, traces and configs through flint-opt, estimate, emit,
  inspect, simulate and import-trace, in-process (flint/fuzz.py). The longer
  campaign is bench/fuzz.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from flint.fuzz import (
    warm_up,
    SEED_CHAKRA_IR,
    SEED_IR,
    _read_records,
    _set_attr,
    _write_records,
    check_outcome,
    config_case,
    ir_case,
    run_command,
    trace_case,
    write_seed_trace,
)


@pytest.fixture(scope="module", autouse=True)
def _imports_done():
    warm_up()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_seed_trace(tmp_path_factory.mktemp("seed") / "trace")


def _ir(tmp_path: Path, text: str | bytes) -> str:
    p = tmp_path / "in.mlir"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def _fails_located(command: str, argv: list[str], *needles: str) -> str:
    o = check_outcome(run_command(command, argv))
    assert o.problem is None, o.describe()
    assert o.code not in (0, None), o.describe()
    msg = o.stderr + (o.stdout if command == "inspect" else "")
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


# -- IR classes ---------------------------------------------------------------------------

IR_CLASSES = [
    ("non-utf8", SEED_IR.encode().replace(b"phase", b"ph\xffase", 1), ":4:", "not UTF-8"),
    ("grid axis > i16", SEED_IR.replace("grid_axes = [1]", "grid_axes = [40000]"), ":13:5:", "out of range"),
    ("grid too big", SEED_CHAKRA_IR.replace("shape = 2x2", "shape = 2000000000x2"), ":2:3:", "the limit is 1,048,576"),
    ("grid beyond i64", SEED_CHAKRA_IR.replace("shape = 2x2", "shape = 1000000000000000000000000000000x2"), ":2:3:",
     "out of range for type i64"),
    ("grid axis 0", SEED_CHAKRA_IR.replace("shape = 2x2", "shape = 0x2"), ":2:3:", "at least one rank"),
    ("shape beyond i64", SEED_IR.replace("tensor<8x64xbf16> {flint.role = \"input\"}",
                                         "tensor<9223372036854775807x9223372036854775807xbf16> {flint.role = \"input\"}"),
     "in.mlir:", "error"),
    ("repeat 1e9", SEED_CHAKRA_IR.replace("chakra.repeat 3", "chakra.repeat 1000000000"), ":5:5:", "out of range 1..10,000,000"),
    ("repeat 2**64", SEED_CHAKRA_IR.replace("chakra.repeat 3", "chakra.repeat 18446744073709551616"), ":5:5:", "out of range"),
    ("tag beyond int32", SEED_IR.replace("tag = 7", "tag = 2147483648"), ":15:5:", "int32"),
    ("unranked tensor", SEED_IR.replace('(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>',
                                        '(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<*xbf16>'), ":9:5:", "tensor"),
    ("schedule names a missing function", SEED_IR.replace('["block", 3]', '["nowhere", 3]'), ":1:1:", "@nowhere"),
    ("schedule of the wrong type", SEED_IR.replace('[["embed", 1], ["block", 3]]', '[[1, "embed"]]'), ":1:1:", "is not [\"function\", count]"),
    ("schedule empty", SEED_IR.replace('[["embed", 1], ["block", 3]]', '[]'), ":1:1:", "is empty"),
    ("schedule 1e9", SEED_IR.replace('["block", 3]', '["block", 1000000000]'), ":1:1:", "the limit is 10,000,000"),
    ("mm shapes", SEED_IR.replace('%7 = aten.op "aten.add.Tensor"(%6, %3) phase = "fwd" : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>',
                                  '%7 = aten.op "aten.mm.default"(%6, %3) phase = "fwd" : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>'),
     ":17:5:", "inner dimensions differ"),
    ("comp depends on itself", SEED_CHAKRA_IR.replace('duration_us = 1.5', 'duration_us = 1.5 data(%e)'), ":4:5:", "depends on itself"),
    ("deep nesting", SEED_IR.replace("args = {size = [8, 64]}", "args = {size = " + "[" * 5000 + "]" * 5000 + "}"),
     ":11:", "nesting deeper than"),
    ("value defined in its user's region", SEED_CHAKRA_IR.replace(
        '    %e = chakra.comp "embed" flops = 65536 bytes = 10240 duration_us = 1.5\n', "").replace(
        "    ^bb0(%c: !chakra.node):\n",
        '    ^bb0(%c: !chakra.node):\n      %e = chakra.comp "embed" flops = 65536 bytes = 10240 duration_us = 1.5\n'),
     ":4:5:", "'chakra.repeat' uses %e, which is not defined before it"),
    # xDSL's string pattern backtracks exponentially on these (the unterminated one never returned)
    ("unterminated string", SEED_IR.replace('phase = "fwd" module = "embed" :', 'phase = "fwd module = embed :', 1),
     ":4:52:", "unterminated string literal"),
    ("invalid escape", SEED_IR.replace('phase = "fwd"', 'phase = "f\\qwd"', 1), ":4:54:", "invalid escape '\\qw'"),
]


@pytest.mark.parametrize("name,text,where,what", IR_CLASSES, ids=[c[0] for c in IR_CLASSES])
def test_ir_class_is_located(tmp_path, name, text, where, what):
    src = _ir(tmp_path, text)
    out = tmp_path / "out"
    for command, argv in (("flint-opt", [src]), ("estimate", [src, "--network", "ring"]), ("emit", [src, "-o", str(out)])):
        msg = _fails_located(command, argv, where, what)
        assert "Traceback" not in msg
    assert not out.exists()


@pytest.mark.parametrize("text", ["builtin.module {\n}\n", "builtin.module {\n  shard.grid @mesh(shape = 2x2)\n}\n"])
def test_module_without_a_step_is_refused(tmp_path, text):
    """fuzz seed 48: emit ended in an internal error (lower-to-chakra's VerifyException), estimate in a message about
    a chakra.graph the file does not hold."""
    src = _ir(tmp_path, text)
    out = tmp_path / "out"
    for command, argv in (("estimate", [src, "--network", "ring"]), ("simulate", [src]),
                          ("emit", [src, "-o", str(out)])):
        _fails_located(command, argv, "in.mlir:1:1: error: the module holds no training step: no func.func")
    assert not out.exists()


def test_unmatched_send_is_refused_before_simulation(tmp_path):
    # verify-dist is not run by estimate/emit; the trace check catches the deadlock before simulating.
    src = _ir(tmp_path, SEED_IR.replace("tag = 7 : tensor<8x64xbf16>\n    %6", "tag = 8 : tensor<8x64xbf16>\n    %6"))
    _fails_located("estimate", [src, "--network", "ring"], "unmatched send", "deadlock")
    _fails_located("emit", [src, "-o", str(tmp_path / "o")], "unmatched send")


# -- trace classes ---------------------------------------------------------------------------

def _copy(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine.parent, tmp_path / "t")
    return tmp_path / "t" / pristine.name


def _edit_node(prefix: Path, rank: int, fn) -> None:
    f = prefix.parent / f"{prefix.name}.{rank}.et"
    meta, nodes = _read_records(f)
    fn(nodes)
    _write_records(f, meta, nodes)


def _groups(prefix: Path, text: str) -> None:
    (prefix.parent / f"{prefix.name}.comm_groups.json").write_text(text)


def _append_raw_node(prefix: Path) -> None:
    """A compute node whose num_ops attribute is a double encoded as a string (wire type 2 for field 3)."""
    from flint.chakra import wire

    attr = wire.length_delimited(1, b"num_ops") + wire.length_delimited(3, b"12345678")
    node = wire.key(1, 0) + wire.varint(999) + wire.key(3, 0) + wire.varint(4) + wire.length_delimited(10, attr)
    f = prefix.parent / f"{prefix.name}.0.et"
    f.write_bytes(f.read_bytes() + wire.varint(len(node)) + node)


def _coll(nodes):
    return next(n for n in nodes if n.type == 7)


TRACE_CLASSES = {
    "group rank outside world": (lambda p: _groups(p, '{"1": [0, 9], "2": [1, 3], "3": [0, 2], "4": [2, 3]}'),
                                 "names rank 9"),
    "last rank file missing": (lambda p: (p.parent / f"{p.name}.3.et").unlink(), "trace.3.et missing"),
    "group claiming 2M members": (lambda p: _groups(p, '{"1": [' + ", ".join(map(str, range(2_000_000))) + "]}"),
                                   "lists 2,000,000 members"),
    "cycle": (lambda p: _edit_node(p, 0, lambda ns: (ns[1].data_deps.append(ns[2].id), ns[2].data_deps.append(ns[1].id))),
              "cycle"),
    "self dependency": (lambda p: _edit_node(p, 1, lambda ns: ns[2].ctrl_deps.append(ns[2].id)), "cycle"),
    "dangling dependency": (lambda p: _edit_node(p, 2, lambda ns: ns[3].data_deps.append(10**6)), "not in the rank's file"),
    "comm_type 99": (lambda p: _edit_node(p, 0, lambda ns: _set_attr(_coll(ns), "comm_type", 99)), "comm_type' is 99"),
    "collective without comm_type": (lambda p: _edit_node(p, 0, lambda ns: setattr(next(n for n in ns if n.type == 4), "type", 7)),
                                     "without a comm_type"),
    "node type 99": (lambda p: _edit_node(p, 0, lambda ns: setattr(ns[0], "type", 99)), "node type 99"),
    "negative num_ops": (lambda p: _edit_node(p, 0, lambda ns: _set_attr(ns[0], "num_ops", -5)), "'num_ops' is -5"),
    "tag beyond int32": (lambda p: _edit_node(p, 0, lambda ns: _set_attr(next(n for n in ns if n.type == 5), "comm_tag", 2**40)),
                         "comm_tag"),
    "broken comm-group JSON": (lambda p: _groups(p, '{"1": [0, 1'), "not valid JSON"),
    "attribute of the wrong wire type": (lambda p: _append_raw_node(p), "wire type 2"),
    "truncated record": (lambda p: (lambda f: f.write_bytes(f.read_bytes()[:-3]))(p.parent / f"{p.name}.1.et"), "truncated"),
}


@pytest.mark.parametrize("name", list(TRACE_CLASSES))
def test_trace_class_is_located(tmp_path, pristine, name):
    prefix = _copy(pristine, tmp_path)
    mutate, what = TRACE_CLASSES[name]
    mutate(prefix)
    out = tmp_path / "imported.mlir"
    for command, argv in (("inspect", [str(prefix)]), ("estimate", [str(prefix), "--network", "ring"]),
                          ("simulate", [str(prefix), "--network", "ring"]), ("import-trace", [str(prefix), "-o", str(out)])):
        if command == "import-trace" and name == "dangling dependency":
            continue  # import keeps a dangling dependency out of the graph; inspect and the simulators refuse it
        msg = _fails_located(command, argv, what)
        assert "Traceback" not in msg
    assert not out.exists()


def test_send_without_tag_imports(tmp_path, pristine):
    """An absent comm_tag (chakra_converter's sends) reads as -1 and imports; found by bench/fuzz.py."""
    prefix = _copy(pristine, tmp_path)

    def drop_tag(nodes):
        n = next(n for n in nodes if n.type == 5)
        keep = [a for a in n.attr if a.name != "comm_tag"]
        del n.attr[:]
        n.attr.extend(keep)

    _edit_node(prefix, 0, drop_tag)
    o = check_outcome(run_command("import-trace", [str(prefix), "-o", str(tmp_path / "i.mlir")]))
    assert o.problem is None and o.code == 0, o.describe()
    assert "tag = -1" in (tmp_path / "i.mlir").read_text()


def test_import_trace_output_is_a_directory(tmp_path, pristine):
    (tmp_path / "d").mkdir()
    _fails_located("import-trace", [str(pristine), "-o", str(tmp_path / "d")], "is a directory")


# -- config classes -----------------------------------------------------------------------------

NETWORK = """name = "n"
[[dims]]
name = "x"
topology = "ring"
size = {size}
bandwidth_gbytes_per_s = {bw}
latency_us = {lat}
"""


@pytest.mark.parametrize("size,bw,lat,what", [
    ("2.5", "50.0", "1.0", "size = 2.5 must be a whole number"),
    ("4", "0", "1.0", "bandwidth_gbytes_per_s = 0"),
    ("4", "nan", "1.0", "bandwidth_gbytes_per_s = nan"),
    ("4", "-50.0", "1.0", "bandwidth_gbytes_per_s = -50.0"),
    ("4", "\"fast\"", "1.0", "bandwidth_gbytes_per_s = 'fast'"),
    ("4", "50.0", "-1.0", "latency_us = -1.0"),
    ("4", "50.0", "inf", "latency_us = inf"),
    ("true", "50.0", "1.0", "size = True"),
])
def test_network_values_are_checked(tmp_path, size, bw, lat, what):
    net = tmp_path / "net.toml"
    net.write_text(NETWORK.format(size=size, bw=bw, lat=lat))
    _fails_located("estimate", [_ir(tmp_path, SEED_IR), "--network", str(net)], "net.toml: dims[0]", what)


@pytest.mark.parametrize("key,value", [("hbm_bandwidth_gbytes_per_s", "-3350.0"), ("peak_tflops_bf16", "nan"),
                                       ("peak_tflops_bf16", "0"), ("hbm_capacity_gib", "\"80\"")])
def test_device_values_are_checked(tmp_path, key, value):
    import re

    text = (Path(__file__).resolve().parents[1] / "flint" / "devices" / "h100-sxm.toml").read_text()
    text = re.sub(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", text)
    text = text.replace('calibration = "', f'calibration = "{Path(__file__).resolve().parents[1]}/flint/devices/calibration/', 1) \
        if 'calibration = "' in text and "/" not in text.split('calibration = "', 1)[1].split('"')[0] else text
    dev = tmp_path / "dev.toml"
    dev.write_text(text)
    _fails_located("estimate", [_ir(tmp_path, SEED_IR), "--device", str(dev)], "dev.toml", key)


def test_device_comm_sms_without_sm_count_names_the_file(tmp_path):
    """fuzz seed 48: the message named the device, not the file."""
    text = (Path(__file__).resolve().parents[1] / "flint" / "devices" / "h100-sxm.toml").read_text()
    dev = tmp_path / "dev.toml"
    dev.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith("sm_count")))
    _fails_located("estimate", [_ir(tmp_path, SEED_IR), "--device", str(dev)],
                   f"{dev}: device 'h100-sxm': comm_sms = 24 (calibration ", "needs sm_count above it")


# -- the fuzz property ------------------------------------------------------------------------------

# the profile's settings (tests/conftest.py), plus: a fixture shared by the examples (this list replaces
# the profile's, so it names too_slow again)
FUZZ = settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _assert_all_hold(outcomes):
    bad = [o for o in outcomes if o.problem]
    assert not bad, "\n\n".join(o.describe() for o in bad)


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_ir(tmp_path_factory, seed):
    _assert_all_hold(ir_case(random.Random(seed), tmp_path_factory.mktemp("ir")))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_traces(tmp_path_factory, pristine, seed):
    _assert_all_hold(trace_case(random.Random(seed), tmp_path_factory.mktemp("tr"), pristine))


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_configs(tmp_path_factory, seed):
    _assert_all_hold(config_case(random.Random(seed), tmp_path_factory.mktemp("cfg")))


# -- capture arguments and user model files (all refused before any capture work) -------------------

@pytest.mark.parametrize("argv,what", [
    (["--model", "llama-tiny", "--world-size", "2", "--layers", "0"], "--layers must be at least 1, got 0"),
    (["--model", "llama-tiny", "--world-size", "2", "--seq-len", "-5"], "--seq-len must be at least 1, got -5"),
    (["--model", "llama-tiny", "--world-size", "2", "--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    (["--model", "llama-tiny", "--world-size", "2", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--model", "llama-tiny", "--world-size", "4", "--plan", "fsdp", "--tp", "2"], "--tp applies to plans with tp"),
    (["--model", "llama-tiny", "--world-size", "1000000000"], "--world-size 1,000,000,000 is more than Flint can hold"),
    (["--model", "llama-tiny", "--world-size", "0"], "--world-size must be at least 1, got 0"),
])
def test_capture_arguments(tmp_path, argv, what):
    out = tmp_path / "o.mlir"
    msg = _fails_located("capture", [*argv, "-o", str(out)], what)
    assert "Traceback" not in msg and not out.exists()


@pytest.mark.parametrize("body,what", [
    ("import sys\nsys.exit(0)\n", "called sys.exit(0) while being imported"),
    ("def model_factory():\n    raise ValueError('no weights')\n", "raised ValueError: no weights"),
    ("def model_factory():\n    return 42\n", "returned int, not a torch.nn.Module"),
    ("def model_factory():\n    import sys\n    sys.exit(3)\n", "called sys.exit(3) instead of returning"),
])
def test_user_model_files(tmp_path, body, what):
    model = tmp_path / "m.py"
    model.write_text(body)
    out = tmp_path / "o.mlir"
    msg = _fails_located("capture", ["--model", str(model), "--world-size", "2", "-o", str(out)], "model", what)
    assert "Traceback" not in msg and not out.exists()
