"""Generic adapter-layer additions that two-stack and padded-text families need (HunyuanVideo, Flux, -1.5).

* ``AttentionSite(continues=True)``: single-stream blocks number their layers after the dual-stream ones;
* ``RankArg(optional=True)``: a rank-dependent argument only some variants' blocks take;
* CFG kinds "ordered" (two unnamed calls per step) and "guider" (a diffusers guider), at 2 ranks against
  one process, and the refusal of a guider with more than two predictions before any collective;
* block-sparse joint attention with padded text (the padded text tokens left out of the sparse call).
"""

import pytest
from torch import nn

import _dist_adapter_cases as toy
from lite_boost.adapter import AttentionSite, LiteBoostProcessor, ModelFamily

TOL = 1e-5


# --------------------------------------------------------------------------------------- layer numbering
class _TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(toy.ToyBlock() for _ in range(2))
        self.singles = nn.ModuleList(toy.ToyBlock() for _ in range(3))


def test_a_continued_site_numbers_its_layers_after_the_previous_sites():
    from lite_boost.adapter.boost import match_sites

    def family(continues):
        return ModelFamily("two-stacks", transformers=("_TwoStacks",), attention=(
            AttentionSite("blocks.*.attn", LiteBoostProcessor, "self"),
            AttentionSite("singles.*.attn", LiteBoostProcessor, "self", continues=continues)))

    model = _TwoStacks()
    assert [(n, i) for n, _, _, i in match_sites(family(True), model)] == [
        ("blocks.0.attn", 0), ("blocks.1.attn", 1), ("singles.0.attn", 2), ("singles.1.attn", 3), ("singles.2.attn", 4)]
    assert [i for *_, i in match_sites(family(False), model)] == [0, 1, 0, 1, 2]  # the site's own index
    boosted = family(True).boost_transformer(model)
    assert sorted(p.layer_idx for p in boosted._lite_boost.self_attention_processors) == [0, 1, 2, 3, 4]
