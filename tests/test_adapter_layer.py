"""The generic adapter machinery on a toy family: plan rules beyond Wan / Qwen-Image, batched CFG, validation."""

import pytest
import torch

import _dist_adapter_cases as cases
from _dist_utils import run_ranks
from lite_boost.adapter import AttentionSite, LiteBoostProcessor, ModelFamily
from lite_boost.parallel.plan import CfgPlan, GatherOutput, PlanError, ShardingPlan, SplitInput

TOL = 1e-5


@pytest.fixture(scope="module")
def toy_results():
    return run_ranks(cases.toy_cases, 2, timeout=240)


def test_star_split_rank_arg_and_indexed_split_output_equal_one_process(toy_results):
    """2 ranks, 7 tokens (4 + 3 and a pad): every block gets its shard of the per-token tensor and its
    own count of 'first' tokens (4 on rank 0, none on rank 1)."""
    for rank, res in enumerate(toy_results):
        r = res["ulysses"]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, (rank, r)
        assert r["seen"] == [(torch.Size([2, 4]), torch.Size([2, 4]), 4 if rank == 0 else 0)], r["seen"]


def test_batched_cfg_splits_the_batch_and_gathers_it(toy_results):
    for rank, res in enumerate(toy_results):
        r = res["batched_cfg"]
        assert r["maxdiff"] <= TOL and r["cfg_calls"] == {"computed": 0, "split": 1}, (rank, r)
        assert r["seen"][0][0] == torch.Size([1, 7]), r["seen"]  # each cfg rank runs one branch of the batch


def test_cfg_passes_told_apart_by_call_order_split_over_cfg_ranks(toy_results):
    """CfgPlan(by_call_order=True): unnamed cond / uncond calls; 2 calls x 2 steps, half of them deferred."""
    for rank, res in enumerate(toy_results):
        r = res["order_cfg"]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, (rank, r)
        assert r["cfg_calls"] == {"computed": 4, "deferred": 4}, (rank, r)  # two pipeline calls
        r = res["order_no_cfg"]
        assert r["maxdiff"] <= TOL and r["cfg_calls"] == {"computed": 4, "deferred": 0}, (rank, r)


def test_family_description_is_validated():
    site = AttentionSite("blocks.*.attn", LiteBoostProcessor, "self")
    with pytest.raises(ValueError, match="role must be one of"):
        AttentionSite("blocks.*.attn", LiteBoostProcessor, "sideways")
    with pytest.raises(ValueError, match="joint must be one of"):
        ModelFamily("x", transformers=("X",), attention=(site,), joint="text_last")
    with pytest.raises(ValueError, match="needs at least one attention site with role 'joint'"):
        ModelFamily("x", transformers=("X",), attention=(site,), joint="text_first")
    with pytest.raises(ValueError, match="unknown feature"):
        ModelFamily("x", transformers=("X",), attention=(site,), unsupported={"warp": "no"})
    with pytest.raises(PlanError, match="batch_args"):
        CfgPlan(kind="batched")
    with pytest.raises(PlanError, match="kind must be one of"):
        CfgPlan(kind="sometimes")
    with pytest.raises(PlanError, match="needs a pipeline flag attribute, or encodes= and call_start="):
        CfgPlan(flag=None)
    with pytest.raises(PlanError, match=r"by_call_order=True\) needs kind='separate' and call_start="):
        CfgPlan(by_call_order=True)
    with pytest.raises(PlanError, match=r"by_call_order=True\) needs kind='separate'"):
        CfgPlan(kind="batched", batch_args=("x",), by_call_order=True, call_start="check_inputs")
    with pytest.raises(PlanError, match="text must be one of"):
        ShardingPlan((SplitInput("a", "x", 1),), (GatherOutput("b", 1),), text="half")


def test_boosting_a_model_without_the_sites_says_what_is_missing():
    fam = cases.toy_family()
    with pytest.raises(TypeError, match=r"does not look like a toy transformer .*\['blocks.\*.attn'\]"):
        fam.boost_transformer(torch.nn.Linear(2, 2))
    model = fam.boost_transformer(cases.ToyTransformer())
    assert [p.layer_idx for p in model._lite_boost.self_attention_processors] == [0, 1]
    assert fam.boost_transformer.__name__ == "boost_toy_transformer" and fam.boost_transformer.family is fam
    fam.boost_transformer.unboost(model)
    assert not hasattr(model, "_lite_boost") and model.blocks[0].attn.processor is None


def test_call_context_is_recorded_for_the_call_in_progress_only():
    """ModelFamily.call_context: the RoPE shim reads the caller's arguments of the current call
    (here: the token count and the caller's tensor), nothing outside a call, hooks gone on unboost."""
    from lite_boost.adapter import RopeSource

    seen = []

    def rope_forward(rope, state):
        def forward(n):
            seen.append(state.call)
            return type(rope).forward(rope, n)
        return forward

    fam = ModelFamily("toy-ctx", transformers=("ToyTransformer",), attention=cases.toy_family().attention,
                      rope=RopeSource("pos", rope_forward),
                      call_context=lambda model, args, kwargs: (kwargs["hidden_states"].shape[1],
                                                                kwargs["hidden_states"]))
    model = fam.boost_transformer(cases.ToyTransformer())
    state = model._lite_boost
    x, t, per_token, first_n = cases.inputs(seq=5)
    model(hidden_states=x, timestep=t, per_token=per_token, first_n=first_n, rope=(torch.ones(5, 4), torch.zeros(5, 4)))
    assert len(seen) == 1 and seen[0][0] == 5 and seen[0][1] is x  # the caller's tensor, before any hook
    assert state.call is None  # cleared when the call ends ...
    with pytest.raises(Exception):
        model(hidden_states=x, timestep=t, per_token=per_token[:, :2], first_n=first_n, rope=None)
    assert state.call is None and seen[-1][0] == 5  # ... also when it raises
    model.pos(3)
    assert seen[-1] is None  # the RoPE module called outside a transformer call sees no context
    fam.boost_transformer.unboost(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    with pytest.raises(TypeError, match="call_context must be callable"):
        ModelFamily("x", transformers=("X",), attention=cases.toy_family().attention, call_context=3)


def test_a_second_block_list_is_numbered_after_the_first():
    """AttentionSite.layer_offset: two block lists (dual- then single-stream, as Flux) get distinct layer indices."""
    sites = (AttentionSite("blocks.*.attn", LiteBoostProcessor, "self"),
             AttentionSite("single.*.attn", LiteBoostProcessor, "self", layer_offset=lambda m: len(m.blocks)))
    fam = ModelFamily("toy-two-lists", transformers=("ToyTransformer",), attention=sites)
    model = cases.ToyTransformer()
    model.single = torch.nn.ModuleList(cases.ToyBlock() for _ in range(3))
    fam.boost_transformer(model)
    procs = model._lite_boost.processors
    assert [procs[f"blocks.{i}.attn"].layer_idx for i in range(2)] == [0, 1]
    assert [procs[f"single.{i}.attn"].layer_idx for i in range(3)] == [2, 3, 4]
    with pytest.raises(TypeError, match="layer_offset must be an int or a callable"):
        AttentionSite("blocks.*.attn", LiteBoostProcessor, "self", layer_offset="2")
    bad = ModelFamily("toy-bad", transformers=("ToyTransformer",),
                      attention=(AttentionSite("blocks.*.attn", LiteBoostProcessor, "self", layer_offset=lambda m: -1),))
    with pytest.raises(TypeError, match=r"layer_offset of attention site 'blocks.\*.attn' must give an int >= 0"):
        bad.boost_transformer(cases.ToyTransformer())


def test_cfg_degree_2_is_refused_for_a_pipeline_listed_without_cfg():
    """PipelinePlan.without_cfg: a guidance-distilled pipeline of a family with CFG (Flux Control / Fill)."""
    import dataclasses

    from lite_boost.config import ConfigError
    from lite_boost.parallel import ParallelManager
    from lite_boost.registry import SUPPORTED_MODELS, _FAMILIES, register_family

    class ToyDistilledPipeline(cases.ToyPipeline):
        pass

    base = cases.toy_family()
    fam = dataclasses.replace(base, name="toy-distilled", pipelines=("ToyPipeline", "ToyDistilledPipeline"),
                              pipeline=dataclasses.replace(base.pipeline, without_cfg=("ToyDistilledPipeline",)))
    register_family(fam)
    try:
        assert fam.pipeline.cfg_for(cases.ToyPipeline(None)) is fam.pipeline.cfg
        assert fam.pipeline.cfg_for(ToyDistilledPipeline(None)) is None
        pipe = ToyDistilledPipeline(cases.ToyTransformer())
        with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline that runs classifier-free guidance; "
                                              r"ToyDistilledPipeline is not one"):
            ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})
        assert not hasattr(pipe.transformer, "_lite_boost")  # refused before anything was touched
    finally:
        for n in fam.transformers + fam.pipelines:
            SUPPORTED_MODELS.pop(n, None)
        _FAMILIES.pop(fam.name, None)


def test_step_caching_is_refused_for_a_pipeline_the_cache_adapter_names():
    """CacheAdapter.refuse_pipelines: e.g. a pipeline calling the transformer without cache_context."""
    import dataclasses

    from lite_boost.cache import CacheAdapter, check_cache_support
    from lite_boost.config import CacheConfig
    from lite_boost.config import ConfigError
    from lite_boost.registry import SUPPORTED_MODELS, _FAMILIES, register_family

    class ToyNoContextPipeline(cases.ToyPipeline):
        pass

    adapter = CacheAdapter(methods=("first_block_cache",), refuse_pipelines={"ToyNoContextPipeline": "no cache_context"})
    fam = dataclasses.replace(cases.toy_family(), name="toy-cache", pipelines=("ToyPipeline", "ToyNoContextPipeline"),
                              cache=adapter)
    register_family(fam)
    try:
        cfg = CacheConfig("first_block_cache")
        with pytest.raises(ConfigError, match=r"step caching \(cache method 'first_block_cache'\) is not supported for "
                                              r"ToyNoContextPipeline \(no cache_context\); pipelines of its family "
                                              r"with step caching: \['ToyPipeline'\]"):
            check_cache_support(ToyNoContextPipeline(cases.ToyTransformer()), cfg)
        assert check_cache_support(cases.ToyPipeline(cases.ToyTransformer()), cfg) is adapter
        assert check_cache_support(cases.ToyTransformer(), cfg) is adapter  # a bare transformer is not refused
    finally:
        for n in fam.transformers + fam.pipelines:
            SUPPORTED_MODELS.pop(n, None)
        _FAMILIES.pop(fam.name, None)


def test_a_processor_with_weights_of_its_own_is_refused_before_anything_is_touched():
    """An IP-Adapter-style processor (an nn.Module holding projections) would lose its weights to the shim."""
    fam = cases.toy_family()
    model = cases.ToyTransformer()
    model.blocks[1].attn.processor = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"blocks.1.attn of ToyTransformer has a Linear processor with weights of its "
                                        r"own \(an IP-Adapter\?\).*unload it"):
        fam.boost_transformer(model)
    assert not hasattr(model, "_lite_boost") and model.blocks[0].attn.processor is None
    model.blocks[1].attn.processor = torch.nn.Identity()  # a module without weights is fine
    fam.boost_transformer(model)
    fam.boost_transformer(model, {"attention_backend": "sdpa"})  # re-boost: the original processors are checked
    assert isinstance(model._lite_boost.original_processors["blocks.1.attn"], torch.nn.Identity)


def test_call_args_rewrite_the_call_before_anything_else_sees_it():
    """ModelFamily.call_args: a pure rewrite of the transformer call's arguments (here: a keyword the
    blocks receive), before call_context records the call; gone on unboost."""
    seen = []
    fam = ModelFamily("toy-args", transformers=("ToyTransformer",), attention=cases.toy_family().attention,
                      call_args=lambda model, args, kwargs: (args, {**kwargs, "first_n": kwargs["hidden_states"].shape[1]}),
                      call_context=lambda model, args, kwargs: kwargs["first_n"])
    model = fam.boost_transformer(cases.ToyTransformer())
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.append(kw["first_n"]), with_kwargs=True)
    x, t, per_token, _ = cases.inputs(seq=5)
    ctx = []
    model.pos.register_forward_pre_hook(lambda m, a: ctx.append(model._lite_boost.call))
    with torch.no_grad():
        model(hidden_states=x, timestep=t, per_token=per_token, first_n=0, rope=(torch.ones(5, 4), torch.zeros(5, 4)))
    assert seen == [5] and ctx == [5]
    hook.remove()
    fam.boost_transformer.unboost(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_broadcast_split_input_passes_a_size_one_sequence_dim():
    """SplitInput(broadcast=True): per-token (B, S) values are split with the tokens, one value per sample
    given as (B, 1) passes whole (without the flag it would be taken for a 1-token sequence)."""
    from lite_boost.parallel.comm import Communicator
    from lite_boost.parallel.plan import SequenceParallelHooks

    class Stop(Exception):
        pass

    def run(broadcast, timestep):
        model = cases.toy_family().boost_transformer(cases.ToyTransformer())
        plan = ShardingPlan((SplitInput("", "hidden_states", dim=1),
                             SplitInput("", "timestep", dim=1, ndim=2, broadcast=broadcast)),
                            (GatherOutput("proj_out", 1),))
        hooks = SequenceParallelHooks(model, plan, Communicator(None, size=2, rank=1)).apply()  # local splits only
        seen = []

        def record(mod, args, kwargs):
            seen.append(kwargs["timestep"])
            raise Stop

        model.register_forward_pre_hook(record, with_kwargs=True)  # after the split hooks
        try:
            with pytest.raises(Stop):
                model(hidden_states=torch.randn(2, 7, 5), timestep=timestep)
        finally:
            hooks.remove()
        return seen[0]

    per_token, per_sample = torch.rand(2, 7), torch.rand(2, 1)
    assert torch.equal(run(True, per_token), torch.cat([per_token[:, 4:], torch.zeros(2, 1)], dim=1))  # rank 1's rows
    assert torch.equal(run(True, per_sample), per_sample)
    with pytest.raises(RuntimeError, match="sequence length changed within one forward: 7 -> 1"):
        run(False, per_sample)
