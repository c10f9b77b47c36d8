"""diffusers' own FluxTransformer2DModel tests, run on boosted models.

Source: tests/models/transformers/test_models_transformer_flux.py of huggingface/diffusers (the tests
ship in the repository, not in the wheel; its mixins need diffusers' test package). The model-specific
test (deprecated 3-D ids) and the mixin checks that apply to inference on CPU (QKV fusion,
torch.compile without recompilation; save / load, determinism, tuple vs dict output and regional
compilation are the family contract, tests/test_family_contract.py) are reproduced with diffusers' tiny config and dummy inputs (2 heads x 16,
1 + 1 layers, axes (4, 4, 8), 4 x 4 image tokens, 48 text tokens with random ids: the text is
rotated). Each runs on a boosted model and, beyond diffusers' own assertions, compares with the stock
model's output. Not reproduced: the attention-backend tests (CUDA backends), LoRA (needs peft),
IP-Adapter (its processors hold weights: boosting refuses them, see test_flux.py), quantization, hub
and training tests.
"""

import os

import pytest
import torch

import lite_boost

TOL = 1e-5
INIT = {"patch_size": 1, "in_channels": 4, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8]}


def _model(seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**INIT).eval()


def _pair():
    """(stock, boosted) models with the same weights."""
    return _model(), lite_boost.boost(_model())


def dummy_inputs(batch_size=1, height=4, width=4, sequence_length=48):
    """diffusers' get_dummy_inputs (FluxTransformerTesterConfig): one generator for every tensor, random ids."""
    from diffusers.utils.torch_utils import randn_tensor

    g = torch.Generator("cpu").manual_seed(0)
    return {
        "hidden_states": randn_tensor((batch_size, height * width, 4), generator=g),
        "encoder_hidden_states": randn_tensor((batch_size, sequence_length, 32), generator=g),
        "pooled_projections": randn_tensor((batch_size, 32), generator=g),
        "img_ids": randn_tensor((height * width, 3), generator=g),
        "txt_ids": randn_tensor((sequence_length, 3), generator=g),
        "timestep": torch.tensor([1.0]).expand(batch_size),
    }


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@torch.no_grad()
def test_deprecated_inputs_img_txt_ids_3d():
    stock, model = _pair()
    inputs = dummy_inputs()
    output_1 = model(**inputs).to_tuple()[0]
    inputs_3d = {**inputs, "txt_ids": inputs["txt_ids"].unsqueeze(0), "img_ids": inputs["img_ids"].unsqueeze(0)}
    output_2 = model(**inputs_3d).to_tuple()[0]
    assert output_1.shape == output_2.shape and torch.allclose(output_1, output_2, atol=1e-5)
    assert _close(output_2, stock(**inputs_3d).to_tuple()[0])


@pytest.mark.parametrize("batch_size", [1, 2])
@torch.no_grad()
def test_fuse_unfuse_qkv_projections(batch_size):
    """AttentionTesterMixin.test_fuse_unfuse_qkv_projections on a boosted model (processors stay lite_boost's)."""
    from lite_boost.models.flux import FluxAttnProcessor

    stock, model = _pair()
    inputs = dummy_inputs(batch_size=batch_size)
    before = model(**inputs, return_dict=False)[0]
    model.fuse_qkv_projections()
    assert model.transformer_blocks[0].attn.fused_projections
    assert all(isinstance(p, FluxAttnProcessor) for p in model.attn_processors.values())
    fused = model(**inputs, return_dict=False)[0]
    assert _close(before, fused, 1e-3) and _close(before, stock(**inputs, return_dict=False)[0])
    model.unfuse_qkv_projections()
    assert not hasattr(model.transformer_blocks[0].attn, "to_qkv")
    assert _close(before, model(**inputs, return_dict=False)[0], 1e-3)


@pytest.mark.slow
@torch.no_grad()
def test_torch_compile_recompilation_and_graph_break():
    """TorchCompileTesterMixin: fullgraph compile, no recompilation on the second call, same output as stock."""
    torch._dynamo.reset()
    stock, model = _pair()
    inputs = dummy_inputs()
    model.compile(fullgraph=True, backend=os.environ.get("LITE_BOOST_TEST_COMPILE_BACKEND", "aot_eager"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = model(**inputs).sample
        second = model(**inputs).sample
    assert _close(first, second) and _close(first, stock(**inputs).sample, 1e-4)
    torch._dynamo.reset()


