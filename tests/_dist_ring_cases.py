"""Per-rank bodies of the Ring / USP tests (spawned gloo ranks, see test_ring.py).

One spawn per world size runs every case of that size (process start-up, torch and diffusers imports
are paid once): attention-level cases against a float64 reference computed without lite_boost code,
against the chunked single-process walk (bitwise), joint text attention, the overlap order, the
counted bytes, block-sparse attention against the one-process ``sparse_attention``, and tiny Wan
pipelines / transformers under ``ParallelManager`` against the single-process ``lite_boost.boost``.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 120

# name -> (B, S as a function of the world size, H, D)
ATTN_SHAPES = {
    "even": (1, lambda p: 6 * p, 3, 8),
    "uneven": (2, lambda p: 6 * p + 1, 3, 8),
    "fewer_tokens_than_ranks": (1, lambda p: p - 1, 3, 8),
    "one_head": (1, lambda p: 5 * p + 2, 1, 16),
    "more_ranks_than_heads": (1, lambda p: 4 * p + 3, 2, 8),
}

# Wan cases: name -> (kind, heads, (height, width, frames) or ("transformer", latent grid), parallel config,
# sparsity or None, extras)
# token grids (patch 1x2x2, VAE 8x): 32x80x5 -> 2x2x5 = 20 tokens, 48x80x9 -> 3x3x5 = 45
WAN_CASES = {
    # 2 ranks
    "ring2_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"ring_degree": 2}, None, {}),
    "ring2_t2v_h4_tok20": ("t2v", 4, (32, 80, 5), {"ring_degree": 2}, None, {}),
    "ring2_allgather_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"ring_degree": 2, "rotate_method": "allgather"}, None, {}),
    "ring2_i2v_h3_tok20": ("i2v", 3, (32, 80, 5), {"ring_degree": 2}, None, {}),
    "ring2_two_stage_h3": ("t2v", 3, (48, 80, 9), {"ring_degree": 2}, None, {"two_stage": True}),
    "ring2_sparse08_h3": ("t2v", 3, (48, 80, 9), {"ring_degree": 2}, 0.8, {}),
    "ring2_sparse08_reuse_h3": ("t2v", 3, (48, 80, 9), {"ring_degree": 2}, 0.8,
                                {"sparse": {"mask_reuse_steps": 2, "dense_steps_first": 1}, "steps": 4}),
    "ring2_fbcache_h3": ("t2v", 3, (48, 80, 9), {"ring_degree": 2}, None,
                         {"cache": "first_block_cache:threshold=0.3", "steps": 4}),
    "ring2_ti2v_per_token_timestep_h3": ("t2v", 3, ("transformer", (3, 3, 5)), {"ring_degree": 2}, None, {}),
    # 3 ranks
    "ring3_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"ring_degree": 3}, None, {}),
    "ring3_i2v_h5_tok45": ("i2v", 5, (48, 80, 9), {"ring_degree": 3}, None, {}),
    "ring3_sparse08_h3": ("t2v", 3, (48, 80, 9), {"ring_degree": 3}, 0.8, {}),
    "ring3_fewer_tokens_than_ranks_h3": ("t2v", 3, ("transformer", (1, 1, 2)), {"ring_degree": 3}, None, {}),
    # 4 ranks
    "ring4_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"ring_degree": 4}, None, {}),
    "u2r2_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"ulysses_degree": 2, "ring_degree": 2}, None, {}),
    "u2r2_i2v_h3_tok20": ("i2v", 3, (32, 80, 5), {"ulysses_degree": 2, "ring_degree": 2}, None, {}),
    "u2r2_sparse08_h3": ("t2v", 3, (48, 80, 9), {"ulysses_degree": 2, "ring_degree": 2}, 0.8, {}),
    "u2r2_fewer_tokens_than_ranks_h3": ("t2v", 3, ("transformer", (1, 1, 3)),
                                        {"ulysses_degree": 2, "ring_degree": 2}, None, {}),
    "cfg2_r2_t2v_h3_tok45": ("t2v", 3, (48, 80, 9), {"cfg_degree": 2, "ring_degree": 2}, None, {}),
    "cfg2_r2_i2v_two_stage_h3": ("i2v", 3, (32, 80, 5), {"cfg_degree": 2, "ring_degree": 2}, None,
                                 {"two_stage": True}),
}
WAN_BY_WORLD = {2: [n for n in WAN_CASES if n.startswith("ring2")],
                3: [n for n in WAN_CASES if n.startswith("ring3")],
                4: [n for n in WAN_CASES if n.startswith(("ring4", "u2r2", "cfg2"))]}


def reference(q, k, v):
    """float64 softmax attention on (B, S, H, D)."""
    logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v.double())


def _qkv(seed, B, S, H, D, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(3)]


def _dense():
    from lite_boost.models.wan import DenseAttention

    return DenseAttention()


def chunked_reference(q, k, v, rank, size, chunk):
    """One process: this rank's query chunk over the K/V chunks in ring order, merged like the ring."""
    from lite_boost.ops.lse import merge_partial, start_partial

    S = q.shape[1]
    kern = _dense().lse_attention

    def valid(j):
        return max(0, min(chunk, S - j * chunk))

    qv = q[:, rank * chunk: rank * chunk + valid(rank)]
    acc = None
    for t in range(size):
        j = (rank - t) % size
        if valid(j) == 0 or qv.shape[1] == 0:
            continue
        out, lse = kern(qv, k[:, j * chunk: j * chunk + valid(j)], v[:, j * chunk: j * chunk + valid(j)])
        if acc is None:
            acc = start_partial(out, lse.transpose(1, 2))
        else:
            merge_partial(acc[0], acc[1], out, lse.transpose(1, 2))
    return None if acc is None else acc[0].to(q.dtype)


# ------------------------------------------------------------------------------------------ attention
def attention_cases(mesh, world):
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.ring import RingAttention, sequence_parallel_attention

    out = {}
    ring_comm, seq = mesh.ring, mesh.sequence
    for seed, (name, (B, S_of, H, D)) in enumerate(ATTN_SHAPES.items()):
        S = S_of(world)
        q, k, v = _qkv(seed, B, S, H, D)
        ref = reference(q, k, v)
        info = SequenceShardInfo(world)
        info.set(S)
        ql, kl, vl = (seq.shard(x, 1) for x in (q, k, v))
        res = {}
        outs = {}
        for method in ("p2p", "allgather"):
            wrapper = sequence_parallel_attention(_dense(), mesh.ulysses, ring_comm, info, rotate_method=method)
            local = wrapper(ql, kl, vl)
            outs[method] = local
            full = seq.gather(local, 1, S)
            res[f"err_{method}"] = (full.double() - ref).abs().max().item()
            res[f"pad_rows_zero_{method}"] = bool(local[:, max(0, min(info.shard_len, S - seq.rank * info.shard_len)):]
                                                  .abs().sum() == 0)
        res["p2p_equals_allgather"] = torch.equal(outs["p2p"], outs["allgather"])
        if mesh.ulysses_degree == 1:  # the ring's own chunks are the shards: bitwise against the chunked walk
            mine = chunked_reference(q, k, v, ring_comm.rank, ring_comm.size, info.shard_len)
            got = outs["p2p"][:, : (0 if mine is None else mine.shape[1])]
            res["bitwise_chunked"] = mine is None or torch.equal(got, mine)
        # bf16 inputs: fp32 merge, bf16 output
        qb, kb, vb = (x.to(torch.bfloat16) for x in (ql, kl, vl))
        wrapper = sequence_parallel_attention(_dense(), mesh.ulysses, ring_comm, info)
        res["err_bf16"] = (seq.gather(wrapper(qb, kb, vb), 1, S).double() - ref).abs().max().item()
        out[name] = res
    out["_overlap_trace"] = overlap_trace(mesh, world)
    out["_bytes"] = counted_bytes(mesh, world)
    out["_joint"] = joint_cases(mesh, world)
    return out


def overlap_trace(mesh, world):
    """Events of one p2p ring pass with a recording kernel: post(t + 1) < kernel(t) < wait(t + 1)."""
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.ring import RingAttention

    if mesh.ulysses_degree != 1:
        return None
    S = 8 * world
    q, k, v = _qkv(7, 1, S, 2, 8)
    info = SequenceShardInfo(world)
    info.set(S)
    ql, kl, vl = (mesh.sequence.shard(x, 1) for x in (q, k, v))
    dense = _dense()
    ring = RingAttention(dense, mesh.ring, info)
    ring.trace = []
    done = [0]

    def kernel(qq, kk, vv):  # the compute of step done[0]
        ring.trace.append(("kernel", done[0]))
        done[0] += 1
        return dense.lse_attention(qq, kk, vv)

    ring.kernel = kernel
    ring(ql, kl, vl)
    return ring.trace


def counted_bytes(mesh, world):
    """Bytes each part of one USP / ring attention call sends, counted by the communicators."""
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.comm import shard_length
    from lite_boost.parallel.ring import sequence_parallel_attention, usp_bytes_per_layer

    B, S, H, D = 1, 10 * world + 1, 4, 8  # heads divide 1, 2, 4: every rank moves the same bytes
    q, k, v = _qkv(11, B, S, H, D)
    info = SequenceShardInfo(world)
    info.set(S)
    ql, kl, vl = (mesh.sequence.shard(x, 1) for x in (q, k, v))
    res = {}
    for method in ("p2p", "allgather"):
        uly, ring = mesh.ulysses.enable_stats(), mesh.ring.enable_stats()
        uly.reset()
        ring.reset()
        sequence_parallel_attention(_dense(), mesh.ulysses, mesh.ring, info, rotate_method=method)(ql, kl, vl)
        res[method] = {"ulysses": uly.bytes_sent.get("qkv_to_heads", 0) + uly.bytes_sent.get("heads_to_seq", 0),
                       "ring": ring.bytes_sent.get("ring_kv", 0) + ring.bytes_sent.get("ring_kv_allgather", 0),
                       "ring_calls": dict(ring.calls)}
        mesh.ulysses.stats = mesh.ring.stats = None
    padded = world * shard_length(S, world)
    res["formula"] = usp_bytes_per_layer(padded, H, D, mesh.ulysses_degree, mesh.ring_degree, element_size=4,
                                         batch=B)
    return res


def joint_cases(mesh, world):
    """Joint text attention through Ring / USP vs one-process float64 attention over the concatenation."""
    from _dist_joint_cases import JOINT_SHAPES, keys_only, make_case
    from _dist_joint_cases import reference as joint_reference
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.ring import sequence_parallel_attention

    out = {}
    seq = mesh.sequence
    for seed, (name, B, S, T, H, D, masked, first) in enumerate(JOINT_SHAPES):
        (q, k, v), joint = make_case(seed, B, S, T, H, D, masked, first)
        ref_out, ref_joint = joint_reference(q, k, v, joint.q, joint.k, joint.v, joint.key_mask, first)
        info = SequenceShardInfo(world)
        info.set(S)
        dense = _dense()
        calls = {"image_x_text": 0}

        class Counting:  # the dense attention, counting image-query calls on the text keys
            def __call__(self, a, b, c):
                return dense(a, b, c)

            def lse_attention(self, a, b, c):
                storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731 (Ulysses passes head slices)
                if storage(b) == storage(joint.k) and storage(a) != storage(joint.q):
                    calls["image_x_text"] += 1
                return dense.lse_attention(a, b, c)

        wrapper = sequence_parallel_attention(Counting(), mesh.ulysses, mesh.ring, info)
        ql, kl, vl = (seq.shard(x, 1) for x in (q, k, v))
        local, joint_out = wrapper(ql, kl, vl, joint=joint)
        full = seq.gather(local, 1, S)
        out[name] = {"image_err": (full.double() - ref_out).abs().max().item(),
                     "joint_err": (joint_out.double() - ref_joint).abs().max().item(),
                     "joint_sum": joint_out.double().sum().item(),
                     "image_x_text_calls": calls["image_x_text"], "masked": masked,
                     "has_rows": seq.rank * info.shard_len < S}
        only = keys_only(joint)  # keys only: the same image rows, no text rows, nothing gathered
        local, joint_out = sequence_parallel_attention(_dense(), mesh.ulysses, mesh.ring, info)(ql, kl, vl, joint=only)
        out[name + ":keys_only"] = {"image_err": (seq.gather(local, 1, S).double() - ref_out).abs().max().item(),
                                    "joint_rows": joint_out.shape[1]}
    return out


# ------------------------------------------------------------------------------------------ block-sparse
SPARSE_SHAPES = {  # name -> (grid, block, sparsity, backend, selector)
    "grid357_b4_cpp": ((3, 5, 7), 4, 0.8, "cpp", "subblock"),
    "grid2910_b16_gather_reference": ((2, 9, 10), 16, 0.6, "gather", "reference"),
    "grid546_b7_cpp": ((5, 4, 6), 7, 0.7, "cpp", "subblock"),
    "tiny_grid113_b2": ((1, 1, 3), 2, 0.5, "gather", "subblock"),
}


def sparse_cases(mesh, world):
    from lite_boost.ops import rain_fusion
    from lite_boost.ops.sparse import sparse_attention
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.ring import RingAttention

    out = {}
    seq = mesh.sequence
    for seed, (name, (grid, bs, sp, backend, selector)) in enumerate(SPARSE_SHAPES.items()):
        S = math.prod(grid)
        q, k, v = _qkv(100 + seed, 1, S, 3, 8)
        kw = dict(head_num=3, input_layout="BSND", sparse_type="rf_v2", block_size=bs, latent_shape_q=grid,
                  sparsity=sp, backend=backend, selector=selector, return_stats=True)
        ref, st = sparse_attention(q, k, v, **kw)
        info = SequenceShardInfo(world)
        info.set(S)
        ring = RingAttention(_dense(), mesh.ring, info)
        ql, kl, vl = (seq.shard(x, 1) for x in (q, k, v))
        local, st2 = sparse_attention(ql, kl, vl, ring=ring, **kw)
        full = seq.gather(local, 1, S)
        nb = -(-S // bs)
        per = -(-nb // world)
        rows = st2.selection.select_idx.shape[0]
        mine_idx = st.selection.select_idx[seq.rank * per: seq.rank * per + rows]
        m = st2.selection.select_idx.shape[-1]
        same_sel = (torch.equal(st.selection.select_num[seq.rank * per: seq.rank * per + rows], st2.selection.select_num)
                    and torch.equal(mine_idx[..., :m], st2.selection.select_idx)
                    and bool((mine_idx[..., m:] == -1).all()))
        reused, st3 = sparse_attention(ql, kl, vl, ring=ring, selection=st2.selection, **kw)
        prow = max(0, min(per * bs, S - seq.rank * per * bs))
        out[name] = {"err": (full - ref).abs().max().item(), "same_selection": same_sel, "path": st2.path,
                     "reuse_equal": torch.equal(reused, local), "reused": st3.reused,
                     "effective_ref": st.effective_sparsity, "effective": st2.effective_sparsity, "rows": prow,
                     "backend": st2.backend}
    # a block-diagonal problem: every row selects its own block only, so every step but the first is
    # empty on every rank: the kernel runs once per rank and the chunks are still relayed
    bs, nblk, d = 4, 3 * world, 16
    S = bs * nblk
    q = (torch.eye(d)[:nblk].repeat_interleave(bs, 0) * 6.0)[None, :, None, :].repeat(1, 1, 2, 1)  # token t -> e_{t//bs}
    k = q.clone()
    v = torch.randn(1, S, 2, d, generator=torch.Generator().manual_seed(5))
    kw = dict(head_num=2, input_layout="BSND", sparse_type="rf_v2", block_size=bs, latent_shape_q=(1, 1, S),
              sparsity=0.95, backend="gather", selector="reference", keep_sink=False, window="raster",
              return_stats=True)
    ref, _ = sparse_attention(q, k, v, **kw)
    info = SequenceShardInfo(world)
    info.set(S)
    ring = RingAttention(_dense(), mesh.ring, info)
    calls = [0]
    original = rain_fusion.rain_fusion_attention

    def counting(*a, **kw_):
        calls[0] += 1
        return original(*a, **kw_)

    rain_fusion.rain_fusion_attention = counting
    stats = mesh.ring.enable_stats()
    stats.reset()
    try:
        local, _ = sparse_attention(*(seq.shard(x, 1) for x in (q, k, v)), ring=ring, **kw)
    finally:
        rain_fusion.rain_fusion_attention = original
    out["_empty_steps"] = {"err": (seq.gather(local, 1, S) - ref).abs().max().item(), "kernel_calls": calls[0],
                           "relays": stats.calls.get("ring_kv", 0)}
    mesh.ring.stats = None
    out["_int8"] = sparse_int8_case(mesh, world)
    return out


def sparse_int8_case(mesh, world):
    """Ring x block-sparse x int8: each K/V chunk is smoothed and quantized on its own rank, and the partial
    results merge through the kernel's shift-corrected lse; against one process (full precision and int8)."""
    from lite_boost.ops.precision import cpu_int8_reason
    from lite_boost.ops.sparse import sparse_attention
    from lite_boost.parallel import SequenceShardInfo
    from lite_boost.parallel.ring import RingAttention

    why = cpu_int8_reason()
    if why is not None:
        return {"skip": why}
    seq = mesh.sequence
    grid, bs = (3, 6, 8), 8
    S = math.prod(grid)
    q, k, v = _qkv(300, 1, S, 2, 32)
    k = k + 4.0 * torch.randn(32, generator=torch.Generator().manual_seed(301))  # DiT-like key offsets
    kw = dict(head_num=2, input_layout="BSND", sparse_type="rf_v2", block_size=bs, latent_shape_q=grid,
              sparsity=0.6, backend="cpp", return_stats=True)
    ref, _ = sparse_attention(q, k, v, **kw)
    ref8, _ = sparse_attention(q, k, v, precision="int8", **kw)
    info = SequenceShardInfo(world)
    info.set(S)
    ring = RingAttention(_dense(), mesh.ring, info)
    local, st = sparse_attention(*(seq.shard(x, 1) for x in (q, k, v)), ring=ring, precision="int8", **kw)
    full = seq.gather(local, 1, S).double()

    def rel(a, b):
        return ((a - b.double()).abs().sum() / b.double().abs().sum()).item()

    return {"rel_fp": rel(full, ref), "rel_int8": rel(full, ref8), "one_process_rel": rel(ref8.double(), ref),
            "backend": st.backend, "path": st.path}


# ------------------------------------------------------------------------------------------ Wan
def _config(par, sparsity, extras):
    cfg = {"parallel": dict(par, timeout_s=TIMEOUT)}
    if sparsity is not None:
        cfg["sparse"] = dict({"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4}, **extras.get("sparse", {}))
    if "cache" in extras:
        cfg["cache"] = extras["cache"]
    return cfg


def _transformer_case(heads, grid, config, mesh):
    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    f, h, w = grid
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, f, 2 * h, 2 * w, generator=g)
    t = (torch.rand(2, f * h * w, generator=g) * 900).round()  # a timestep per token (Wan2.2 TI2V)
    ctx = torch.randn(2, 512, 32, generator=g)
    ref_model = lite_boost.boost(tiny_wan_transformer(TinyWanSpec(heads=heads)), dict(config, parallel={}))
    model = ParallelManager(tiny_wan_transformer(TinyWanSpec(heads=heads)), config, mesh=mesh)
    with torch.no_grad():
        ref = ref_model(x, t, ctx).sample
        got = model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
    return {"maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
            "ref_abs": ref.abs().max().item()}


def wan_case(name, mesh):
    import lite_boost
    from _dist_wan_cases import _call_kwargs, _spec
    from lite_boost.demo import tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    kind, heads, shape, par, sparsity, extras = WAN_CASES[name]
    config = _config(par, sparsity, extras)
    if shape[0] == "transformer":
        return _transformer_case(heads, shape[1], config, mesh)
    two_stage = extras.get("two_stage", False)
    steps = extras.get("steps", 2)

    def call():
        kw = _call_kwargs(kind, shape)
        kw["num_inference_steps"] = steps
        return kw

    ref_pipe = tiny_wan_pipeline(kind, spec=_spec(kind, heads), two_stage=two_stage)
    lite_boost.boost(ref_pipe, dict(config, parallel={}))
    ref = ref_pipe(**call()).frames
    pipe = tiny_wan_pipeline(kind, spec=_spec(kind, heads), two_stage=two_stage)
    ParallelManager(pipe, config, mesh=mesh)
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    stats = mesh.ring.enable_stats()
    stats.reset()
    got = pipe(**call()).frames
    res = {"maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
           "ref_abs": ref.abs().max().item(), "ring_calls": dict(stats.calls),
           "layers_per_call": sum(len(m.blocks) for m in models) // (2 if two_stage else 1)}
    mesh.ring.stats = None
    sparse = pipe.transformer._lite_boost.extras.get("sparse")
    if sparse is not None:
        ref_sparse = ref_pipe.transformer._lite_boost.extras["sparse"]
        res["paths"] = [(e.step, e.layer, e.path, e.reused) for e in sparse.events]
        res["ref_paths"] = [(e.step, e.layer, e.path, e.reused) for e in ref_sparse.events]
        res["effective"] = [e.effective_sparsity for e in sparse.events]
        res["ref_effective"] = [e.effective_sparsity for e in ref_sparse.events]
    cache = pipe.transformer._lite_boost.extras.get("cache")
    if cache is not None:
        res["decisions"] = [d.compute for d in cache.decisions]
        res["ref_decisions"] = [d.compute for d in ref_pipe.transformer._lite_boost.extras["cache"].decisions]
    lite_boost.parallel.unparallelize(pipe)
    return res


def compiled_ring(mesh):
    """torch._dynamo.explain of a boosted tiny Wan under ring vs stock, then regional compile parity."""
    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    spec = TinyWanSpec(heads=3, head_dim=24)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16, 3, 10, 6, generator=g)  # 45 tokens: a padded shard
    ctx = torch.randn(1, 512, 32, generator=g)
    steps = (torch.tensor([900.0]), torch.tensor([700.0]))
    out = {}
    for kind, sparse in (("dense", None), ("sparse", {"sparsity": 0.8, "block_size": 16, "backend": "gather"})):
        torch._dynamo.reset()
        config = {"parallel": {"ring_degree": mesh.ring_degree, "timeout_s": TIMEOUT}}
        if sparse:
            config["sparse"] = sparse
        ref_model = lite_boost.boost(tiny_wan_transformer(spec), {"sparse": sparse} if sparse else None)
        stock = tiny_wan_transformer(spec)
        model = ParallelManager(tiny_wan_transformer(spec), config, mesh=mesh)
        with torch.no_grad():
            rep_stock = torch._dynamo.explain(stock)(x, steps[0], ctx)
            torch._dynamo.reset()
            rep = torch._dynamo.explain(model)(x, steps[0], ctx)
            torch._dynamo.reset()
            model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            stats = mesh.ring.enable_stats()
            stats.reset()
            diffs = [(model(x, t, ctx).sample - ref_model(x, t, ctx).sample).abs().max().item() for t in steps]
            mesh.ring.stats = None
        out[kind] = {"breaks": rep.graph_break_count, "graphs": rep.graph_count,
                     "stock_breaks": rep_stock.graph_break_count, "stock_graphs": rep_stock.graph_count,
                     "reasons": [r.reason.splitlines()[0] for r in rep.break_reasons][:3], "diffs": diffs,
                     "eager_collectives": dict(stats.calls)}
    torch._dynamo.reset()
    return out


# ------------------------------------------------------------------------------------------ entry
def run_all(rank, world_size, init_method):
    warnings.simplefilter("ignore")
    from lite_boost.parallel import initialize_usp

    results = {}
    meshes = {}

    def mesh_for(par):
        key = tuple(sorted(par.items()))
        if key not in meshes:
            meshes[key] = initialize_usp({"parallel": dict(par, timeout_s=TIMEOUT)}, init_method=init_method)
        return meshes[key]

    ring_mesh = mesh_for({"ring_degree": world_size})
    results["mesh"] = {"ring": list(ring_mesh.ring.ranks), "ring_rank": ring_mesh.ring_rank}
    results["attention_ring"] = attention_cases(ring_mesh, world_size)
    results["sparse_ring"] = sparse_cases(ring_mesh, world_size)
    if world_size == 4:
        usp = mesh_for({"ulysses_degree": 2, "ring_degree": 2})
        results["mesh_usp"] = {"ulysses": list(usp.ulysses.ranks), "ring": list(usp.ring.ranks),
                               "sequence": list(usp.sequence.ranks), "ulysses_rank": usp.ulysses_rank,
                               "ring_rank": usp.ring_rank}
        results["attention_usp"] = attention_cases(usp, world_size)
    for name in WAN_BY_WORLD[world_size]:
        par = WAN_CASES[name][3]
        results[name] = wan_case(name, mesh_for(par))
    if world_size == 2:
        results["compile"] = compiled_ring(ring_mesh)
    return results
