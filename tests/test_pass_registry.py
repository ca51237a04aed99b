"""Pass pipelines from text (`-p`, `--passes`, a space's `passes`): parsed by xDSL, errors naming the pass
and the option at fault."""

import pytest

from flint.errors import FlintError
from flint.passes.registry import all_passes, options, parse_passes


def test_a_pipeline_parses_into_configured_passes():
    pipeline = parse_passes(all_passes(), "fuse-pointwise{parts=block,head inline=false},sink-waits")
    fuse, sink = pipeline.passes
    assert (fuse.parts, fuse.inline, fuse.device) == (("block", "head"), False, "h100-sxm")
    assert sink.name == "sink-waits"


@pytest.mark.parametrize("spec, message", [
    ("fuse-pointwis", "unknown pass 'fuse-pointwis'; did you mean 'fuse-pointwise'?"),
    ("nothing-like-it", "unknown pass 'nothing-like-it' (flint-opt --help"),
    ("fuse-pointwise{inlin=true}", "pass 'fuse-pointwise': it has no option 'inlin'; its options: "
                                   "device=h100-sxm, parts=(), inline=true"),
    ("fuse-pointwise{inline=1}", "option 'inline' is '1', which is not true or false"),
    ("fuse-pointwise{parts=3}", "option 'parts' is '3', which is not a comma-separated list"),
    ("reorder-all-gather{prefetch=two}", "option 'prefetch' is 'two', which is not an integer"),
    ("fuse-pointwise{device}", "option 'device' needs a value (a string)"),
])
def test_a_bad_pipeline_names_the_pass_and_the_option(spec, message):
    with pytest.raises(FlintError) as e:
        parse_passes(all_passes(), spec)
    assert message in str(e.value)


def test_options_are_spelled_as_the_pipeline_takes_them():
    assert options(all_passes()["lower-to-chakra"]()) == ["device=h100-sxm", "merge-compute=true",
                                                           "grad-wait=part", "class-times=false"]


def test_a_pass_s_own_check_of_an_option_keeps_its_message():
    from dataclasses import dataclass

    from xdsl.passes import ModulePass

    @dataclass(frozen=True)
    class Picky(ModulePass):
        name = "picky"
        kind: str = "all"

        def __post_init__(self):
            if self.kind not in ("all", "some"):
                raise ValueError("option kind must be 'all' or 'some'")

        def apply(self, ctx, op):
            pass

    assert parse_passes({"picky": lambda: Picky}, "picky{kind=some}").passes[0].kind == "some"
    with pytest.raises(FlintError, match="pass 'picky': option kind must be 'all' or 'some'; its options: kind=all"):
        parse_passes({"picky": lambda: Picky}, "picky{kind=none}")
