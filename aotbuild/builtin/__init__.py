"""Built-in tiny models, for machines that cannot reach a model hub (CI, tests, first runs).

``builtin:tiny-sd`` is a real ``StableDiffusionPipeline`` with random weights, small enough to
compile in well under a minute on two CPU cores. It is created deterministically (fixed seeds, fixed
configs) on first use, saved with ``save_pretrained`` under ``models/`` in the cache root, and then
loaded with ``from_pretrained`` like any other model, so every code path is the one a Hub model
takes. ``TinySD.version`` is a key factor: bump it whenever anything below changes the saved model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from aotbuild.errors import StoreError, UsageError

PREFIX = "builtin:"
TOKENIZER_DIR = Path(__file__).with_name("tiny_clip_tokenizer")


class BuiltinModel:
    name: str
    version: int

    @property
    def folder_name(self) -> str:
        return f"{self.name}-v{self.version}"

    def create(self, folder: Path) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class TinySD(BuiltinModel):
    """UNet2DConditionModel + AutoencoderKL + CLIPTextModel + CLIP tokenizer, all tiny."""

    name = "tiny-sd"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=16,
            attention_head_dim=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        torch.manual_seed(0)
        # Four levels make the VAE scale factor 8, as in real Stable Diffusion: a 64x64 image is an
        # 8x8 latent, which keeps the UNet (the compiled part) tiny.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
            block_out_channels=(8, 8, 8, 8), norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        )
        tokenizer = CLIPTokenizer.from_pretrained(str(TOKENIZER_DIR), model_max_length=77)
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_hidden_layers=2, max_position_embeddings=77, projection_dim=16,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
        scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                           steps_offset=1)
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        pipe.save_pretrained(str(folder), safe_serialization=True)


BUILTINS: dict[str, BuiltinModel] = {m.name: m for m in (TinySD(),)}


def is_builtin(model_id: str) -> bool:
    return model_id.startswith(PREFIX)


def lookup(model_id: str) -> BuiltinModel:
    name = model_id[len(PREFIX):]
    try:
        return BUILTINS[name]
    except KeyError:
        known = ", ".join(PREFIX + n for n in sorted(BUILTINS))
        raise UsageError(f"unknown built-in model {model_id!r}; known: {known}") from None


def ensure(model_id: str, models_dir: Path) -> Path:
    """Return the folder of a built-in model under ``models_dir``, creating it on first use.

    Creation happens in a temporary sibling folder that is renamed into place, so concurrent
    first uses never see a half-written model: the loser of the race discards its copy.
    """
    model = lookup(model_id)
    folder = models_dir / model.folder_name
    if (folder / "model_index.json").is_file():
        return folder
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}.", dir=models_dir))
    except OSError as exc:
        raise StoreError(f"cannot create {model_id} in {models_dir}: {exc.strerror or exc}; use a writable cache "
                         "(--cache DIR or AOTBUILD_CACHE)") from None
    logging.getLogger("aotbuild").info("creating %s in %s (first use; a few seconds) ...", model_id, folder)
    try:
        model.create(staging)
        try:
            os.rename(staging, folder)
        except OSError:
            if not (folder / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
