"""FSDP2 weight sharding and tensor parallelism vs the single-process run; bad degrees refused before any collective.

Parity (max abs diff <= 1e-5, fp32) on spawned gloo ranks: a Wan I2V transformer under fsdp 2 x Ulysses 2
(with the next block's all-gather seen in flight when a block starts, a compiled run, and unparallelize
bringing the full weights back), Wan I2V under tp 2 and tp 2 x Ulysses 2, a Wan2.2 two-expert pipeline
under cfg 2 x fsdp 2 (both experts and the text encoder sharded, with a step cache and block-sparse attention), cfg 2 x
Ulysses 2 x fsdp 2, and
Qwen-Image (joint attention, diffusers' ``_tp_plan``) under tp 2 and cfg 2 x fsdp 2, Flux.1 under tp 2
(its packed single-block projection), and fsdp 2 x Ulysses 2 with ``offload`` (FSDP2's CPUOffloadPolicy: a Wan I2V
transformer and a Wan T2V pipeline with its text encoder). The video families whose record carries a plan
(HunyuanVideo, -1.5, LTX-Video, CogVideoX, MiniMax-H3) under tp 2 (HunyuanVideo also tp 2 x fsdp 2), unboost
giving their weights back bit-equal, and the LTX-Video I2V pipeline under tp 2. Every rank's local
parameter bytes are checked against the sharded modules' sizes.
"""

import os

import pytest
import torch.distributed as dist

import _dist_weight_sharding_cases as cases
from _dist_utils import HERE, launch_fault_workers, run_ranks, stop_workers
from lite_boost.config import BoostConfig, ConfigError, ParallelConfig, parallel_from_boost_manager
from lite_boost.parallel.groups import _mesh_ranks

TOL = 1e-5
CASES_2 = ["wan_i2v_fsdp2_ulysses2", "wan_i2v_fsdp2_ring2", "wan_i2v_tp2", "wan22_cfg2_fsdp2_fbc_sparse", "qwen_tp2", "qwen_cfg2_fsdp2",
           "flux_tp2"]
CASES_OFFLOAD = ["wan_i2v_fsdp2_offload", "wan_fsdp2_offload_pipeline"]
CASES_4 = ["wan_i2v_tp2_ulysses2", "wan_cfg2_ulysses2_fsdp2"]
VIDEO_TP = ["hunyuan_tp2", "hunyuan15_tp2", "ltx_tp2", "cogvideox_tp2", "minimax_h3_tp2", "wan_animate_tp2"]  # video families' own plans
CASES_QUANT = ["wan_fsdp2_quant", "wan_tp2_quant"]  # quantized weights
SPAWNS = {2: (2, CASES_2), 4: (4, CASES_4), "tp_fsdp": (4, ["wan_i2v_tp2_fsdp2", "wan_cfg2_tp2_fsdp2"]),
          "offload": (2, CASES_OFFLOAD), "video_tp": (2, VIDEO_TP + ["ltx_i2v_pipeline_tp2"]),
          "video_tp_fsdp": (4, ["hunyuan_tp2_fsdp2"]), "quant": (2, CASES_QUANT)}  # one spawn each
_RESULTS = {}


def _results(key):
    if key not in _RESULTS:
        world, names = SPAWNS[key]
        _RESULTS[key] = run_ranks(cases.run_cases, world, names, timeout=600)
    return _RESULTS[key]


def _each(key, name):
    return [res[name] for res in _results(key)]


def _halves(local_total_per_rank):
    """Each rank holds about half of the sharded bytes; together exactly all of them."""
    locals_ = [lt[0] for lt in local_total_per_rank]
    total = local_total_per_rank[0][1]
    assert total > 0 and sum(locals_) == total, local_total_per_rank
    for local in locals_:
        assert 0.4 * total <= local <= 0.6 * total, local_total_per_rank


@pytest.mark.parametrize("case", ["wan_i2v_fsdp2_ulysses2", "wan_i2v_fsdp2_ring2"])
def test_fsdp_wan_transformer_parity_prefetch_compile_unshard(case):
    results = _each(2, case)
    for r in results:
        assert ("ring" in r["mesh"]) == case.endswith("ring2") and ", fsdp " in r["mesh"], r["mesh"]
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL, r
        assert r["compiled_diff"] <= TOL and r["unsharded_diff"] <= TOL, r
        # block i+1's gather was already issued when block i started (2 calls x 2 block pairs)
        assert r["prefetch_seen"] == [True] * 4, r
        assert r["unsharded_plain"] and r["class_restored"] and r["unsharded_bytes"] == r["full_bytes"], r
        # everything but the model's own modulation table is sharded
        assert r["dtensor_total"] > 0.99 * r["full_bytes"], r
    _halves([(r["dtensor_local"], r["dtensor_total"]) for r in results])


def test_fsdp_shards_torchao_int8_weights_as_their_stored_data():
    results = _each("quant", "wan_fsdp2_quant")
    for r in results:
        for method, q in r.items():
            if method == "mesh":
                continue
            # the same quantized weights as one process: only the attention split's summation order differs
            assert q["ref_abs"] > 0.1 and q["diff"] <= TOL and q["unsharded_diff"] <= TOL, (method, q)
            # compile_repeated_blocks(fullgraph=True) of the sharded blocks equals the one-process quantized
            # model compiled the same way; explain finds no graph break in a block, one graph computes it
            # (int8_dynamic: a custom op on the gathered int8 data, no Int8Tensor in the graph)
            assert q["compiled_diff"] <= TOL and q["explained_diff"] <= TOL, (method, q)
            assert q["breaks_graphs"] == (0, 1), (method, q)
            # the int8 rows of ffn.net.0.proj (64 -> 2 x 32): sharded as int8, nothing dequantized
            assert q["qdata"] == ("torch.int8", (32, 48), (64, 48)), q
            assert q["weight_between_calls"] is None, q
            assert q["unsharded_type"] == q["ref_type"] == "Int8Tensor" and q["unboosted_plain"], q
    for method in ("int8_dynamic", "int8_weight_only"):
        _halves([(r[method]["int8_local"], r[method]["int8_total"]) for r in results])


def test_tensor_parallel_splits_torchao_int8_weights_as_their_stored_data():
    results = _each("quant", "wan_tp2_quant")
    for r in results:
        # int8 dynamic: each of the 30 split layers (column-wise: the whole input, row-wise: the whole row's per-token
        # scale and exact int32 sums) equals the one-process layer on the same input bit for bit. The rest of the
        # model (distributed RMS norm, attention on 2 of 4 heads) differs in the last fp32 bit, which can move an
        # activation across an int8 rounding step of a later layer, and such steps cascade: tp 2 is another int8
        # result as close to fp32 as the one-process one (measured rel. L2 5.3e-4 apart, each 1.4e-3 from fp32)
        d = r["int8_dynamic"]
        assert d["layers_exact"] == (30, 30), d
        quant_err = min(d["int8_rel_l2"])
        assert d["ref_abs"] > 0.1 and max(d["rel_l2"]) < 0.6 * quant_err, d
        assert max(d["tp_fp32_rel_l2"]) < 1.25 * max(d["int8_rel_l2"]), d
        assert d["unsharded_type"] == "Int8Tensor" and d["unsharded_equal"] and d["unsharded_diff"] <= TOL, d
        assert d["unboosted_plain"] and d["heads_after"] == 4 and d["heads"] == 2, d
        q = r["int8_weight_only"]
        # quantized once on the full weights, then split: only the partial sums' order differs from one process
        assert q["layers_exact"][1] == 30, q
        assert q["ref_abs"] > 0.1 and max(q["diffs"]) <= TOL and q["unsharded_diff"] <= TOL, q
        # column-wise to_q: 96 -> 2 x 48 output rows (int8 rows, scale rows, bias); row-wise ffn out: 64 -> 2 x 32
        # input columns, the per-row scale and bias whole; the parts are the one-process int8 data exactly
        assert q["q"] == ("torch.int8", (48, 96), (48, 1), (48,)), q
        assert q["ffn_out"] == ("torch.int8", (96, 32), (96, 1), (96,)), q
        assert q["slices_equal"] and q["weight_between_calls"] is None and q["heads"] == 2, q
        # unparallelize gathers the same Int8Tensor back; unboost restores the fp32 weights and head counts
        assert q["unsharded_type"] == "Int8Tensor" and q["unsharded_equal"], q
        assert q["unboosted_plain"] and q["heads_after"] == 4, q
    assert results[0]["int8_weight_only"]["int8_layers"] == 30  # every quantized Linear of the 3 blocks
    for method in ("int8_dynamic", "int8_weight_only"):
        _halves([(r[method]["int8_local"], r[method]["int8_total"]) for r in results])


def test_fsdp_two_experts_text_encoder_cfg2_cached_sparse():
    results = _each(2, "wan22_cfg2_fsdp2_fbc_sparse")
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL, r
    # the cache skipped blocks in the reference, and the two cfg ranks together computed exactly those blocks
    ref_calls, ref_ffn = results[0]["ref_work"]
    assert 0 < ref_ffn < ref_calls, results[0]
    assert sum(r["work"][1] for r in results) == ref_ffn, results
    for key in ("transformer", "transformer_2", "text_encoder"):
        _halves([r["dtensor"][key] for r in results])
        # the text encoder's tied input embedding stays whole; the rest is sharded
        assert results[0]["dtensor"][key][1] >= (0.5 if key == "text_encoder" else 0.99) * results[0]["full"][key]


def test_fsdp_with_offload_uses_fsdp2_cpu_offload_policy():
    """offload x fsdp 2 (x Ulysses 2): FSDP2's CPUOffloadPolicy manages the weights, lite_boost's block hooks none.
    On gloo the mesh device is the host, so the policy's host-to-device copies move nothing: what is checked is
    that every gather went through the policy's copy branch, the exact output, and the way back."""
    results = _each("offload", "wan_i2v_fsdp2_offload")
    for r in results:
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL, r
        assert not r["record"] and r["block_hooks"] == 0, r  # no block offload hooks on the sharded transformer
        # blocks, the other children with weights and the root: every param group has the policy (no pinning on
        # the CPU), every shard is in host memory and every all-gather input came through the offload branch
        assert r["policies"] == ["CPUOffloadPolicy"] and r["units"] >= r["blocks"] and not r["pinned"], r
        assert r["shard_devices"] == ["cpu"] and r["offload_to_cpu"], r
        assert r["gathers"] == {"offloaded": 2 * r["fsdp_params"], "other": 0} and r["fsdp_params"] > 0, r
        assert r["prefetch_seen"] == [True] * 4, r  # the next block's gather in flight when a block starts
        assert "FSDP2 CPUOffloadPolicy" in r["summary"], r
        # unparallelize: full plain weights, offloaded block by block again (one upload per group), same output
        assert r["unsharded_plain"] and r["class_restored"] and r["unsharded_bytes"] == r["full_bytes"], r
        assert r["reoffloaded"] and r["reoffload_uploads"] == r["blocks"] + 1 and r["unsharded_diff"] <= TOL, r
        assert r["unboosted"] and r["unboosted_diff"] <= TOL, r
        assert r["dtensor_total"] > 0.99 * r["full_bytes"], r
    _halves([(r["dtensor_local"], r["dtensor_total"]) for r in results])


def test_fsdp_with_offload_pipeline_transformer_and_text_encoder():
    results = _each("offload", "wan_fsdp2_offload_pipeline")
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL and r["unboosted_diff"] <= TOL, r
        assert r["records"] == [False, False] and all(n > 0 for n in r["units"].values()), r
        assert "text_encoder" in r["summary"] and r["unboosted"], r
    for key in ("transformer", "text_encoder"):
        _halves([r["dtensor"][key] for r in results])


def test_tensor_parallel_wan_i2v():
    for r in _each(2, "wan_i2v_tp2"):
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL and r["unsharded_diff"] <= TOL, r
        assert r["heads"] == (2, 2) and r["heads_after"] == (4, 4) and r["unboosted_plain"], r
        assert r["q_local"] == (48, 96) and r["ffn_local"] == (96, 32), r  # 4 x 24 channels: rows / columns halved
    _halves([(r["dtensor_local"], r["dtensor_total"]) for r in _each(2, "wan_i2v_tp2")])


@pytest.mark.parametrize("name", ["qwen_tp2", "qwen_cfg2_fsdp2", "flux_tp2"])
def test_joint_attention_families(name):
    results = _each(2, name)
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL, r
        assert r.get("unsharded_diff", 0.0) <= TOL, r  # Flux: after unboost (the packed proj_out gathered back)
        assert r["heads"] == (2 if "tp2" in name else 4), r
    _halves([r["dtensor"] for r in results])


@pytest.mark.parametrize("name", VIDEO_TP)
def test_tensor_parallel_video_families(name):
    results = _each("video_tp", name)
    for r in results:
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL and r["unsharded_diff"] <= TOL, r
        assert set(r["heads"]) == {2} and set(r["heads_after"]) == {4} and r["weights_back"], r
        assert r["outputs"] == (2 if name == "minimax_h3_tp2" else 1), r  # video (and audio) compared
        # the rank holds its half of the split layers, everything else whole
        assert r["local_bytes"] == r["full_bytes"] - r["dtensor_total"] + r["dtensor_local"] < r["full_bytes"], r
    _halves([(r["dtensor_local"], r["dtensor_total"]) for r in results])


def test_tensor_parallel_ltx_pipeline():
    """LTX-Video I2V pipeline (batched CFG, padded text, per-token timesteps) under tp 2 = one process."""
    results = _each("video_tp", "ltx_i2v_pipeline_tp2")
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL and r["heads"] == 2, r
    _halves([r["dtensor"] for r in results])


def test_tensor_parallel_x_fsdp_packed_layer_unparallelized_in_order():
    """HunyuanVideo under tp 2 x fsdp 2 (Ulysses 2): parity, and unboost (FSDP's removal gathers the 2-D weights
    first) puts the single blocks' packed proj_out columns back in their own order."""
    for r in _each("video_tp_fsdp", "hunyuan_tp2_fsdp2"):
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL and r["unsharded_diff"] <= TOL, r
        assert set(r["heads"]) == {2} and set(r["heads_after"]) == {4} and r["weights_back"], r
        assert r["local_bytes"] < 0.5 * r["full_bytes"], r


def test_world_4_tp2_ulysses2_and_cfg2_ulysses2_fsdp2():
    for r in _each(4, "wan_i2v_tp2_ulysses2"):
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL, r
        assert "sequence 0/2" in r["mesh"] or "sequence 1/2" in r["mesh"], r["mesh"]
        assert "tp" in r["mesh"] and r["heads"] == (2, 2)
    results = _each(4, "wan_cfg2_ulysses2_fsdp2")
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL, r
    _halves([r["dtensor"]["transformer"] for r in results[:2]])  # one fsdp group = ranks 0, 1


def test_world_4_tp2_x_fsdp2_on_one_2d_mesh():
    """tp 2 x Ulysses 2 x fsdp 2: FSDP shards the tp shards over the ranks with the same tp rank."""
    results = _each("tp_fsdp", "wan_i2v_tp2_fsdp2")
    for rank, r in enumerate(results):
        assert r["ref_abs"] > 0.1 and max(r["diffs"]) <= TOL and r["unsharded_diff"] <= TOL, r
        assert r["tp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1], r
        assert r["fsdp_ranks"] == [rank % 2, rank % 2 + 2], r  # same tp rank, both sequence positions
        assert r["q_mesh"] == ("fsdp", "tp") and len(r["q_placements"]) == 2, r
        assert r["q_local"] == (24, 96), r  # 96 output rows / (tp 2 x fsdp 2)
        assert r["heads"] == (2, 2) and r["heads_after"] == (4, 4) and r["norm_distributed"], r
        assert r["prefetch_seen"] == [True] * 4, r
        # the split Linears: all of them are 2-D DTensors, a quarter on each rank
        assert r["split"]["total"] == r["linear_full"], r
        assert 0.24 * r["linear_full"] <= r["split"]["local"] <= 0.26 * r["linear_full"], r
        assert 0.45 * r["rest"]["total"] <= r["rest"]["local"] <= 0.55 * r["rest"]["total"], r
        assert r["state_keys_equal"] and r["state_max_diff"] == 0.0, r
        assert r["unsharded_plain"] and r["class_restored"], r
    assert sum(r["split"]["local"] for r in results) == results[0]["linear_full"]


def test_world_4_cfg2_tp2_fsdp2_pipeline():
    """cfg 2 x tp 2, fsdp 2 (sequence 1): the fsdp groups span the CFG branches; the text encoder is sharded over
    them too (no tp); the transformer's split weights are 2-D DTensors."""
    results = _each("tp_fsdp", "wan_cfg2_tp2_fsdp2")
    for r in results:
        assert r["ref_abs"] > 0.1 and r["diff"] <= TOL, r
        assert "sequence 0/1" in r["mesh"] and "tp" in r["mesh"] and "fsdp" in r["mesh"], r["mesh"]
    _halves([results[i]["dtensor"]["text_encoder"] for i in (0, 2)])  # one fsdp group = ranks 0, 2 (tp rank 0)
    # the split Linear weights: a quarter on each rank, all four ranks together hold each element once
    total = results[0]["dtensor_2d"][1]
    assert total > 0.5 * results[0]["full"]["transformer"], results[0]
    assert [r["dtensor_2d"] for r in results] == [(total // 4, total)] * 4, results


# ---------------------------------------------------------------- configuration and refusals (one process)
def _env(world, monkeypatch):
    for k, v in {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)


def test_degrees_resolve_and_refuse_with_valid_choices():
    assert ParallelConfig(tp_degree=2).resolve_mesh(4) == (1, 2, 1)
    assert ParallelConfig(tp_degree=2, cfg_degree=2).resolve_mesh(4) == (2, 1, 1)
    assert ParallelConfig(fsdp_degree=4, cfg_degree=2).resolve_mesh(4) == (2, 2, 1)
    with pytest.raises(ConfigError, match=r"tp_degree=3 does not divide .*valid tp_degree values: \[1, 2, 4\]"):
        ParallelConfig(tp_degree=3).resolve_mesh(4)
    with pytest.raises(ConfigError, match=r"fsdp_degree=3 does not divide world_size=4; valid fsdp_degree values: "
                                          r"\[1, 2, 4\]"):
        ParallelConfig(fsdp_degree=3).resolve_mesh(4)
    with pytest.raises(ConfigError, match=r"valid \(ulysses_degree, ring_degree\) pairs .*tp_degree=2: \[\(1, 4\), "
                                          r"\(2, 2\), \(4, 1\)\]"):
        ParallelConfig(tp_degree=2, ulysses_degree=3).resolve_mesh(8)
    # fsdp x tp: fsdp_degree divides world_size / tp_degree (the fsdp groups share a tp rank)
    assert ParallelConfig(tp_degree=2, fsdp_degree=2).resolve_mesh(4) == (1, 2, 1)
    assert ParallelConfig(tp_degree=2, fsdp_degree=2, cfg_degree=2).resolve_mesh(4) == (2, 1, 1)
    assert ParallelConfig(tp_degree=2, fsdp_degree=4).resolve_mesh(8) == (1, 4, 1)
    assert ParallelConfig(tp_degree=2, fsdp_degree=2).processes_needed() == 4
    with pytest.raises(ConfigError, match=r"fsdp_degree=4 does not divide world_size=4 / tp_degree=2 = 2 .*valid "
                                          r"\(tp_degree, fsdp_degree\) pairs for world_size=4, cfg_degree=1: "
                                          r"\[\(1, 1\), \(1, 2\), \(1, 4\), \(2, 1\), \(2, 2\), \(4, 1\)\]"):
        ParallelConfig(tp_degree=2, fsdp_degree=4).resolve_mesh(4)
    with pytest.raises(ConfigError, match=r"fsdp_degree=4 does not divide world_size=12 / tp_degree=2 = 6"):
        ParallelConfig(tp_degree=2, fsdp_degree=4).resolve_mesh(12)  # 4 divides 12, not the 6 ranks per tp rank
    with pytest.raises(ConfigError, match="fsdp_degree must be >= 1"):
        ParallelConfig(fsdp_degree=0)
    with pytest.raises(ConfigError, match="fsdp_text_encoder must be True or False"):
        ParallelConfig(fsdp_text_encoder="yes")


def test_yaml_and_boost_manager_schema():
    cfg = BoostConfig.from_dict({"Parallel": {"dit": {"alg": "CP", "fsdp_degree": 2, "tp_degree": 1,
                                                      "fsdp_text_encoder": False}}})
    assert (cfg.parallel.fsdp_degree, cfg.parallel.tp_degree, cfg.parallel.fsdp_text_encoder) == (2, 1, False)
    assert parallel_from_boost_manager({"dit": {"tp_degree": 2}}) == {"tp_degree": 2}
    with pytest.raises(ConfigError, match="Parallel.dit.fsdp_degree must be >= 1"):
        parallel_from_boost_manager({"dit": {"fsdp_degree": 0}})
    assert BoostConfig.from_dict({"parallel": {"tp_degree": 2}}).parallel.tp_degree == 2


def test_mesh_layout_with_tp_innermost_and_contiguous_fsdp_groups():
    seq, cfg, uly, ring, tp, fsdp = _mesh_ranks(2, 2, 2, tp_degree=2, fsdp_degree=4)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert seq == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cfg == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # with tp, an fsdp group holds fsdp_degree consecutive cfg x sequence positions of one tp rank
    assert fsdp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert _mesh_ranks(1, 4, tp_degree=2, fsdp_degree=2)[5] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _mesh_ranks(2, 4, fsdp_degree=4)[5] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # without tp: contiguous ranks
    # without tp the layout is unchanged
    assert _mesh_ranks(2, 2)[:2] == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


@pytest.mark.parametrize("parallel, world, match", [
    ({"tp_degree": 2}, 2, r"tp_degree=2 does not divide the 3 attention heads .*valid tp_degree for this model and "
                          r"world size: \[1\]"),
    ({"tp_degree": 2, "cfg_degree": 2}, 4, r"tp_degree=2 does not divide the 3 attention heads .*: \[1\]"),
    ({"fsdp_degree": 3}, 2, r"fsdp_degree=3 does not divide world_size=2; valid fsdp_degree values: \[1, 2\]"),
    ({"tp_degree": 3}, 2, r"tp_degree=3 does not divide world_size=2 / cfg_degree=1 = 2; valid tp_degree values: "
                          r"\[1, 2\]"),
    ({"tp_degree": 2, "fsdp_degree": 4}, 4, r"fsdp_degree=4 does not divide world_size=4 / tp_degree=2 = 2 .*"
                                            r"valid \(tp_degree, fsdp_degree\) pairs .*\(2, 2\), \(4, 1\)\]"),
    ({"tp_degree": 2, "fsdp_degree": 2}, 4, r"tp_degree=2 does not divide the 3 attention heads .*: \[1\]"),
])
def test_bad_degrees_for_the_model_fail_before_any_collective(parallel, world, match, monkeypatch):
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    _env(world, monkeypatch)
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    before = {n: p.clone() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ConfigError, match=match):
        ParallelManager(pipe, {"parallel": parallel})
    assert not dist.is_initialized()
    assert getattr(pipe.transformer, "_lite_boost", None) is None  # nothing modified
    assert all((p == before[n]).all() for n, p in pipe.transformer.named_parameters())


@pytest.mark.parametrize("family, first", [("hunyuan", "transformer_blocks.0.attn"),
                                           ("hunyuan15", "transformer_blocks.0.attn"),
                                           ("ltx", "transformer_blocks.0.attn1"),
                                           ("cogvideox", "transformer_blocks.0.attn1"),
                                           ("minimax_h3", "transformer_blocks.0.attn")])
def test_video_family_heads_not_divisible_refused(family, first, monkeypatch):
    from lite_boost.parallel import ParallelManager

    _env(2, monkeypatch)
    model = cases._video_family(family, heads=3)[0]()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=rf"tp_degree=2 does not divide the 3 attention heads of {first} of "
                                          r"\w+ \(and \d+ more\); valid tp_degree for this model and world size: \[1\]"):
        ParallelManager(model, {"parallel": {"tp_degree": 2}})
    assert not dist.is_initialized()
    assert getattr(model, "_lite_boost", None) is None  # nothing modified
    assert all((p == before[n]).all() for n, p in model.named_parameters())


def test_ffn_width_and_quant_refused(monkeypatch):
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    _env(2, monkeypatch)
    model = tiny_wan_transformer(TinyWanSpec(heads=2, ffn_dim=63))
    with pytest.raises(ConfigError, match=r"does not divide the 63 output features of blocks.0.ffn.net.0.proj.*"
                                          r"valid tp_degree for this model and world size: \[1\]"):
        ParallelManager(model, {"parallel": {"tp_degree": 2}})
    model = tiny_wan_transformer(TinyWanSpec(heads=2))
    from lite_boost.config import QuantConfig
    from lite_boost.parallel.shard import check_fsdp, check_tensor_parallel_quant

    with pytest.raises(ConfigError, match=r"quant='fp8'.*valid quant with tp_degree > 1: "
                                          r"\['int8_weight_only', 'int8_dynamic'\] or None"):
        check_tensor_parallel_quant(model, None, 2, QuantConfig("fp8"))

    with pytest.raises(ConfigError, match=r"quant='w8a8_npu'.*valid quant with tp_degree > 1: "
                                          r"\['int8_weight_only', 'int8_dynamic'\]"):
        check_tensor_parallel_quant(model, None, 2, QuantConfig("w8a8_npu"))
    with pytest.raises(ConfigError, match=r"tp_degree=2 x fsdp_degree=2 with quant='int8_weight_only'.*valid: quant "
                                          r"with tp_degree or fsdp_degree alone"):
        check_tensor_parallel_quant(model, None, 2, QuantConfig("int8_weight_only"), fsdp_degree=2)
    # a quantized layer split another way than column / row-wise (Flux's packed single-block projection)
    from lite_boost.parallel.shard import TensorParallelPlan

    packed = TensorParallelPlan(layers={"blocks.*.ffn.net.2": object()})
    with pytest.raises(ConfigError, match=r"blocks.0.ffn.net.2 is split as .*QuantConfig\(exclude="):
        check_tensor_parallel_quant(model, packed, 2, QuantConfig("int8_weight_only"), ["blocks.0.ffn.net.2"])
    check_tensor_parallel_quant(model, packed, 2, QuantConfig("int8_weight_only"), ["blocks.0.ffn.net.0.proj"])

    with pytest.raises(ConfigError, match=r"quant='w8a8_npu'.*valid quant with fsdp_degree > 1: \['int8_dynamic', "
                                          r"'int8_weight_only', 'fp8'\] or None"):
        check_fsdp("M", [], 2, QuantConfig("w8a8_npu"))
    model.fuse_qkv_projections()
    with pytest.raises(ConfigError, match="fused q/k/v projections"):
        ParallelManager(model, {"parallel": {"tp_degree": 2}})
    assert not dist.is_initialized()


# ---------------------------------------------------------------- a rank dies in a weight all-gather
@pytest.mark.parametrize("mode, world, faulty, collective, ranks", [
    ("fsdp_die", 2, 1, "'fsdp_all_gather[patch_embedding]' on the fsdp group", [0, 1]),  # a weight all-gather
    ("tp_die", 2, 1, "'tp_all_reduce[blocks.0.attn1.to_out.0]' on the tp group", [0, 1]),  # a row-wise all-reduce
    # tp 2 x fsdp 2 (2-D mesh): rank 0's fsdp group is [0, 2] (the ranks with tp rank 0)
    ("fsdptp_die", 4, 2, "'fsdp_all_gather[patch_embedding]' on the fsdp group", [0, 2]),
])
def test_rank_dying_in_a_weight_collective_makes_the_others_raise_naming_it(mode, world, faulty, collective, ranks):
    timeout_s = 4.0
    procs = launch_fault_workers(os.path.join(HERE, "_dist_fault_worker.py"), mode, world, faulty, timeout_s)
    try:
        code = procs[0].wait(timeout=90 + timeout_s)  # start-up, then the failure (a closed peer or the timeout)
        log = procs[0].communicate(timeout=10)[0]
        assert code != 0, log
        assert f"CollectiveError: collective {collective} (global ranks {ranks}" in log, log
        assert procs[faulty].wait(timeout=30) == 3
    finally:
        stop_workers(procs)


def test_cli_flags_reach_the_config_and_bad_degrees_stop_before_torchrun():
    from lite_boost.cli import _boost_config, _validate_generate, build_parser

    args = build_parser().parse_args(["generate", "--nproc", "4", "--fsdp-degree", "4", "--cfg-degree", "2"])
    _validate_generate(args)
    p = _boost_config(args).parallel
    assert (p.fsdp_degree, p.tp_degree, p.cfg_degree) == (4, 1, 2)
    args = build_parser().parse_args(["generate", "--nproc", "4", "--tp-degree", "2"])
    _validate_generate(args)
    assert _boost_config(args).parallel.tp_degree == 2
    args = build_parser().parse_args(["generate", "--nproc", "4", "--tp-degree", "2", "--fsdp-degree", "2"])
    _validate_generate(args)
    assert (_boost_config(args).parallel.tp_degree, _boost_config(args).parallel.fsdp_degree) == (2, 2)
    for flags, match in ((["--tp-degree", "3"], r"valid tp_degree values: \[1, 2, 4\]"),
                         (["--fsdp-degree", "3"], r"valid fsdp_degree values: \[1, 2, 4\]"),
                         (["--fsdp-degree", "0"], "--fsdp-degree must be a positive integer"),
                         (["--tp-degree", "2", "--fsdp-degree", "4"], r"valid \(tp_degree, fsdp_degree\) pairs")):
        with pytest.raises(SystemExit, match=match):
            _validate_generate(build_parser().parse_args(["generate", "--nproc", "4", *flags]))


def test_int8_ops_equal_torchao_linear_whole_and_split_by_columns():
    """The custom ops on an Int8Tensor's stored tensors = torchao's own Linear, bit for bit: whole (both methods,
    eager and in one fullgraph compiled graph), and int8_dynamic split by input columns with the whole row's
    absmax and exact int32 sums."""
    import warnings

    import torch
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    from lite_boost.ops.quant_int8 import int8_act_absmax, int8_finish, int8_linear, int8_partial_mm, int8_spec

    torch.manual_seed(0)
    x = torch.randn(2, 9, 32)
    for config in (Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
                   Int8WeightOnlyConfig(set_inductor_config=False)):
        lin = torch.nn.Linear(32, 24)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(lin, config)
        w, spec = lin.weight, int8_spec(lin.weight)
        with torch.no_grad():
            ref = lin(x)
            got = int8_linear(x, w.qdata, w.scale, w.zero_point, lin.bias, spec)
            assert torch.equal(got, ref), (spec, (got - ref).abs().max())
            torch._dynamo.reset()
            fn = lambda a: int8_linear(a, w.qdata, w.scale, w.zero_point, lin.bias, spec)  # noqa: E731
            explained = torch._dynamo.explain(fn)(x)
            assert explained.graph_break_count == 0 and explained.graph_count == 1
            assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(x), ref)
            torch._dynamo.reset()
        if not spec.dynamic:
            continue
        halves = list(zip(x.chunk(2, -1), w.qdata.chunk(2, -1)))
        absmax = torch.maximum(*[int8_act_absmax(xs) for xs, _ in halves])  # the all-reduce (MAX)
        parts = [int8_partial_mm(xs, absmax, qs, spec) for xs, qs in halves]
        assert torch.equal(parts[0][1], parts[1][1])  # both halves quantized with the whole row's scale
        c = parts[0][0] + parts[1][0]  # the all-reduce (SUM) of the int32 products
        assert torch.equal(int8_finish(c, parts[0][1], w.scale, lin.bias, x), ref)
        # a half's own absmax would give another scale: the whole row's is what makes it exact
        assert not torch.equal(int8_act_absmax(halves[0][0]), absmax)
