"""diffusers' own CogVideoXTransformer3DModel tests, run on boosted models.

Source: tests/models/transformers/test_models_transformer_cogvideox.py of huggingface/diffusers (the
tests ship in the repository, not in the wheel; its mixins need diffusers' test package). Both of its
configs are reproduced (CogVideoX 1.0: 2 heads x 8, 1 frame, no RoPE; CogVideoX 1.5: 2 layers,
``patch_size_t`` 2, rotary embeddings, called without tables as diffusers does, plus with tables) with
its dummy inputs (batch 2, 8 x 8 latents, 8 text tokens), and the ModelTesterMixin checks that apply
(determinism, output shape, tuple vs dict output, gradient checkpointing with the same gradients; save /
load: the family contract, tests/test_family_contract.py). Each runs on a boosted model and, beyond diffusers' own assertions, compares with stock.
"""

import pytest
import torch

import lite_boost

TOL = 1e-5
BASE = {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "time_embed_dim": 2,
        "text_embed_dim": 8, "sample_width": 8, "sample_height": 8, "sample_frames": 8, "patch_size": 2,
        "temporal_compression_ratio": 4, "max_text_seq_length": 8}
CONFIGS = {
    "1.0": ({**BASE, "num_layers": 1}, 1),
    "1.5": ({**BASE, "num_layers": 2, "patch_size_t": 2, "use_rotary_positional_embeddings": True}, 2),
}
# with tables passed in (diffusers' test passes none): RoPE needs head_dim a multiple of 16
CONFIGS["1.5h16"] = ({**CONFIGS["1.5"][0], "attention_head_dim": 16}, 2)


def _model(init, seed=0):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(**init).eval()


def _pair(init):
    """(stock, boosted) models with the same weights."""
    return _model(init), lite_boost.boost(_model(init))


def dummy_inputs(frames, rope=False, seed=0):
    """diffusers' dummy_input (batch 2, 4 channels, 8 x 8, 8 text tokens of width 8), seeded."""
    g = torch.Generator().manual_seed(seed)
    kw = {"hidden_states": torch.randn((2, frames, 4, 8, 8), generator=g),
          "encoder_hidden_states": torch.randn((2, 8, 8), generator=g),
          "timestep": torch.randint(0, 1000, size=(2,), generator=g)}
    if rope:
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        kw["image_rotary_emb"] = get_3d_rotary_pos_embed(16, None, (4, 4), frames // 2, grid_type="slice",
                                                         max_size=(4, 4))
    return kw


def _close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("name, rope", [("1.0", False), ("1.5", False), ("1.5h16", True)])
@torch.no_grad()
def test_determinism_output_shape_and_outputs_equivalence(name, rope):
    init, frames = CONFIGS[name]
    stock, model = _pair(init)
    first = model(**dummy_inputs(frames, rope), return_dict=False)[0]
    second = model(**dummy_inputs(frames, rope), return_dict=False)[0]
    assert _close(first, second)
    assert first.shape == (2, frames, 4, 8, 8)  # input_shape == output_shape (1, 4, 8, 8) per frame
    as_dict = model(**dummy_inputs(frames, rope)).sample
    assert _close(first, as_dict) and _close(first, stock(**dummy_inputs(frames, rope), return_dict=False)[0])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_checkpointing_is_applied_and_gradients_match_stock(name):
    from diffusers import CogVideoXTransformer3DModel

    init, frames = CONFIGS[name]
    stock, model = _pair(init)
    grads = []
    for m, checkpoint in ((stock, False), (model, False), (model, True)):
        m.train()
        if checkpoint:
            m.enable_gradient_checkpointing()
            assert {type(x).__name__ for x in m.modules() if getattr(x, "gradient_checkpointing", False)} == \
                {CogVideoXTransformer3DModel.__name__}
        m.zero_grad()
        out = m(**dummy_inputs(frames, name == "1.5h16")).sample
        (out - torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    ref = grads[0]
    for g in grads[1:]:
        assert g.keys() == ref.keys()
        assert all(_close(g[k], ref[k], 5e-5) for k in ref)
