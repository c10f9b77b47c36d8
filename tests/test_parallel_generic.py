"""Sequence parallelism on the generic path: a diffusers ``_cp_plan`` executed with lite_boost's Ulysses / Ring.

Parity: tiny ChronoEdit and Flux.2 (their families unregistered in the ranks) transformers (generic path, diffusers'
own ``_cp_plan``) under ``ParallelManager`` at 2 and 3 gloo ranks, token counts that do not divide the world size (35 video tokens;
17 image + 7 text tokens, split separately and concatenated by the processor), 2 or 3 heads (fewer heads
than ranks at 3), against the stock model's one-process output; one spawn per world size runs every case.
Refusal: a generic model without a plan gets a PlanError naming what is missing and how to supply it,
before any process group exists.
"""

from __future__ import annotations

import pytest
import torch

import _dist_generic_sp_cases as cases
from _diffusers_tiny import build, model_class
from _dist_utils import run_ranks
from lite_boost.config import ConfigError
from lite_boost.parallel.plan import PlanError

TOL = 1e-5
_RESULTS: dict = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_all, world, timeout=400)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_cp_plan_parity_with_one_process(world, case):
    for rank, res in enumerate(_results(world)):
        r = res[case]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["shape"] == r["ref_shape"]
        assert r["err"] <= TOL, (rank, r)
        assert r["err_again"] <= TOL, (rank, r)
        assert r["err_unboost"] == 0.0, (rank, r)  # unboost leaves the stock model
        assert r["procs_restored"], rank


def test_model_without_cp_plan_is_refused_before_any_collective(monkeypatch):
    import lite_boost

    name = "BriaTransformer2DModel"
    assert not getattr(model_class(name), "_cp_plan", None)
    model = build(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(PlanError, match=r"(?s)BriaTransformer2DModel.*generic path.*_cp_plan.*ContextParallelInput"
                                        r".*ModelFamily\(sharding=ShardingPlan"):
        lite_boost.ParallelManager(model, {"parallel": {"ulysses_degree": 2}})
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    from lite_boost.api import is_boosted

    assert not is_boosted(model)


def test_generic_records_say_which_classes_run_sequence_parallel():
    from lite_boost.adapter.generic import class_family, generic_family

    assert class_family(model_class("ChronoEditTransformer3DModel")).supports("sequence_parallel")
    assert class_family(model_class("Flux2Transformer2DModel")).supports("sequence_parallel")
    bria = generic_family(build("BriaTransformer2DModel"))
    assert not bria.supports("sequence_parallel")
    assert "_cp_plan" in bria.features["sequence_parallel"]


def test_plan_with_a_known_gap_is_refused_before_any_collective():
    """LTX-2's own plan leaves the cross-attention RoPE unsplit: the generic path, forced, refuses it with that
    reason, nothing changed; a plan the user puts on the instance is taken instead. A plain ``ParallelManager``
    takes the named ltx2 family, which splits both video RoPE tables (tests/test_parallel_ltx2.py)."""
    from lite_boost.adapter.generic import class_family, generic_family
    from lite_boost.api import is_boosted
    from lite_boost.registry import family_of

    name = "LTX2VideoTransformer3DModel"
    assert family_of(build(name)).name == "ltx2" and family_of(build(name)).supports("sequence_parallel")
    assert not class_family(model_class(name)).supports("sequence_parallel")
    from lite_boost.plan import make_plan

    model = build(name)
    with pytest.raises(ConfigError, match=r"(?s)sequence.*LTX2VideoTransformer3DModel.*cross_attn_rope"):
        make_plan(None, {"parallel": {"ulysses_degree": 2}}, parallel=True, family=generic_family(model),
                  class_name=name, world_size=2)
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    assert not is_boosted(model)
    model._cp_plan = dict(type(model)._cp_plan)  # the user's own plan
    assert generic_family(model).supports("sequence_parallel")


def test_plan_entries_past_the_model_depth_are_dropped():
    """Helios' plan names blocks 0..39 of the released model; a 2-block config keeps the entries it has."""
    from lite_boost.adapter.generic_parallel import fitted_plan, sequence_plan

    model = build("HeliosTransformer3DModel")
    plan = model._cp_plan
    fitted = fitted_plan(model, plan)
    assert "blocks.1.attn1" in fitted and "blocks.2.attn1" not in fitted and "blocks.*.attn1" in fitted
    assert len(fitted) == 3 + 3 * len(model.blocks)
    sequence_plan(model).check(model)  # no PlanError
    broken = dict(plan, **{"blocks.0.nope": plan["blocks.0.attn1"]})  # a name that is wrong, not too deep
    assert "blocks.0.nope" in fitted_plan(model, broken)


def test_key_bias_takes_only_masks_over_the_keys():
    from lite_boost.adapter.generic_parallel import key_bias

    q, k = torch.zeros(2, 5, 3, 4), torch.zeros(2, 7, 3, 4)
    for shape in ((2, 1, 1, 7), (1, 3, 1, 7), (2, 3, 1, 7)):
        assert key_bias(torch.zeros(shape), q, k) is not None
    for mask in (torch.zeros(2, 1, 5, 7), torch.zeros(2, 1, 1, 6), torch.zeros(2, 7), torch.zeros(2, 1, 1, 7).bool(),
                 torch.zeros(2, 2, 1, 7)):
        assert key_bias(mask, q, k) is None


def test_cp_plan_naming_a_missing_module_is_refused():
    from lite_boost.adapter.generic_parallel import sequence_plan

    model = build("ChronoEditTransformer3DModel")
    plan = sequence_plan(model)
    plan.check(model)  # diffusers' own plan fits
    from diffusers.models._modeling_parallel import ContextParallelInput

    model._cp_plan = {**model._cp_plan, "blocks.7": {"hidden_states": ContextParallelInput(split_dim=1)}}
    with pytest.raises(PlanError, match="blocks.7"):
        sequence_plan(model).check(model)
    model._cp_plan = {**type(model)._cp_plan, "blocks.0": {"nope": ContextParallelInput(split_dim=1)}}
    with pytest.raises(PlanError, match="'nope'"):
        sequence_plan(model).check(model)
