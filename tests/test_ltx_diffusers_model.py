"""diffusers' own LTXVideoTransformer3DModel tests, run on boosted models.

Source: tests/models/transformers/test_models_transformer_ltx.py of huggingface/diffusers (the tests ship
in the repository, not in the wheel; its mixins need diffusers' test package). Reproduced with diffusers'
tiny config and dummy inputs (2 heads x 8 = inner dim 16, so the RoPE has its 4-channel identity pad;
batch 2, 2 x 16 x 16 = 512 video tokens, 16 text tokens): the ModelTesterMixin checks that apply to
inference (dtype round trip; save / load, determinism and tuple vs dict output are the family contract,
tests/test_family_contract.py), the
TrainingTesterMixin ones (backward, gradient checkpointing equivalence, the set of checkpointed modules),
the Ulysses-Anything inputs (no text mask; an uneven 1 x 3 x 3 grid with 15 text tokens) and the
TorchCompileTesterMixin ones (fullgraph without recompilation; repeated blocks: the family contract). Each runs on a boosted
model and, beyond diffusers' own assertions, compares with the stock model.
"""

import os

import pytest
import torch

import lite_boost

TOL = 1e-5
INIT = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
        "cross_attention_dim": 16, "num_layers": 1, "qk_norm": "rms_norm_across_heads", "caption_channels": 16}


def _model(seed=0):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(**INIT).eval()


def _pair():
    """(stock, boosted) models with the same weights."""
    return _model(), lite_boost.boost(_model())


def dummy_inputs():
    """diffusers' get_dummy_inputs (LTXTransformerTesterConfig)."""
    from diffusers.utils.torch_utils import randn_tensor

    batch_size, num_channels, num_frames, height, width, embedding_dim, sequence_length = 2, 4, 2, 16, 16, 16, 16
    g = torch.Generator("cpu").manual_seed(0)
    return {
        "hidden_states": randn_tensor((batch_size, num_frames * height * width, num_channels), generator=g),
        "encoder_hidden_states": randn_tensor((batch_size, sequence_length, embedding_dim), generator=g),
        "timestep": torch.randint(0, 1000, size=(batch_size,), generator=g),
        "encoder_attention_mask": torch.ones((batch_size, sequence_length)).bool(),
        "num_frames": num_frames,
        "height": height,
        "width": width,
    }


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_from_save_pretrained_dtype(tmp_path, dtype):
    from diffusers import LTXVideoTransformer3DModel

    model = lite_boost.boost(_model().to(dtype))
    model.save_pretrained(tmp_path)
    new_model = LTXVideoTransformer3DModel.from_pretrained(tmp_path, low_cpu_mem_usage=True, torch_dtype=dtype)
    assert new_model.dtype == dtype and lite_boost.boost(new_model).dtype == dtype


@torch.no_grad()
def test_ulysses_anything_inputs():
    """TestLTXTransformerUlyssesAnythingBackward's inputs: no text mask, and an uneven grid / text length."""
    stock, model = _pair()
    inputs = {**dummy_inputs(), "encoder_attention_mask": None}
    uneven = {**inputs, "num_frames": 1, "height": 3, "width": 3, "hidden_states": inputs["hidden_states"][:, :9],
              "encoder_hidden_states": inputs["encoder_hidden_states"][:, :-1]}
    for kw in (inputs, uneven):
        out = model(**kw).sample
        assert out.shape[1] == kw["hidden_states"].shape[1] and _close(out, stock(**kw).sample)


def test_training_backward_matches_stock():
    """TrainingTesterMixin.test_training: the boosted forward (in-place fp32 RoPE) is differentiable and
    gives stock's gradients."""
    stock, model = _pair()
    grads = []
    for m in (stock, model):
        m.train()
        out = m(**dummy_inputs(), return_dict=False)[0]
        torch.nn.functional.mse_loss(out, torch.ones_like(out)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        assert _close(g, grads[1][name], 5e-5), name


def test_gradient_checkpointing_equivalence_and_applied_set():
    """TrainingTesterMixin.test_gradient_checkpointing_equivalence / _is_applied on a boosted model."""
    model = lite_boost.boost(_model())
    model.train()
    out = model(**dummy_inputs(), return_dict=False)[0]
    labels = torch.randn_like(out)
    (out - labels).mean().backward()
    model_2 = lite_boost.boost(_model())
    model_2.load_state_dict(model.state_dict())
    model_2.enable_gradient_checkpointing()
    model_2.train()
    assert model_2.is_gradient_checkpointing
    out_2 = model_2(**dummy_inputs(), return_dict=False)[0]
    (out_2 - labels).mean().backward()
    assert _close(out, out_2)
    for (name, p), (_, p2) in zip(model.named_parameters(), model_2.named_parameters()):
        if p.grad is not None:
            assert _close(p.grad, p2.grad, 5e-5), name
    applied = {type(m).__name__ for m in model_2.modules() if getattr(m, "gradient_checkpointing", False)}
    assert applied == {"LTXVideoTransformer3DModel"}


@pytest.mark.slow
@torch.no_grad()
def test_torch_compile_recompilation_and_graph_break(fresh_dynamo):
    stock, model = _pair()
    compiled = torch.compile(model, fullgraph=True, backend=os.environ.get("LITE_BOOST_TEST_COMPILE_BACKEND",
                                                                            "aot_eager"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = compiled(**dummy_inputs()).sample
        second = compiled(**dummy_inputs()).sample
    assert _close(first, second) and _close(first, stock(**dummy_inputs()).sample, 1e-4)


