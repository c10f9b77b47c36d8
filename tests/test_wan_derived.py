"""The Wan-derived families (ChronoEdit, SkyReels-V2, Wan VACE, Wan Animate) against stock diffusers, one table.

Each family's tiny pipeline (``_tiny_wan_derived``: 3 heads, odd token planes, CFG on) boosted = stock within
1e-5 (fp32), and back to stock after unboost; the transformer alone at awkward shapes (batch 2, odd grids);
sparsity 0 = dense and 0.8 skips blocks; the offered step cache = the same diffusers hook on stock; no graph
break; Wan Animate's face adapter on any run of tokens (a shard cut mid-frame, padding) = diffusers' on the whole
sequence; ``ParallelManager`` at 2, 3 and 4 gloo ranks (Ulysses, Ring, Ulysses x Ring, Ring x sparse, CFG,
CFG x Ulysses) = one process.
"""

from __future__ import annotations

import pytest
import torch

import _dist_wan_derived_cases as dist_cases
import _tiny_wan_derived as tiny
import lite_boost
from _dist_utils import run_ranks
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.wan import LiteBoostWanAttnProcessor
from lite_boost.models.wan_animate import LiteBoostWanAnimateFaceProcessor

TOL = 1e-5
# (family, pipeline kind, call overrides): awkward token grids
PIPELINES = [
    # temporal reasoning: 3 x 3 x 5 tokens, then the two-frame edit (RoPE frames 0 and skip - 1)
    ("chronoedit", None, dict(num_frames=9, enable_temporal_reasoning=True, num_temporal_reasoning_steps=1,
                              num_inference_steps=3)),
    ("skyreels-v2", "t2v", {}),
    ("skyreels-v2", "i2v", {}),  # CLIP image context through the added k / v of the cross-attention
    # asynchronous diffusion forcing: per-frame timesteps, 5 x 3 x 5 tokens, the causal mask of 2-frame blocks
    ("skyreels-v2", "df", dict(num_frames=17, base_num_frames=17, causal_block_size=2, ar_step=1)),
    ("wan-vace", None, dict(height=80, width=48)),  # control video and mask, 2 x 5 x 3 tokens
    ("wan-animate", None, {}),  # reference frame + 2 frames of pose / face, 3 x 3 x 5 tokens
]
FAMILIES = sorted({f for f, _, _ in PIPELINES})
# family -> (transformer input frame counts, the step cache offered and its stock diffusers config)
STEPS = 4


def _pab(pipe):
    import diffusers.hooks as h

    return h.PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                             spatial_attention_timestep_skip_range=(0, 1000),
                                             current_timestep_callback=lambda: pipe.current_timestep)


def _taylorseer(pipe):
    import diffusers.hooks as h

    return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32,
                                   cache_identifiers=[r"^blocks\.\d+\.(attn1|attn2|ffn)$"])


def _fbc(pipe):
    import diffusers.hooks as h

    return h.FirstBlockCacheConfig(threshold=0.5)


# family -> (pipeline kind, method, lite_boost parameters, the stock diffusers config); ChronoEdit: its pipeline
# sets no cache_context, so its reference names the calls by hand (tests/test_cache_chronoedit.py)
CACHES = {"skyreels-v2": ("t2v", "taylorseer_cache", {"cache_interval": 2, "disable_cache_before_step": 1,
                                                     "taylor_factors_dtype": "float32"}, _taylorseer),
          "wan-vace": (None, "first_block_cache", {"threshold": 0.5}, _fbc),
          "wan-animate": (None, "taylorseer_cache", {"cache_interval": 2, "disable_cache_before_step": 1,
                                                     "taylor_factors_dtype": "float32"}, _taylorseer)}
# family -> direct transformer calls: (frames, per-frame timesteps)
FRAMES = {"chronoedit": ((2, False), (3, False)), "skyreels-v2": ((3, False), (3, True)), "wan-vace": ((3, False),),
          "wan-animate": ((3, False), (4, False))}


def _frames(pipe, family, kind=None, **over):
    return pipe(**tiny.call_kwargs(family, kind, **over)).frames


@pytest.mark.parametrize("family, kind, over", PIPELINES)
def test_boosted_pipeline_matches_stock(family, kind, over):
    pipe = tiny.pipeline(family, kind)
    stock = _frames(pipe, family, kind, **over)
    assert lite_boost.boost(pipe) is pipe
    state = pipe.transformer._lite_boost
    assert state.family.name == family
    face = {n for n in state.processors if n.startswith("face_adapter.")}  # Wan Animate's face adapter
    assert all(isinstance(p, LiteBoostWanAnimateFaceProcessor if n in face else LiteBoostWanAttnProcessor)
               for n, p in state.processors.items())
    assert len(face) == len(getattr(pipe.transformer, "face_adapter", ()))
    blocks = len(pipe.transformer.blocks) + len(getattr(pipe.transformer, "vace_blocks", ()))  # VACE's context blocks
    assert sorted(p.layer_idx for p in state.self_attention_processors) == list(range(blocks))
    boosted = _frames(pipe, family, kind, **over)
    assert boosted.shape == stock.shape and (boosted - stock).abs().max().item() <= TOL
    assert state.rope_patched and state.rope_cache.misses == (2 if "enable_temporal_reasoning" in over else 1)
    assert state.rope_cache.hits >= 1
    lite_boost.unboost(pipe)
    assert not lite_boost.api.is_boosted(pipe) and "forward" not in pipe.transformer.rope.__dict__
    assert (_frames(pipe, family, kind, **over) - stock).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_matches_stock_at_awkward_shapes(family):
    model = tiny.transformer(family)
    refs = []
    with torch.no_grad():
        inputs = [tiny.transformer_inputs(family, frames=f, batch=2, per_frame=pf) for f, pf in FRAMES[family]]
        refs = [model(**x).sample for x in inputs]
        lite_boost.boost(model)
        for x, ref in zip(inputs, refs):
            assert (model(**x).sample - ref).abs().max().item() <= TOL
    assert model._lite_boost.rope_cache.misses == len({f for f, _ in FRAMES[family]})


@pytest.mark.parametrize("family", FAMILIES)
def test_sparsity_zero_is_dense_and_a_sparse_run_skips_blocks(family):
    model = tiny.transformer(family)
    x = tiny.transformer_inputs(family, frames=4)  # 4 x 5 x 7 = 140 tokens
    base = dict(block_size=4, backend="gather")
    with torch.no_grad():
        stock = model(**x).sample
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
        assert (model(**x).sample - stock).abs().max().item() <= TOL
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.8, **base)))
        sparse = model(**x).sample
    st = model._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (4, 5, 7)
    assert st.mean_effective_sparsity() > 0.3 and (sparse - stock).abs().max() > 1e-4


@pytest.mark.parametrize("family", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(family):
    kind, method, params, stock_config = CACHES[family]
    stock_pipe = tiny.pipeline(family, kind)
    plain = _frames(stock_pipe, family, kind, num_inference_steps=STEPS)
    stock_pipe.transformer.enable_cache(stock_config(stock_pipe))
    stock = _frames(stock_pipe, family, kind, num_inference_steps=STEPS)
    pipe = lite_boost.boost(tiny.pipeline(family, kind), {"cache": {"method": method, **params}})
    got = _frames(pipe, family, kind, num_inference_steps=STEPS)
    assert (stock - plain).abs().max() > 1e-5 and (got - stock).abs().max().item() <= TOL
    refused = sorted(set(lite_boost.models.wan.WAN_CACHE_ADAPTER.methods) - set(
        pipe.transformer._lite_boost.family.cache.methods))
    for other in refused:  # the others are refused with the reason, before anything changes
        with pytest.raises(ConfigError, match=other):
            lite_boost.boost(tiny.pipeline(family, kind), {"cache": other})


# dense boosts: tests/test_family_contract.py; here block-sparse (VACE's context blocks, diffusion forcing)
@pytest.mark.parametrize("family, frames, per_frame", [("skyreels-v2", 3, True), ("wan-vace", 2, False)])
def test_explain_reports_no_graph_break_with_sparse(family, frames, per_frame, fresh_dynamo):
    model = lite_boost.boost(tiny.transformer(family), BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=4,
                                                                                      backend="gather")))
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**tiny.transformer_inputs(family, frames=frames, per_frame=per_frame))
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


def test_wan_animate_face_adapter_on_any_run_of_tokens_equals_diffusers_on_the_whole(fresh_dynamo):
    """The face adapter shim on the shard [start, stop) of P ranks (cut mid-frame; the last with padding rows, or
    padding only) = the slice of diffusers' processor on the whole sequence; the whole = diffusers' bit for bit;
    no graph break on a shard."""
    model = tiny.transformer("wan-animate")
    face, stock = model.face_adapter[0], model.face_adapter[0].processor
    frames, frame_len, batch = 4, 35, 2
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(batch, frames * frame_len, face.inner_dim, generator=g)
    motion = torch.randn(batch, frames, 3, face.inner_dim, generator=g)
    total = frames * frame_len
    with torch.no_grad():
        whole = face(hidden, motion)
        lite_boost.boost(model)
        state = model._lite_boost
        assert isinstance(face.processor, LiteBoostWanAnimateFaceProcessor) and face.processor.state is state
        assert torch.equal(face(hidden, motion), whole)  # outside a call: the whole sequence
        state.call = total  # as the family's call_context sets it during a transformer call
        assert torch.equal(face(hidden, motion), whole)
        for ranks in (2, 3, 6, 29, 141):  # 141: ranks of padding only
            shard = -(-total // ranks)
            padded = torch.cat([hidden, torch.zeros(batch, shard * ranks - total, face.inner_dim)], dim=1)
            for rank in range(ranks):
                start = rank * shard
                state.rope_range = lambda n, start=start: (start, start + shard)
                out = face(padded[:, start:start + shard], motion)
                real = max(0, min(shard, total - start))
                assert out.shape == (batch, shard, face.inner_dim)
                if real:
                    assert (out[:, :real] - whole[:, start:start + real]).abs().max().item() <= 1e-6
        state.rope_range = lambda n: (47, 94)  # rank 1 of 3: frames 1 (from its 13th token) to 2 (to its 24th)
        report = torch._dynamo.explain(face)(hidden[:, 47:94], motion)
        assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
        state.rope_range = lambda n: (0, 2)
        with pytest.raises(RuntimeError, match=r"face adapter 0: got 5 video tokens, expected 2"):
            face(hidden[:, :5], motion)
        state.rope_range, state.call = None, total + 1
        with pytest.raises(ValueError, match=r"141 video tokens do not split into the motion vector's 4 frames"):
            face(torch.cat([hidden, hidden[:, :1]], dim=1), motion)
        state.call = None
    lite_boost.unboost(model)
    assert face.processor is stock


# --------------------------------------------------------------------------------------------- parallel
_RESULTS: dict = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(dist_cases.run_all, world, dist_cases.cases_for(world), timeout=600)
    return _RESULTS[world]


@pytest.mark.parametrize("world, case", [(w, c) for w in (2, 3, 4) for c in dist_cases.cases_for(w)])
def test_parallel_matches_one_process(world, case):
    for rank, res in enumerate(_results(world)):
        r = res[case]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        if case.endswith("_refused"):  # on every rank, before any collective of the call (no hang)
            assert "causal_block_size=2" in r["refused"] and "ulysses_degree" in r["refused"], r
            continue
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, (rank, r)
        if "cfg2" in case:  # each cfg rank computed one pass per step and received the other
            assert all(c["deferred"] == c["computed"] > 0 for c in r["cfg_calls"]), r
        if "sparse" in case:
            assert r["sparse_paths"] == ["sparse"], r
        if "sparsity0" in case:  # the sparse path ran, and ran dense
            assert r["sparse_paths"] == ["dense"], r
        if case.startswith("animate_") and r["sequence_degree"] > 1:  # the face adapter ran on this rank's shard
            assert r["face_runs"] and all(local == -(-total // r["sequence_degree"]) < total
                                          for local, total in r["face_runs"]), r
