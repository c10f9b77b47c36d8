"""Per-rank bodies of the communication tests (run in spawned gloo processes by test_comm.py).

Every rank builds the same global tensors from a fixed seed, works on its shard through the
parallel code, and compares with the single-process reference computed on the full tensors.
Each case returns a number (max abs error or a count) so the parent test asserts per case.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def maxdiff(a, b) -> float:
    """Max abs difference (0.0 for empty tensors); inf on a shape mismatch."""
    if a.shape != b.shape:
        return math.inf
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def dense_bsnd(q, k, v):
    """Reference attention in (B, S, H, D)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


# (name, B, S, H, D)
ATTN_SHAPES = [
    ("even", 1, 24, 6, 8),
    ("uneven_heads", 2, 24, 5, 8),
    ("uneven_tokens", 1, 37, 6, 16),
    ("uneven_both", 2, 29, 3, 8),
    ("fewer_heads_than_ranks", 1, 19, 1, 8),
    ("tiny_seq", 1, 2, 4, 8),
]


def comm_cases(rank, world_size, init_method):
    from lite_boost.config import ParallelConfig
    from lite_boost.parallel import UlyssesAttention, SequenceShardInfo, init_mesh
    from lite_boost.parallel.comm import head_split, ulysses_lower_bound_bytes

    mesh = init_mesh(ParallelConfig(timeout_s=60), init_method=init_method)
    assert mesh.world_size == world_size and mesh.rank == rank and mesh.sequence_degree == world_size
    comm = mesh.sequence
    P = comm.size
    out = {}

    for seed, (name, B, S, H, D) in enumerate(ATTN_SHAPES):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
        ref = dense_bsnd(q, k, v)
        info = SequenceShardInfo(P)
        info.set(S)
        s = info.shard_len
        ql, kl, vl = (comm.shard(x, 1) for x in (q, k, v))
        assert ql.shape == (B, s, H, D)
        # exchange alone: the full sequence for this rank's heads
        qh, kh, vh = comm.qkv_to_heads(ql, kl, vl, seq_len=S)
        heads = head_split(H, P)
        h0 = sum(heads[:rank])
        err_x = max(maxdiff(a, b[:, :, h0:h0 + heads[rank]]) for a, b in ((qh, q), (kh, k), (vh, v)))
        out[f"exchange/{name}"] = err_x
        # inverse exchange restores the shards
        back = comm.heads_to_seq(qh, H, s)
        real = max(0, min(s, S - rank * s))  # real (unpadded) tokens on this rank
        out[f"roundtrip/{name}"] = maxdiff(back[:, :real], ql[:, :real])
        # Ulysses attention vs dense attention on the whole sequence
        uly = UlyssesAttention(dense_bsnd, comm, info)
        local = uly(ql, kl, vl)
        full = comm.gather(local, 1, S)
        out[f"attention/{name}"] = maxdiff(full, ref)

    # uneven all_gather and shard/gather round trip
    n = 3 + 2 * rank
    x = torch.arange(n * 4, dtype=torch.float32).view(1, n, 4) + 100 * rank
    got = comm.all_gather_uneven(x, 1)
    want = torch.cat([torch.arange((3 + 2 * r) * 4, dtype=torch.float32).view(1, 3 + 2 * r, 4) + 100 * r
                      for r in range(P)], 1)
    out["all_gather_uneven"] = (got - want).abs().max().item() if got.shape == want.shape else math.inf
    got2 = comm.all_gather_uneven(x, 1, sizes=[3 + 2 * r for r in range(P)])
    out["all_gather_uneven_sizes"] = (got2 - want).abs().max().item() if got2.shape == want.shape else math.inf
    y = torch.randn(2, 3, 31, generator=torch.Generator().manual_seed(5))
    out["shard_gather_dim2"] = (comm.gather(comm.shard(y, 2), 2, 31) - y).abs().max().item()

    # bf16 exchange is exact (pure data movement)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 23, 5, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    info = SequenceShardInfo(P)
    info.set(23)
    uly = UlyssesAttention(dense_bsnd, comm, info)
    full = comm.gather(uly(*(comm.shard(t, 1) for t in (q, k, v))), 1, 23)
    out["attention/bf16"] = (full.float() - dense_bsnd(q, k, v).float()).abs().max().item()

    # collectives and bytes per self-attention vs the Ulysses lower bound (divisible shape)
    B, S, H, D = 1, 12 * P, 2 * P, 8
    stats = comm.enable_stats()
    stats.reset()
    info = SequenceShardInfo(P)
    info.set(S)
    q, k, v = (torch.randn(B, S // P, H, D) for _ in range(3))
    UlyssesAttention(dense_bsnd, comm, info)(q, k, v)
    out["collectives_per_attention"] = stats.total_calls
    out["bytes_sent"] = stats.total_bytes_sent
    out["bytes_lower_bound"] = ulysses_lower_bound_bytes(B, S, H, D, P)
    comm.stats = None

    # world broadcast: every rank ends with rank 0's tensor
    t = torch.full((3,), float(rank))
    mesh.world.broadcast(t, 0)
    out["broadcast"] = t.abs().max().item()
    mesh.destroy()
    return out


def mesh_cases(rank, world_size, init_method, cfg_degree):
    """Mesh layout for cfg x sequence: coordinates, group membership, per-group collectives."""
    from lite_boost.config import ParallelConfig
    from lite_boost.parallel import init_mesh

    mesh = init_mesh(ParallelConfig(cfg_degree=cfg_degree, timeout_s=60), init_method=init_method)
    seq = world_size // cfg_degree
    out = {
        "cfg_rank": mesh.cfg_rank,
        "sequence_rank": mesh.sequence_rank,
        "seq_size": mesh.sequence.size,
        "cfg_size": mesh.cfg.size,
    }
    # a sum over the sequence group = sum of the global ranks in it
    t = torch.tensor([float(rank)])
    gathered = mesh.sequence.gather(t.view(1, 1), 1).flatten().tolist()
    out["seq_members"] = [int(x) for x in gathered]
    gathered = mesh.cfg.gather(t.view(1, 1), 1).flatten().tolist()
    out["cfg_members"] = [int(x) for x in gathered]
    out["expected_seq_members"] = list(range(mesh.cfg_rank * seq, (mesh.cfg_rank + 1) * seq))
    out["expected_cfg_members"] = [c * seq + mesh.sequence_rank for c in range(cfg_degree)]
    mesh.destroy()
    return out
