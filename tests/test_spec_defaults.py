"""Every operator's default is a point of its own search space and passes its own constraint
checks, for every problem of every workload suite and every target kind it serves. A constant
default is the `[<kind>.default]` table of configs/<op>.toml, beside the space it belongs to (and
not part of it); a problem-dependent one is the kind's `Backend.default`; never both."""

from __future__ import annotations

import tomllib

import pytest

from tileops.ops import SPECS
from tileops.resources import data_dir
from tileops.spec import _spaces
from tileops.target import Target
from tileops.tuner import suites

TARGETS = [Target("cuda", "sm_90a", "H200", 132), Target("cuda", "sm_80", "A100", 108),
           Target("hip", "gfx942", "MI300X", 304), Target("hip", "gfx1100", "RX 7900 XTX", 96),
           Target("metal", "apple", "Apple GPU"), Target("cpu", "x86_64", "CPU", 2)]


@pytest.mark.parametrize("suite", suites.available())
def test_defaults_are_valid_points_of_the_space(suite):
    loaded = suites.load(suite)
    spec = suites.named_spec(loaded.op)
    for target in TARGETS:
        if spec.unsupported_reason(target):
            continue
        space = spec.space(target)
        for problem in loaded.problems:
            config = spec.default_config(problem, target)
            where = f"{spec.problem_label(problem)} on {target.kind}:{target.arch}"
            assert set(config) == set(space), where
            assert all(config[k] in space[k] for k in space), f"{where}: {config}"
            assert spec.check_config(problem, config, target) is None, \
                f"{where}: {config}: {spec.check_config(problem, config, target)}"


def _toml(op: str) -> dict:
    with open(data_dir("configs") / f"{op}.toml", "rb") as f:
        return tomllib.load(f)


# The kinds whose default is constant, so configs/<op>.toml holds it. MXFP4's hip default and
# every cuda default depend on the problem (M, head_dim, batch), as GEMM's cpu default does.
CONSTANT = {"gemm": {"hip", "metal"}, "mxfp4_gemm": {"metal"}, "mxfp4_gemm_packed": set(),
            "attention": {"hip", "cpu"}, "attention_backward": {"cuda", "cpu"},
            "attention_varlen": {"cpu"}, "attention_varlen_backward": {"cuda", "cpu"},
            "attention_paged": {"cpu"}, "mla_decode": {"cpu"}}
_SUITES = {"gemm": "gemm_llama", "mxfp4_gemm": "mxfp4_llama", "mxfp4_gemm_packed": "mxfp4_llama",
           "attention": "attention", "attention_backward": "attention",
           "attention_varlen": "attention_varlen",
           "attention_varlen_backward": "attention_varlen",
           "attention_paged": "attention_paged", "mla_decode": "mla_decode"}


@pytest.mark.parametrize("op", SPECS)
def test_constant_defaults_come_from_the_configs_and_are_points_of_their_spaces(op):
    spec, tables = SPECS[op], _toml(op)
    assert set(CONSTANT) == set(SPECS)
    for kind, backend in spec.backends.items():
        in_configs = "default" in tables[kind]
        assert in_configs == (kind in CONSTANT[op]), kind
        assert in_configs != (backend.default is not None), f"{kind}: one default, in one place"
        target = next(t for t in TARGETS if t.kind == kind)
        # (a kind's space as configs/<op>.toml has it, also where the target's arch is refused)
        space = {k: list(v) for k, v in _spaces(op)[kind].items()}
        assert "default" not in space, "the default is not a search parameter"
        assert space == {k: v for k, v in tables[kind].items() if k != "default"}
        if in_configs:
            fixed = tables[kind]["default"]
            assert set(fixed) == set(space) and all(fixed[k] in space[k] for k in space), kind
            for problem in suites.load(_SUITES[op]).problems[:8]:
                assert spec.default_config(problem, target) == fixed
                assert spec.check_config(problem, fixed, target) is None

