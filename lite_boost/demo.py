"""Tiny random-weight Wan and Qwen-Image pipelines that build offline in milliseconds.

They exist for the default ``lite-boost generate`` run, the examples and the tests: the same
diffusers classes as the real Wan2.1 / Wan2.2 checkpoints (WanTransformer3DModel, AutoencoderKLWan,
UMT5 text encoder, FlowMatchEulerDiscreteScheduler, CLIP image encoder for I2V), scaled down.
No hub access: the tokenizer is a WordLevel model built in memory. The Qwen-Image pipelines
(``tiny_qwen_image_pipeline``) have no text encoder, tokenizer or processor: they are called with
``prompt_embeds`` (``qwen_prompt_embeds``).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

__all__ = ["TinyWanSpec", "tiny_wan_transformer", "tiny_wan_pipeline", "DEMO_PROMPT", "DEMO_NEGATIVE_PROMPT",
           "DEMO_SPEC", "DEMO_SHAPE", "DEMO_STEPS", "DEMO_SPARSITY", "DEMO_VAE_BASE_DIM", "TinyQwenImageSpec",
           "tiny_qwen_image_transformer", "tiny_qwen_image_pipeline", "qwen_prompt_embeds", "DEMO_QWEN_SPEC",
           "DEMO_QWEN_SHAPE", "DEMO_QWEN_STEPS", "DEMO_QWEN_TEXT_LEN", "qwen_demo_prompt_kwargs", "demo_wan_pipeline",
           "describe_wan_demo", "demo_qwen_image_pipeline", "describe_qwen_image_demo", "qwen_demo_prompt",
           "TinyLTX2Spec", "tiny_ltx2_transformer", "tiny_ltx2_pipeline", "ltx2_prompt_embeds", "demo_ltx2_pipeline",
           "ltx2_demo_prompt", "describe_ltx2_demo", "TinyQwenImage21Spec", "tiny_qwen_image21_transformer",
           "tiny_qwen_image21_pipeline", "demo_qwen_image21_pipeline", "qwen21_demo_prompt", "describe_qwen_image21_demo"]

DEMO_PROMPT = "a red fox runs through fresh snow at dawn"
DEMO_NEGATIVE_PROMPT = "blurry low quality static"
_WORDS = (DEMO_PROMPT + " " + DEMO_NEGATIVE_PROMPT + " a the cat dog walks on beach in city at night rain").split()
_TEXT_LEN = 512  # Wan's processor hard-codes a 512-token text context


@dataclass(frozen=True)
class TinyWanSpec:
    """Size of a tiny Wan transformer (defaults: 2 heads of 24 channels, 2 layers)."""

    heads: int = 2
    head_dim: int = 24
    layers: int = 2
    ffn_dim: int = 64
    text_dim: int = 32
    freq_dim: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 16
    out_channels: int = 16
    image_dim: int | None = None  # set for I2V
    added_kv_proj_dim: int | None = None  # set for I2V


# The main job (`lite-boost generate` without --model). It has to show what the boost does on 2 CPU
# cores in about 30 s, stock and boosted run both included, with the transformer doing most of the
# work. On a CPU the dense boost's saving is the RoPE tables (a few percent of a step at thousands of
# tokens), so the main job's boosted run uses block-sparse self-attention at sparsity 0.8, which pays
# once attention is a large share of the step: a narrow transformer (2 layers x 2 heads of Wan's
# head_dim 128) over several thousand tokens. Two departures from Wan keep the VAE, which the boost
# does not touch, from outweighing the denoising loop: the transformer's patch is 1 x 1 x 1 (one token
# per latent pixel, so 4x fewer pixels per token than Wan's 1 x 2 x 2) and the VAE is 2 channels wide
# (DEMO_VAE_BASE_DIM; the tests' default of 8 decodes about 3x slower). Measured (docs/benchmarks/main-job.md):
# 192 x 256, 25 frames = 7 x 24 x 32 = 5,376 tokens, 10 steps.
DEMO_SPEC = TinyWanSpec(heads=2, head_dim=128, layers=2, ffn_dim=256, patch_size=(1, 1, 1))
DEMO_SHAPE = (192, 256, 25)  # height, width, frames -> 7 x 24 x 32 = 5,376 tokens
DEMO_STEPS = 10
DEMO_SPARSITY = 0.8  # the main job's boosted run (block-sparse self-attention); --sparsity 0 = dense boost
DEMO_VAE_BASE_DIM = 2


def tiny_wan_transformer(spec: TinyWanSpec = TinyWanSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=spec.patch_size,
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=spec.in_channels,
        out_channels=spec.out_channels,
        text_dim=spec.text_dim,
        freq_dim=spec.freq_dim,
        ffn_dim=spec.ffn_dim,
        num_layers=spec.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=spec.image_dim,
        added_kv_proj_dim=spec.added_kv_proj_dim,
        rope_max_seq_len=1024,
    )
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=_TEXT_LEN
    )


def tiny_wan_pipeline(kind: str = "t2v", *, spec: TinyWanSpec | None = None, seed: int = 0,
                      dtype=torch.float32, two_stage: bool = False, boundary_ratio: float = 0.5,
                      vae_base_dim: int = 8):
    """Build a tiny random-weight Wan pipeline.

    kind: "t2v" (WanPipeline) or "i2v" (WanImageToVideoPipeline with a tiny CLIP image encoder).
    two_stage: add ``transformer_2`` with ``boundary_ratio`` (the Wan2.2 A14B layout).
    vae_base_dim: channels of the tiny VAE (AutoencoderKLWan ``base_dim``; the main job uses 2).
    """
    if not isinstance(vae_base_dim, int) or isinstance(vae_base_dim, bool) or vae_base_dim < 1:
        raise ValueError(f"vae_base_dim must be a positive integer, got {vae_base_dim!r}")
    if kind not in ("t2v", "i2v"):
        raise ValueError(f"kind must be 't2v' or 'i2v', got {kind!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    spec = spec or TinyWanSpec()
    if kind == "i2v" and spec.image_dim is None:
        spec = TinyWanSpec(**{**spec.__dict__, "in_channels": 36, "image_dim": 4,
                              "added_kv_proj_dim": spec.heads * spec.head_dim})
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=64, d_model=spec.text_dim, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8)
    ).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=vae_base_dim, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    transformer = tiny_wan_transformer(spec, seed=seed + 2, dtype=dtype)
    transformer_2 = tiny_wan_transformer(spec, seed=seed + 3, dtype=dtype) if two_stage else None
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    kwargs = dict(tokenizer=_tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                  transformer=transformer, transformer_2=transformer_2,
                  boundary_ratio=boundary_ratio if two_stage else None)
    if kind == "t2v":  # WanImageToVideoPipeline is imported only for i2v (its module pulls in the CLIP classes)
        from diffusers import WanPipeline

        pipe = WanPipeline(**kwargs)
    else:
        import transformers
        from diffusers import WanImageToVideoPipeline
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        # the PIL processor by its own name where transformers has it (its torchvision one needs torchvision)
        CLIPImageProcessor = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor

        torch.manual_seed(seed + 4)
        image_encoder = CLIPVisionModelWithProjection(
            CLIPVisionConfig(hidden_size=spec.image_dim, projection_dim=spec.image_dim, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=16, image_size=32, patch_size=8)
        ).eval()
        image_processor = CLIPImageProcessor(crop_size=32, size=32)
        pipe = WanImageToVideoPipeline(image_encoder=image_encoder, image_processor=image_processor, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------- Qwen-Image
@dataclass(frozen=True)
class TinyQwenImageSpec:
    """Size of a tiny QwenImageTransformer2DModel (defaults: 3 heads of 16 channels, 2 layers, as diffusers'
    pipeline tests; RoPE axes (8, 4, 4) split each head)."""

    heads: int = 3
    head_dim: int = 16
    layers: int = 2
    text_dim: int = 16  # joint_attention_dim: the width of prompt_embeds
    in_channels: int = 16  # 4 latent channels packed 2 x 2
    out_channels: int = 4
    axes: tuple[int, int, int] = (8, 4, 4)
    zero_cond_t: bool = False  # Qwen-Image-Edit-2511: per-token modulation of the condition image tokens


def tiny_qwen_image_transformer(spec: TinyQwenImageSpec = TinyQwenImageSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=spec.in_channels, out_channels=spec.out_channels, num_layers=spec.layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads, joint_attention_dim=spec.text_dim,
        guidance_embeds=False, axes_dims_rope=spec.axes, zero_cond_t=spec.zero_cond_t,
    )
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def tiny_qwen_image_pipeline(kind: str = "t2i", *, spec: TinyQwenImageSpec | None = None, seed: int = 0,
                             dtype=torch.float32):
    """Build a tiny random-weight Qwen-Image pipeline without text encoder, tokenizer or processor.

    kind: "t2i" (QwenImagePipeline), "edit" (QwenImageEditPipeline), "edit_plus" (QwenImageEditPlusPipeline).
    The VAE is ``AutoencoderKLQwenImage`` with 4 latent channels and a 4x spatial factor, so an image of
    H x W pixels is (H / 8) x (W / 8) transformer tokens. Call it with ``prompt_embeds`` (and
    ``negative_prompt_embeds`` for CFG with ``true_cfg_scale > 1``), see :func:`qwen_prompt_embeds`.
    """
    pipelines = {"t2i": "QwenImagePipeline", "edit": "QwenImageEditPipeline", "edit_plus": "QwenImageEditPlusPipeline"}
    if kind not in pipelines:
        raise ValueError(f"kind must be one of {list(pipelines)}, got {kind!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    spec = spec or TinyQwenImageSpec()
    torch.manual_seed(seed + 1)
    z_dim = spec.in_channels // 4
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * z_dim,
                                 latents_std=[1.0] * z_dim).eval()
    transformer = tiny_qwen_image_transformer(spec, seed=seed + 2, dtype=dtype)
    kwargs = dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                  transformer=transformer)
    if kind != "t2i":
        kwargs["processor"] = None
    pipe = getattr(diffusers, pipelines[kind])(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def qwen_prompt_embeds(length: int, *, batch: int = 1, dim: int = 16, seed: int = 0, valid=None):
    """(prompt_embeds, prompt_embeds_mask) as Qwen-Image's text encoder would give them.

    ``valid``: real tokens per batch element (the rest is padding, mask 0); None = all real (the
    pipelines then drop the mask, as for an unpadded prompt).
    """
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, length, dim, generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if valid is not None:
        for b, n in enumerate(valid):
            mask[b, n:] = 0
    return embeds, mask


# --------------------------------------------------------------------------------------------- built-in models
# The built-in tiny models that `lite-boost generate --family NAME` runs offline. The family records say which
# (ModelFamily.tiny: lite_boost.models.wan, lite_boost.models.qwenimage refer to these functions by name).


def demo_wan_pipeline(kind: str, dtype=torch.float32):
    """The main job's tiny Wan pipeline (:data:`DEMO_SPEC`, a :data:`DEMO_VAE_BASE_DIM`-channel VAE)."""
    return tiny_wan_pipeline(kind, spec=DEMO_SPEC, dtype=dtype, vae_base_dim=DEMO_VAE_BASE_DIM)


def describe_wan_demo(pipe, kw) -> str:
    """What the built-in Wan model is: random weights, its transformer and tokens, the small VAE."""
    cfg = pipe.transformer.config
    p_t, p_h, p_w = cfg.patch_size
    grid = ((kw["num_frames"] - 1) // 4 + 1) // p_t, kw["height"] // 8 // p_h, kw["width"] // 8 // p_w
    return (f"  model: random weights; transformer {cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
            f"{cfg.attention_head_dim}, patch {p_t}x{p_h}x{p_w}, {grid[0]} x {grid[1]} x {grid[2]} = "
            f"{grid[0] * grid[1] * grid[2]:,} tokens; VAE only {pipe.vae.config.base_dim} channels wide (the "
            "VAE is not what this job demonstrates, so it is kept small enough not to outweigh the denoising loop)")


# The Qwen-Image job (`lite-boost generate --family qwen-image`): the tiny transformer of the tests at
# 256 x 256 pixels = 32 x 32 = 1,024 image tokens, with cond / uncond prompts of different lengths (as
# Qwen-Image's are), true CFG on. Dense attention by default (--sparsity for the block-sparse path).
DEMO_QWEN_SPEC = TinyQwenImageSpec()
DEMO_QWEN_SHAPE = (256, 256)  # height, width
DEMO_QWEN_STEPS = 10
DEMO_QWEN_TEXT_LEN = (12, 7)  # prompt / negative prompt tokens


def qwen_demo_prompt_kwargs(dim: int = DEMO_QWEN_SPEC.text_dim, *, cfg: bool = True, seed: int = 0) -> dict:
    """``prompt_embeds`` (+ ``negative_prompt_embeds`` with ``cfg``) and their masks for a Qwen-Image pipeline
    without a text encoder (random, of width ``dim`` = the transformer's ``joint_attention_dim``)."""
    embeds, mask = qwen_prompt_embeds(DEMO_QWEN_TEXT_LEN[0], dim=dim, seed=seed)
    kw = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    if cfg:
        neg, neg_mask = qwen_prompt_embeds(DEMO_QWEN_TEXT_LEN[1], dim=dim, seed=seed + 1)
        kw.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
    return kw


def demo_qwen_image_pipeline(kind: str, dtype=torch.float32):
    """The tiny Qwen-Image pipeline of ``lite-boost generate --family qwen-image`` (:data:`DEMO_QWEN_SPEC`)."""
    return tiny_qwen_image_pipeline(kind, spec=DEMO_QWEN_SPEC, dtype=dtype)


def qwen_demo_prompt(pipe, *, cfg: bool, seed: int) -> dict:
    """Random prompt embeddings for a Qwen-Image pipeline without a text encoder (:func:`qwen_demo_prompt_kwargs`
    at the width of its transformer's ``joint_attention_dim``)."""
    return qwen_demo_prompt_kwargs(pipe.transformer.config.joint_attention_dim, cfg=cfg, seed=seed)


def describe_qwen_image_demo(pipe, kw) -> str:
    """What the built-in Qwen-Image model is: random weights, its transformer, image and text tokens."""
    cfg = pipe.transformer.config
    down = pipe.vae_scale_factor * cfg.patch_size
    h, w = kw["height"] // down, kw["width"] // down
    text = (f"{DEMO_QWEN_TEXT_LEN[0]} / {DEMO_QWEN_TEXT_LEN[1]} text tokens (cond / uncond, random prompt "
            "embeddings: no text encoder)" if "negative_prompt_embeds" in kw else
            f"{DEMO_QWEN_TEXT_LEN[0]} text tokens (random prompt embeddings: no text encoder)")
    return (f"  model: random weights; transformer {cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
            f"{cfg.attention_head_dim}, {h} x {w} = {h * w:,} image tokens + {text}; VAE "
            f"{pipe.vae.config.base_dim} channels wide")


# ------------------------------------------------------------------------------------------------ Flux.2
DEMO_FLUX2_SHAPE = (64, 64)  # height, width px -> 32 x 32 = 1,024 image tokens (1-level VAE, 2 x 2 packing)
DEMO_FLUX2_TEXT_LEN = 12


def demo_flux2_pipeline(kind: str, dtype=torch.float32):
    """The tiny Flux.2 [klein] pipeline of ``lite-boost generate --family flux2``: random weights, 2 dual- and 2
    single-stream blocks of 2 heads x 64, a one-level ``AutoencoderKLFlux2`` with 1 latent channel, no text
    encoder (random prompt embeddings, :func:`flux2_demo_prompt`)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                    attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=(16, 16, 16, 16), guidance_embeds=False).to(dtype).eval()
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=None,
                              tokenizer=None, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux2_demo_prompt(pipe, *, cfg: bool, seed: int) -> dict:
    """Random ``prompt_embeds`` (+ ``negative_prompt_embeds`` with ``cfg``) for a Flux.2 pipeline without a text
    encoder, at the width of its transformer's ``joint_attention_dim``."""
    g = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.joint_attention_dim
    kw = {"prompt_embeds": torch.randn(1, DEMO_FLUX2_TEXT_LEN, dim, generator=g)}
    if cfg and "negative_prompt_embeds" in inspect.signature(pipe.__call__).parameters:
        kw["negative_prompt_embeds"] = torch.randn(1, DEMO_FLUX2_TEXT_LEN, dim, generator=g)
    return kw


def describe_flux2_demo(pipe, kw) -> str:
    """What the built-in Flux.2 model is: random weights, its transformer, image and text tokens."""
    cfg = pipe.transformer.config
    h, w = kw["height"] // (2 * pipe.vae_scale_factor), kw["width"] // (2 * pipe.vae_scale_factor)
    return (f"  model: random weights; transformer {cfg.num_layers} + {cfg.num_single_layers} blocks x "
            f"{cfg.num_attention_heads} heads x {cfg.attention_head_dim}, {h} x {w} = {h * w:,} image tokens + "
            f"{DEMO_FLUX2_TEXT_LEN} text tokens (random prompt embeddings: no text encoder)")


# ------------------------------------------------------------------------------------------------ LTX-2
@dataclass(frozen=True)
class TinyLTX2Spec:
    """A tiny LTX-2 audio-video transformer: 4 video heads x 6 (inner 24), 2 audio heads x 8 (inner 16).

    ``rope_type`` "split" (the released LTX-2 configs) or "interleaved" (diffusers' default).
    """

    heads: int = 4
    head_dim: int = 6
    audio_heads: int = 2
    audio_head_dim: int = 8
    layers: int = 2
    rope_type: str = "split"
    text_dim: int = 16  # the connectors' width (caption_channels)
    text_layers: int = 2  # text encoder layers stacked in prompt_embeds (text_proj_in_factor)
    gated: bool = False
    perturbed: bool = False


DEMO_LTX2_TEXT_LEN = 8


def tiny_ltx2_transformer(spec: TinyLTX2Spec = TinyLTX2Spec(), seed: int = 0, dtype=torch.float32):
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    audio_inner = spec.audio_heads * spec.audio_head_dim
    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=spec.heads, attention_head_dim=spec.head_dim,
        cross_attention_dim=spec.heads * spec.head_dim, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=spec.audio_heads, audio_attention_head_dim=spec.audio_head_dim,
        audio_cross_attention_dim=audio_inner, num_layers=spec.layers, caption_channels=spec.text_dim,
        rope_type=spec.rope_type, gated_attn=spec.gated, audio_gated_attn=spec.gated, perturbed_attn=spec.perturbed)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_ltx2_pipeline(kind: str = "t2v", *, spec: TinyLTX2Spec | None = None, seed: int = 0, dtype=torch.float32):
    """A tiny LTX-2 pipeline ("t2v": LTX2Pipeline, "i2v": LTX2ImageToVideoPipeline) without text encoder: a
    video VAE with LTX-2's compression (32 x 32 x 8, 4 latent channels), an audio VAE (2 latent channels x 2 mel
    bins = 4 audio channels, 25 latents per second), small text connectors and vocoder; random weights.
    Called with ``prompt_embeds`` (B, T, text_dim x text_layers) and masks (:func:`ltx2_demo_prompt`)."""
    import diffusers
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    pipelines = {"t2v": "LTX2Pipeline", "i2v": "LTX2ImageToVideoPipeline"}
    if kind not in pipelines:
        raise ValueError(f"kind must be one of {list(pipelines)}, got {kind!r}")
    spec = spec or TinyLTX2Spec()
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 3,
        layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 4, decoder_inject_noise=(False,) * 4,
        upsample_residual=(False,) * 3, upsample_factor=(1,) * 3, decoder_causal=False, spatial_compression_ratio=32,
        temporal_compression_ratio=8).eval()
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, ch_mult=(1,), num_res_blocks=1, resolution=32, latent_channels=2,
                                       mel_bins=8).eval()
    connectors = LTX2TextConnectors(
        caption_channels=spec.text_dim, text_proj_in_factor=spec.text_layers, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=spec.text_dim // 2, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=spec.text_dim // 2, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type=spec.rope_type).eval()
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=8, upsample_kernel_sizes=[4], upsample_factors=[2],
                          resnet_kernel_sizes=[3], resnet_dilations=[[1]], output_sampling_rate=16000).eval()
    if dtype != torch.float32:
        vae, audio_vae, connectors, vocoder = (m.to(dtype) for m in (vae, audio_vae, connectors, vocoder))
    pipe = getattr(diffusers, pipelines[kind])(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
        connectors=connectors, transformer=tiny_ltx2_transformer(spec, seed + 1, dtype), vocoder=vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ltx2_prompt_embeds(length: int, *, batch: int = 1, dim: int = 32, seed: int = 0, valid=None):
    """(prompt_embeds, prompt_attention_mask) shaped as the Gemma encoder's stacked layers, left-padded
    (``valid`` real tokens per sample, at the end)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(valid or ()):
        mask[b, :length - n] = 0
    return torch.randn(batch, length, dim, generator=g), mask


def demo_ltx2_pipeline(kind: str, dtype=torch.float32):
    """The tiny LTX-2 pipeline of ``lite-boost generate --family ltx2`` (:func:`tiny_ltx2_pipeline`)."""
    return tiny_ltx2_pipeline(kind, dtype=dtype)


def ltx2_demo_prompt(pipe, *, cfg: bool, seed: int) -> dict:
    """Random Gemma-shaped prompt embeddings (+ the negative prompt's with ``cfg``) for an LTX-2 pipeline without
    a text encoder, padded on the left as the pipeline's tokenizer pads."""
    c = pipe.connectors.config
    dim = c.caption_channels * c.text_proj_in_factor
    pe, pm = ltx2_prompt_embeds(DEMO_LTX2_TEXT_LEN, dim=dim, seed=seed, valid=[DEMO_LTX2_TEXT_LEN - 2])
    kw = {"prompt_embeds": pe, "prompt_attention_mask": pm}
    if cfg:
        ne, nm = ltx2_prompt_embeds(DEMO_LTX2_TEXT_LEN, dim=dim, seed=seed + 1, valid=[3])
        kw.update(negative_prompt_embeds=ne, negative_prompt_attention_mask=nm)
    return kw


def describe_ltx2_demo(pipe, kw) -> str:
    """What the built-in LTX-2 model is: random weights, its transformer, video and audio tokens."""
    cfg = pipe.transformer.config
    f = (kw["num_frames"] - 1) // pipe.vae_temporal_compression_ratio + 1
    h, w = kw["height"] // pipe.vae_spatial_compression_ratio, kw["width"] // pipe.vae_spatial_compression_ratio
    seconds = kw["num_frames"] / kw.get("frame_rate", 24.0)
    audio = round(seconds * pipe.audio_sampling_rate / pipe.audio_hop_length / pipe.audio_vae_temporal_compression_ratio)
    return (f"  model: random weights; transformer {cfg.num_layers} blocks, video {cfg.num_attention_heads} heads x "
            f"{cfg.attention_head_dim}, audio {cfg.audio_num_attention_heads} x {cfg.audio_attention_head_dim}; "
            f"{f} x {h} x {w} = {f * h * w:,} video tokens + {audio} audio tokens + {DEMO_LTX2_TEXT_LEN} text tokens "
            "(random prompt embeddings: no text encoder)")


# ---------------------------------------------------------------------------------------------- Qwen-Image 2.1
@dataclass(frozen=True)
class TinyQwenImage21Spec:
    """Size of a tiny Qwen-Image 2.1 transformer (defaults: 3 heads of 16 channels, 2 blocks, 4 latent channels)."""

    heads: int = 3
    head_dim: int = 16
    layers: int = 2
    text_dim: int = 32
    channels: int = 4
    axes: tuple[int, int, int] = (4, 6, 6)
    causal_condition: bool = True


def tiny_qwen_image21_transformer(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), *, seed: int = 0,
                                  dtype=torch.float32):
    """A random-weight ``QwenImage21Transformer2DModel`` of ``spec``'s size (the same weights for a seed)."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        in_channels=spec.channels, out_channels=spec.channels, num_layers=spec.layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads, context_in_dim=spec.text_dim,
        axes_dims_rope=spec.axes, causal_condition=spec.causal_condition)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


class _TinyQwen21Tokenizer:
    """What ``QwenImage21Pipeline.__init__`` reads of the tokenizer: the id of the image placeholder."""

    def encode(self, text):
        return [0]


class _TinyQwen21Processor:
    """What ``QwenImage21Pipeline.__init__`` reads of its processor (the system-prompt length to drop); a
    pipeline built with it is called with ``prompt_embeds``."""

    tokenizer = _TinyQwen21Tokenizer()

    def apply_chat_template(self, messages, tokenize=True, return_dict=False):
        return [[0] * 4]


def qwen21_stand_in_processor() -> _TinyQwen21Processor:
    """What ``QwenImage21Pipeline.__init__`` reads of its processor (the system-prompt length), for a pipeline
    folder saved without processor and text encoder (called with prompt embeddings); it encodes nothing."""
    return _TinyQwen21Processor()


def tiny_qwen_image21_pipeline(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), *, seed: int = 0,
                               dtype=torch.float32):
    """A ``QwenImage21Pipeline`` of random weights: ``spec``'s transformer, a 16x ``AutoencoderKLQwenImage21``
    of 4 channels, no text encoder (called with ``prompt_embeds``, :func:`qwen21_demo_prompt`)."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    torch.manual_seed(seed + 1)
    z = spec.channels
    vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False] * 4, latents_mean=[0.0] * z,
                                   latents_std=[1.0] * z).eval()
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                               processor=_TinyQwen21Processor(),
                               transformer=tiny_qwen_image21_transformer(spec, seed=seed + 2, dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


DEMO_QWEN21_SPEC = TinyQwenImage21Spec(heads=2, head_dim=64, layers=2, axes=(16, 24, 24))
DEMO_QWEN21_TEXT_LEN = (12, 7)  # cond / uncond prompt tokens


def demo_qwen_image21_pipeline(kind: str, dtype=torch.float32):
    """The tiny pipeline of ``lite-boost generate --family qwen-image-2.1`` (2 blocks of 2 heads x 64)."""
    return tiny_qwen_image21_pipeline(DEMO_QWEN21_SPEC, dtype=dtype)


def qwen21_demo_prompt(pipe, *, cfg: bool, seed: int) -> dict:
    """Random ``prompt_embeds`` (+ ``negative_prompt_embeds`` with ``cfg``) at the transformer's text width."""
    g = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.context_in_dim
    kw = {"prompt_embeds": torch.randn(1, DEMO_QWEN21_TEXT_LEN[0], dim, generator=g)}
    if cfg:
        kw["negative_prompt_embeds"] = torch.randn(1, DEMO_QWEN21_TEXT_LEN[1], dim, generator=g)
    return kw


def describe_qwen_image21_demo(pipe, kw) -> str:
    """What the built-in Qwen-Image 2.1 model is: random weights, its transformer, target and text tokens."""
    cfg = pipe.transformer.config
    h, w = kw["height"] // pipe.vae_scale_factor, kw["width"] // pipe.vae_scale_factor
    text = (f"{DEMO_QWEN21_TEXT_LEN[0]} / {DEMO_QWEN21_TEXT_LEN[1]} text tokens (cond / uncond" if
            "negative_prompt_embeds" in kw else f"{DEMO_QWEN21_TEXT_LEN[0]} text tokens (")
    return (f"  model: random weights; transformer {cfg.num_layers} layers x {cfg.num_attention_heads} heads x "
            f"{cfg.attention_head_dim}, {h} x {w} = {h * w:,} image tokens after {text}, random prompt embeddings: "
            "no text encoder), block-causal")


# ------------------------------------------------------------------------------------------ MiniMax-H3
DEMO_MINIMAX_H3_TEXT_LEN = 6


def demo_minimax_h3_pipeline(kind: str = "t2v", *, seed: int = 0, dtype=torch.float32):
    """A ``MiniMaxH3ModularPipeline`` of random weights: diffusers' ``t2va`` workflow (layout, noise, per-row
    timesteps, denoising loop, video and audio decode) without its text-encoder step (no Qwen3-VL conditioner:
    called with ``prompt_embeds`` / ``text_token_tags``, :func:`minimax_h3_demo_prompt`); a 2-block transformer
    of 3 heads, a 4x spatial / 4x temporal video VAE of 4 latent channels and an audio VAE of 8."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel,
                           MiniMaxH3Blocks)
    from diffusers.schedulers import MiniMaxH3Scheduler

    blocks = MiniMaxH3Blocks().get_workflow("t2va")
    blocks.sub_blocks.pop("text_encoder")
    pipe = blocks.init_pipeline()
    torch.manual_seed(seed)
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=3, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2).eval()
    if dtype != torch.float32:
        transformer = transformer.to(dtype)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=(8, 16), layers_per_block=1, spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2), norm_num_groups=8, decoder_num_layers=1, decoder_num_attention_heads=2,
        decoder_attention_head_dim=8, decoder_num_register_tokens=2, decoder_ffn_mult=2, latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4).eval()
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 2), latent_dim=32, latent_channels=8, num_attention_heads=2, decoder_dim=16,
        decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3, 7),
        resblock_dilation_sizes=((1, 3), (1, 3)), latents_mean=[0.0] * 8, latents_std=[1.0] * 8).eval()
    pipe.update_components(transformer=transformer, vae=vae, audio_vae=audio_vae,
                           scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def minimax_h3_demo_prompt(pipe, *, cfg: bool, seed: int) -> dict:
    """Random ``prompt_embeds`` at the transformer's text width and their per-row text tags (the checkpoint is
    guidance-distilled: no negative prompt, ``cfg`` is ignored)."""
    g = torch.Generator().manual_seed(seed)
    dim = pipe.transformer.config.text_dim
    return {"prompt_embeds": torch.randn(1, DEMO_MINIMAX_H3_TEXT_LEN, dim, generator=g),
            "text_token_tags": torch.full((DEMO_MINIMAX_H3_TEXT_LEN,), pipe.text_tag, dtype=torch.long)}
