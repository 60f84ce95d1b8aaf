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


class FakeSession:
    """Stands in for `tuner.session.Session` in search tests: compiles nothing, answers each
    measurement with the latency `latencies` gives a configuration (abandoning it where the
    search asks), and remembers how many compiles were in flight at each measurement."""

    def __init__(self, latencies, overlap=True, compilers=2, compile_rounds=1):
        self.latencies, self.overlap, self.compilers = latencies, overlap, compilers
        self.compile_rounds = compile_rounds  # finished() calls a compile takes
        self._compiling = {}  # tag -> rounds left
        self.in_flight_at_measure = []
        self.measured = []

    @property
    def free(self):
        return self.compilers - len(self._compiling)

    @property
    def compiling(self):
        return len(self._compiling)

    def submit(self, tag, job):
        self._compiling[tag] = self.compile_rounds

    def compile_ahead(self, jobs):
        pass

    def finished(self, block=False):
        from tileops.tuner.child import Outcome

        for tag in self._compiling:
            self._compiling[tag] -= 1
        done = [tag for tag, left in self._compiling.items() if left <= 0]
        if block and not done and self._compiling:
            done = [next(iter(self._compiling))]
        for tag in done:
            del self._compiling[tag]
        return [(tag, Outcome()) for tag in done]

    def measure(self, job, seed, program=None, abandon_above_us=None):
        from tileops.tuner.evaluate import ABANDONED, Measurement
        from tileops.tuner.timing import Stats

        us = self.latencies(job.config) if job.config is not None else 10.0
        self.in_flight_at_measure.append(len(self._compiling))
        self.measured.append((job.config, abandon_above_us))
        if abandon_above_us is not None and us > abandon_above_us:
            return Measurement(failure=ABANDONED, estimate_us=us, reason="slow")
        return Measurement(stats=Stats(us, us, us, 1, us))
