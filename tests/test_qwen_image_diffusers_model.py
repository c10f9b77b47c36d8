"""diffusers' own QwenImageTransformer2DModel tests, run on boosted models.

Source: tests/models/transformers/test_models_transformer_qwenimage.py of huggingface/diffusers (the
tests ship in the repository, not in the wheel; its mixins need diffusers' test package). The model-
specific tests are reproduced with diffusers' tiny config and dummy inputs (4 heads x 16, 4 x 4 image
tokens, 8 text tokens, axes (8, 4, 4)). Each runs on a boosted model and, beyond diffusers' own
assertions, compares with the stock model's output. The ModelTesterMixin checks that apply to inference
(save / load, determinism, tuple vs dict output) and regional compilation are the family contract, checked
for every family in tests/test_family_contract.py.
"""

import os

import pytest
import torch

import lite_boost

TOL = 1e-5
INIT = {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 16, "guidance_embeds": False, "axes_dims_rope": (8, 4, 4)}


def _model(init=INIT, seed=0):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**init).eval()


def _pair(init=INIT):
    """(stock, boosted) models with the same weights."""
    return _model(init), lite_boost.boost(_model(init))


def dummy_inputs(batch_size=1, height=4, width=4):
    """diffusers' get_dummy_inputs (QwenImageTransformerTesterConfig)."""
    from diffusers.utils.torch_utils import randn_tensor

    num_latent_channels = embedding_dim = 16
    sequence_length = 8
    vae_scale_factor = 4
    g = torch.Generator("cpu").manual_seed(0)
    hidden_states = randn_tensor((batch_size, height * width, num_latent_channels), generator=g)
    encoder_hidden_states = randn_tensor((batch_size, sequence_length, embedding_dim),
                                         generator=torch.Generator("cpu").manual_seed(0))
    orig_height, orig_width = height * 2 * vae_scale_factor, width * 2 * vae_scale_factor
    return {
        "hidden_states": hidden_states,
        "encoder_hidden_states": encoder_hidden_states,
        "encoder_hidden_states_mask": torch.ones((batch_size, sequence_length)).to(torch.long),
        "timestep": torch.tensor([1.0]).expand(batch_size),
        "img_shapes": [(1, orig_height // vae_scale_factor // 2, orig_width // vae_scale_factor // 2)] * batch_size,
    }


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("batch_size", [1, 2])
@torch.no_grad()
def test_infers_text_seq_len_from_mask(batch_size):
    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    stock, model = _pair()
    inputs = dummy_inputs(batch_size=batch_size)
    mask = inputs["encoder_hidden_states_mask"].clone()
    mask[:, 2:] = 0
    rope_len, per_sample, normalized = compute_text_seq_len_from_mask(inputs["encoder_hidden_states"], mask)
    assert isinstance(rope_len, int) and int(per_sample.max().item()) == 2 and normalized.dtype == torch.bool
    assert normalized.sum().item() == 2 * batch_size and rope_len >= inputs["encoder_hidden_states"].shape[1]
    inputs["encoder_hidden_states_mask"] = normalized
    output = model(**inputs)
    assert output.sample.shape[1] == inputs["hidden_states"].shape[1]
    assert _close(output.sample, stock(**inputs).sample)
    mask2 = inputs["encoder_hidden_states_mask"].clone()
    mask2[:, :3] = 0
    mask2[:, 3:] = 1
    _, per_sample2, normalized2 = compute_text_seq_len_from_mask(inputs["encoder_hidden_states"], mask2)
    assert int(per_sample2.max().item()) == 8 and normalized2.sum().item() == 5 * batch_size
    assert _close(model(**{**inputs, "encoder_hidden_states_mask": normalized2}).sample,
                  stock(**{**inputs, "encoder_hidden_states_mask": normalized2}).sample)


@pytest.mark.parametrize("batch_size", [1, 2])
@torch.no_grad()
def test_non_contiguous_attention_mask(batch_size):
    stock, model = _pair()
    inputs = dummy_inputs(batch_size=batch_size)
    mask = inputs["encoder_hidden_states_mask"].clone()
    mask[:, 1] = 0
    mask[:, 3] = 0
    mask[:, 5:] = 0
    inputs["encoder_hidden_states_mask"] = mask.bool()
    output = model(**inputs)
    assert output.sample.shape[1] == inputs["hidden_states"].shape[1]
    assert _close(output.sample, stock(**inputs).sample)


@torch.no_grad()
def test_layered_model_with_mask():
    """Qwen-Image-Layered's 3-D layer RoPE: its own tables stay (not the cached form); output equal to stock."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedLayer3DRope

    init = {**INIT, "use_layer3d_rope": True, "use_additional_t_cond": True}
    stock, model = _pair(init)
    assert isinstance(model.pos_embed, QwenEmbedLayer3DRope) and not model._lite_boost.rope_patched
    layers, img_h, img_w = 4, 4, 4
    inputs = dict(hidden_states=torch.randn(1, (layers + 1) * img_h * img_w, 16),
                  encoder_hidden_states=torch.randn(1, 8, 16), encoder_hidden_states_mask=torch.ones(1, 8),
                  timestep=torch.tensor([1.0]), img_shapes=[[(1, img_h, img_w)] * (layers + 1)],
                  additional_t_cond=torch.tensor([0], dtype=torch.long))
    inputs["encoder_hidden_states_mask"][0, 5:] = 0
    output = model(**inputs)
    assert output.sample.shape[1] == inputs["hidden_states"].shape[1]
    assert _close(output.sample, stock(**inputs).sample)


@torch.no_grad()
def test_attention_backend_inputs_per_sample_masks():
    """TestQwenImageTransformerAttentionBackend's inputs: batch 2 with 2 and 6 valid text tokens."""
    stock, model = _pair()
    inputs = dummy_inputs(batch_size=2)
    mask = inputs["encoder_hidden_states_mask"]
    mask[...] = 0
    mask[0, :2] = 1
    mask[1, :6] = 1
    inputs["encoder_hidden_states_mask"] = mask.bool()
    assert _close(model(**inputs).sample, stock(**inputs).sample)


@pytest.mark.slow
@torch.no_grad()
def test_torch_compile_with_and_without_mask():
    """TestQwenImageTransformerCompile.test_torch_compile_with_and_without_mask on a boosted model."""
    torch._dynamo.reset()
    stock, model = _pair()
    inputs = dummy_inputs()
    model.compile(mode="default", fullgraph=True,
                  backend=os.environ.get("LITE_BOOST_TEST_COMPILE_BACKEND", "aot_eager"))
    no_mask = {**inputs, "encoder_hidden_states_mask": None}
    padded = {**inputs, "encoder_hidden_states_mask": inputs["encoder_hidden_states_mask"].clone()}
    padded["encoder_hidden_states_mask"][:, 4:] = 0
    outs = {}
    for name, kw in (("no_mask", no_mask), ("all_ones", inputs), ("padded", padded)):
        first = model(**kw)
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = model(**kw)
        assert first.sample.shape[1] == second.sample.shape[1] == inputs["hidden_states"].shape[1]
        assert _close(first.sample, stock(**kw).sample, 1e-4) and _close(first.sample, second.sample)
        outs[name] = first.sample
    assert not torch.allclose(outs["no_mask"], outs["padded"], atol=1e-3)
    torch._dynamo.reset()
