"""Per-rank bodies of the FSDP2 / tensor-parallel parity tests (spawned gloo ranks, see test_weight_sharding.py).

Every case computes its single-process reference on each rank (a boosted copy, no collectives), then
runs a fresh copy under ``ParallelManager`` with the case's degrees and returns the max abs difference
and what the rank holds (local parameter bytes, DTensor placements, head counts), so the test can
assert both the output and the sharding. Many cases share one spawn (start-up is paid once per world).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT_S = 120
METHODS = ("int8_dynamic", "int8_weight_only")  # the torchao methods the quantized cases run


def _diff(a, b) -> float:
    return (a - b).abs().max().item() if a.shape == b.shape else float("inf")


def _rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _dtensor_bytes(module):
    """(local bytes, global bytes) of ``module``'s sharded DTensor parameters (replicated ones left out)."""
    from torch.distributed.tensor import DTensor, Shard

    local = total = 0
    for p in module.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            local += p.to_local().numel() * p.element_size()
            total += p.numel() * p.element_size()
    return local, total


def _dtensor_bytes_2d(module):
    """(local bytes, global bytes) of ``module``'s parameters sharded on both dimensions of a 2-D mesh
    (fsdp x tp: the split Linear weights)."""
    from torch.distributed.tensor import DTensor, Replicate

    local = total = 0
    for p in module.parameters():  # (colwise: FSDP's placement is a _StridedShard of the tp-sharded rows)
        if isinstance(p, DTensor) and len(p.placements) == 2 and not any(isinstance(pl, Replicate)
                                                                          for pl in p.placements):
            local += p.to_local().numel() * p.element_size()
            total += p.numel() * p.element_size()
    return local, total


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _mesh(cache, parallel, init_method):
    from lite_boost.parallel import initialize_usp

    key = tuple(sorted(parallel.items()))
    if key not in cache:
        cache[key] = initialize_usp({"parallel": dict(parallel, timeout_s=TIMEOUT_S)}, init_method=init_method)
    return cache[key]


def _wan_inputs(i2v, grid, seed=3):
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(1, 36 if i2v else 16, f, 2 * h, 2 * w, generator=g)
    ctx = torch.randn(1, 512, 32, generator=g)
    kw = {"encoder_hidden_states_image": torch.randn(1, 257, 4, generator=g)} if i2v else {}
    return x, ctx, kw


def _wan_spec(heads, i2v):
    from lite_boost.demo import TinyWanSpec

    if i2v:
        return TinyWanSpec(heads=heads, in_channels=36, image_dim=4, added_kv_proj_dim=heads * 24, layers=3)
    return TinyWanSpec(heads=heads, layers=3)


def _two_steps_with_prefetch(model, ref_model, x, ctx, kw):
    """Two calls (t = 900, 600) of an FSDP-sharded Wan ``model`` against ``ref_model``, recording at each block's
    start whether the next block's all-gather was already issued (the prefetch): (steps, refs, diffs, seen)."""
    blocks = list(model.blocks)
    seen = []

    def probe(i):
        def hook(module, args):
            seen.append(blocks[i + 1]._get_fsdp_state()._fsdp_param_group._all_gather_result is not None)
        return hook

    handles = [blocks[i].register_forward_pre_hook(probe(i)) for i in range(len(blocks) - 1)]
    steps = (torch.tensor([900.0]), torch.tensor([600.0]))
    try:
        with torch.no_grad():
            refs = [ref_model(x, t, ctx, **kw).sample for t in steps]
            diffs = [_diff(model(x, t, ctx, **kw).sample, r) for t, r in zip(steps, refs)]
    finally:
        for h in handles:
            h.remove()
    return steps, refs, diffs, seen


def wan_transformer_fsdp(mesh, *, heads=3, i2v=True, grid=(3, 3, 5), parallel=None):
    """Wan I2V transformer, fsdp 2 x Ulysses 2 (or ``parallel``: fsdp 2 x Ring 2): parity over two steps, local
    bytes, prefetch, compiled run, and unparallelize (full weights back, plain tensors, the same output)."""
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.shard import local_parameter_bytes

    spec = _wan_spec(heads, i2v)
    x, ctx, kw = _wan_inputs(i2v, grid)
    ref_model = lite_boost.boost(tiny_wan_transformer(spec))
    model = tiny_wan_transformer(spec)
    full_bytes = _bytes(model)
    ParallelManager(model, {"parallel": {**(parallel or {"fsdp_degree": 2}), "timeout_s": TIMEOUT_S}}, mesh=mesh)
    out = {"full_bytes": full_bytes, "local_bytes": local_parameter_bytes(model)}
    out["dtensor_local"], out["dtensor_total"] = _dtensor_bytes(model)
    steps, refs, out["diffs"], out["prefetch_seen"] = _two_steps_with_prefetch(model, ref_model, x, ctx, kw)
    with torch.no_grad():
        # compiled: diffusers' regional compilation still finds the (FSDP-wrapped) blocks
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        out["compiled_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
        torch._dynamo.reset()
    unparallelize(model)
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
    out["unsharded_bytes"] = local_parameter_bytes(model)
    out["unsharded_plain"] = all(type(p) is torch.nn.Parameter for p in model.parameters())
    out["class_restored"] = all(type(b).__name__ == "WanTransformerBlock" for b in model.blocks)
    out["ref_abs"] = refs[0].abs().max().item()
    return out


class _Explained(torch.nn.Module):
    """Stands in for a block for one call: torch._dynamo.explain of the block (its FSDP and sequence-parallel
    hooks included) with the inputs the model gives it, then the block's eager call."""

    def __init__(self, block):
        super().__init__()
        self.block, self.explained = block, None

    def forward(self, *args, **kwargs):
        self.explained = torch._dynamo.explain(self.block)(*args, **kwargs)
        return self.block(*args, **kwargs)


def _block_graph_breaks(model, *inputs):
    """torch._dynamo.explain on the first block: (its graph breaks, the graphs holding its Linear layers), and the
    model's output."""
    block = model.blocks[0]
    model.blocks[0] = probe = _Explained(block)
    try:
        out = model(*inputs).sample
    finally:
        model.blocks[0] = block
    torch._dynamo.reset()
    ex = probe.explained
    # the graphs with the block's Linear layers (explain also lists the sequence split of the block's input,
    # the Ulysses pre-hook's narrow / pad, as a graph of its own: no break reason)
    with_ops = sum(any("linear" in str(n.target) for n in g.graph.nodes if n.op == "call_function")
                   for g in ex.graphs)
    return (len(ex.break_reasons), with_ops), out


def wan_transformer_fsdp_quant(mesh, *, heads=2, grid=(3, 3, 5)):
    """Wan T2V transformer quantized (torchao int8 weights, int8 dynamic and weight-only) under fsdp 2 x
    Ulysses 2 against the one-process run of the same quantization: parity (eager and compiled), the int8
    data sharded (each rank holds half of it), and unparallelize bringing the quantized weight back."""
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager, unparallelize

    spec = _wan_spec(heads, False)
    x, ctx, kw = _wan_inputs(False, grid)
    t = torch.tensor([700.0])
    out = {}
    for method in METHODS:
        ref_model = lite_boost.boost(tiny_wan_transformer(spec), {"quant": method})
        model = tiny_wan_transformer(spec)
        ParallelManager(model, {"quant": method, "parallel": {"fsdp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
        q = model.blocks[0].ffn.net[0].proj
        r = {"qdata": (str(q.weight__qdata.dtype), tuple(q.weight__qdata.to_local().shape),
                       tuple(q.weight__qdata.shape)), "weight_between_calls": q.weight}
        int8 = [p for n, p in model.named_parameters() if n.endswith("__qdata")]
        r["int8_local"] = sum(p.to_local().numel() for p in int8)
        r["int8_total"] = sum(p.numel() for p in int8)
        with torch.no_grad():
            ref = ref_model(x, t, ctx).sample
            r["diff"] = _diff(model(x, t, ctx).sample, ref)
            r["breaks_graphs"], explained = _block_graph_breaks(model, x, t, ctx)
            r["explained_diff"] = _diff(explained, ref)
            # compiled (one graph per block): against the one-process quantized model compiled the same way
            # (a compiled block's fp32 rounding can differ from eager by an ulp, which may move an
            # activation across an int8 rounding step)
            torch._dynamo.reset()
            ref_model.compile_repeated_blocks(fullgraph=True, backend="eager")
            ref_compiled = ref_model(x, t, ctx).sample
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            r["compiled_diff"] = _diff(model(x, t, ctx).sample, ref_compiled)
            r["ref_compiled_vs_eager"] = _diff(ref_compiled, ref)
            torch._dynamo.reset()
        unparallelize(model)
        r["unsharded_type"] = type(q.weight).__name__
        r["ref_type"] = type(ref_model.blocks[0].ffn.net[0].proj.weight).__name__
        with torch.no_grad():  # both still compiled
            r["unsharded_diff"] = _diff(model(x, t, ctx).sample, ref_compiled)
        lite_boost.unboost(model)  # the original full-precision weights come back
        r["unboosted_plain"] = all(type(p) is torch.nn.Parameter and p.dtype == torch.float32
                                   for p in model.parameters())
        r["ref_abs"] = ref.abs().max().item()
        out[method] = r
    return out


def wan_transformer_tp(mesh, *, heads=4, i2v=True, grid=(3, 3, 5)):
    """Wan I2V transformer under tp 2 (x Ulysses when the world allows): parity, local Linear bytes, local
    head counts (restored by unboost, which unparallelizes first)."""
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    spec = _wan_spec(heads, i2v)
    x, ctx, kw = _wan_inputs(i2v, grid)
    ref_model = lite_boost.boost(tiny_wan_transformer(spec))
    model = tiny_wan_transformer(spec)
    ParallelManager(model, {"parallel": {"tp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    attn = model.blocks[0].attn2
    out = {"heads": (model.blocks[0].attn1.heads, attn.heads), "q_local": tuple(attn.to_q.weight.to_local().shape),
           "ffn_local": tuple(model.blocks[0].ffn.net[2].weight.to_local().shape)}
    out["dtensor_local"], out["dtensor_total"] = _dtensor_bytes(model)
    steps = (torch.tensor([900.0]), torch.tensor([600.0]))
    with torch.no_grad():
        refs = [ref_model(x, t, ctx, **kw).sample for t in steps]
        out["diffs"] = [_diff(model(x, t, ctx, **kw).sample, r) for t, r in zip(steps, refs)]
    lite_boost.unboost(model)  # unparallelizes first: full weights, global head counts, stock processors
    out["heads_after"] = (model.blocks[0].attn1.heads, attn.heads)
    out["unboosted_plain"] = all(type(p) is torch.nn.Parameter for p in model.parameters())
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
    out["ref_abs"] = refs[0].abs().max().item()
    return out


def wan_transformer_tp_fsdp(mesh, *, heads=4, grid=(3, 3, 5)):
    """Wan I2V transformer under tp 2 x fsdp 2 (one 2-D DeviceMesh, world 4, sequence 1): parity over two steps,
    the 2-D placements and local bytes of the split Linears (a quarter each), the prefetch, the distributed q / k
    norm, and unparallelize bringing back exactly the original weights."""
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.shard import DistributedRMSNorm
    from torch.distributed.tensor import DTensor

    spec = _wan_spec(heads, True)
    x, ctx, kw = _wan_inputs(True, grid)
    ref_model = lite_boost.boost(tiny_wan_transformer(spec))
    model = tiny_wan_transformer(spec)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    linears = {n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("blocks.") and ".norm" not in n}
    ParallelManager(model, {"parallel": {"tp_degree": 2, "fsdp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    q = model.blocks[0].attn1.to_q.weight
    out = {"heads": (model.blocks[0].attn1.heads, model.blocks[0].attn2.heads), "fsdp_ranks": list(mesh.fsdp.ranks),
           "tp_ranks": list(mesh.tp.ranks), "q_mesh": tuple(q.device_mesh.mesh_dim_names or ()),
           "q_placements": [type(pl).__name__ for pl in q.placements], "q_local": tuple(q.to_local().shape),
           "norm_distributed": isinstance(model.blocks[0].attn1.norm_q.__dict__.get("forward"), DistributedRMSNorm)}
    split = {"local": 0, "total": 0}  # the weights of the planned (split) Linears of the blocks
    rest = {"local": 0, "total": 0}  # everything else (FSDP-sharded only)
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if not isinstance(p, DTensor):
            continue
        bucket = split if (owner in linears and name.endswith(".weight") and len(p.placements) == 2) else rest
        bucket["local"] += p.to_local().numel() * p.element_size()
        bucket["total"] += p.numel() * p.element_size()
    out["split"], out["rest"] = split, rest
    out["linear_full"] = sum(v.numel() * v.element_size() for k, v in original.items()
                             if k.rsplit(".", 1)[0] in linears and k.endswith(".weight"))
    steps, refs, out["diffs"], out["prefetch_seen"] = _two_steps_with_prefetch(model, ref_model, x, ctx, kw)
    unparallelize(model)
    state = model.state_dict()
    out["state_keys_equal"] = sorted(state) == sorted(original)
    out["state_max_diff"] = max(((state[k] - v).abs().max().item() if state[k].shape == v.shape else float("inf"))
                                for k, v in original.items() if k in state)
    out["unsharded_plain"] = all(type(p) is torch.nn.Parameter for p in model.parameters())
    out["heads_after"] = (model.blocks[0].attn1.heads, model.blocks[0].attn2.heads)
    out["class_restored"] = all(type(b).__name__ == "WanTransformerBlock" for b in model.blocks)
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
    out["ref_abs"] = refs[0].abs().max().item()
    return out


def _tp_layer_exactness(model, ref_model, names, mesh, run):
    """Run ``run()`` with every split quantized layer of ``model`` recorded; return how many layers' outputs equal
    the one-process layer (``ref_model``) on the same (gathered) input bit for bit, and how many were seen.
    Column-wise: the whole input, this rank's output features. Row-wise: this rank's input features (gathered
    here), the whole output after the all-reduce."""
    seen = {}
    def record(name, module, args, output):
        if name not in seen:  # the first call (a hook returning nothing leaves the output alone)
            seen[name] = (args[0].detach().clone(), output.detach().clone())

    handles = [model.get_submodule(n).register_forward_hook(functools.partial(record, n)) for n in names]
    run()
    for h in handles:
        h.remove()
    equal = 0
    with torch.no_grad():
        for n in names:  # the same order on every rank: the gathers below are collectives
            x, y = seen[n]
            ref = ref_model.get_submodule(n)
            if x.shape[-1] != ref.in_features:  # row-wise: this rank's input columns
                x = mesh.tp.gather(x.contiguous(), -1, op="test_gather")
            want = ref(x)
            if y.shape[-1] != want.shape[-1]:  # column-wise: this rank's output features
                want = want.chunk(mesh.tp.size, -1)[mesh.tp.rank]
            equal += bool(torch.equal(y, want))
    return equal, len(seen)


def wan_transformer_tp_quant(mesh, *, heads=4, grid=(3, 3, 5)):
    """Wan T2V transformer quantized (torchao int8 weight-only and int8 dynamic) under tp 2 against the
    one-process run of the same quantization: parity (int8 dynamic: every split layer equal to the one-process
    layer on the same input, the whole output within the int8 noise), the int8 data and scales split (column-wise
    layers keep their output rows, row-wise ones their input columns and the whole per-row scale), unparallelize
    gathering the quantized weight back, unboost restoring the original weights."""
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager, unparallelize

    spec = _wan_spec(heads, False)
    x, ctx, kw = _wan_inputs(False, grid)
    steps = (torch.tensor([900.0]), torch.tensor([600.0]))
    out = {}
    with torch.no_grad():
        fp32_refs = [lite_boost.boost(tiny_wan_transformer(spec))(x, t, ctx).sample for t in steps]
    for method in ("int8_weight_only", "int8_dynamic"):
        ref_model = lite_boost.boost(tiny_wan_transformer(spec), {"quant": method})
        model = tiny_wan_transformer(spec)
        ParallelManager(model, {"quant": method, "parallel": {"tp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
        blk, ref_blk = model.blocks[0], ref_model.blocks[0]
        r = {"heads": blk.attn1.heads, "weight_between_calls": blk.attn1.to_q.weight}
        for key, lin in (("q", blk.attn1.to_q), ("ffn_out", blk.ffn.net[2])):
            r[key] = (str(lin.weight__qdata.dtype), tuple(lin.weight__qdata.shape), tuple(lin.weight__scale.shape),
                      None if lin.bias is None else tuple(lin.bias.shape))
        # every quantized layer's int8 data: this rank's part vs the one-process weight
        qd = {n[: -len(".weight__qdata")]: p for n, p in model.named_parameters() if n.endswith(".weight__qdata")}
        r["int8_layers"] = len(qd)
        r["int8_local"] = sum(p.numel() for p in qd.values())
        r["int8_total"] = sum(ref_model.get_submodule(n).weight.qdata.numel() for n in qd)
        # the slices are the one-process int8 data, exactly
        rank, q_ref, o_ref = mesh.tp.rank, ref_blk.attn1.to_q.weight, ref_blk.ffn.net[2].weight
        r["slices_equal"] = (torch.equal(blk.attn1.to_q.weight__qdata, q_ref.qdata.chunk(2, 0)[rank])
                             and torch.equal(blk.attn1.to_q.weight__scale, q_ref.scale.chunk(2, 0)[rank])
                             and torch.equal(blk.ffn.net[2].weight__qdata, o_ref.qdata.chunk(2, 1)[rank])
                             and torch.equal(blk.ffn.net[2].weight__scale, o_ref.scale))
        with torch.no_grad():
            refs = [ref_model(x, t, ctx).sample for t in steps]
            r["diffs"] = [_diff(model(x, t, ctx).sample, ref) for t, ref in zip(steps, refs)]
            r["int8_vs_fp32"] = [_diff(ref, f) for ref, f in zip(refs, fp32_refs)]
            outs = [model(x, t, ctx).sample for t in steps]
            r["rel_l2"] = [_rel_l2(o, ref) for o, ref in zip(outs, refs)]  # tp vs one process, same quantization
            r["int8_rel_l2"] = [_rel_l2(ref, f) for ref, f in zip(refs, fp32_refs)]  # int8 vs fp32, one process
            r["tp_fp32_rel_l2"] = [_rel_l2(o, f) for o, f in zip(outs, fp32_refs)]  # tp int8 vs fp32
        r["layers_exact"] = _tp_layer_exactness(model, ref_model, list(qd), mesh, lambda: model(x, steps[0], ctx))
        unparallelize(model)
        r["unsharded_type"] = type(blk.attn1.to_q.weight).__name__
        r["unsharded_equal"] = all(torch.equal(getattr(model.get_submodule(n).weight, k),
                                               getattr(ref_model.get_submodule(n).weight, k))
                                   for n in qd for k in ("qdata", "scale"))
        with torch.no_grad():
            r["unsharded_diff"] = _diff(model(x, steps[0], ctx).sample, refs[0])
        lite_boost.unboost(model)
        r["unboosted_plain"] = all(type(p) is torch.nn.Parameter and p.dtype == torch.float32
                                   for p in model.parameters())
        r["heads_after"] = model.blocks[0].attn1.heads
        r["ref_abs"] = refs[0].abs().max().item()
        out[method] = r
    return out


def wan_pipeline(mesh, parallel, *, heads=3, two_stage=True, extra=None):
    """Wan2.2 two-stage T2V pipeline (two experts, text encoder) under ``parallel`` (and ``extra`` boost options:
    a step cache, sparse attention, applied to the reference too): parity, local bytes, block work done."""
    import lite_boost
    from lite_boost.cache import count_block_work
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    from conftest import pipeline_kwargs

    extra = extra or {}
    spec = TinyWanSpec(heads=heads, head_dim=24)
    call = dict(height=48, width=80, num_frames=9, steps=4) if extra else dict(height=32, width=80, num_frames=5, steps=2)
    ref_pipe = lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec, two_stage=two_stage), extra)
    with count_block_work([ref_pipe.transformer, ref_pipe.transformer_2]) as ref_work:
        ref = ref_pipe(**pipeline_kwargs("t2v", **call)).frames
    pipe = tiny_wan_pipeline("t2v", spec=spec, two_stage=two_stage)
    mods = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2, "text_encoder": pipe.text_encoder}
    full = {k: _bytes(m) for k, m in mods.items() if m is not None}
    ParallelManager(pipe, dict(extra, parallel=dict(parallel, timeout_s=TIMEOUT_S)), mesh=mesh)
    out = {"full": full, "dtensor": {k: _dtensor_bytes(m) for k, m in mods.items() if m is not None},
           "dtensor_2d": _dtensor_bytes_2d(pipe.transformer)}
    with count_block_work([pipe.transformer, pipe.transformer_2]) as work:
        got = pipe(**pipeline_kwargs("t2v", **call)).frames
    out["diff"] = _diff(got, ref)
    out["ref_abs"] = ref.abs().max().item()
    out["ref_work"] = (ref_work.calls, ref_work.ffn_runs)
    out["work"] = (work.calls, work.ffn_runs)
    return out


def qwen_pipeline(mesh, parallel, *, heads=4):
    """Qwen-Image (joint attention, diffusers' _tp_plan) pipeline under ``parallel``: parity."""
    import lite_boost
    from lite_boost.demo import TinyQwenImageSpec, tiny_qwen_image_pipeline
    from lite_boost.parallel import ParallelManager

    from _qwen_cases import call_kwargs

    spec = TinyQwenImageSpec(heads=heads)
    ref_pipe = lite_boost.boost(tiny_qwen_image_pipeline("t2i", spec=spec))
    ref = ref_pipe(**call_kwargs("t2i")).images
    pipe = tiny_qwen_image_pipeline("t2i", spec=spec)
    ParallelManager(pipe, {"parallel": dict(parallel, timeout_s=TIMEOUT_S)}, mesh=mesh)
    out = {"dtensor": _dtensor_bytes(pipe.transformer), "heads": pipe.transformer.transformer_blocks[0].attn.heads}
    got = pipe(**call_kwargs("t2i")).images
    out["diff"] = _diff(got, ref)
    out["ref_abs"] = ref.abs().max().item()
    return out


def flux_transformer_tp(mesh, *, heads=4):
    """Flux.1 transformer (dual- and single-stream blocks; diffusers' _tp_plan with its packed row-wise
    single-block projection) under tp 2: parity, and after unboost (full weights gathered back)."""
    import lite_boost
    from lite_boost.parallel import ParallelManager

    import _tiny_flux as flux

    spec = flux.TinyFluxSpec(heads=heads)
    inputs = flux.transformer_inputs(spec)
    ref_model = lite_boost.boost(flux.transformer(spec))
    model = ParallelManager(flux.transformer(spec), {"parallel": {"tp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        got = model(**inputs).sample
    out = {"diff": _diff(got, ref), "ref_abs": ref.abs().max().item(), "dtensor": _dtensor_bytes(model),
           "heads": model.single_transformer_blocks[0].attn.heads}
    lite_boost.unboost(model)  # unparallelizes first: the packed proj_out's columns back in their own order
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(**inputs).sample, ref)
    return out


def _count_offloaded_gathers(model):
    """Count, per FSDP parameter, the all-gather inputs taken through FSDP2's CPU-offload branch (the shard copied
    from host memory to the mesh's device): each parameter's instance gets a subclass whose property counts
    (test instrumentation only). Returns (counter dict, number of FSDP parameters)."""
    counts = {"offloaded": 0, "other": 0}
    params = []
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get is not None else None
        params += list(group.fsdp_params) if group is not None else []
    for fp in params:
        base = type(fp)

        class Counting(base):
            @property
            def all_gather_inputs(self):
                counts["offloaded" if self.offload_to_cpu else "other"] += 1
                return base.all_gather_inputs.fget(self)

        fp.__class__ = Counting
    return counts, len(params)


def wan_transformer_fsdp_offload(mesh, *, heads=3, grid=(3, 3, 5)):
    """Wan I2V transformer, fsdp 2 x Ulysses 2 with ``offload``: FSDP2's CPUOffloadPolicy instead of lite_boost's
    block hooks (parity over two steps, the policy on every unit, every gather taken through its host-copy branch,
    the next block's gather prefetched), then unparallelize (full plain weights on the host, offloaded block by
    block again: parity, uploads counted) and unboost (no hooks, parity)."""
    import lite_boost
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.offload import fsdp_cpu_offload_units, offload_record, offload_summary
    from lite_boost.parallel import ParallelManager, unparallelize

    spec = _wan_spec(heads, True)
    x, ctx, kw = _wan_inputs(True, grid)
    ref_model = lite_boost.boost(tiny_wan_transformer(spec))
    model = tiny_wan_transformer(spec)
    full_bytes = _bytes(model)
    ParallelManager(model, {"offload": True, "parallel": {"fsdp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    out = {"full_bytes": full_bytes, "record": offload_record(model) is not None, "summary": offload_summary(model),
           "units": fsdp_cpu_offload_units(model), "blocks": len(model.blocks)}
    out["dtensor_local"], out["dtensor_total"] = _dtensor_bytes(model)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    groups = [g for g in groups if g is not None]
    out["policies"] = sorted({type(g.offload_policy).__name__ for g in groups})
    out["pinned"] = any(g.offload_policy.pin_memory for g in groups if isinstance(g.offload_policy, CPUOffloadPolicy))
    out["shard_devices"] = sorted({p.to_local().device.type for p in model.parameters() if isinstance(p, DTensor)})
    out["offload_to_cpu"] = all(fp.offload_to_cpu for g in groups for fp in g.fsdp_params)
    out["block_hooks"] = sum(hasattr(b, "_diffusers_hook") and b._diffusers_hook.get_hook("group_offloading") is not None
                             for b in model.blocks)
    counts, n_params = _count_offloaded_gathers(model)
    steps, refs, out["diffs"], out["prefetch_seen"] = _two_steps_with_prefetch(model, ref_model, x, ctx, kw)
    out["gathers"], out["fsdp_params"] = dict(counts), n_params
    unparallelize(model)
    rec = offload_record(model)
    out["unsharded_plain"] = all(type(p) is torch.nn.Parameter for p in model.parameters())
    out["unsharded_bytes"] = _bytes(model)
    out["class_restored"] = all(type(b).__name__ == "WanTransformerBlock" for b in model.blocks)
    out["reoffloaded"] = rec is not None and rec.blocks == len(model.blocks)
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
    out["reoffload_uploads"] = rec.onloads if rec is not None else 0
    lite_boost.unboost(model)
    out["unboosted"] = offload_record(model) is None and all(type(p) is torch.nn.Parameter for p in model.parameters())
    with torch.no_grad():
        out["unboosted_diff"] = _diff(model(x, steps[0], ctx, **kw).sample, refs[0])
    out["ref_abs"] = refs[0].abs().max().item()
    return out


def wan_pipeline_fsdp_offload(mesh, *, heads=3):
    """Wan T2V pipeline, fsdp 2 x Ulysses 2 with ``offload``: the transformer and the text encoder sharded with
    CPUOffloadPolicy (no block hooks on either), parity with the one-process boosted pipeline, then unboost."""
    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.offload import fsdp_cpu_offload_units, offload_record, offload_summary
    from lite_boost.parallel import ParallelManager

    from conftest import pipeline_kwargs

    spec = TinyWanSpec(heads=heads, head_dim=24)
    call = dict(height=32, width=80, num_frames=5, steps=2)
    ref = lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec))(**pipeline_kwargs("t2v", **call)).frames
    pipe = tiny_wan_pipeline("t2v", spec=spec)
    ParallelManager(pipe, {"offload": True, "parallel": {"fsdp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    out = {"units": {k: fsdp_cpu_offload_units(getattr(pipe, k)) for k in ("transformer", "text_encoder")},
           "records": [offload_record(getattr(pipe, k)) is not None for k in ("transformer", "text_encoder")],
           "dtensor": {k: _dtensor_bytes(getattr(pipe, k)) for k in ("transformer", "text_encoder")},
           "summary": offload_summary(pipe)}
    out["diff"] = _diff(pipe(**pipeline_kwargs("t2v", **call)).frames, ref)
    lite_boost.unboost(pipe)
    out["unboosted"] = all(offload_record(getattr(pipe, k)) is None and fsdp_cpu_offload_units(getattr(pipe, k)) == 0
                           and all(type(p) is torch.nn.Parameter for p in getattr(pipe, k).parameters())
                           for k in ("transformer", "text_encoder"))
    out["unboosted_diff"] = _diff(pipe(**pipeline_kwargs("t2v", **call)).frames, ref)
    out["ref_abs"] = ref.abs().max().item()
    return out


def _video_family(name, heads=4):
    """(build, inputs (a list of call kwargs), attention paths whose heads tp splits) of a tiny video transformer
    whose family record carries the tensor-parallel plan: 4 heads, so tp 2 leaves 2 per rank."""
    if name == "hunyuan":  # 1 dual + 2 single blocks; the text padded (9 of 12 tokens real)
        import _tiny_hunyuan as hy

        spec = hy.HySpec(heads=heads, single_layers=2)
        return (lambda: hy.hunyuan_transformer(spec), [hy.transformer_inputs(spec, valid=[9])],
                ("transformer_blocks.0.attn", "single_transformer_blocks.1.attn"))
    if name == "hunyuan15":  # dual blocks only
        import _tiny_hunyuan as hy

        spec = hy.Hy15Spec(heads=heads)
        return (lambda: hy.hunyuan15_transformer(spec), [hy.transformer_inputs_15(spec, valid=[(5, 3)])],
                ("transformer_blocks.1.attn",))
    if name == "ltx":  # padded text (bias mask), RoPE over the whole inner dim: grid tables and per-token coords
        from _tiny_ltx import TinyLTXSpec, tiny_ltx_transformer, transformer_inputs

        spec = TinyLTXSpec(heads=heads)
        return (lambda: tiny_ltx_transformer(spec),
                [transformer_inputs(spec), transformer_inputs(spec, coords=True, per_token=True)],
                ("transformer_blocks.0.attn1", "transformer_blocks.1.attn2"))
    if name == "cogvideox":  # 5B layout (RoPE), batched [uncond, cond]
        from _tiny_cogvideox import TinyCogSpec, tiny_transformer, transformer_inputs

        spec = TinyCogSpec(heads=heads)
        return (lambda: tiny_transformer(spec), [transformer_inputs(spec)], ("transformer_blocks.1.attn1",))
    if name == "minimax_h3":  # one packed sequence (text, condition, audio, video rows); SwiGLU feed-forward
        import _tiny_minimax_h3 as mm

        spec = mm.TinyMiniMaxSpec(heads=heads)
        return (lambda: mm.transformer(spec), [mm.transformer_inputs(spec)], ("transformer_blocks.1.attn",))
    if name == "wan_animate":  # Wan's blocks split, the face adapter (after block 0) whole on every rank
        import _tiny_wan_derived as wd

        return (lambda: wd.transformer("wan-animate", num_attention_heads=heads),
                [wd.transformer_inputs("wan-animate", frames=3, batch=2)], ("blocks.0.attn1", "blocks.1.attn2"))
    raise KeyError(name)


def video_transformer_tp(mesh, family, parallel=None):
    """A video family's tiny transformer under tp 2 (or ``parallel``) with its family record's plan: parity against
    the boosted one-process run (every input set), local head counts, sharded / local bytes, and unboost
    (unparallelizes first: full weights in their own order, global head counts) giving the one-process output
    again."""
    import lite_boost
    from lite_boost.parallel import ParallelManager
    from lite_boost.parallel.shard import local_parameter_bytes

    build, inputs, attns = _video_family(family)
    ref_model = lite_boost.boost(build())
    model = build()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ParallelManager(model, {"parallel": dict(parallel or {"tp_degree": 2}, timeout_s=TIMEOUT_S)}, mesh=mesh)
    out = {"heads": [model.get_submodule(a).heads for a in attns], "full_bytes": _bytes(ref_model),
           "local_bytes": local_parameter_bytes(model)}
    out["dtensor_local"], out["dtensor_total"] = _dtensor_bytes(model)
    with torch.no_grad():
        refs = [ref_model(**kw) for kw in inputs]
        gots = [model(**kw) for kw in inputs]
        # MiniMax-H3's audio output too
        out["diffs"] = [_diff(g[k], r[k]) for g, r in zip(gots, refs) for k in ("sample", "audio_sample")
                        if getattr(r, k, None) is not None]
        out["outputs"] = sum(getattr(refs[0], k, None) is not None for k in ("sample", "audio_sample"))
        refs = [r.sample for r in refs]
    lite_boost.unboost(model)
    out["heads_after"] = [model.get_submodule(a).heads for a in attns]
    out["weights_back"] = all(type(p) is torch.nn.Parameter and torch.equal(p, full[n])
                              for n, p in model.named_parameters())
    with torch.no_grad():
        out["unsharded_diff"] = _diff(model(**inputs[0]).sample, refs[0])
    out["ref_abs"] = min(r.abs().max().item() for r in refs)
    return out


def ltx_pipeline_tp(mesh, kind="i2v"):
    """LTX-Video pipeline (batched CFG B = 2, padded text, I2V per-token timesteps) under tp 2: parity of the
    latents against the boosted one-process pipeline, the transformer's split layers halved."""
    import lite_boost
    from lite_boost.parallel import ParallelManager

    from _tiny_ltx import TinyLTXSpec, call_kwargs, tiny_ltx_pipeline

    spec = TinyLTXSpec(heads=4)
    ref = lite_boost.boost(tiny_ltx_pipeline(kind, spec=spec))(**call_kwargs(kind)).frames
    pipe = tiny_ltx_pipeline(kind, spec=spec)
    ParallelManager(pipe, {"parallel": {"tp_degree": 2, "timeout_s": TIMEOUT_S}}, mesh=mesh)
    got = pipe(**call_kwargs(kind)).frames
    return {"diff": _diff(got, ref), "ref_abs": ref.abs().max().item(), "dtensor": _dtensor_bytes(pipe.transformer),
            "heads": pipe.transformer.transformer_blocks[0].attn1.heads}


CASES = {
    "wan_i2v_fsdp2_offload": ({"fsdp_degree": 2}, lambda mesh: wan_transformer_fsdp_offload(mesh)),
    "wan_fsdp2_offload_pipeline": ({"fsdp_degree": 2}, lambda mesh: wan_pipeline_fsdp_offload(mesh)),
    # world 2
    "wan_i2v_fsdp2_ulysses2": ({"fsdp_degree": 2}, lambda mesh: wan_transformer_fsdp(mesh)),
    "wan_i2v_fsdp2_ring2": ({"fsdp_degree": 2, "ring_degree": 2}, lambda mesh: wan_transformer_fsdp(
        mesh, parallel={"fsdp_degree": 2, "ring_degree": 2})),
    "wan_i2v_tp2": ({"tp_degree": 2}, lambda mesh: wan_transformer_tp(mesh)),
    "wan_fsdp2_quant": ({"fsdp_degree": 2}, lambda mesh: wan_transformer_fsdp_quant(mesh)),
    "wan_tp2_quant": ({"tp_degree": 2}, lambda mesh: wan_transformer_tp_quant(mesh)),
    # a data-dependent step cache (each cfg rank decides for its branch) and block-sparse attention on top
    "wan22_cfg2_fsdp2_fbc_sparse": ({"cfg_degree": 2, "fsdp_degree": 2}, lambda mesh: wan_pipeline(
        mesh, {"cfg_degree": 2, "fsdp_degree": 2},
        extra={"cache": "first_block_cache:threshold=0.3",
               "sparse": {"sparse_type": "rf_v2", "sparsity": 0.8, "block_size": 4, "backend": "gather"}})),
    "qwen_tp2": ({"tp_degree": 2}, lambda mesh: qwen_pipeline(mesh, {"tp_degree": 2})),
    "flux_tp2": ({"tp_degree": 2}, lambda mesh: flux_transformer_tp(mesh)),
    "qwen_cfg2_fsdp2": ({"cfg_degree": 2, "fsdp_degree": 2},
                        lambda mesh: qwen_pipeline(mesh, {"cfg_degree": 2, "fsdp_degree": 2})),
    # video families whose record carries the plan (a world-2 spawn of their own: test_tensor_parallel_video_families)
    **{f"{f}_tp2": ({"tp_degree": 2}, lambda mesh, f=f: video_transformer_tp(mesh, f))
       for f in ("hunyuan", "hunyuan15", "ltx", "cogvideox", "minimax_h3", "wan_animate")},
    "ltx_i2v_pipeline_tp2": ({"tp_degree": 2}, lambda mesh: ltx_pipeline_tp(mesh)),
    # world 4: tp 2 x fsdp 2 (Ulysses 2): FSDP's removal gathers the packed single-block proj_out first
    "hunyuan_tp2_fsdp2": ({"tp_degree": 2, "fsdp_degree": 2}, lambda mesh: video_transformer_tp(
        mesh, "hunyuan", {"tp_degree": 2, "fsdp_degree": 2})),
    "wan_i2v_tp2_ulysses2": ({"tp_degree": 2}, lambda mesh: wan_transformer_tp(mesh)),
    "wan_i2v_tp2_fsdp2": ({"tp_degree": 2, "fsdp_degree": 2}, lambda mesh: wan_transformer_tp_fsdp(mesh)),
    "wan_cfg2_tp2_fsdp2": ({"cfg_degree": 2, "tp_degree": 2, "fsdp_degree": 2},
                           lambda mesh: wan_pipeline(mesh, {"cfg_degree": 2, "tp_degree": 2, "fsdp_degree": 2},
                                                     heads=4, two_stage=False)),
    "wan_cfg2_ulysses2_fsdp2": ({"cfg_degree": 2, "fsdp_degree": 2},
                                lambda mesh: wan_pipeline(mesh, {"cfg_degree": 2, "fsdp_degree": 2},
                                                          two_stage=False)),
}


def run_cases(rank, world_size, init_method, names):
    meshes = {}
    out = {}
    for name in names:
        parallel, fn = CASES[name]
        mesh = _mesh(meshes, parallel, init_method)
        out[name] = fn(mesh)
        out[name]["mesh"] = mesh.describe()
    return out
