"""Tiny random-weight Flux and SD3 pipelines saved with ``save_pretrained``, for regional-scope tests.

Nothing is downloaded: every tokenizer is built locally (the CLIP one from the built-in tiny-sd's
vocabulary, the T5 one with the ``tokenizers`` library). Both VAEs have four levels, so a 64x64
image is an 8x8 latent, as in the real models (scale factor 8).
"""

from __future__ import annotations

from pathlib import Path


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    from aotbuild.builtin import TOKENIZER_DIR

    return CLIPTokenizer.from_pretrained(str(TOKENIZER_DIR), model_max_length=77)


def _t5_tokenizer():
    """A T5TokenizerFast with a 100-piece Unigram vocabulary (T5's own model type)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{c}", -1.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [(c, -2.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    pieces += [("\u2581", -3.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=512)


def _vae(latent_channels: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, layers_per_block=1,
                         block_out_channels=(8, 8, 8, 8), norm_num_groups=4,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                         scaling_factor=1.5035)


def _clip_config(tokenizer, projection_dim: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=4,
                          num_hidden_layers=2, max_position_embeddings=77, projection_dim=projection_dim,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, hidden_act="gelu")


def _t5_encoder(tokenizer):
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


def flux_transformer(num_layers: int = 2, num_single_layers: int = 2):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=num_layers,
                                  num_single_layers=num_single_layers, attention_head_dim=16, num_attention_heads=2,
                                  joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def make_tiny_flux(folder: Path, num_layers: int = 2, num_single_layers: int = 2) -> Path:
    """A FluxPipeline (schnell-like: no guidance embedding) with random weights, saved to ``folder``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(0)
    transformer = flux_transformer(num_layers, num_single_layers)
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    text_encoder_2 = _t5_encoder(tokenizer_2)
    torch.manual_seed(0)
    vae = _vae(latent_channels=1)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        transformer=transformer)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def sd3_transformer(num_layers: int = 3):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=num_layers,
                                 attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                 joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
                                 pos_embed_max_size=16)


def make_tiny_sd3(folder: Path, num_layers: int = 3) -> Path:
    """A StableDiffusion3Pipeline with random weights, saved to ``folder``. Its last block is
    ``context_pre_only`` (diffusers' own layout), so it differs from the others."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer, tokenizer_3 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(0)
    transformer = sd3_transformer(num_layers)
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(_clip_config(tokenizer))
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer))
    torch.manual_seed(0)
    vae = _vae(latent_channels=4)
    pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                                    tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
                                    text_encoder_3=_t5_encoder(tokenizer_3), tokenizer_3=tokenizer_3,
                                    transformer=transformer)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder
