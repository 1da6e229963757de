"""Device helpers, driven by one table: synchronize, empty cache, seeding, device count, peak memory.

Lessons from diffusers' MLU bug: a device missing from the table is an error naming it and the
known ones (never a ``None`` default called later, never ``getattr(torch, kind, torch.cuda)``),
seeding reaches the accelerator's own generator, and a vendor module (``torch_npu``,
``torch_mlu``, ``torch_neuronx``, ``torch_tpu``) is imported under its availability guard before
``torch.<device>`` is touched, because importing it is what creates that namespace.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from aotbuild.errors import DeviceError


@dataclass(frozen=True)
class DeviceOps:
    vendor: str | None  # module whose import registers torch.<namespace>
    namespace: str | None  # torch.<namespace>; None for the CPU
    synchronize: str | None = "synchronize"
    empty_cache: str | None = "empty_cache"
    seed: str | None = "manual_seed_all"
    count: str | None = "device_count"
    peak_memory: str | None = "max_memory_allocated"
    reset_peak: str | None = "reset_peak_memory_stats"


TABLE: dict[str, DeviceOps] = {
    "cpu": DeviceOps(None, None),
    "cuda": DeviceOps(None, "cuda"),
    "xpu": DeviceOps(None, "xpu"),
    # MPS has one device, seeds with manual_seed, and reports the driver's allocation, not a peak.
    "mps": DeviceOps(None, "mps", seed="manual_seed", count=None, peak_memory="driver_allocated_memory",
                     reset_peak=None),
    "mlu": DeviceOps("torch_mlu", "mlu"),
    "npu": DeviceOps("torch_npu", "npu"),
    "neuron": DeviceOps("torch_neuronx", "neuron"),
    "tpu": DeviceOps("torch_tpu", "tpu"),
}

OPERATIONS = ("synchronize", "empty_cache", "manual_seed", "device_count", "peak_memory", "reset_peak_memory")


def _kind(device: Any) -> str:
    kind = str(device).partition(":")[0]
    if kind not in TABLE:
        raise DeviceError(f"unknown device {str(device)!r}; known: {', '.join(TABLE)}")
    return kind


def namespace(device: Any) -> Any:
    """``torch.<kind>`` for an accelerator, after importing its vendor module; None for the CPU."""
    import torch

    kind = _kind(device)
    ops = TABLE[kind]
    if ops.namespace is None:
        return None
    if ops.vendor is not None:
        try:
            importlib.import_module(ops.vendor)
        except ImportError as exc:
            raise DeviceError(f"device {kind} needs the {ops.vendor} package, which cannot be imported: "
                              f"{exc}") from None
    mod = getattr(torch, ops.namespace, None)
    if mod is None:
        raise DeviceError(f"torch.{ops.namespace} does not exist in this PyTorch build: device {kind} is not "
                          f"supported here")
    return mod


def _call(device: Any, field: str, operation: str, *args: Any) -> Any:
    kind = _kind(device)
    mod = namespace(kind)
    name = getattr(TABLE[kind], field)
    fn = getattr(mod, name, None) if (mod is not None and name) else None
    if fn is None:
        raise DeviceError(f"{operation} is not supported on device {kind}")
    available = getattr(mod, "is_available", None)
    if available is not None and not available():
        raise DeviceError(f"device {kind} is not available here ({operation})")
    return fn(*args)


def synchronize(device: Any) -> None:
    if _kind(device) != "cpu":
        _call(device, "synchronize", "synchronize")


def empty_cache(device: Any) -> None:
    if _kind(device) != "cpu":
        _call(device, "empty_cache", "empty_cache")


def manual_seed(device: Any, seed: int) -> None:
    """Seed the host generator and, for an accelerator, its own generators too."""
    import torch

    kind = _kind(device)
    # The host generator alone: torch.manual_seed would also reach into torch.cuda, mps and xpu.
    torch.default_generator.manual_seed(seed)
    if kind != "cpu":
        _call(device, "seed", "manual_seed", seed)


def device_count(device: Any) -> int:
    kind = _kind(device)
    if kind == "cpu":
        return 1
    mod = namespace(kind)
    name = TABLE[kind].count
    if name is None:  # a single-device backend (mps)
        available = getattr(mod, "is_available", lambda: True)
        return 1 if available() else 0
    fn = getattr(mod, name, None)
    if fn is None:
        raise DeviceError(f"device_count is not supported on device {kind}")
    return int(fn())


def peak_memory(device: Any) -> int:
    """Peak bytes allocated on the device (CPU: the process's peak resident set size)."""
    if _kind(device) == "cpu":
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    return int(_call(device, "peak_memory", "peak_memory"))


def reset_peak_memory(device: Any) -> None:
    if _kind(device) == "cpu":
        raise DeviceError("reset_peak_memory is not supported on device cpu (the peak RSS cannot be reset)")
    _call(device, "reset_peak", "reset_peak_memory")
