"""Per-rank body of the compiled Ulysses test (spawned gloo ranks, see test_compile.py).

Every rank computes the single-process eager reference itself (a boosted copy, no collectives), then
runs a fresh copy under ParallelManager (sequence degree = world size) with diffusers' regional
compilation of the blocks, so each compiled block holds the two Ulysses all_to_all exchanges
(functional collectives).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HEADS = 3  # uneven head split on 2 ranks
GRID = (3, 5, 3)  # 45 tokens: uneven sequence shards (23 + 22, one padded row)


def _inputs():
    g = torch.Generator().manual_seed(5)
    f, h, w = GRID
    x = torch.randn(1, 16, f, 2 * h, 2 * w, generator=g)
    ctx = torch.randn(1, 512, 32, generator=g)
    return x, ctx


def _one(spec, sparse_cfg, backend):
    import lite_boost
    from lite_boost.demo import tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    torch._dynamo.reset()
    config = {"parallel": {"timeout_s": 120}}
    if sparse_cfg is not None:
        config["sparse"] = sparse_cfg
    x, ctx = _inputs()
    steps = (torch.tensor([900.0]), torch.tensor([700.0]))  # two steps: the compiled graph is reused
    ref_model = lite_boost.boost(tiny_wan_transformer(spec), {"sparse": sparse_cfg} if sparse_cfg else None)
    model = ParallelManager(tiny_wan_transformer(spec), config)
    model.compile_repeated_blocks(fullgraph=True, backend=backend)
    stats = model._lite_boost.extras["parallel"].hooks.comm.enable_stats()
    diffs = []
    with torch.no_grad():
        for t in steps:
            ref = ref_model(x, t, ctx).sample
            out = model(x, t, ctx).sample
            diffs.append((out - ref).abs().max().item())
    events = None
    if sparse_cfg is not None:
        events = [(e.step, e.layer, e.path) for e in model._lite_boost.extras["sparse"].events]
    return {"diffs": diffs, "events": events, "eager_collectives": dict(stats.calls)}


def compiled_ulysses(rank, world_size, init_method, sparse_cfg):
    """Dense blocks compiled by inductor, then sparse blocks traced by dynamo + AOT (aot_eager)."""
    from lite_boost.demo import TinyWanSpec

    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    spec = TinyWanSpec(heads=HEADS, head_dim=24)
    return {"dense": _one(spec, None, "inductor"), "sparse": _one(spec, sparse_cfg, "aot_eager")}
