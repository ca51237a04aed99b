"""Building Flint IR from Python: the API the importer and passes use."""

import subprocess
import sys
import textwrap

import pytest
from xdsl.builder import Builder
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, bf16, f32
from xdsl.dialects.shard import GridOp
from xdsl.dialects.builtin import DenseArrayBase, IntegerAttr, StringAttr, i64, ArrayAttr
from xdsl.ir import Block, Region
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException
from io import StringIO

from flint.ir import flint_context
from flint.ir import aten, chakra, dist


def _grid(name: str, shape: list[int]) -> GridOp:
    return GridOp.create(properties={"sym_name": StringAttr(name), "shape": DenseArrayBase.from_list(i64, shape)})


def _print(module: ModuleOp, **kw) -> str:
    out = StringIO()
    Printer(stream=out, **kw).print_op(module)
    return out.getvalue()


def build_step() -> ModuleOp:
    """A tiny FSDP-style step: gather a weight shard, matmul, reduce-scatter the gradient."""
    shard_t = TensorType(bf16, [4, 16])
    full_t = TensorType(bf16, [16, 16])
    x_t = TensorType(bf16, [8, 16])
    block = Block(arg_types=[shard_t, x_t])
    w_shard, x = block.args
    ops = []
    ag = dist.AllGatherOp(w_shard, "grid", [0], dist.FutureType(full_t), gather_dim=0)
    wait = dist.WaitOp(ag.result)
    mm = aten.AtenOp("aten.mm.default", [x, wait.result], [x_t], phase="fwd", module="layers.0.mlp")
    rs = dist.ReduceScatterOp(mm.outputs[0], "grid", [0], TensorType(bf16, [2, 16]), scatter_dim=0)
    ops = [ag, wait, mm, rs, func.ReturnOp(rs.result)]
    block.add_ops(ops)
    fn = func.FuncOp("step", ((shard_t, x_t), (TensorType(bf16, [2, 16]),)), Region(block))
    return ModuleOp([_grid("grid", [4]), fn])


def test_build_verify_and_round_trip():
    module = build_step()
    module.verify()
    text = _print(module)
    assert 'aten.op "aten.mm.default"' in text
    assert "dist.all_gather" in text and "!dist.future<tensor<16x16xbf16>>" in text
    reparsed = Parser(flint_context(), text).parse_module()
    reparsed.verify()
    assert _print(reparsed) == text
    generic = _print(module, print_generic_format=True)
    assert _print(Parser(flint_context(), generic).parse_module()) == text


def test_group_size_follows_the_grid():
    module = build_step()
    ag = next(op for op in module.walk() if isinstance(op, dist.AllGatherOp))
    assert ag.group_size() == 4 and ag.is_async and ag.axes() == (0,)


def test_verifier_rejects_wrong_shape_from_python():
    shard_t = TensorType(f32, [4, 16])
    block = Block(arg_types=[shard_t])
    bad = dist.AllGatherOp(block.args[0], "grid", [0], TensorType(f32, [4, 16]), gather_dim=0)
    block.add_ops([bad, func.ReturnOp()])
    module = ModuleOp([_grid("grid", [4]), func.FuncOp("f", ((shard_t,), ()), Region(block))])
    with pytest.raises(VerifyException, match=r"result shape \[4, 16\] does not match expected \[16, 16\]"):
        module.verify()


def test_chakra_graph_from_python():
    body = Block()
    a = chakra.CompOp("aten.mm.default", flops=2 * 8 * 16 * 16, bytes=1024, duration_us=1.0)
    b = chakra.CompOp("aten.relu.default", data_deps=[a.node])
    body.add_ops([a, b])
    g = chakra.GraphOp.create(properties={"sym_name": StringAttr("step")}, regions=[Region(body)])
    module = ModuleOp([g])
    module.verify()
    text = _print(module)
    assert 'chakra.comp "aten.relu.default" data(%0)' in text


def test_flint_opt_main_returns_nonzero_on_bad_input(tmp_path, capsys):
    from flint.tools.flint_opt import main

    bad = tmp_path / "bad.mlir"
    bad.write_text("func.func @f( {\n")
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1:15: error:" in err and "Traceback" not in err


def test_flint_opt_output_is_atomic(tmp_path):
    """-o is written through a temp file: a failing run leaves the old file untouched."""
    from flint.tools.flint_opt import main

    good = tmp_path / "good.mlir"
    good.write_text("shard.grid @g(shape = 2)\n")
    out = tmp_path / "out.mlir"
    assert main([str(good), "-o", str(out)]) == 0
    before = out.read_text()
    assert "shard.grid @g" in before
    bad = tmp_path / "bad.mlir"
    bad.write_text("shard.grid @g(shape = 2)\nfunc.func @f( {\n")
    assert main([str(bad), "-o", str(out)]) == 1
    assert out.read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".flint-opt")] == []


def test_out_of_tree_pass_plugin(tmp_path):
    """A package registering a pass in the `flint.passes` entry-point group is runnable by name."""
    pkg = tmp_path / "myplugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from xdsl.passes import ModulePass
        from flint.ir import dist

        @dataclass(frozen=True)
        class CountWaitsPass(ModulePass):
            """Count dist.wait ops (a user's analysis)."""
            name = "count-waits"
            def apply(self, ctx, op):
                n = sum(isinstance(o, dist.WaitOp) for o in op.walk())
                op.attributes["waits"] = __import__("xdsl.dialects.builtin", fromlist=["IntegerAttr"]).IntegerAttr(n, 64)
    '''))
    dist_info = tmp_path / "myplugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[flint.passes]\ncount-waits = myplugin:CountWaitsPass\n")
    src = tmp_path / "in.mlir"
    src.write_text(textwrap.dedent('''
        shard.grid @grid(shape = 4)
        func.func @f(%x: tensor<4xf32>) {
          %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4xf32> -> !dist.future<tensor<4xf32>>
          %1 = dist.wait %0 : tensor<4xf32>
          func.return
        }
    '''))
    env_path = str(tmp_path)
    code = (
        "import sys; sys.path.insert(0, %r); from flint.tools.flint_opt import main; "
        "sys.exit(main([%r, '-p', 'count-waits']))" % (env_path, str(src))
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "waits = 1 : i64" in res.stdout
    helped = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r}); "
                             "from flint.tools.flint_opt import main; main(['--help'])"], capture_output=True, text=True)
    assert "count-waits" in helped.stdout and "[plug-in]" in helped.stdout
