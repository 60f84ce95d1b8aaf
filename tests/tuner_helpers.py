"""Helpers for the tuner tests: a GEMM spec whose configurations misbehave on purpose.

It lives in a module of its own so that the tuner's child processes can import it when they
unpickle the spec; a test registers it in `tileops.ops.SPECS` for the command line to find.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

from tileops import dispatch
from tileops.ops.gemm.spec import GemmSpec

# block_N x block_K -> what the configuration does (block_M is always 16).
FAULTS = {
    (16, 16): "compile",  # build raises
    (16, 32): "wrong",  # fast, wrong values
    (32, 32): "unwritten",  # fast, leaves the output as it was
    (16, 64): "hang",  # never returns
    (32, 64): "crash",  # kills its process
    (32, 128): "refused",  # check_config refuses it
}
GOOD = [{"block_M": 16, "block_N": 32, "block_K": 16}, {"block_M": 16, "block_N": 16, "block_K": 128}]
SPACE = {"block_M": [16], "block_N": [16, 32], "block_K": [16, 32, 64, 128]}


def fault(config: dict[str, Any]) -> str | None:
    return FAULTS.get((config["block_N"], config["block_K"]))


class FaultyGemm(GemmSpec):
    name = "gemm_faulty"

    def space(self, target):
        return {k: list(v) for k, v in SPACE.items()}

    def check_config(self, problem, config, target):
        return "refused on purpose" if fault(config) == "refused" else None

    def build(self, problem, config, target):
        if fault(config) == "compile":
            raise RuntimeError("injected compile failure")
        return super().build(problem, config, target)

    def launch(self, kernel, args, out=None):
        what = fault(_config_of(kernel))
        if what == "wrong":
            a, b, trans_b, out_dtype = args
            return torch.zeros(a.shape[0], b.shape[0] if trans_b else b.shape[1], dtype=out_dtype)
        if what == "unwritten":
            return out
        if what == "hang":
            time.sleep(3600)
        if what == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().launch(kernel, args, out)


def _config_of(kernel) -> dict[str, Any]:
    """The configuration a compiled kernel was built for (from dispatch's in-process memo)."""
    for key, k in dispatch._kernels.items():
        if k is kernel:
            return json.loads(key[3])
    raise LookupError("kernel not in the memo")


FAULTY = FaultyGemm()
