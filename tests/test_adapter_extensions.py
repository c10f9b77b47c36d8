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


# --------------------------------------------------------------------------------------- optional RankArg
class _Mixed(nn.Module):
    """Blocks of which only the second takes ``first_n`` (as HunyuanVideo's token-replace variant)."""

    class Plain(nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([self.Plain(), toy.ToyBlock()])
        self.proj_out = nn.Linear(2, 2)
        self._lite_boost = type("S", (), {"self_attention_processors": [LiteBoostProcessor(0)]})()


def test_an_optional_rank_arg_skips_blocks_without_the_argument(monkeypatch):
    import lite_boost.parallel.plan as plan_module
    from lite_boost.parallel.plan import GatherOutput, PlanError, RankArg, SequenceParallelHooks, ShardingPlan, SplitInput

    comm = type("Comm", (), {"size": 2, "rank": 0})()  # no collective runs here: hooks are only installed
    monkeypatch.setattr(plan_module, "UlyssesAttention", lambda fn, comm, info: fn)

    def plan(optional):
        return ShardingPlan((SplitInput("blocks.0", "hidden_states", 1),), (GatherOutput("proj_out", 1),),
                            rank_args=(RankArg("blocks.*", "first_n", lambda n, a, b: n, optional=optional),))

    model = _Mixed()
    with pytest.raises(PlanError, match=r"'blocks.\*' \(Plain\).forward has no argument 'first_n'"):
        SequenceParallelHooks(model, plan(False), comm)
    hooks = SequenceParallelHooks(model, plan(True), comm).apply()
    assert len(model.blocks[0]._forward_pre_hooks) == 1  # the split of hidden_states only
    assert len(model.blocks[1]._forward_pre_hooks) == 1  # the rank argument
    hooks.remove()
    assert not model.blocks[0]._forward_pre_hooks and not model.blocks[1]._forward_pre_hooks
