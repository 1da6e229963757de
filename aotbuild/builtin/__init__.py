"""Built-in tiny models, for machines that cannot reach a model hub (CI, tests, first runs).

Each is a real diffusers pipeline with random weights, small enough that Inductor compiles its
denoiser in a minute or two on two CPU cores:

* ``builtin:tiny-sd``: ``StableDiffusionPipeline`` (UNet2DConditionModel, one CLIP text encoder);
* ``builtin:tiny-sdxl``: ``StableDiffusionXLPipeline`` (UNet with SDXL's ``text_time`` conditioning,
  CLIPTextModel and CLIPTextModelWithProjection);
* ``builtin:tiny-sd3``: ``StableDiffusion3Pipeline`` (SD3Transformer2DModel, two CLIP encoders, T5);
* ``builtin:tiny-flux``: ``FluxPipeline`` (FluxTransformer2DModel with double- and single-stream
  blocks, CLIP, T5, guidance embedding as in FLUX.1-dev);
* ``builtin:tiny-pixart-sigma``: ``PixArtSigmaPipeline`` (PixArtTransformer2DModel, T5): guidance
  batches both halves into one call of twice the batch, without SD's ``do_classifier_free_guidance``;
* ``builtin:tiny-wan``: ``WanPipeline`` as Wan 2.1 (WanTransformer3DModel, AutoencoderKLWan, UMT5):
  video (``num_frames``, ``num_videos_per_prompt``), guidance as two calls of the batch per step;
* ``builtin:tiny-wan22``: ``WanPipeline`` as Wan 2.2 A14B: two denoisers, ``transformer`` for the
  high-noise steps and ``transformer_2`` for the rest (``boundary_ratio``);
* ``builtin:tiny-qwenimage``: ``QwenImagePipeline`` (QwenImageTransformer2DModel, AutoencoderKLQwenImage,
  a Qwen2.5-VL text encoder): an LLM text encoder whose text is padded to the batch's longest prompt,
  so the denoiser's text length follows the prompt (issue 34).

A model is created deterministically (fixed seeds, fixed configs, tokenizers built from files shipped
here or from code) on first use, saved with ``save_pretrained`` under ``models/`` in the cache root,
and then loaded with ``from_pretrained`` like any other model, so every code path is the one a Hub
model takes. Each model's ``version`` is a key factor: bump it whenever anything below changes what
that model saves.
"""

from __future__ import annotations

import atexit
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


#: T5 tokenizer vocabulary: whole words that prompts often use (one token each), then single
#: characters, so any ASCII text tokenizes without ``<unk>``. Scores are Unigram log-probabilities:
#: a word beats spelling it out. Token ids are positions here: any change to either bumps the
#: versions of the models that use it (tiny-sd3, tiny-flux).
T5_WORDS = ("a", "an", "the", "of", "and", "in", "on", "with", "at", "photo", "picture", "painting", "cat", "dog",
            "man", "woman", "city", "house", "tree", "sky", "sea", "red", "blue", "green", "white", "black",
            "small", "big", "cute", "astronaut", "riding", "horse", "mountain", "sunset", "portrait", "style")
T5_CHARS = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
            ".,;:!?'\"()[]{}<>-_+=*/\\|&%$#@~^`")


def t5_tokenizer(model_max_length: int = 512):
    """A tiny T5 (Unigram, SentencePiece-style) tokenizer built in code: nothing to download.

    Laid out like T5's own: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, whitespace split then ``▁`` word
    prefixes, ``</s>`` appended; no sentinel ``<extra_id_N>`` tokens (the encoder never sees them)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -4.0) for w in T5_WORDS]
    vocab += [(c, -8.0) for c in T5_CHARS]
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tok, extra_ids=0, additional_special_tokens=[], eos_token="</s>",
                           unk_token="<unk>", pad_token="<pad>", model_max_length=model_max_length)


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(str(TOKENIZER_DIR), model_max_length=77)


def _clip_text_encoder(tokenizer, hidden_size: int, with_projection: bool):
    """A 2-layer CLIP text encoder (SDXL and SD3 read the penultimate layer's hidden states)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=77, projection_dim=hidden_size,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ))


def _t5_encoder(tokenizer, d_model: int):
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
        is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
    ))


def _vae(latent_channels: int, **config):
    """Four levels make the VAE scale factor 8, as in the real models: 64x64 pixels are 8x8 latents."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, layers_per_block=1,
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, **config,
    )


class TinySDXL(BuiltinModel):
    """SDXL's layout: a UNet with ``text_time`` added conditioning (pooled text embedding + the six
    size/crop ids), cross-attending to two CLIP encoders' concatenated penultimate hidden states."""

    name = "tiny-sdxl"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

        tokenizer, tokenizer_2 = _clip_tokenizer(), _clip_tokenizer()
        text_encoder = _clip_text_encoder(tokenizer, 16, with_projection=False)
        text_encoder_2 = _clip_text_encoder(tokenizer_2, 16, with_projection=True)
        addition_time_embed_dim = 8
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            norm_num_groups=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
            transformer_layers_per_block=(1, 2), use_linear_projection=True,
            cross_attention_dim=text_encoder.config.hidden_size + text_encoder_2.config.hidden_size,
            addition_embed_type="text_time", addition_time_embed_dim=addition_time_embed_dim,
            # six time ids (original size, crop top-left, target size), each embedded, + the pooled text
            projection_class_embeddings_input_dim=6 * addition_time_embed_dim + text_encoder_2.config.projection_dim,
        )
        vae = _vae(4, scaling_factor=0.13025, force_upcast=False)
        scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                           steps_offset=1, timestep_spacing="leading")
        pipe = StableDiffusionXLPipeline(
            vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
            tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, add_watermarker=False,
        )
        pipe.save_pretrained(str(folder), safe_serialization=True)


class TinySD3(BuiltinModel):
    """SD3's layout: an MMDiT of JointTransformerBlocks (the last one ``context_pre_only``) over
    2x2 latent patches; text from two CLIP encoders (pooled and penultimate) and T5."""

    name = "tiny-sd3"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), t5_tokenizer(256)
        text_encoder = _clip_text_encoder(tokenizer, 16, with_projection=True)
        text_encoder_2 = _clip_text_encoder(tokenizer_2, 16, with_projection=True)
        # The pipeline pads the two CLIP encoders' concatenated hidden states to T5's width.
        t5_width = text_encoder.config.hidden_size + text_encoder_2.config.hidden_size
        text_encoder_3 = _t5_encoder(tokenizer_3, t5_width)
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=t5_width, caption_projection_dim=32,
            pooled_projection_dim=text_encoder.config.projection_dim + text_encoder_2.config.projection_dim,
            pos_embed_max_size=32,
        )
        vae = _vae(4, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
        pipe.save_pretrained(str(folder), safe_serialization=True)


class TinyFlux(BuiltinModel):
    """FLUX.1-dev's layout: double-stream then single-stream blocks over 2x2-packed latents, CLIP's
    pooled output and T5's hidden states as text, guidance as an embedded input (no CFG)."""

    name = "tiny-flux"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        tokenizer, tokenizer_2 = _clip_tokenizer(), t5_tokenizer(512)
        text_encoder = _clip_text_encoder(tokenizer, 16, with_projection=False)
        text_encoder_2 = _t5_encoder(tokenizer_2, 32)
        latent_channels = 4
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=2, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_encoder_2.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        )
        vae = _vae(latent_channels, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                   shift_factor=0.1159)
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
            max_image_seq_len=4096)
        pipe = FluxPipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
        )
        pipe.save_pretrained(str(folder), safe_serialization=True)


class TinyPixArtSigma(BuiltinModel):
    """PixArt-Sigma's layout: a DiT of ``ada_norm_single`` blocks over 2x2 patches (learned sigma:
    twice the latent channels out), T5 text. Its ``sample_size`` 32 is the smallest that PixArt's
    default resolution binning accepts: any requested size is denoised at a 256-pixel bin (a 32x32
    latent) and resized back."""

    name = "tiny-pixart-sigma"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

        tokenizer = t5_tokenizer(300)
        text_encoder = _t5_encoder(tokenizer, 32)
        torch.manual_seed(0)
        transformer = PixArtTransformer2DModel(
            sample_size=32, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2,
            in_channels=4, out_channels=8, cross_attention_dim=16, caption_channels=32, attention_bias=True,
            activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, use_additional_conditions=False,
        )
        vae = _vae(4, sample_size=256)
        pipe = PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                                   scheduler=DPMSolverMultistepScheduler())
        pipe.save_pretrained(str(folder), safe_serialization=True)


def _wan_transformer(seed: int):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


class TinyWan(BuiltinModel):
    """Wan 2.1's layout: a video DiT over (1, 2, 2) patches of a causal 3D VAE's latents (8x spatial, 4x
    temporal: ``num_frames`` is 4k+1, sides multiples of 16), UMT5 text, UniPC in flow mode as the
    Wan 2.1 Diffusers repos ship. Guidance runs the conditional and unconditional passes as two calls."""

    name = "tiny-wan"
    version = 1
    #: Wan 2.2 A14B: a second denoiser for the low-noise steps (t < boundary_ratio x 1000).
    boundary_ratio: float | None = None

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
        from transformers import UMT5Config, UMT5EncoderModel

        tokenizer = t5_tokenizer(512)
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
        ))
        torch.manual_seed(0)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=1000, flow_shift=3.0)
        extra = {} if self.boundary_ratio is None else {"transformer_2": _wan_transformer(1),
                                                        "boundary_ratio": self.boundary_ratio}
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=_wan_transformer(0), **extra)
        pipe.save_pretrained(str(folder), safe_serialization=True)


class TinyWan22(TinyWan):
    """Wan 2.2 A14B's layout: TinyWan with two denoisers, switched at ``boundary_ratio`` 0.875 (its value):
    with 2 steps the first runs ``transformer``, the second ``transformer_2``."""

    name = "tiny-wan22"
    version = 1
    boundary_ratio = 0.875


#: The tiny Qwen2 tokenizer's words: byte-level BPE (GPT-2's byte alphabet), every byte a token, and
#: these words (space-prefixed, "Ġ") merged into one token each, so QwenImage's prompt template is
#: about as many tokens as with the real tokenizer (its first 34 are the system part the pipeline
#: drops). Token ids are positions: any change bumps tiny-qwenimage's version.
QWEN_WORDS = ("Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture", "quantity",
              "text", "spatial", "relationships", "of", "objects", "and", "background", "system", "user",
              "assistant", "a", "an", "photo", "cat", "dog", "in", "on", "with", "red", "blue", "small", "big")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen2_tokenizer():
    """A tiny Qwen2Tokenizer built in code (nothing to download): byte-level BPE over GPT-2's byte
    alphabet plus :data:`QWEN_WORDS`, and the chat template's special tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(QWEN_SPECIAL)}
    for c in alphabet:
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    space = bytes_to_unicode()[ord(" ")]
    for word in QWEN_WORDS:
        for text in (word, space + word):
            for i in range(1, len(text)):
                piece = (text[:i], text[i])
                if text[:i + 1] not in vocab:
                    vocab[text[:i + 1]] = len(vocab)
                    merges.append(piece)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=list(QWEN_SPECIAL[1:]),
                          model_max_length=32768)


class TinyQwenImage(BuiltinModel):
    """Qwen-Image's layout: an MMDiT of QwenImageTransformerBlocks over 2x2-packed latents of a causal
    3D VAE (used for single frames), text from a Qwen2.5-VL language model's last hidden states, padded
    to the batch's longest prompt (no fixed length: the denoiser's text dimension follows the prompt).
    True classifier-free guidance (``true_cfg_scale`` with a ``negative_prompt``) runs two calls."""

    name = "tiny-qwenimage"
    version = 1

    def create(self, folder: Path) -> None:
        import torch
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        tokenizer = qwen2_tokenizer()
        torch.manual_seed(0)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                         "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         "rope_theta": 1000000.0},
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": 16},
            hidden_size=16, vocab_size=len(tokenizer), vision_start_token_id=len(tokenizer) - 3,
            vision_end_token_id=len(tokenizer) - 2, vision_token_id=len(tokenizer) - 1,
            image_token_id=len(tokenizer) - 1, video_token_id=len(tokenizer) - 1,
        ))
        torch.manual_seed(0)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )
        torch.manual_seed(0)
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4)
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                 tokenizer=tokenizer, transformer=transformer)
        pipe.save_pretrained(str(folder), safe_serialization=True)


BUILTINS: dict[str, BuiltinModel] = {m.name: m for m in (TinySD(), TinySDXL(), TinySD3(), TinyFlux(),
                                                         TinyPixArtSigma(), TinyWan(), TinyWan22(),
                                                         TinyQwenImage())}


def is_builtin(model_id: str) -> bool:
    return model_id.startswith(PREFIX)


def lookup(model_id: str) -> BuiltinModel:
    name = model_id[len(PREFIX):]
    try:
        return BUILTINS[name]
    except KeyError:
        known = ", ".join(PREFIX + n for n in sorted(BUILTINS))
        raise UsageError(f"unknown built-in model {model_id!r}; known: {known}") from None


def folder_of(model_id: str, models_dir: Path, *, create: bool = True) -> Path:
    """The folder of a built-in model: the cache's (``models_dir``), created there on first use; with
    ``create=False`` (a command that only reads the cache: plan, a load until it succeeds) the cache's
    where it has the model, else one made outside the cache (:func:`scratch`)."""
    if create:
        return ensure(model_id, models_dir)
    folder = models_dir / lookup(model_id).folder_name
    return folder if (folder / "model_index.json").is_file() else scratch(model_id)


#: This process's built-in models made outside any cache (:func:`scratch`): folder name -> folder.
_scratch: dict[str, Path] = {}


def scratch(model_id: str) -> Path:
    """A built-in model made in a temporary folder of this process's (``TMPDIR``), once, removed when the
    process exits: for a command that only reads a cache, which needs the model's configs for its keys.
    ``plan`` created every built-in model it planned in the cache, and a load that failed left one behind
    (issue 55). :func:`ensure` copies it into a cache (a build, a load that succeeded) instead of making
    it again: the same files, as a model is made deterministically."""
    model = lookup(model_id)
    made = _scratch.get(model.folder_name)
    if made is None or not (made / "model_index.json").is_file():  # (a TMPDIR cleaner may have taken it)
        _scratch.pop(model.folder_name, None)
        if not _scratch_root:
            _scratch_root.append(Path(tempfile.mkdtemp(prefix="aotbuild-models-")))
            atexit.register(_remove_scratch, _scratch_root[0], os.getpid())
        _scratch[model.folder_name] = ensure(model_id, _scratch_root[0])
    return _scratch[model.folder_name]


#: The one temporary folder of this process's scratch models, once made.
_scratch_root: list[Path] = []


def _remove_scratch(root: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked child that exits normally leaves its parent's models alone
        shutil.rmtree(root, ignore_errors=True)


def ensure(model_id: str, models_dir: Path) -> Path:
    """Return the folder of a built-in model under ``models_dir``, creating it on first use (a copy of
    this process's :func:`scratch` one where it has made the model there).

    Creation happens in a temporary sibling folder (``.<name>.*``, locked while its writer lives)
    that is renamed into place, so concurrent first uses never see a half-written model: the loser
    of the race discards its copy. A writer killed midway leaves its folder unlocked: the next
    creation removes it (and ``aotbuild verify`` reports it). The model is readable by every user
    of a shared store (folders 0755, files 0644), whatever the umask.
    """
    from aotbuild.cache.locks import flocked

    model = lookup(model_id)
    folder = models_dir / model.folder_name
    if (folder / "model_index.json").is_file():
        return folder
    made = _scratch.get(model.folder_name)
    if made is not None and not (made / "model_index.json").is_file():
        made = None
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(models_dir)
        staging = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}.", dir=models_dir))
    except OSError as exc:
        raise StoreError(f"cannot create {model_id} in {models_dir}: {exc.strerror or exc}; use a writable cache "
                         "(--cache DIR or AOTBUILD_CACHE)") from None
    if made is None:
        logging.getLogger("aotbuild").info("creating %s in %s (first use; a few seconds) ...", model_id, folder)
    try:
        with flocked(staging / STAGING_LOCK, exclusive=True, timeout=0):
            if made is not None:
                shutil.copytree(made, staging, dirs_exist_ok=True)
            else:
                model.create(staging)
            (staging / STAGING_LOCK).unlink()
            _share(staging)
            try:
                os.rename(staging, folder)
            except OSError:
                if not (folder / "model_index.json").is_file():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


STAGING_LOCK = ".creating.lock"


def dead_staging(models_dir: Path) -> list[Path]:
    """Staging folders of built-in models whose writer died (killed while creating a model)."""
    from aotbuild.cache.locks import is_unlocked

    if not models_dir.is_dir():
        return []
    return [p for p in sorted(models_dir.glob(".*.*")) if p.is_dir() and (p / STAGING_LOCK).is_file()
            and is_unlocked(p / STAGING_LOCK)]


def remove_dead_staging(models_dir: Path) -> None:
    for path in dead_staging(models_dir):
        shutil.rmtree(path, ignore_errors=True)


def _share(folder: Path) -> None:
    """Folders 0755 and files 0644: another account loading from a shared store must read them
    (mkdtemp makes 0700)."""
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
