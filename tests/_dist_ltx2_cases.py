"""Per-rank bodies of the LTX-2 parallel parity tests (spawned gloo ranks, test_parallel_ltx2.py).

Each case builds a tiny LTX-2 pipeline from a fixed seed and runs it in this process with stock diffusers (the
reference; for sparse / cached cases lite_boost.boost with the same config, single process), then a fresh copy
under ``ParallelManager`` on the rank group, and returns the max abs difference of both outputs (video and
audio latents), the audio output itself (every rank must hold the same), what the first block saw (batch,
video tokens, audio tokens, per-token modulation rows) and the collectives that ran. All cases of one world
size share one process group (one mesh per (cfg, ring) layout).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# (height, width, frames) px -> video tokens (32 x 32 x 8 compression), audio tokens (25 a second at 24 fps)
ODD = (96, 160, 17)  # 3 x 3 x 5 = 45 video tokens (2 ranks: 23 + 22), 18 audio tokens
FORTY = (128, 160, 9)  # 2 x 4 x 5 = 40 video tokens (3 ranks: 14 + 14 + 12), 9 audio tokens
SPARSE = (128, 256, 25)  # 4 x 4 x 8 = 128 video tokens (3 ranks: 43 + 43 + 42), 26 audio tokens
TALL = (192, 160, 9)  # 2 x 6 x 5 = 60 video tokens, 9 audio tokens: 6 latent rows, bands of 2 rows at 3 ranks
_SPARSE = {"sparse_type": "rf_v2", "block_size": 4, "backend": "gather"}
_STG = {"stg": 1.0, "stg_blocks": [0], "modality": 3.0}  # three transformer calls a step (B = 2, 1, 1)
_PAB = {"method": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2,
        "spatial_attention_timestep_skip_range": (0, 1000)}
_TAYLOR = {"method": "taylorseer_cache", "cache_interval": 2, "disable_cache_before_step": 1,
           "taylor_factors_dtype": "float32"}

# name -> kind, spec, (height, width, frames), parallel config, extra boost config, extra call arguments
CASES = {
    "t2v_split_tok45": ("t2v", "split", ODD, {}, {}, {}),
    "t2v_interleaved_tok40": ("t2v", "interleaved", FORTY, {}, {}, {}),
    "t2v_gated_stg_modality_tok45": ("t2v", "gated_stg", ODD, {}, {}, _STG),  # perturbed block 0, B = 1 calls
    "i2v_tok45": ("i2v", "split", ODD, {}, {}, {}),  # per-token video timesteps split with the tokens
    "t2v_decoded": ("t2v", "split", TALL, {}, {}, {"output_type": "pt", "steps": 1}),  # exact parallel VAE
    "t2v_ring_tok45": ("t2v", "split", ODD, {"ring": True}, {}, {}),
    "t2v_ring_sparse075": ("t2v", "split", SPARSE, {"ring": True}, {"sparse": {**_SPARSE, "sparsity": 0.75}}, {}),
    "t2v_sparse0": ("t2v", "split", SPARSE, {}, {"sparse": {**_SPARSE, "sparsity": 0.0}}, {}),
    "t2v_sparse075": ("t2v", "split", SPARSE, {}, {"sparse": {**_SPARSE, "sparsity": 0.75}}, {}),
    "t2v_taylorseer": ("t2v", "split", ODD, {}, {"cache": _TAYLOR}, {"steps": 4}),
    "i2v_pab": ("i2v", "split", ODD, {}, {"cache": _PAB}, {"steps": 4}),
    "t2v_cfg2": ("t2v", "split", ODD, {"cfg": 2}, {}, _STG),  # batched half per cfg rank; B = 1 calls whole
    "i2v_cfg2": ("i2v", "interleaved", ODD, {"cfg": 2}, {}, {}),
    "t2v_cfg2_no_guidance": ("t2v", "split", ODD, {"cfg": 2}, {}, {"guidance": 1.0}),  # B = 1: nothing split
}


def tokens(hwf):
    h, w, f = hwf
    return ((f - 1) // 8 + 1) * (h // 32) * (w // 32), round(f / 24.0 * 25)


def layout(world, par):
    """(cfg_degree, ring_degree) of a case at ``world`` ranks (None: the case does not run there)."""
    cfg = par.get("cfg", 1)
    if world % cfg:
        return None
    return cfg, (world // cfg if par.get("ring") else 1)


def _config(cfg, ring, extra):
    return {"parallel": {"cfg_degree": cfg, "ring_degree": ring, "timeout_s": 120}, **extra}


def run_cases(rank, world_size, init_method, names):
    import _tiny_ltx2 as t
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    specs = {"split": t.TinyLTX2Spec(), "interleaved": t.TinyLTX2Spec(rope_type="interleaved"),
             "gated_stg": t.TinyLTX2Spec(gated=True, perturbed=True)}
    meshes, out = {}, {}
    for name in names:
        kind, spec, (h, w, f), par, extra_cfg, extra = CASES[name]
        cfg, ring = layout(world_size, par)
        config = _config(cfg, ring, extra_cfg)
        call = lambda: t.call_kwargs(kind, height=h, width=w, frames=f, **extra)  # noqa: E731
        ref_pipe = t.tiny_ltx2_pipeline(kind, spec=specs[spec])
        if extra_cfg:
            lite_boost.boost(ref_pipe, extra_cfg)
        ref = ref_pipe(**call())
        if (cfg, ring) not in meshes:
            meshes[(cfg, ring)] = initialize_usp(config, init_method=init_method)
        mesh = meshes[(cfg, ring)]
        pipe = t.tiny_ltx2_pipeline(kind, spec=specs[spec])
        ParallelManager(pipe, config, mesh=mesh)
        seen = []
        hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
            lambda mod, args, kw: seen.append((tuple(kw["hidden_states"].shape[:2]), kw["temb"].shape[1],
                                               kw["audio_hidden_states"].shape[1])), with_kwargs=True)
        stats = mesh.sequence.enable_stats()
        stats.reset()
        got = pipe(**call())
        hook.remove()
        mesh.sequence.stats = None
        out[name] = {
            **parallel_record(pipe.transformer, mesh, got.frames, ref.frames, seen, stats),
            "audio_maxdiff": (got.audio - ref.audio).abs().max().item(),
            "audio_abs": ref.audio.abs().max().item(),
            "audio": got.audio.clone(),
            "layout": (cfg, ring),
        }
        unparallelize(pipe)
    return out
