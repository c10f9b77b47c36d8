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
