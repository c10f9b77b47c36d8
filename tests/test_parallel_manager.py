"""ParallelManager in one process: world size 1 == boost, validation before any collective, removal."""

import pytest
import torch

import lite_boost
from lite_boost.config import ConfigError
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline, tiny_wan_transformer
from lite_boost.models import SUPPORTED_MODELS, UnsupportedModelError, register_model
from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize
from lite_boost.parallel.plan import PlanError, SequenceParallelHooks, ShardingPlan, SplitInput, GatherOutput
from lite_boost.parallel.comm import Communicator

from conftest import pipeline_kwargs


pytestmark = pytest.mark.usefixtures("single_process_env")


def test_world_size_one_equals_boost():
    spec = TinyWanSpec(heads=3)
    ref = lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec))(**pipeline_kwargs("t2v")).frames
    pipe = tiny_wan_pipeline("t2v", spec=spec)
    assert ParallelManager(pipe) is pipe
    assert lite_boost.api.is_boosted(pipe)
    got = pipe(**pipeline_kwargs("t2v")).frames
    assert torch.equal(got, ref)
    # the top-level lazy export is the same function
    assert lite_boost.ParallelManager is ParallelManager


def test_initialize_usp_single_process():
    mesh = initialize_usp()
    assert (mesh.world_size, mesh.cfg_degree, mesh.sequence_degree) == (1, 1, 1)
    assert "rank 0/1" in mesh.describe()


def test_model_without_plan_fails_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # no MASTER_ADDR: reaching init would raise a different error

    class NoPlanModel(torch.nn.Module):
        pass

    @register_model("NoPlanModel")
    def boost_no_plan(target, config):
        return target

    try:
        with pytest.raises(PlanError, match=r"NoPlanModel has no sequence-parallel sharding plan; models with a plan: "
                                            r"\[.*'WanTransformer3DModel'.*\]"):
            ParallelManager(NoPlanModel())
    finally:
        del SUPPORTED_MODELS["NoPlanModel"]


def test_unsupported_class_lists_supported_ones(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UnsupportedModelError, match="supported classes: .*WanPipeline"):
        ParallelManager(torch.nn.Linear(2, 2))


def test_bad_degrees_fail_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    pipe = tiny_wan_pipeline("t2v")
    with pytest.raises(ConfigError, match=r"valid sequence_degree for this cfg_degree: \[2\]"):
        ParallelManager(pipe, {"parallel": {"cfg_degree": 2, "sequence_degree": 3}})
    with pytest.raises(ConfigError, match="cfg_degree must be one of"):
        ParallelManager(pipe, {"parallel": {"cfg_degree": 4}})
    with pytest.raises(ConfigError, match=r"vae_parallel must be one of \[None, 'exact', 'chunked', 'off'\]"):
        ParallelManager(pipe, {"parallel": {"vae_parallel": "fast"}})
    with pytest.raises(ConfigError, match="vae_overlap=0|vae_overlap must be >= 1"):
        ParallelManager(pipe, {"parallel": {"vae_parallel": "chunked", "vae_overlap": 0}})
    with pytest.raises(ConfigError, match="unknown ParallelConfig key"):
        ParallelManager(pipe, {"parallel": {"ring_size": 2}})
    with pytest.raises(ConfigError, match=r"valid \(ulysses_degree, ring_degree\) pairs .*\[\(1, 4\), \(2, 2\), \(4, 1\)\]"):
        ParallelManager(pipe, {"parallel": {"ring_degree": 3}})
    assert not lite_boost.api.is_boosted(pipe)  # nothing was touched


def test_cfg_parallel_needs_a_pipeline(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline .* Valid cfg_degree here: \[1\]"):
        ParallelManager(tiny_wan_transformer(), {"parallel": {"cfg_degree": 2}})


def test_bad_mesh_argument():
    with pytest.raises(TypeError, match="mesh must be a ParallelMesh"):
        ParallelManager(tiny_wan_pipeline("t2v"), mesh="world")


def test_plan_naming_a_missing_module_is_rejected():
    model = lite_boost.boost(tiny_wan_transformer())
    bad = ShardingPlan(split_inputs=(SplitInput("blocks.99", "hidden_states", 1),),
                       gather_outputs=(GatherOutput("proj_out", 1),))
    with pytest.raises(PlanError, match="blocks.99"):
        SequenceParallelHooks(model, bad, Communicator(None, 1, 0))
    bad = ShardingPlan(split_inputs=(SplitInput("blocks.0", "tokens", 1),), gather_outputs=(GatherOutput("proj_out", 1),))
    with pytest.raises(PlanError, match="no argument 'tokens'"):
        SequenceParallelHooks(model, bad, Communicator(None, 1, 0))
    with pytest.raises(PlanError, match="not boosted"):
        SequenceParallelHooks(tiny_wan_transformer(), bad, Communicator(None, 1, 0))


def test_hooks_on_one_rank_are_exact_and_removable():
    """The generic hooks with a size-1 communicator change nothing; remove() restores the model."""
    from lite_boost.models.wan import WAN_SHARDING_PLAN

    model = lite_boost.boost(tiny_wan_transformer(TinyWanSpec(heads=3)))
    x = torch.randn(1, 16, 2, 4, 10)
    t = torch.tensor([500])
    ctx = torch.randn(1, 512, 32)
    with torch.no_grad():
        ref = model(x, t, ctx).sample
        hooks = SequenceParallelHooks(model, WAN_SHARDING_PLAN, Communicator(None, 1, 0)).apply()
        procs = model._lite_boost.self_attention_processors
        assert all(type(p.attn_fn).__name__ == "UlyssesAttention" for p in procs)
        got = model(x, t, ctx).sample
        hooks.remove()
        assert all(type(p.attn_fn).__name__ == "DenseAttention" for p in procs)
        assert model._lite_boost.rope_range is None
        again = model(x, t, ctx).sample
    assert torch.equal(got, ref) and torch.equal(again, ref)


def test_unparallelize_keeps_the_boost():
    pipe = ParallelManager(tiny_wan_pipeline("t2v"))
    assert unparallelize(pipe) is pipe and lite_boost.api.is_boosted(pipe)
    lite_boost.unboost(pipe)
    assert not lite_boost.api.is_boosted(pipe)


@pytest.mark.parametrize("kind", ["separate", "batched"])
def test_cfg_forward_wrappers_expose_the_wrapped_signature(kind):
    """The CFG wrappers installed as ``transformer.forward`` have the stock forward's signature (diffusers' modular
    denoise steps pass only the inputs ``inspect.signature(transformer.forward)`` names: Qwen-Image 2.1's
    ``img_shapes`` was dropped under cfg_degree 2), and with CFG off they return stock's output."""
    import inspect
    import types

    from lite_boost.demo import tiny_qwen_image21_transformer
    from lite_boost.parallel.manager import _BatchedCfgForward, _CfgForward
    from lite_boost.parallel.plan import CfgPlan

    from _tiny_qwen21 import transformer_inputs

    stock = tiny_qwen_image21_transformer()
    model = lite_boost.boost(tiny_qwen_image21_transformer())
    from lite_boost.models.qwenimage21 import QWEN21_PIPELINE_PLAN

    cls, plan = ((_CfgForward, QWEN21_PIPELINE_PLAN.cfg) if kind == "separate"
                 else (_BatchedCfgForward, CfgPlan(kind="batched", flag="do_cfg", batch_args=("hidden_states",))))
    wrapper = cls(model, lambda: False, plan, types.SimpleNamespace(cfg_degree=2))  # CFG off: every call computed
    assert inspect.signature(wrapper) == inspect.signature(stock.forward)
    assert "img_shapes" in inspect.signature(wrapper).parameters
    assert wrapper.__name__ == "forward" and wrapper.__doc__ == stock.forward.__doc__
    model.forward = wrapper
    assert inspect.signature(model.forward) == inspect.signature(stock.forward)
    x = transformer_inputs(layout="one_condition")
    with torch.no_grad():
        assert (model(**x).sample - stock(**x).sample).abs().max().item() <= 1e-5
    assert wrapper.calls["computed"] == 1
