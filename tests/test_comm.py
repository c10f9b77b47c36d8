"""Collectives of lite_boost.parallel: packed q/k/v all_to_all with uneven heads and padded tokens,
uneven gathers, Ulysses attention == dense attention, byte counts vs the Ulysses lower bound.

Multi-process cases run once per world size (a module fixture spawns the gloo group once and every
test asserts on its share of the results) to keep process start-up cost low.
"""

import pytest
import torch

from lite_boost.parallel.comm import Communicator, head_split, pad_dim, shard_length

import _dist_comm_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5


def test_head_split_covers_all_heads():
    for h in range(0, 13):
        for p in range(1, 6):
            split = head_split(h, p)
            assert sum(split) == h and len(split) == p and max(split) - min(split) <= 1
    assert head_split(3, 2) == [2, 1] and head_split(5, 3) == [2, 2, 1]
    with pytest.raises(ValueError):
        head_split(4, 0)


def test_shard_length_and_pad():
    assert shard_length(37, 2) == 19 and shard_length(36, 3) == 12 and shard_length(2, 3) == 1
    x = torch.ones(1, 5, 2)
    y = pad_dim(x, 1, 8)
    assert y.shape == (1, 8, 2) and y[:, 5:].abs().sum() == 0 and pad_dim(x, 1, 5) is x
    with pytest.raises(ValueError):
        pad_dim(x, 1, 3)


def test_single_rank_communicator_is_identity():
    comm = Communicator(None, size=1, rank=0)
    q, k, v = (torch.randn(2, 7, 3, 4) for _ in range(3))
    qh, kh, vh = comm.qkv_to_heads(q, k, v)
    assert qh is q and kh is k and vh is v
    assert comm.heads_to_seq(q, 3, 7) is q
    assert comm.shard(q, 1) is q and comm.gather(q, 1).equal(q)
    from lite_boost.parallel import UlyssesAttention

    out = UlyssesAttention(cases.dense_bsnd, comm)(q, k, v)
    assert torch.equal(out, cases.dense_bsnd(q, k, v))


def test_ulysses_rejects_bad_input():
    from lite_boost.parallel import UlyssesAttention

    comm = Communicator(None, size=1, rank=0)
    with pytest.raises(TypeError, match="attn_fn"):
        UlyssesAttention(None, comm)
    with pytest.raises(TypeError, match="comm"):
        UlyssesAttention(cases.dense_bsnd, object())
    with pytest.raises(ValueError, match="B, S, H, D"):
        UlyssesAttention(cases.dense_bsnd, comm)(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="one shape"):
        comm.qkv_to_heads(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 2, 4), torch.ones(1, 2, 3, 4))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"{p}ranks")
def comm_results(request):
    return request.param, run_ranks(cases.comm_cases, request.param)


@pytest.mark.parametrize("kind", ["exchange", "roundtrip", "attention"])
@pytest.mark.parametrize("shape", [c[0] for c in cases.ATTN_SHAPES])
def test_ulysses_matches_dense(comm_results, kind, shape):
    world, results = comm_results
    for rank, res in enumerate(results):
        err = res[f"{kind}/{shape}"]
        tol = 0.0 if kind != "attention" else TOL
        assert err <= tol, f"{kind}/{shape} rank {rank}/{world}: max abs diff {err}"


def test_bf16_exchange(comm_results):
    _, results = comm_results
    for res in results:
        assert res["attention/bf16"] <= 1e-2


@pytest.mark.parametrize("key", ["all_gather_uneven", "all_gather_uneven_sizes", "shard_gather_dim2", "broadcast"])
def test_gathers(comm_results, key):
    _, results = comm_results
    for res in results:
        assert res[key] == 0.0, key


def test_bytes_and_collectives_match_lower_bound(comm_results):
    _, results = comm_results
    for res in results:
        assert res["collectives_per_attention"] == 2
        assert res["bytes_sent"] == res["bytes_lower_bound"]


@pytest.mark.slow
@pytest.mark.parametrize("cfg_degree", [1, 2])
def test_mesh_layout_four_ranks(cfg_degree):
    results = run_ranks(cases.mesh_cases, 4, cfg_degree)
    for rank, res in enumerate(results):
        seq = 4 // cfg_degree
        assert res["cfg_rank"] == rank // seq and res["sequence_rank"] == rank % seq
        assert res["seq_size"] == seq and res["cfg_size"] == cfg_degree
        assert res["seq_members"] == res["expected_seq_members"]
        assert res["cfg_members"] == res["expected_cfg_members"]
