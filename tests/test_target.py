"""Target detection and overrides, for every kind, with simulated device facts."""

from __future__ import annotations

import pytest
import torch

from tileops import target as tgt
from tileops.target import DeviceFacts, Target, normalise


@pytest.mark.parametrize(
    ("facts", "kind", "arch", "warp"),
    [
        (DeviceFacts("cuda", 0, "NVIDIA H200", (9, 0), None, 132), "cuda", "sm_90a", 32),
        (DeviceFacts("cuda", 0, "NVIDIA A100-SXM4-80GB", (8, 0), None, 108), "cuda", "sm_80", 32),
        (DeviceFacts("cuda", 0, "NVIDIA B200", (10, 0), None, 148), "cuda", "sm_100a", 32),
        (DeviceFacts("cuda", 0, "NVIDIA GeForce RTX 4090", (8, 9), None, 128), "cuda", "sm_89", 32),
        (DeviceFacts("cuda", 1, "AMD Instinct MI300X", (9, 4), "gfx942:sramecc+:xnack-", 304),
         "hip", "gfx942", 64),
        (DeviceFacts("cuda", 0, "AMD Instinct MI355X", (9, 5), "gfx950", 256), "hip", "gfx950", 64),
        (DeviceFacts("cuda", 0, "AMD Radeon RX 7900 XTX", (11, 0), "gfx1100", 96), "hip", "gfx1100",
         32),
        (DeviceFacts("mps", None, "Apple GPU"), "metal", "apple", 32),
        (DeviceFacts("npu", 0, "Ascend910B"), "ascend", "Ascend910B", 1),
        (DeviceFacts("cpu", None, "AMD EPYC", units=2), "cpu", None, 1),
    ],
)
def test_normalise_every_kind(facts, kind, arch, warp):
    t = normalise(facts)
    assert t.kind == kind
    if arch is not None:
        assert t.arch == arch
    assert t.device == facts.name
    assert t.units == facts.units
    assert t.warp_size == warp
    assert t.key == (t.kind, t.arch, t.device)


def test_tilelang_target_spelling():
    assert Target("cuda", "sm_90a", "H200").tilelang() == {"kind": "cuda", "arch": "sm_90a"}
    assert Target("hip", "gfx942", "MI300X").tilelang() == {"kind": "hip", "mcpu": "gfx942"}
    assert Target("cpu", "x86_64", "cpu").tilelang() == "c"
    assert Target("metal", "apple", "Apple GPU").tilelang() == "metal"


def test_is_hopper_is_sm_90_cuda_only():
    hopper = [Target(kind, arch, "x").is_hopper for kind, arch in
              [("cuda", "sm_90a"), ("cuda", "sm_90"), ("cuda", "sm_80"), ("cuda", "sm_100a"),
               ("hip", "gfx942"), ("metal", "apple"), ("cpu", "x86_64")]]
    assert hopper == [True, True, False, False, False, False, False]


def test_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        normalise(DeviceFacts("xla", 0))
    with pytest.raises(ValueError, match="unknown target kind"):
        Target("tpu", "v5", "x")


def test_cpu_tensor_means_cpu_target():
    t = tgt.target_of(torch.device("cpu"))
    assert t.kind == "cpu" and t.tilelang() == "c" and t.units >= 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cuda", {"kind": "cuda"}),
        ("c", {"kind": "cpu"}),
        ("rocm", {"kind": "hip"}),
        ('{"kind": "cuda", "arch": "sm_80"}', {"kind": "cuda", "arch": "sm_80"}),
        ('{"kind": "hip", "mcpu": "gfx942"}', {"kind": "hip", "arch": "gfx942"}),
        ('{"kind": "c", "device": "ci", "units": 2}', {"kind": "cpu", "device": "ci", "units": 2}),
    ],
)
def test_parse_override(text, expected):
    assert tgt.parse_override(text) == expected


@pytest.mark.parametrize("text", ["cuda -arch=sm_90a", '{"arch": "sm_90a"}', "{bad json", "tpu"])
def test_parse_override_rejects(text):
    with pytest.raises(ValueError):
        tgt.parse_override(text)


def _simulate(monkeypatch, facts: DeviceFacts):
    monkeypatch.setattr(tgt, "device_facts", lambda device: facts)
    tgt.clear_cache()


def test_tileops_target_beats_tilelang_default(monkeypatch):
    _simulate(monkeypatch, DeviceFacts("cuda", 0, "NVIDIA H200", (9, 0), None, 132))
    monkeypatch.setenv("TILELANG_DEFAULT_TARGET", '{"kind": "cuda", "arch": "sm_89"}')
    assert tgt.target_of(torch.device("cuda", 0)).arch == "sm_89"
    monkeypatch.setenv("TILEOPS_TARGET", '{"kind": "cuda", "arch": "sm_80"}')
    tgt.clear_cache()
    t = tgt.target_of(torch.device("cuda", 0))
    assert (t.kind, t.arch, t.device, t.units) == ("cuda", "sm_80", "NVIDIA H200", 132)


def test_override_of_another_kind_is_an_error(monkeypatch):
    _simulate(monkeypatch, DeviceFacts("cpu", None, "cpu", units=2))
    monkeypatch.setenv("TILEOPS_TARGET", "cuda")
    with pytest.raises(ValueError, match="tensors are on a cpu device"):
        tgt.target_of(torch.device("cpu"))


def test_tilelang_default_target_kind_string(monkeypatch):
    monkeypatch.setenv("TILELANG_DEFAULT_TARGET", "c")
    tgt.clear_cache()
    assert tgt.target_of(torch.device("cpu")).kind == "cpu"


def test_resolve_device_without_gpu_fails_fast():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for spec in ("cuda", "cuda:1", "hip", "metal", "ascend"):
        with pytest.raises(ValueError, match="no .*(GPU|device|NPU)"):
            tgt.resolve_device(spec)
    target, device = tgt.resolve_device("auto")
    assert target.kind == "cpu" and device.type == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        tgt.resolve_device("tpu")
