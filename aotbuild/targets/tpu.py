"""Google Cloud TPU (v6e, v7x) through TorchTPU: ``torch.compile(backend="tpu")``.

TorchTPU registers the ``tpu`` device when ``import torch`` autoloads it, or on ``import
torch_tpu``. Compiled executables persist under ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT``, which
a build captures and a load lays back. A new height/width recompiles, a new number of steps does
not: warmup runs the recipe's steps (default 1) once per shape. Model CPU offload
(``offload: model``) needs ``scope: regional``: the offload hooks cannot be traced.
"""

from __future__ import annotations

import os
from typing import Any

from aotbuild.targets.folder import FolderCacheTarget


class TPUTarget(FolderCacheTarget):
    name = "tpu"
    vendor = "torch_tpu"
    toolchain = ("libtpu",)
    cache_env = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    hardware = "a Cloud TPU VM (v6e, v7x) with TorchTPU"

    def import_vendor(self) -> Any:
        import torch

        if hasattr(torch, "tpu"):  # autoloaded with torch
            try:
                return super().import_vendor()
            except ImportError:
                return torch.tpu
        return super().import_vendor()

    hardware_factor = "tpu_generation"

    def hardware_kind(self) -> str:
        """``TPU_ACCELERATOR_TYPE`` (set on Cloud TPU VMs, e.g. ``v6e-8``) without the chip count."""
        accel = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        return accel.rsplit("-", 1)[0] if accel else "unknown"
