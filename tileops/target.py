"""Target records: which accelerator a call runs on, normalised so tuning records can be keyed by it.

A `Target` is derived from the device of a call's input tensors (a CPU tensor means TileLang's `"c"`
target) and can be overridden by `TILEOPS_TARGET` (ours) or `TILELANG_DEFAULT_TARGET` (TileLang's),
each a kind string (`"cuda"`, `"c"`, ...) or a JSON dict such as
`{"kind": "cuda", "arch": "sm_80"}` or `{"kind": "hip", "mcpu": "gfx942"}`.
Detection reads raw facts from torch (`DeviceFacts`) and normalises them in pure functions, so that
every kind can be tested by simulating the facts.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, replace
from typing import Any

import torch

KINDS = ("cuda", "hip", "metal", "cpu", "ascend")

# TileLang's target kind names, mapped to ours.
_TILELANG_KINDS = {
    "cuda": "cuda",
    "hip": "hip",
    "rocm": "hip",
    "metal": "metal",
    "c": "cpu",
    "llvm": "cpu",
    "cpu": "cpu",
    "ascend": "ascend",
    "npu": "ascend",
}
# Compute capabilities whose arch-specific instructions (wgmma, tcgen05) TileLang uses: `sm_XXa`.
_ARCH_SPECIFIC_MAJORS = (9, 10)


@dataclass(frozen=True)
class Target:
    """A normalised target. `(kind, arch, device)` is what tuning records are keyed by."""

    kind: str
    arch: str
    device: str
    units: int = 0  # streaming multiprocessors / compute units / CPU cores
    index: int | None = None  # device ordinal; not part of the key

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown target kind {self.kind!r}; expected one of {KINDS}")

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.arch, self.device)

    @property
    def is_hopper(self) -> bool:
        """An sm_90 CUDA target, where TileLang's T.gemm issues wgmma (tiles of 64 rows per
        warpgroup of 128 threads) and its pipelines are TMA-fed and warp-specialised."""
        return self.kind == "cuda" and self.arch.startswith("sm_90")

    @property
    def warp_size(self) -> int:
        """Threads per warp/wavefront: 64 on CDNA (gfx9xx), 32 elsewhere (RDNA is gfx10+)."""
        if self.kind == "hip" and self.arch.startswith("gfx9"):
            return 64
        return 32 if self.kind in ("cuda", "hip", "metal") else 1

    def tilelang(self) -> dict[str, Any] | str:
        """The target as TileLang's `compile`/`lower` take it."""
        if self.kind == "cuda":
            return {"kind": "cuda", "arch": self.arch}
        if self.kind == "hip":
            return {"kind": "hip", "mcpu": self.arch}
        if self.kind == "cpu":
            return "c"
        return self.kind

    def describe(self) -> str:
        units = f", {self.units} units" if self.units else ""
        return f"{self.kind}:{self.arch} ({self.device}{units})"


@dataclass(frozen=True)
class DeviceFacts:
    """What torch says about a device, before normalisation."""

    type: str  # torch device type: cuda, mps, npu, cpu
    index: int | None = None
    name: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability
    gcn_arch: str | None = None  # ROCm gcnArchName, e.g. "gfx942:sramecc+:xnack-"
    units: int = 0


def cuda_arch(capability: tuple[int, int]) -> str:
    major, minor = capability
    suffix = "a" if major in _ARCH_SPECIFIC_MAJORS else ""
    return f"sm_{major}{minor}{suffix}"


def normalise(facts: DeviceFacts) -> Target:
    """Turn raw device facts into a `Target`."""
    if facts.type == "cuda" and facts.gcn_arch:
        arch = facts.gcn_arch.split(":")[0]
        return Target("hip", arch, facts.name or arch, facts.units, facts.index)
    if facts.type == "cuda":
        if facts.capability is None:
            raise ValueError("a CUDA device needs a compute capability")
        return Target("cuda", cuda_arch(facts.capability), facts.name, facts.units, facts.index)
    if facts.type == "mps":
        return Target("metal", "apple", facts.name or "Apple GPU", facts.units, facts.index)
    if facts.type == "npu":
        return Target("ascend", facts.name or "ascend", facts.name or "Ascend NPU", facts.units,
                      facts.index)
    if facts.type == "cpu":
        return Target("cpu", platform.machine() or "unknown", facts.name or "cpu", facts.units)
    raise ValueError(f"tensors on device type {facts.type!r} are not supported")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_facts(device: torch.device) -> DeviceFacts:
    """Read what torch knows about `device` (the only function here that touches the hardware)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        gcn = getattr(props, "gcnArchName", None) if torch.version.hip else None
        return DeviceFacts("cuda", index, props.name, (props.major, props.minor), gcn,
                           props.multi_processor_count)
    if device.type == "cpu":
        return DeviceFacts("cpu", None, _cpu_name(), units=os.cpu_count() or 1)
    if device.type == "mps":
        return DeviceFacts("mps", device.index, "Apple GPU")
    if device.type == "npu":
        npu = getattr(torch, "npu", None)
        name = npu.get_device_name(device.index or 0) if npu is not None else "Ascend NPU"
        return DeviceFacts("npu", device.index, name)
    return DeviceFacts(device.type, device.index)


def parse_override(text: str) -> dict[str, Any]:
    """Parse a target override: a kind string or a JSON dict (TileLang's spelling accepted)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"target override {text!r} is not valid JSON: {e}") from None
        if not isinstance(raw, dict) or "kind" not in raw:
            raise ValueError(f"target override {text!r} must be a JSON object with a 'kind'")
    elif " " in text or text.startswith("-"):
        raise ValueError(
            f"target override {text!r}: use a kind ('cuda', 'hip', 'metal', 'c', 'ascend') or a "
            'JSON dict such as {"kind": "cuda", "arch": "sm_90a"}, not a CLI target string'
        )
    else:
        raw = {"kind": text}
    kind = _TILELANG_KINDS.get(str(raw["kind"]).lower())
    if kind is None:
        raise ValueError(f"target override {text!r}: unknown kind {raw['kind']!r}")
    out: dict[str, Any] = {"kind": kind}
    arch = raw.get("arch") or raw.get("mcpu")
    if arch:
        out["arch"] = str(arch)
    for field, key in (("device", "device"), ("units", "units")):
        if key in raw:
            out[field] = raw[key]
    return out


def active_override() -> dict[str, Any] | None:
    """The override in force: `TILEOPS_TARGET` first, then `TILELANG_DEFAULT_TARGET`."""
    for var in ("TILEOPS_TARGET", "TILELANG_DEFAULT_TARGET"):
        text = os.environ.get(var)
        if text and text.strip() and text.strip().lower() != "auto":
            try:
                return parse_override(text)
            except ValueError as e:
                raise ValueError(f"{var}: {e}") from None
    return None


def apply_override(target: Target, override: dict[str, Any] | None) -> Target:
    """Refine a detected target with an override; a different kind than the tensors' is an error."""
    if not override:
        return target
    if override["kind"] != target.kind:
        raise ValueError(
            f"target override asks for kind {override['kind']!r} but the tensors are on a "
            f"{target.kind} device ({target.describe()}); move the tensors or change the override"
        )
    fields = {k: v for k, v in override.items() if k in ("arch", "device", "units")}
    return replace(target, **fields)


_cache: dict[tuple[str, int | None], Target] = {}


def target_of(device: torch.device) -> Target:
    """The target for tensors on `device`, overrides applied.

    Memoised per device: overrides are read at first use; `clear_cache()` (or `tileops.reset()`)
    makes the next call read them again.
    """
    key = (device.type, device.index)
    target = _cache.get(key)
    if target is None:
        target = apply_override(normalise(device_facts(device)), active_override())
        _cache[key] = target
    return target


def clear_cache() -> None:
    _cache.clear()


def resolve_device(spec: str) -> tuple[Target, torch.device]:
    """Resolve a user's `--device` choice: auto, cpu, cuda[:N], hip, metal, ascend or a JSON dict.

    `auto` takes the first GPU found, else the CPU. A kind whose hardware is absent is an error.
    """
    spec = spec.strip()
    if spec in ("", "auto"):
        override = active_override()
        if override is not None:
            return resolve_device(json.dumps(override))
        if torch.cuda.is_available():
            return resolve_device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return resolve_device("mps")
        return resolve_device("cpu")
    override = parse_override(spec) if spec.startswith("{") else None
    name = override["kind"] if override else spec
    base, _, index = name.partition(":")
    kind = _TILELANG_KINDS.get(base.lower(), base.lower())
    if kind == "cpu":
        device = torch.device("cpu")
    elif kind in ("cuda", "hip"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no {kind} GPU is visible to torch on this machine")
        is_hip = torch.version.hip is not None
        if (kind == "hip") != is_hip:
            have = "a ROCm" if is_hip else "a CUDA"
            raise ValueError(f"--device {spec}: this torch is {have} build; no {kind} device")
        device = torch.device("cuda", int(index) if index else 0)
    elif kind == "metal":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"--device {spec}: no Metal (mps) device on this machine")
        device = torch.device("mps")
    elif kind == "ascend":
        if getattr(torch, "npu", None) is None:
            raise ValueError(f"--device {spec}: no Ascend NPU (torch_npu) on this machine")
        device = torch.device("npu", int(index) if index else 0)
    else:
        raise ValueError(f"--device {spec}: unknown device; expected auto, cpu, cuda[:N], hip, "
                         "metal, ascend or a JSON target dict")
    return apply_override(normalise(device_facts(device)), override), device
