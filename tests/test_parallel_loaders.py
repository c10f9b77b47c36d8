"""diffusers' loaders under ParallelManager (2 gloo ranks, fp32): LoRAs loaded before or after it equal the stock
one-process run with the same LoRAs (Wan and Flux.1; Ulysses, Ring, CFG parallel, FSDP2), fuse / unfuse / unload
included; a LoRA loaded onto FSDP2-sharded weights is refused on every rank before any collective.
"""

import pytest

import _dist_loaders_cases as cases
from _dist_utils import run_ranks

pytest.importorskip("peft")
TOL = 1e-5
_RESULTS = {}


def _results():
    if "lora" not in _RESULTS:
        _RESULTS["lora"] = run_ranks(cases.run_cases, 2, list(cases.LORA_CASES), timeout=900)
    return _RESULTS["lora"]


@pytest.mark.parametrize("name", list(cases.LORA_CASES))
def test_lora_under_parallel_manager_equals_one_process(name):
    parallel = cases.LORA_CASES[name][2]
    for rank, res in enumerate(_results()):
        r = res[name]
        assert r["lora_effect"] > 1e-3 and r["ref_abs"] > 0.1, (name, rank, r)  # the LoRAs change the output
        assert r["diff"] <= TOL, (name, rank, r)
        assert r["lora_layers"] > 0, r
        cfg, ring = parallel.get("cfg_degree", 1), parallel.get("ulysses_degree") == 1
        assert r["degrees"] == (cfg, 2 // cfg, 2 if ring else 1), r
        if cfg > 1:
            assert r["cfg_calls"]["deferred"] > 0, r  # the two CFG passes ran on the two ranks
        else:
            assert r["calls"].get("gather", 0) > 0, r  # the sequence was split and gathered
        if parallel.get("fsdp_degree", 1) > 1:
            assert r["refused"] is not None and "ParallelManager split its weights" in r["refused"], r
            assert "before ParallelManager" in r["refused"], r
            assert r["diff_after_refusal"] <= TOL, (name, rank, r)
        else:
            assert r["diff_fused"] <= TOL and r["diff_unloaded"] <= TOL, (name, rank, r)
