"""diffusers' own HunyuanVideo / HunyuanVideo-1.5 transformer tests, run on boosted models.

Sources: tests/models/transformers/test_models_transformer_hunyuan_video.py (text-to-video, image-to-video
latent-concat and token-replace configs) and test_models_transformer_hunyuan_1_5.py of huggingface/diffusers
(the tests ship in the repository, not in the wheel; their mixins need diffusers' test package). Reproduced
with diffusers' tiny configs and dummy inputs: the ModelTesterMixin checks that apply to inference (dtype
round trip, determinism, output shape, tuple vs dict output; save / load: the family contract,
tests/test_family_contract.py) and TorchCompileTesterMixin's
fullgraph compile without recompilation. Each runs on a boosted model and, beyond diffusers' own assertions,
compares with the stock model's output.
"""

import os

import pytest
import torch

import lite_boost

TOL = 1e-5
_HV = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 1,
       "num_single_layers": 1, "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1, "guidance_embeds": True,
       "text_embed_dim": 16, "pooled_projection_dim": 8, "rope_axes_dim": (2, 4, 4), "image_condition_type": None}
CONFIGS = {
    "t2v": _HV,
    "i2v_latent_concat": {**_HV, "in_channels": 2 * 4 + 1, "guidance_embeds": False,
                          "image_condition_type": "latent_concat"},
    "i2v_token_replace": {**_HV, "in_channels": 2, "image_condition_type": "token_replace"},
    "1.5": {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2,
            "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 1, "patch_size_t": 1, "text_embed_dim": 16,
            "text_embed_2_dim": 8, "image_embed_dim": 12, "rope_axes_dim": (2, 2, 4), "target_size": 16,
            "task_type": "t2v"},
}


def _cls(name):
    from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel

    return HunyuanVideo15Transformer3DModel if name == "1.5" else HunyuanVideoTransformer3DModel


def _model(name, seed=0):
    torch.manual_seed(seed)
    return _cls(name)(**CONFIGS[name]).eval()


def _pair(name):
    """(stock, boosted) models with the same weights."""
    return _model(name), lite_boost.boost(_model(name))


def dummy_inputs(name, batch_size=1):
    """diffusers' get_dummy_inputs of each tester config."""
    from diffusers.utils.torch_utils import randn_tensor

    g = torch.Generator("cpu").manual_seed(0)
    cfg = CONFIGS[name]
    if name == "1.5":
        return {"hidden_states": randn_tensor((batch_size, 4, 1, 8, 8), generator=g),
                "timestep": torch.tensor([1.0]).expand(batch_size),
                "encoder_hidden_states": randn_tensor((batch_size, 6, 16), generator=g),
                "encoder_hidden_states_2": randn_tensor((batch_size, 4, 8), generator=g),
                "encoder_attention_mask": torch.ones((batch_size, 6)),
                "encoder_attention_mask_2": torch.ones((batch_size, 4)),
                "image_embeds": torch.zeros((batch_size, 3, 12))}
    inputs = {"hidden_states": randn_tensor((batch_size, cfg["in_channels"], 1, 16, 16), generator=g),
              "timestep": torch.randint(0, 1000, size=(batch_size,), generator=g).float(),
              "encoder_hidden_states": randn_tensor((batch_size, 12, 16), generator=g),
              "pooled_projections": randn_tensor((batch_size, 8), generator=g),
              "encoder_attention_mask": torch.ones((batch_size, 12))}
    if cfg["guidance_embeds"]:
        inputs["guidance"] = torch.randint(0, 1000, size=(batch_size,), generator=g).float()
    return inputs


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("name", ["t2v", "1.5"])
def test_from_save_pretrained_dtype(name, tmp_path):
    model = lite_boost.boost(_model(name)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    new_model = _cls(name).from_pretrained(tmp_path, low_cpu_mem_usage=True, torch_dtype=torch.bfloat16)
    assert new_model.dtype == torch.bfloat16 and lite_boost.boost(new_model).dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_determinism_output_shape_and_outputs_equivalence(name):
    stock, model = _pair(name)
    first = model(**dummy_inputs(name), return_dict=False)[0]
    second = model(**dummy_inputs(name), return_dict=False)[0]
    assert _close(first, second)
    assert first[0].shape == ((4, 1, 8, 8) if name == "1.5" else (4, 1, 16, 16))  # diffusers' output_shape
    assert _close(first, model(**dummy_inputs(name)).sample)
    assert _close(first, stock(**dummy_inputs(name), return_dict=False)[0])


@pytest.mark.parametrize("name", ["t2v", "i2v_token_replace", "1.5"])
@torch.no_grad()
def test_batch_of_two_with_padded_text(name):
    stock, model = _pair(name)
    inputs = dummy_inputs(name, batch_size=2)
    inputs["encoder_attention_mask"][1, 3:] = 0
    assert _close(model(**inputs).sample, stock(**inputs).sample)


@pytest.mark.slow
@torch.no_grad()
def test_torch_compile_fullgraph_without_recompilation():
    """TestHunyuanVideoTransformerCompile (TorchCompileTesterMixin) on a boosted model: padded and unpadded text."""
    torch._dynamo.reset()
    stock, model = _pair("t2v")
    model.compile(mode="default", fullgraph=True, backend=os.environ.get("LITE_BOOST_TEST_COMPILE_BACKEND", "aot_eager"))
    padded = dummy_inputs("t2v")
    padded["encoder_attention_mask"][:, 5:] = 0
    for kw in (dummy_inputs("t2v"), padded):
        first = model(**kw)
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = model(**kw)
        assert _close(first.sample, stock(**kw).sample, 1e-4) and _close(first.sample, second.sample)
    torch._dynamo.reset()
