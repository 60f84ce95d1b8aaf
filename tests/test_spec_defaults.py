"""Every operator's heuristic default is a point of its own search space and passes its own
constraint checks, for every problem of every workload suite and every target kind it serves."""

from __future__ import annotations

import pytest

from tileops.target import Target
from tileops.tuner import suites

TARGETS = [Target("cuda", "sm_90a", "H200", 132), Target("cuda", "sm_80", "A100", 108),
           Target("hip", "gfx942", "MI300X", 304), Target("hip", "gfx1100", "RX 7900 XTX", 96),
           Target("metal", "apple", "Apple GPU"), Target("cpu", "x86_64", "CPU", 2)]


@pytest.mark.parametrize("suite", suites.available())
def test_defaults_are_valid_points_of_the_space(suite):
    loaded = suites.load(suite)
    spec = suites._spec(loaded.op)
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
