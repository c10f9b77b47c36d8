"""torch.compile of boosted Wan transformers: no graph breaks, eager parity, bounded recompiles.

Compiles are slow on small shared CPUs, so the models are tiny, dynamo-only checks use the "eager"
or a counting backend, and inductor runs only where its output is what is asserted.
"""

import pytest
import torch
import torch._dynamo.testing

import lite_boost
from lite_boost.config import BoostConfig, SparseConfig
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline, tiny_wan_transformer
from lite_boost.ops.attention import AttentionBackendError, attention_backend

from conftest import pipeline_kwargs

TOL = 1e-4
# Small blocks so a tiny grid has many blocks to drop; the pure-PyTorch kernel avoids a FlexAttention
# compile (the kernels are tested in test_rain_fusion.py).
SPARSE = SparseConfig(sparsity=0.8, block_size=16, backend="gather", dense_steps_first=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo(fresh_dynamo):
    yield


def _inputs(i2v=False, grid=(3, 8, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(1, 36 if i2v else 16, f, 2 * h, 2 * w, generator=g)
    ctx = torch.randn(1, 512, 32, generator=g)
    kw = {"encoder_hidden_states_image": torch.randn(1, 257, 4, generator=g)} if i2v else {}
    return (x, torch.tensor([700.0]), ctx), kw


def _model(kind, heads=3):
    if kind == "i2v":
        spec = TinyWanSpec(heads=heads, in_channels=36, image_dim=4, added_kv_proj_dim=heads * 24)
    else:
        spec = TinyWanSpec(heads=heads)
    model = tiny_wan_transformer(spec)
    return model, (BoostConfig(sparse=SPARSE) if kind == "sparse" else None)


@pytest.mark.parametrize("kind", ["sparse", "i2v"])  # stock, dense: tests/test_family_contract.py
def test_explain_reports_no_graph_break(kind):
    model, config = _model(kind)
    if kind != "stock":
        lite_boost.boost(model, config)
    args, kw = _inputs(i2v=kind == "i2v")
    with torch.no_grad():
        report = torch._dynamo.explain(model)(*args, **kw)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind):
    """diffusers' regional compile recipe, with inductor, on a boosted transformer (two steps)."""
    model, config = _model(kind)
    lite_boost.boost(model, config)
    (x, _, ctx), _ = _inputs(grid=(3, 5, 7))
    steps = [torch.tensor([900.0]), torch.tensor([600.0])]
    with torch.no_grad():
        ref = [model(x, t, ctx).sample for t in steps]
        if kind == "sparse":
            eager_events = [(e.layer, e.path) for e in model._lite_boost.extras["sparse"].events]
            assert ("sparse" in {p for _, p in eager_events}), eager_events
        model.compile_repeated_blocks(fullgraph=True)
        out = [model(x, t, ctx).sample for t in steps]
    for r, o in zip(ref, out):
        assert (o - r).abs().max().item() <= TOL
    if kind == "sparse":
        # the compiled blocks took the same (sparse) paths as eager; the mask built at the first
        # step was reused at the second (mask_reuse_steps default)
        events = model._lite_boost.extras["sparse"].events
        assert [(e.layer, e.path) for e in events][-4:] == eager_events[-4:]


def _count_compiles(pipe, kind, *, regional):
    counter = torch._dynamo.testing.CompileCounter()
    if regional:
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=counter)
    else:
        pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend=counter)
    with torch.no_grad():
        pipe(**pipeline_kwargs(kind, height=64, width=128, num_frames=5, steps=6))  # 64 tokens
    return counter.frame_count


@pytest.mark.parametrize("regional", [True, False], ids=["compile_repeated_blocks", "torch.compile"])
def test_six_step_pipeline_compiles_at_most_twice(regional):
    """Step index and timestep never become guards: 6 steps x (cond, uncond) x 2 layers, dense steps
    and sparse steps with mask reuse, still at most one recompile."""
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    schedule = SparseConfig(sparsity=0.8, block_size=16, backend="gather", dense_steps_first=2, dense_steps_last=1,
                            mask_reuse_steps=2)
    lite_boost.boost(pipe, BoostConfig(sparse=schedule))
    compiles = _count_compiles(pipe, "t2v", regional=regional)
    assert 1 <= compiles <= 2, compiles
    paths = {e.path for e in pipe.transformer._lite_boost.extras["sparse"].events}
    assert paths == {"dense", "sparse"}  # the schedule really switched while compiled


@pytest.mark.parametrize("how", ["config", "context", "sparse"])
def test_forced_backend_that_cannot_run_raises_the_dispatch_error(how):
    model, _ = _model("dense")
    args, _ = _inputs(grid=(2, 3, 3))
    if how == "sparse":  # block-sparse kernel forced to the Ascend one on CPU, inside compiled blocks
        from lite_boost.ops.rain_fusion import SparseBackendError

        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=4, backend="npu")))
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        with torch.no_grad(), pytest.raises(SparseBackendError, match=r"'npu' \(requested by the call\) cannot run"):
            model(*args)
        return
    if how == "config":
        lite_boost.boost(model, BoostConfig(attention_backend="fa2"))
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with torch.no_grad(), pytest.raises(AttentionBackendError, match=r"'fa2' \(requested by the call\)"):
            compiled(*args)
        return
    lite_boost.boost(model)
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        model(*args)  # automatic choice compiles and runs
        # a context manager around the compiled call is honoured (the guard on it retraces)
        with attention_backend("npu"), pytest.raises(AttentionBackendError, match=r"forced by attention_backend"):
            model(*args)
        model(*args)  # and leaving it restores the automatic graph


@pytest.mark.slow
def test_ulysses_two_ranks_with_compiled_blocks_matches_single_process():
    """Blocks compiled with fullgraph=True hold the all_to_alls (3 heads and 45 tokens on 2 ranks)."""
    import _dist_compile_cases as cases
    from _dist_utils import run_ranks

    sparse_cfg = {"sparsity": 0.8, "block_size": 16, "backend": "gather"}
    results = run_ranks(cases.compiled_ulysses, 2, sparse_cfg, timeout=420)
    for rank, per_kind in enumerate(results):
        for kind, res in per_kind.items():
            assert max(res["diffs"]) <= TOL, (rank, kind, res)
            # the exchanges ran inside the compiled blocks (eager ones are counted); the final gather is eager
            assert "qkv_to_heads" not in res["eager_collectives"] and "gather" in res["eager_collectives"], res
        assert {p for _, _, p in per_kind["sparse"]["events"]} == {"sparse"}, per_kind["sparse"]["events"]


def test_step_cache_composes_with_compiled_blocks():
    """First-Block Cache (diffusers' hooks, issue 10) + sparse attention + compiled blocks = eager output.

    diffusers' cache hooks break the graph themselves (their decisions are ``torch.compiler.disable``d),
    with or without lite_boost, so the blocks are compiled without fullgraph here and lite_boost must
    add no graph beyond what stock diffusers with the same cache compiles.
    """
    from diffusers.hooks import FirstBlockCacheConfig

    from lite_boost.config import CacheConfig

    kw = dict(height=64, width=128, num_frames=5, steps=4)
    config = BoostConfig(sparse=SPARSE, cache=CacheConfig(method="first_block_cache", params={"threshold": 0.3}))
    outs, graphs, decisions = {}, {}, {}
    for variant in ("eager", "compiled", "stock"):
        torch._dynamo.reset()
        pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
        if variant == "stock":
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
        else:
            lite_boost.boost(pipe, config)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        if variant != "eager":
            pipe.transformer.compile_repeated_blocks(backend=counter)
        with torch.no_grad():
            outs[variant] = pipe(**pipeline_kwargs("t2v", **kw)).frames
        graphs[variant] = counter.frame_count
        if variant != "stock":
            decisions[variant] = [d.compute for d in pipe.transformer._lite_boost.extras["cache"].decisions]
    assert (outs["compiled"] - outs["eager"]).abs().max().item() <= TOL
    assert decisions["compiled"] == decisions["eager"] and not all(decisions["eager"]), decisions
    assert graphs["compiled"] == graphs["stock"], graphs
