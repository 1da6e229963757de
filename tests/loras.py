"""LoRA files for tests, made locally with peft from the tiny UNet (tests/test_lora.py and the stale-graph
matrix both load them; a test module never imports another), and the one-level tiny model that the real
LoRA and int8 builds compile (tests/test_lora.py, tests/test_quantization.py)."""

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
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    pipe = StableDiffusionPipeline.from_pretrained(str(next((models_dir / "models").glob("tiny-sd-v*"))))
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(**{**pipe.unet.config, "block_out_channels": (8,),
                                        "down_block_types": ("CrossAttnDownBlock2D",),
                                        "up_block_types": ("CrossAttnUpBlock2D",)})
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder
