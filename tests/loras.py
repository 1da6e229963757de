"""LoRA files for tests, made locally with peft from the tiny UNet (tests/test_lora.py and the stale-graph
matrix both load them; a test module never imports another), and the smaller tiny models that the real
LoRA, int8 and declared-FreeU builds compile (tests/test_lora.py, tests/test_quantization.py,
tests/test_declared_changes.py), and the one-block-of-each tiny Flux that the tensor-parallel and
cache-hook builds compile (tests/test_parallel.py, tests/test_stale_graph.py)."""

from __future__ import annotations

from pathlib import Path

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
ADAPTERS = {"style": (4, 4, ATTENTION, 1), "other": (2, 4, ATTENTION, 2), "big": (16, 16, ATTENTION, 3),
            "wide": (4, 4, ATTENTION + ["proj_in"], 4)}


def make_adapter(model: Path, folder: Path, rank: int, alpha: int, targets: list[str], seed: int) -> Path:
    """A LoRA file made locally with peft and diffusers' save_lora_weights, from the tiny UNet."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    unet = UNet2DConditionModel.from_pretrained(str(model), subfolder="unet")
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    unet.add_adapter(config)
    StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=get_peft_model_state_dict(unet),
                                              safe_serialization=True, unet_lora_adapter_metadata=config.to_dict())
    return folder


def one_level_sd(models_dir: Path, folder: Path) -> Path:
    """``builtin:tiny-sd`` with a one-level UNet (CrossAttnDownBlock2D, the cross-attention mid block,
    CrossAttnUpBlock2D, 8 channels), saved as a local model folder for a recipe's ``model.id``. It has
    every kind of layer a LoRA or int8 build changes (the attention projections, the feed-forwards, the
    resnets' time projections, a down, mid and up block) at fewer distinct shapes than the two-level
    UNet, so a real build compiles fewer kernels: 56 s of Inductor against 76 s single-threaded."""
    return _tiny_sd_with(models_dir, folder, block_out_channels=(8,), down_block_types=("CrossAttnDownBlock2D",),
                         up_block_types=("CrossAttnUpBlock2D",))


def attention_free_sd(models_dir: Path, folder: Path) -> Path:
    """``builtin:tiny-sd`` with its two-level UNet made of resnets only (DownBlock2D and UpBlock2D at both
    levels, UNetMidBlock2D): both up blocks FreeU scales (resolution 0 and 1: b1, s1 and b2, s2), none of
    the transformer blocks FreeU never touches, so a real build compiles fewer kernels."""
    return _tiny_sd_with(models_dir, folder, down_block_types=("DownBlock2D", "DownBlock2D"),
                         up_block_types=("UpBlock2D", "UpBlock2D"), mid_block_type="UNetMidBlock2D")


def _tiny_sd_with(models_dir: Path, folder: Path, **unet: object) -> Path:
    """``builtin:tiny-sd``'s pipeline (from ``models_dir/models``) with a UNet of its config changed by
    ``unet``, random weights, saved to ``folder``."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    pipe = StableDiffusionPipeline.from_pretrained(str(next((models_dir / "models").glob("tiny-sd-v*"))))
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(**{**pipe.unet.config, **unet})
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def flux_1_1(models: Path, folder: Path) -> Path:
    """``builtin:tiny-flux`` (from ``models``, a cache's ``models`` folder holding it) with one double-stream
    and one single-stream block instead of two of each, random weights from a fixed seed, saved to
    ``folder``: a full-scope Flux compile grows with its blocks (benchmarks/README.md, the depth sweep),
    and one block of each kind still has every layer kind (tensor parallelism's plan shards each; a
    cache hook's first block and the rest it skips)."""
    import shutil

    import torch
    from diffusers import FluxTransformer2DModel

    shutil.copytree(next(models.glob("tiny-flux-v*")), folder)
    config = dict(FluxTransformer2DModel.load_config(folder / "transformer"))
    shutil.rmtree(folder / "transformer")
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel.from_config({**config, "num_layers": 1, "num_single_layers": 1})
    transformer.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder
