"""Shared fixtures: every test gets its own user database and no target/config overrides."""

from __future__ import annotations

import pytest
import torch

import tileops
from tileops.db import Resolver
from tileops.dispatch import DISPATCHER

HAS_CUDA = torch.cuda.is_available() and torch.version.hip is None
_SPEC_STATE = {name: dict(vars(spec)) for name, spec in tileops.SPECS.items()}


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_USER_DB", str(tmp_path / "user.sqlite"))
    # The tuner's child processes time torch's CPU baseline: one thread, so that a hiccup of the
    # shared CI cores cannot stall it (a stalled baseline contradicts its own timings, and the
    # tuner then rightly records nothing).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for var in ("TILEOPS_TARGET", "TILELANG_DEFAULT_TARGET", "TILEOPS_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    # A method patched on a spec instance comes back from monkeypatch's undo as an instance
    # attribute (the bound method), which would shadow a later test's patch of the class.
    for name, spec in tileops.SPECS.items():
        vars(spec).clear()
        vars(spec).update(_SPEC_STATE[name])
    tileops.reset()
    DISPATCHER.resolver = Resolver(shipped=[])  # tests never read the databases we ship
    yield
    tileops.reset()


@pytest.fixture
def use_dbs():
    """Point dispatch at the given user database and shipped databases."""

    def use(user, shipped=()):
        tileops.reset()
        DISPATCHER.resolver = Resolver(user_db=user, shipped=list(shipped))

    return use
