"""AWS Neuron (Trainium Trn2/Trn3): ``torch.compile(backend="neuron")``, NEFFs cached on disk.

``import torch_neuronx`` registers the ``neuron`` device and the ``neuron`` torch.compile backend.
The backend lowers each FX graph through StableHLO and ``neuronx-cc`` to a NEFF, kept under
``TORCH_NEURONX_NEFF_CACHE_DIR``; that folder is what a build captures and a load lays back.
Only ``mode: default`` and static shapes are supported by the backend (AWS's torch.compile
reference), so other settings are rejected when the recipe is validated.
``TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION`` keeps its default (a failed compile raises) in build
jobs, so a graph that fell back to eager is never cached as a success.
"""

from __future__ import annotations

import os
from pathlib import Path

from aotbuild.targets.folder import FolderCacheTarget


class NeuronTarget(FolderCacheTarget):
    name = "neuron"
    vendor = "torch_neuronx"
    toolchain = ("neuronx-cc",)
    cache_env = "TORCH_NEURONX_NEFF_CACHE_DIR"
    unset_in_jobs = ("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION",)
    hardware = "an AWS Trainium host (Trn2/Trn3) with the Neuron SDK"
    # torch.compile backends receive parameters as graph inputs (Dynamo lifts them; freezing is
    # Inductor-only), so the NEFFs hold code, not weights: one entry serves every checkpoint.
    embeds_weights = False

    hardware_factor = "neuron_core"

    def hardware_kind(self) -> str:
        """Trn2 and Trn3 NeuronCores differ: NEFFs are compiled for one. From the override the Neuron
        SDK honours, else the EC2 instance family (``trn2.48xlarge`` -> ``trn2``)."""
        override = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
        if override:
            return override
        try:
            product = Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip()
        except OSError:
            return "unknown"
        return product.split(".")[0] or "unknown"
