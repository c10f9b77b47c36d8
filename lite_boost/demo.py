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
           "describe_wan_demo", "demo_qwen_image_pipeline", "describe_qwen_image_demo", "qwen_demo_prompt"]

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
