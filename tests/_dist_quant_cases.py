"""Per-rank body of the ParallelManager + quantization test (spawned gloo ranks, see test_quant.py).

Every rank builds the same tiny pipeline from a fixed seed, runs it single-process with
``lite_boost.boost(..., quant=int8_dynamic)`` (the reference: no collectives), then a fresh copy under
ParallelManager with the same quantization: Ulysses over 2 ranks (3 heads, 45 tokens: uneven heads and
token shards), then cfg 2 with block-sparse attention; where the CPU runs int8 attention, the same two with
``attention.precision="int8"`` as well (each rank's heads or branch see the same K blocks as one process, so the
per-block int8 scales are the same). Each rank quantizes its own copy of the weights; a digest of the int8 data
shows they are identical across ranks.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KW = dict(height=48, width=80, num_frames=9, steps=2)  # 3 x 3 x 5 = 45 tokens


def _run(pipe):
    from conftest import pipeline_kwargs

    with torch.no_grad():
        return pipe(**pipeline_kwargs("t2v", **KW)).frames


def _digest(model) -> str:
    h = hashlib.sha256()
    for name in model._lite_boost.extras["quant"].layers:
        w = model.get_submodule(name).weight
        h.update(w.qdata.contiguous().numpy().tobytes())
        h.update(w.scale.contiguous().numpy().tobytes())
    return h.hexdigest()


def quantized_parallel(rank, world_size, init_method):
    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    warnings.simplefilter("ignore")
    spec = TinyWanSpec(heads=3, head_dim=24)
    sparse = {"sparsity": 0.8, "block_size": 4, "backend": "gather"}
    from lite_boost.ops.precision import cpu_int8_reason

    out = {}
    cases = [("seq2", 1, None, "auto"), ("cfg2_sparse", 2, sparse, "auto")]
    if cpu_int8_reason() is None:
        cases += [("seq2_attn8", 1, None, "int8"), ("cfg2_sparse_attn8", 2, {**sparse, "backend": "cpp"}, "int8")]
    for name, cfg_degree, sp, precision in cases:
        config = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}, "quant": {"method": "int8_dynamic"},
                  "attention": {"precision": precision}}
        if sp is not None:
            config["sparse"] = sp
        stock = _run(tiny_wan_pipeline("t2v", spec=spec))
        ref = _run(lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec), {k: v for k, v in config.items()
                                                                            if k != "parallel"}))
        mesh = initialize_usp(config, init_method=init_method)
        pipe = ParallelManager(tiny_wan_pipeline("t2v", spec=spec), config, mesh=mesh)
        got = _run(pipe)
        out[name] = {"max_diff": (got - ref).abs().max().item(),
                     "quant_rel_err": ((ref - stock).norm() / stock.norm()).item(),
                     "layers": len(pipe.transformer._lite_boost.extras["quant"].layers),
                     "weights_digest": _digest(pipe.transformer)}
        unparallelize(pipe)
    return out
