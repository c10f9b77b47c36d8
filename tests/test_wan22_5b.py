"""Wan2.2-TI2V-5B (``WanPipeline(expand_timesteps=True)``, 48-channel residual VAE) with every feature.

Single process, tiny in-memory pipelines (tests/_tiny_wan5b.py): dense boost vs stock diffusers
(T2V and I2V with ``first_frame_mask``), block-sparse self-attention (sparsity 0 = dense; 0.8 skips
blocks), step caching vs the same diffusers hook on stock, ``torch.compile`` (no graph break,
``compile_repeated_blocks(fullgraph=True)`` = eager) and the parallel-VAE adapter of the 48-channel
VAE. Multi-process (gloo, 2 / 3 / 4 ranks, one spawn per world size running every case of that size,
tests/_dist_wan5b_cases.py): Ulysses with per-token timesteps sharded with the tokens, CFG parallel,
cfg 2 x sequence 2, sparse and cached runs under ParallelManager, and the exact / chunked parallel
VAE for decode and encode, each against the one-process run.
"""

from __future__ import annotations

import pytest
import torch

import lite_boost
from lite_boost.config import BoostConfig, SparseConfig

import _dist_wan5b_cases as cases
from _dist_utils import run_ranks
from _tiny_wan5b import call_kwargs, tiny_wan5b_pipeline, tiny_wan5b_transformer, tiny_wan5b_vae, tokens

TOL = 1e-5
HWF = (96, 160, 9)  # latent 3 x 6 x 10 -> tokens 3 x 3 x 5 = 45 (odd grid)


@pytest.fixture(autouse=True)
def _gather_kernel(monkeypatch):
    """The sparse kernels are tested in test_rain_fusion.py; skip FlexAttention compiles here."""
    monkeypatch.setenv("LITE_BOOST_SPARSE_BACKEND", "gather")


def _timesteps_seen(pipe, kind, **kw):
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["timestep"].clone()), with_kwargs=True)
    try:
        out = pipe(**call_kwargs(kind, HWF, **kw)).frames
    finally:
        handle.remove()
    return out, seen


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_tiny_pipeline_is_the_ti2v_5b_layout(kind):
    """What the other tests rely on: per-token (B, S) timesteps, frame 0 at timestep 0 for I2V, 48 channels."""
    pipe = tiny_wan5b_pipeline(kind)
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    assert (pipe.vae.config.z_dim, pipe.vae.config.patch_size, pipe.vae.config.is_residual) == (48, 2, True)
    video, seen = _timesteps_seen(pipe, kind)
    assert video.shape == (1, 9, 3, 96, 160)
    per_frame = tokens(96, 160, 1)
    assert len(seen) == 4 and all(t.shape == (1, tokens(*HWF)) for t in seen)  # 2 steps x (cond, uncond)
    first, rest = seen[0][:, :per_frame], seen[0][:, per_frame:]
    assert (rest == rest.max()).all() and rest.max() > 0
    assert (first == 0).all() if kind == "i2v" else (first == rest.max()).all()


# ------------------------------------------------------------------------------------------ dense boost
@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_dense_boost_matches_stock(kind):
    pipe = tiny_wan5b_pipeline(kind)
    stock = {o: pipe(**call_kwargs(kind, HWF, output_type=o)).frames for o in ("latent", "pt")}
    lite_boost.boost(pipe)
    state = pipe.transformer._lite_boost
    for o, ref in stock.items():
        got = pipe(**call_kwargs(kind, HWF, output_type=o)).frames
        assert got.shape == ref.shape and ref.abs().max() > 0.1
        assert (got - ref).abs().max().item() <= TOL, o
    assert state.rope_patched and state.grid == (3, 3, 5) and state.rope_cache.hits >= 1
    lite_boost.unboost(pipe)
    assert (pipe(**call_kwargs(kind, HWF, output_type="latent")).frames - stock["latent"]).abs().max().item() == 0


# ------------------------------------------------------------------------------------------ sparse
@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_sparse_attention(kind):
    """sparsity 0 = stock; sparsity 0.8 skips blocks, is deterministic and starts every call afresh."""
    pipe = tiny_wan5b_pipeline(kind)
    kw = call_kwargs(kind, HWF, steps=3, output_type="latent")
    stock = pipe(**kw).frames
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, block_size=4)))
    dense = pipe(**call_kwargs(kind, HWF, steps=3, output_type="latent")).frames
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert st.grid == (3, 3, 5) and {e.path for e in st.events} == {"dense"}
    assert (dense - stock).abs().max().item() <= TOL

    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=4, mask_reuse_steps=2)))
    st = pipe.transformer._lite_boost.extras["sparse"]
    first = pipe(**call_kwargs(kind, HWF, steps=3, output_type="latent")).frames
    events = [(e.step, e.call, e.layer, e.path, e.reused) for e in st.events]
    again = pipe(**call_kwargs(kind, HWF, steps=3, output_type="latent")).frames
    assert {p for *_, p, _ in events} == {"sparse"} and st.mean_effective_sparsity() > 0.2
    assert (first - stock).abs().max().item() > 1e-3  # blocks really were skipped
    assert torch.equal(first, again)
    # the second call is a new generation with the same schedule (I2V's frame-0 tokens have timestep 0:
    # the step tracker reads the call's largest timestep)
    assert st.tracker.generation == 1
    assert [(e.step, e.call, e.layer, e.path, e.reused) for e in st.events] == events
    assert [s for s, c, layer, _, _ in events if layer == 0 and c == 0] == [0, 1, 2]
    assert any(r for *_, r in events)  # masks reused within the mask_reuse_steps window


def test_step_tracker_with_per_token_timesteps():
    """The sparse schedule's step tracker on TI2V timesteps: the noise level is the largest timestep (frame 0
    is at 0), and a scheduler step index going back starts a new generation even when every timestep a
    call sees is 0 (a sequence shard holding only frame-0 tokens, as the compiled path observes it)."""
    from types import SimpleNamespace

    from lite_boost.schedule import StepTracker

    tracker = StepTracker()
    tracker.observe(torch.tensor([[0.0, 0.0, 900.0, 900.0]]))
    tracker.observe(torch.tensor([[0.0, 0.0, 700.0, 700.0]]))
    assert (tracker.step, tracker.generation) == (1, 0)
    tracker.observe(torch.tensor([[0.0, 0.0, 900.0, 900.0]]))  # noise went up: a new call
    assert (tracker.step, tracker.generation) == (0, 1)

    class Pipe:  # the tracker keeps a weak reference to the pipeline
        scheduler = SimpleNamespace(step_index=None, timesteps=[900, 700, 500])

    pipe = Pipe()
    sched = pipe.scheduler
    tracker = StepTracker()
    tracker.attach(pipe)
    zeros = torch.zeros(1, 4)
    for generation in range(2):
        for idx in (None, 1, 2):
            sched.step_index = idx
            tracker.observe(zeros)
            assert (tracker.step, tracker.generation, tracker.total) == (idx or 0, generation, 3)


# ------------------------------------------------------------------------------------------ step caching
STEPS = 6
CACHES = {  # ours (lite_boost's names) -> diffusers' config on stock
    "first_block_cache": {"threshold": 0.1},  # flips between compute and reuse on these grids (I2V: 0.08)
    "mag_cache": {"threshold": 0.05, "num_inference_steps": STEPS, "mag_ratios": [1.0, 0.98, 0.97, 0.99, 0.96, 0.98]},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2, "cross_attention_block_skip_range": 3,
                                    "spatial_attention_timestep_skip_range": (0, 1000),
                                    "cross_attention_timestep_skip_range": (0, 1000)},
    "sea_cache": {"threshold": 1.0},
}


def _params(method, kind):
    p = dict(CACHES[method])
    if method == "first_block_cache" and kind == "i2v":
        p["threshold"] = 0.08
    return p


def _diffusers_cache(method, kind, pipe):
    import diffusers.hooks as h

    p = _params(method, kind)
    if method == "first_block_cache":
        return h.FirstBlockCacheConfig(**p)
    if method == "mag_cache":
        return h.MagCacheConfig(**p)
    if method == "taylorseer_cache":
        return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2,
                                       taylor_factors_dtype=torch.float32,
                                       cache_identifiers=[r"^blocks\.\d+\.(attn1|attn2|ffn)$"])
    if method == "pyramid_attention_broadcast":
        return h.PyramidAttentionBroadcastConfig(**p, current_timestep_callback=lambda: pipe.current_timestep)
    return h.SeaCacheConfig(**p)


@pytest.mark.parametrize("kind, method", [("t2v", m) for m in sorted(CACHES)] + [("i2v", "first_block_cache"),
                                                                               ("i2v", "pyramid_attention_broadcast")])
def test_step_cache_matches_the_diffusers_hook_on_stock(kind, method):
    from lite_boost.cache import count_block_work

    kw = lambda: call_kwargs(kind, HWF, steps=STEPS, output_type="latent")  # noqa: E731
    uncached = tiny_wan5b_pipeline(kind)(**kw()).frames
    stock = tiny_wan5b_pipeline(kind)
    stock.transformer.enable_cache(_diffusers_cache(method, kind, stock))
    with count_block_work([stock.transformer]) as stock_work:
        ref = stock(**kw()).frames
    pipe = lite_boost.boost(tiny_wan5b_pipeline(kind), {"cache": {"method": method, **_params(method, kind)}})
    with count_block_work([pipe.transformer]) as work:
        got = pipe(**kw()).frames
    again = pipe(**kw()).frames  # a fresh cache state per pipeline call
    assert (ref - uncached).abs().max().item() > 1e-4, "the reference skipped nothing: settings too mild"
    assert (got - ref).abs().max().item() <= TOL and (again - ref).abs().max().item() <= TOL
    assert (work.calls, work.ffn_runs, work.attn_runs) == (stock_work.calls, stock_work.ffn_runs, stock_work.attn_runs)


# ------------------------------------------------------------------------------------------ torch.compile
def _transformer_inputs(grid=(3, 3, 5), i2v=True, t=700.0):
    g = torch.Generator().manual_seed(0)
    f, h, w = grid
    x = torch.randn(1, 48, f, 2 * h, 2 * w, generator=g)
    ts = torch.full((1, f * h * w), t)
    if i2v:
        ts[:, : h * w] = 0.0  # first_frame_mask: the conditioning frame's tokens at timestep 0
    return x, ts, torch.randn(1, 512, 32, generator=g)


@pytest.mark.parametrize("kind", ["sparse"])  # stock, dense: tests/test_family_contract.py
def test_explain_reports_no_graph_break_with_per_token_timesteps(kind, fresh_dynamo):
    model = tiny_wan5b_transformer()
    if kind != "stock":
        sparse = SparseConfig(sparsity=0.8, block_size=4, dense_steps_first=0) if kind == "sparse" else None
        lite_boost.boost(model, BoostConfig(sparse=sparse))
    with torch.no_grad():
        report = torch._dynamo.explain(model)(*_transformer_inputs())
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


# ------------------------------------------------------------------------------------------ parallel VAE adapter
def test_vae_adapter_of_the_48_channel_vae():
    """Shapes and frame bookkeeping of the residual, patchified VAE, and chunk replay in one process."""
    from lite_boost.parallel.vae import plan_chunks, vae_adapter_for

    vae = tiny_wan5b_vae()
    ad = vae_adapter_for(vae)
    z, x = cases.vae_inputs(5, 3, 4, seed=3)
    with torch.no_grad():
        dec, enc = vae._decode(z).sample, vae._encode(x)
        assert ad.out_shape(z, "decode") == tuple(dec.shape) == (1, 3, 17, 48, 64)
        assert ad.out_shape(x, "encode") == tuple(enc.shape) == (1, 96, 5, 3, 4)
        for overlap, exact in ((1, False), (5, True)):
            plan = plan_chunks(5, 2, overlap=overlap)
            d = torch.cat([ad.run_chunk(vae._decode, z, c, "decode") for c in plan.chunks], dim=2)
            e = torch.cat([ad.run_chunk(vae._encode, x, c, "encode") for c in plan.chunks], dim=2)
            assert d.shape == dec.shape and e.shape == enc.shape
            assert torch.equal(d, dec) == exact and torch.equal(e, enc) == exact
    # the residual shortcuts are row-local; the encoder's bands stay aligned to its 3 downsamplings
    enc_layout, dec_layout = ad.spatial_layout("encode"), ad.spatial_layout("decode")
    assert enc_layout.unit == 8 and dec_layout.unit == 1
    assert enc_layout.pairs and dec_layout.pairs and len(enc_layout.bottom_halo) == 3
    vae.encoder.down_blocks[0].avg_shortcut.factor_s = 4  # a shortcut coarser than the bands' alignment
    with pytest.raises(NotImplementedError, match="AvgDown3D shortcuts downsample rows by 16.*band unit 8"):
        ad.spatial_layout("encode")


def test_exact_mode_overlap_policy():
    """"auto" overlaps the halo exchange of small CPU convolutions only (oneDNN reorders the weight at every
    call, so the overlapped path's two extra calls outweigh the hidden exchange for large weights)."""
    from torch import nn

    from lite_boost.config import ConfigError
    from lite_boost.parallel.comm import Communicator
    from lite_boost.parallel.vae import parallelize_vae
    from lite_boost.parallel.vae.spatial import _overlap_pays

    assert _overlap_pays(nn.Conv3d(16, 16, 3))  # 108 KiB of fp32 weights
    assert not _overlap_pays(nn.Conv3d(128, 128, 3))  # 1.7 MiB
    assert _overlap_pays(nn.Conv3d(128, 128, 3, device="meta"))  # no per-call weight reorder off the CPU
    with pytest.raises(ConfigError, match=r"overlap_halo must be one of \[True, False, 'auto'\], got 'always'"):
        parallelize_vae(tiny_wan5b_vae(), Communicator(None, 1, 0), overlap_halo="always")


# ------------------------------------------------------------------------------------------ multi-process
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, cases.WORLD_CASES[world], timeout=900)
    return _RESULTS[world]


def _check_pipeline(world, name):
    spec = cases.PIPELINE_CASES[name]
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.01, (rank, r)
        assert r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        seq = world // spec.cfg
        if spec.cfg > 1:  # each rank computes one of the two passes per step and defers the other
            assert r["cfg_calls"]["deferred"] == r["cfg_calls"]["computed"] > 0, r
        if seq > 1:
            # the blocks see a sequence shard, and the per-token timestep_proj / temb shards line up with it
            n = tokens(*spec.hwf)
            shard = -(-n // seq)
            assert r["block_tokens"] == [shard] and r["temb_tokens"] == [shard], r
            # one packed exchange per self-attention that ran: every layer, or only the first block on a
            # First-Block-Cache hit
            ran = [True] * r["transformer_calls"] if spec.cache is None else r["decisions"]
            assert r["qkv_exchanges"] == sum(r["layers"] if c else 1 for c in ran), r
        assert r["vae_calls"] == {"decode": 1, "encode": 1 if spec.kind == "i2v" else 0}, r
        if spec.sparsity is not None:
            assert r["paths"] == r["ref_paths"] == (["sparse"] if spec.sparsity else ["dense"]), r
        if spec.cache is not None:
            assert r["decisions"] == r["ref_decisions"] and False in r["ref_decisions"], r
    if spec.sparsity:
        per_rank = [res[name] for res in _results(world)]
        merged = sum(r["local_heads"] * r["effective"] for r in per_rank) / sum(r["local_heads"] for r in per_rank)
        assert merged == pytest.approx(per_rank[0]["ref_effective"]) and merged > 0.02, per_rank  # blocks skipped


def _check(world, name):
    if name in cases.PIPELINE_CASES:
        return _check_pipeline(world, name)
    for rank, res in enumerate(_results(world)):
        r = res[name]
        if name.startswith("shards"):
            # the one-process timestep_proj / temb / hidden states, sliced at this rank's token range,
            # are what the rank's blocks and output norm received (padding rows beyond S excluded)
            assert r["shape_ok"] and r["maxdiff"] <= TOL and r["ref_abs"] > 0.1, (rank, r)
            assert r["slices"] <= TOL and r["block_tokens"] == r["shard"], (rank, r)
        elif name == "compiled":
            assert max(r["diffs"]) <= 1e-4 and "qkv_to_heads" not in r["eager_collectives"], (rank, r)
        elif name == "vae":
            for key, v in r.items():
                assert v["dec"] <= TOL and v["enc"] <= TOL, (rank, key, v)
                if key[0] == "exact" and key[-1] != "unsplit":
                    assert v["halos"] > 0 and v["enc_halos"] > 0, (rank, key, v)  # really split
                if key[0] == "exact" and key[-1] == "unsplit":
                    assert v["halos"] == 0 and v["enc_halos"] == 0, (rank, key, v)  # every rank ran it whole
                if key[0] == "chunked":
                    assert v["shape_ok"] and v["chunk0"] <= 1e-6 and v["dec_calls"] == {"vae_gather": 1}, (rank, key, v)
        else:
            raise AssertionError(name)


@pytest.mark.parametrize("name", cases.WORLD_CASES[2])
def test_two_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", cases.WORLD_CASES[3])
def test_three_ranks(name):
    _check(3, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", cases.WORLD_CASES[4])
def test_four_ranks_cfg2_x_seq2(name):
    _check(4, name)
