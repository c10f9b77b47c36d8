"""Generic adapter-layer additions that the HunyuanVideo families need (variant blocks, a guider, padded text).

* ``RankArg(optional=True)``: a rank-dependent argument only some variants' blocks take;
* CFG kind "guider" (a diffusers guider), at 2 ranks against one process, and the refusal of a guider
  with more than two predictions before any collective (unnamed calls told apart by call order,
  ``CfgPlan(by_call_order=True)``, are tested in test_adapter_layer.py);
* block-sparse joint attention with padded text (the padded text tokens left out of the sparse call).
"""

import pytest
import torch
from torch import nn

import _dist_adapter_cases as toy
import _dist_cfg_kinds_cases as cases
import _dist_joint_cases as jc
from _dist_utils import run_ranks
from lite_boost.adapter import LiteBoostProcessor
from lite_boost.config import ConfigError, SparseConfig

TOL = 1e-5


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


# --------------------------------------------------------------------------------------- CFG kinds
@pytest.fixture(scope="module")
def cfg_results():
    return run_ranks(cases.cfg_kind_cases, 2, timeout=240)


@pytest.mark.parametrize("name, computed, deferred", [
    ("guider", 8, 8),  # 2 pipeline calls x 4 steps: each rank computes one of each pair
    ("guider_stop", 8, 4),  # the guider stops CFG after half the steps: those make one call, not split
])
def test_cfg_parallel_kinds_equal_one_process(cfg_results, name, computed, deferred):
    for rank, res in enumerate(cfg_results):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, (rank, r)
        assert r["cfg_calls"] == {"computed": computed, "deferred": deferred}, (rank, r)


def test_cfg_plan_kinds_are_validated():
    from lite_boost.parallel.plan import CfgPlan, PlanError

    with pytest.raises(PlanError, match=r"kind='guider'\) needs guider="):
        CfgPlan(kind="guider")
    assert CfgPlan(kind="guider", guider="guider", flag=None).guider == "guider"


def test_cfg_parallel_refuses_a_guider_with_three_predictions_before_any_collective():
    from diffusers.guiders import SkipLayerGuidance

    import lite_boost
    from lite_boost.registry import SUPPORTED_MODELS, _FAMILIES, register_family

    fams = [register_family(f) for f in cases.families()]
    try:
        pipe = cases.GuiderToyPipeline(cases.GuiderToyTransformer(), SkipLayerGuidance(skip_layer_guidance_layers=[0]))
        with pytest.raises(ConfigError, match=r"cfg_degree=2 splits the guider's two predictions "
                                              r"\['pred_cond', 'pred_uncond'\] .*SkipLayerGuidance predicting "
                                              r"\['pred_cond', 'pred_uncond', 'pred_cond_skip'\]"):
            lite_boost.ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})
        assert not lite_boost.api.is_boosted(pipe)  # refused before anything was touched
    finally:
        for family in fams:
            for n in family.transformers + family.pipelines:
                SUPPORTED_MODELS.pop(n, None)
            _FAMILIES.pop(family.name, None)


# --------------------------------------------------------------------------------------- sparse, padded text
def _sparse(sparsity):
    from lite_boost.adapter.processor import DenseAttention
    from lite_boost.adapter.sparse import ScheduledSparseAttention, SparseState
    from lite_boost.schedule import SparseSchedule

    cfg = SparseConfig(sparsity=sparsity, block_size=4, backend="gather", keep_sink=False)
    state = SparseState(cfg, SparseSchedule(cfg))
    state.grid = (1, 6, 8)
    return ScheduledSparseAttention(0, state, DenseAttention()), state


def _padded_case(batch, valid, first=False, seed=0):
    (q, k, v), joint = jc.make_case(seed, batch, 48, 6, 2, 8, False, True)
    mask = torch.zeros(batch, 6, dtype=torch.bool)
    for b, n in enumerate(valid):
        mask[b, :n] = True
    jk = joint.k.masked_fill(~mask[..., None, None], 1e4)  # padded keys would dominate if attended
    return (q, k, v), joint._replace(k=jk, key_mask=mask, first=first)


@pytest.mark.parametrize("first", [True, False])
def test_sparse_joint_attention_leaves_padded_text_out(first):
    from lite_boost.ops.joint import joint_attention

    (q, k, v), joint = _padded_case(1, [4], first)
    ref, ref_text = joint_attention(jc.sdpa_kernel, q, k, v, joint)  # dense with the key-padding mask
    fn, state = _sparse(0.0)
    out, text_out = fn(q, k, v, joint=joint)
    assert state.events[-1].reason == "sparsity keeps every block"  # through sparse_attention, not the fallback
    assert (out - ref).abs().max() <= TOL and (text_out - ref_text).abs().max() <= TOL  # padded rows too
    fn, state = _sparse(0.75)
    out, text_out = fn(q, k, v, joint=joint)
    assert state.events[-1].path == "sparse" and state.events[-1].effective_sparsity > 0.3
    assert (text_out - ref_text).abs().max() <= TOL  # text rows stay dense (real and padded)
    assert torch.isfinite(out).all() and (out - ref).abs().max() > 1e-3  # the image rows skipped blocks


def test_sparse_with_per_sample_padding_runs_dense_and_says_why():
    from lite_boost.ops.joint import joint_attention

    fn, state = _sparse(0.75)
    (q, k, v), joint = _padded_case(2, [4, 4])  # the same padding in both samples: sparse
    fn(q, k, v, joint=joint)
    assert state.events[-1].path == "sparse"
    (q, k, v), joint = _padded_case(2, [4, 3])
    out, text_out = fn(q, k, v, joint=joint)
    ref, ref_text = joint_attention(jc.sdpa_kernel, q, k, v, joint)
    assert state.events[-1].path == "dense" and "key-padding mask" in state.events[-1].reason
    assert (out - ref).abs().max() <= TOL and (text_out - ref_text).abs().max() <= TOL


@pytest.mark.parametrize("padded", [False, True])
def test_sparse_keys_only_joint_stream_matches_the_full_joint_image_rows(padded):
    """Keys-only joint tokens (no joint queries): the image rows equal those of the full joint call, dense and
    sparse, and no joint rows come back."""
    (q, k, v), joint = _padded_case(1, [4] if padded else [6])
    if not padded:
        joint = joint._replace(key_mask=None)
    only = jc.keys_only(joint)
    for sparsity in (0.0, 0.75):
        fn, state = _sparse(sparsity)
        ref, _ = fn(q, k, v, joint=joint)
        fn, state = _sparse(sparsity)
        out, joint_out = fn(q, k, v, joint=only)
        assert state.events[-1].path == ("sparse" if sparsity else state.events[-1].path)
        assert joint_out.shape[1] == 0 and torch.equal(out, ref)
