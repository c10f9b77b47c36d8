"""Per-rank bodies of the joint-attention Ulysses tests (spawned gloo processes, test_joint_attention.py).

Every rank builds the same global image and text tensors from a fixed seed, shards the image stream,
keeps the text replicated, runs ``UlyssesAttention(..., joint=...)`` and compares with one-process
attention over the concatenated sequence, computed independently in float64.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

# (name, B, S image tokens, T text tokens, H, D, text padded, text first)
JOINT_SHAPES = [
    ("text_first", 1, 13, 5, 3, 8, False, True),
    ("text_after_masked", 2, 17, 7, 3, 8, True, False),
    ("one_head", 1, 9, 4, 1, 8, True, True),
    ("fewer_tokens_than_ranks", 1, 2, 3, 4, 8, True, True),
    ("long_text_uneven_heads", 1, 6, 11, 5, 16, True, False),
]


def sdpa_kernel(q, k, v, key_mask=None):
    """Dense (B, S, H, D) attention with an optional (B, S_k) key-padding mask."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def reference(q, k, v, jq, jk, jv, jmask, first):
    """float64 softmax attention over [text, image] / [image, text] with padded text keys excluded."""
    cat = (lambda a, b: torch.cat([b, a] if first else [a, b], dim=1))
    qa, ka, va = (cat(x, y).double() for x, y in ((q, jq), (k, jk), (v, jv)))
    logits = torch.einsum("bqhd,bkhd->bhqk", qa, ka) / math.sqrt(q.shape[-1])
    if jmask is not None:
        keep = cat(torch.ones(q.shape[:2], dtype=torch.bool), jmask)
        logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), va)
    t = jq.shape[1]
    return (out[:, t:], out[:, :t]) if first else (out[:, : q.shape[1]], out[:, q.shape[1]:])


def make_case(seed, B, S, T, H, D, masked, first):
    from lite_boost.ops.joint import JointTokens

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    jq, jk, jv = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    jmask = None
    if masked:  # batch element b keeps T - 1 - b text tokens (at least one)
        jmask = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            jmask[b, : max(1, T - 1 - b)] = True
        jk = jk.masked_fill(~jmask[..., None, None], 1e4)  # padded keys would dominate if attended
    return (q, k, v), JointTokens(jq, jk, jv, jmask, first)


def keys_only(joint):
    """The same joint stream attended as keys only (no joint queries): the main output is unchanged."""
    from lite_boost.ops.joint import JointTokens

    return JointTokens(joint.q[:, :0], joint.k, joint.v, joint.key_mask, joint.first)


def joint_cases(rank, world_size, init_method):
    from lite_boost.config import ParallelConfig
    from lite_boost.ops.joint import joint_attention
    from lite_boost.parallel import SequenceShardInfo, UlyssesAttention, init_mesh
    from lite_boost.parallel.comm import head_split

    mesh = init_mesh(ParallelConfig(timeout_s=60), init_method=init_method)
    comm = mesh.sequence
    stats = comm.enable_stats()
    P = comm.size
    out = {}
    for seed, (name, B, S, T, H, D, masked, first) in enumerate(JOINT_SHAPES):
        (q, k, v), joint = make_case(seed, B, S, T, H, D, masked, first)
        ref_out, ref_joint = reference(q, k, v, joint.q, joint.k, joint.v, joint.key_mask, first)
        info = SequenceShardInfo(P)
        info.set(S)
        s = info.shard_len
        ql, kl, vl = (comm.shard(x, 1) for x in (q, k, v))
        stats.reset()
        wrapper = UlyssesAttention(functools.partial(joint_attention, sdpa_kernel), comm, info)
        local, joint_out = wrapper(ql, kl, vl, joint=joint)
        mine = ref_out[:, rank * s: min((rank + 1) * s, S)]
        real = local[:, : mine.shape[1]]
        heads = head_split(H, P)
        es = q.element_size()
        out[name] = {
            "image_err": (real.double() - mine).abs().max().item() if real.numel() else 0.0,
            "image_pad_rows": local.shape[1] - mine.shape[1],
            "joint_err": (joint_out.double() - ref_joint).abs().max().item(),
            "joint_shape": tuple(joint_out.shape),
            "joint_bytes": joint_out.double().sum().item(),  # identical on every rank (checked by the parent)
            # only the sharded image stream goes through the all_to_all: 3 tensors of s tokens per head sent away
            "a2a_sent": stats.bytes_sent.get("qkv_to_heads", 0),
            "a2a_expected": 3 * B * s * D * (H - heads[rank]) * es,
            "joint_gather_calls": stats.calls.get("joint_heads", 0),
        }
        stats.reset()
        local, joint_out = wrapper(ql, kl, vl, joint=keys_only(joint))
        real = local[:, : mine.shape[1]]
        out[name + ":keys_only"] = {
            "image_err": (real.double() - mine).abs().max().item() if real.numel() else 0.0,
            "joint_shape": tuple(joint_out.shape),
            "joint_gather_calls": stats.calls.get("joint_heads", 0),
        }
    return out
