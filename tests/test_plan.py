"""The one planning step: each check runs once per call, the plan is frozen, the appliers do not check again,
a feature is one step, and boost / ParallelManager / BoostManager / the command line refuse alike."""

import dataclasses

import pytest
import torch

import lite_boost
from lite_boost import plan as planner
from lite_boost.adapter import boost as adapter_boost
from lite_boost.config import BoostConfig, ConfigError, ParallelConfig
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
from lite_boost.registry import families

from conftest import pipeline_kwargs

pytestmark = pytest.mark.usefixtures("single_process_env")


def _counting(monkeypatch, owner, name):
    """Wrap ``owner.name`` (a module function, a method or a classmethod) so its calls are counted."""
    calls = []
    raw = owner.__dict__[name]
    func = raw.__func__ if isinstance(raw, classmethod) else raw

    def wrapped(*a, **k):
        calls.append(1)
        return func(*a, **k)

    monkeypatch.setattr(owner, name, classmethod(wrapped) if isinstance(raw, classmethod) else wrapped)
    return calls


@pytest.mark.parametrize("entry", ["ParallelManager", "BoostManager", "boost"])
def test_each_check_runs_once_per_call(monkeypatch, entry):
    from lite_boost.adapter.family import ModelFamily
    from lite_boost.config import CacheConfig

    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    counts = {
        "coerce": _counting(monkeypatch, BoostConfig, "coerce"),
        "family check": _counting(monkeypatch, ModelFamily, "check_config"),
        "model check": _counting(monkeypatch, adapter_boost, "check_model"),
        "mesh": _counting(monkeypatch, ParallelConfig, "resolve_mesh"),
        "lookup": _counting(monkeypatch, planner, "lookup"),
        "lookup again": _counting(monkeypatch, lite_boost.registry, "lookup"),  # family_of(...) elsewhere
    }
    config = {"cache": {"method": "first_block_cache"}}
    if entry == "ParallelManager":
        lite_boost.ParallelManager(pipe, config)
    elif entry == "BoostManager":
        lite_boost.BoostManager(pipe, config)
    else:
        lite_boost.boost(pipe, config)
    want_mesh = 0 if entry == "boost" else 1
    assert {k: len(v) for k, v in counts.items()} == {"coerce": 1, "family check": 1, "model check": 1,
                                                      "mesh": want_mesh, "lookup": 1,
                                                      "lookup again": 0}
    state = pipe.transformer._lite_boost
    assert state.config.cache == CacheConfig("first_block_cache")
    assert state.extras.get("cache") is not None  # the applier installed what the plan resolved


def test_plan_is_frozen_and_holds_every_part():
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    plan = planner.make_plan(pipe, {"sparse": {"sparsity": 0.5}, "quant": {"method": "int8_weight_only"}},
                             parallel=True)
    assert plan.family.name == "wan" and plan.models == (pipe.transformer,) and plan.target_class == "WanPipeline"
    assert plan.degrees == (1, 1, 1) and plan.world_size == 1
    assert list(plan.parts) == [s.name for s in planner.STEPS]
    assert plan.parts["sparse"].sparsity == 0.5
    quant = plan.part("quant", pipe.transformer)
    assert quant.method == "int8_weight_only" and quant.layers and all(n.startswith("blocks.") for n in quant.layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config = BoostConfig()
    with pytest.raises(TypeError):
        plan.parts["quant"] = None
    assert not lite_boost.api.is_boosted(pipe)  # planning changes nothing


def test_the_applier_executes_the_plan_without_checking_again(monkeypatch):
    """The quantization the plan decided is the one applied (plan_quant is not run again by the applier)."""
    from lite_boost import quant

    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    plan = planner.make_plan(pipe, {"quant": {"method": "int8_weight_only", "include": [r"blocks\.0\.ffn\..*"]}})
    calls = _counting(monkeypatch, quant, "plan_quant")
    lite_boost.api.apply_plan(pipe, plan)
    assert calls == []
    assert set(pipe.transformer._lite_boost.extras["quant"].layers) == set(plan.part("quant", pipe.transformer).layers)
    lite_boost.unboost(pipe)


def test_a_feature_is_one_step(monkeypatch):
    """A step added to STEPS runs in order, its refusal comes before anything is modified, its part is on the plan."""
    seen = []

    def resolve_extra(draft):
        seen.append((draft.family.name, draft.parts["cache"]))
        if draft.config.attention_backend == "sdpa":
            raise ConfigError("attention_backend='sdpa' is refused by the extra step; allowed: [None]")
        return ("extra", len(draft.models))

    monkeypatch.setattr(planner, "STEPS", planner.STEPS + (planner.Step("extra", resolve_extra),))
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    with pytest.raises(ConfigError, match="refused by the extra step"):
        lite_boost.boost(pipe, {"attention_backend": "sdpa"})
    assert not lite_boost.api.is_boosted(pipe)
    plan = planner.make_plan(pipe, None)
    assert plan.parts["extra"] == ("extra", 1) and seen == [("wan", None), ("wan", None)]


def _bare_family():
    qwen = next(f for f in families() if f.name == "qwen-image")
    return dataclasses.replace(qwen, name="bare", unsupported={"sparse": "no latent token grid declared"})


def test_paper_and_instance_plans_refuse_alike():
    """The command line's plan (the family's record, no model) and boost's (the instance) give the same refusal."""
    bare = _bare_family()
    config = BoostConfig(sparse={"sparsity": 0.5})
    with pytest.raises(ConfigError) as paper:
        planner.make_plan(None, config, family=bare, class_name="QwenImagePipeline")
    with pytest.raises(ConfigError) as flags:
        planner.make_plan(None, config, family=bare, option_names={"sparse": "--sparsity 0.5"})
    wan = next(f for f in families() if f.name == "wan")
    assert str(paper.value).startswith("sparse (BoostConfig.sparse) is not supported for the bare family (no latent "
                                       "token grid declared); families with sparse: ['wan'")
    assert str(flags.value).startswith("--sparsity 0.5 is not supported for the bare family")
    with pytest.raises(ConfigError) as instance:
        bare.check_config(config)
    assert str(instance.value) == str(paper.value)
    assert wan.supports("sparse")
    # degrees that cannot fit the world stop the paper plan too
    with pytest.raises(ConfigError, match=r"cfg_degree=2 does not divide world_size=3"):
        planner.make_plan(None, BoostConfig(parallel={"cfg_degree": 2}), parallel=True, family=wan, world_size=3)


@pytest.mark.parametrize("exc, code", [
    (ConfigError("x"), 2), (lite_boost.registry.UnsupportedModelError("x"), 3), (planner.PlanError("x"), 4),
    (RuntimeError("x"), 1),
])
def test_exit_codes(exc, code):
    assert planner.exit_code(exc) == code


def test_cli_refusal_exits_with_the_planner_code(monkeypatch, capsys):
    from lite_boost.cli import main

    monkeypatch.setattr("subprocess.call", lambda *a, **k: pytest.fail("torchrun was launched"))
    with pytest.raises(SystemExit) as info:
        main(["generate", "--family", "qwen-image", "--cache", "pyramid_attention_broadcast"])
    assert info.value.code == 2
    assert "--cache pyramid_attention_broadcast is not available for the qwen-image family" in str(info.value)
    assert "--cache pyramid_attention_broadcast is not available" in capsys.readouterr().err


def test_boosted_output_unchanged_through_the_plan():
    """boost(pipe) == apply_plan(pipe, make_plan(pipe)) == stock (fp32, dense)."""
    spec = TinyWanSpec(heads=3)
    stock = tiny_wan_pipeline("t2v", spec=spec)(**pipeline_kwargs("t2v")).frames
    pipe = tiny_wan_pipeline("t2v", spec=spec)
    lite_boost.api.apply_plan(pipe, planner.make_plan(pipe, None))
    torch.testing.assert_close(pipe(**pipeline_kwargs("t2v")).frames, stock, rtol=0, atol=1e-5)
