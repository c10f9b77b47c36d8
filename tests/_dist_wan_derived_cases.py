"""Per-rank bodies of the Wan-derived families' parity tests (spawned gloo ranks, test_wan_derived.py).

Each case runs a family's tiny pipeline (``_tiny_wan_derived``) once in one process (the reference, on every
rank, no collectives: stock diffusers, or the one-process boost with the same sparse config for sparse
cases) and once under ``ParallelManager`` with the case's layout, and reports the max abs difference of
the output latents. All cases of one world size share one spawn.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 120
SPARSE = {"sparse_type": "rf_v2", "sparsity": 0.8, "block_size": 4}
ASYNC = dict(num_frames=17, base_num_frames=17, causal_block_size=2, ar_step=1)
ANIMATE_140 = dict(height=80, width=112, num_frames=9)  # Wan Animate: reference + 3 latent frames of 5 x 7 tokens

# name -> (family, pipeline kind, layout(world) -> parallel degrees, sparse config or None, call overrides, worlds)
CASES = {
    # ChronoEdit's two-frame edit (RoPE frames 0 and skip - 1): 2 x 5 x 7 = 70 tokens (not a multiple of 3), 3 heads
    "chronoedit_ulysses": ("chronoedit", None, lambda w: {"ulysses_degree": w}, None, dict(height=80, width=112), (3,)),
    "chronoedit_ring_sparse08": ("chronoedit", None, lambda w: {"ring_degree": w}, SPARSE,
                                 dict(height=80, width=112), (2,)),
    # decoded video: the Wan VAE's parallel decode (exact) after CFG parallel (and the edit image's parallel encode)
    "chronoedit_cfg2": ("chronoedit", None, lambda w: {"cfg_degree": 2}, None, dict(output_type="pt"), (2,)),
    # SkyReels-V2 diffusion forcing (per-frame timesteps: per-token modulation split with the tokens)
    "skyreels_df_ulysses": ("skyreels-v2", "df", lambda w: {"ulysses_degree": w}, None, dict(height=80, width=112),
                            (3,)),
    "skyreels_df_ring_sparse08": ("skyreels-v2", "df", lambda w: {"ring_degree": w}, SPARSE, dict(num_frames=9),
                                  (2,)),  # 3 x 3 x 5 = 45 tokens
    # asynchronous diffusion forcing (causal mask): CFG parallel runs it; sequence parallelism refuses it
    "skyreels_async_cfg2": ("skyreels-v2", "df", lambda w: {"cfg_degree": 2}, None, dict(ASYNC, output_type="pt"),
                            (2,)),
    "skyreels_async_ulysses_refused": ("skyreels-v2", "df", lambda w: {"ulysses_degree": w}, None, ASYNC, (2,)),
    # Wan VACE: control tokens split with the video tokens (each rank's context blocks give its tokens' hints)
    "vace_ulysses": ("wan-vace", None, lambda w: {"ulysses_degree": w}, None, dict(height=80, width=112), (3,)),
    "vace_ring_sparse08": ("wan-vace", None, lambda w: {"ring_degree": w}, SPARSE, dict(num_frames=9), (2,)),
    "vace_cfg2": ("wan-vace", None, lambda w: {"cfg_degree": 2}, None, dict(output_type="pt"), (2,)),
    # Wan Animate: CFG parallel (the uncond pass blanks the face video)
    "animate_cfg2": ("wan-animate", None, lambda w: {"cfg_degree": 2}, None, dict(output_type="pt"), (2,)),
    # Wan Animate under sequence parallelism: the face adapter on each rank's shard, shards cutting frames mid-way:
    # 3 frames of 3 x 5 = 45 tokens -> 23 + 22 (+1 padding) at 2 ranks, 4 x 12 (+3) at 4; 4 frames of 5 x 7 =
    # 140 tokens -> 3 x 47 (+1) at 3 ranks
    "animate_ulysses": ("wan-animate", None, lambda w: {"ulysses_degree": w}, None, {}, (2,)),
    "animate_ring": ("wan-animate", None, lambda w: {"ring_degree": w}, None, {}, (2,)),
    "animate_ulysses3": ("wan-animate", None, lambda w: {"ulysses_degree": w}, None, ANIMATE_140, (3,)),
    "animate_ring3": ("wan-animate", None, lambda w: {"ring_degree": w}, None, ANIMATE_140, (3,)),
    "animate_ring_sparsity0": ("wan-animate", None, lambda w: {"ring_degree": w}, {**SPARSE, "sparsity": 0.0}, {},
                               (2,)),  # against stock (dense)
    "animate_ring_sparse08": ("wan-animate", None, lambda w: {"ring_degree": w}, SPARSE, {}, (2,)),
    "animate_u2r2": ("wan-animate", None, lambda w: {"ulysses_degree": 2, "ring_degree": 2}, None, {}, (4,)),
    "animate_cfg2_ulysses2": ("wan-animate", None, lambda w: {"cfg_degree": 2, "ulysses_degree": 2}, None, {}, (4,)),
}


def cases_for(world: int) -> list[str]:
    return [name for name, case in CASES.items() if world in case[5]]


def run_case(name, world, mesh_for):
    import lite_boost
    import _tiny_wan_derived as tiny

    family, kind, layout, sparse, over, _ = CASES[name]
    par = dict(layout(world), timeout_s=TIMEOUT)
    ref_pipe = tiny.pipeline(family, kind)
    if name.endswith("_refused"):
        ref_pipe = None
    elif sparse is not None and sparse["sparsity"] > 0:  # (sparsity 0: against stock, dense)
        lite_boost.boost(ref_pipe, {"sparse": sparse})
    ref = None if ref_pipe is None else ref_pipe(**tiny.call_kwargs(family, kind, **over)).frames
    pipe = tiny.pipeline(family, kind)
    config = {"parallel": par, **({"sparse": sparse} if sparse is not None else {})}
    lite_boost.ParallelManager(pipe, config, mesh=mesh_for(par))
    if name.endswith("_refused"):
        from lite_boost.config import ConfigError

        try:
            pipe(**tiny.call_kwargs(family, kind, **over))
        except ConfigError as exc:
            lite_boost.parallel.unparallelize(pipe)
            return {"refused": str(exc)}
        return {"error": "not refused"}
    runs = set()  # Wan Animate: (tokens the face adapter got, tokens of the whole sequence)
    probe = None if family != "wan-animate" else pipe.transformer.face_adapter[0].register_forward_pre_hook(
        lambda mod, args: runs.add((args[0].shape[1], pipe.transformer._lite_boost.call)))
    try:
        got = pipe(**tiny.call_kwargs(family, kind, **over)).frames
    finally:
        if probe is not None:
            probe.remove()
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    cfg = [dict(m._lite_boost.extras["parallel"].cfg.calls) for m in models
           if m._lite_boost.extras["parallel"].cfg is not None]
    paths = None
    if sparse is not None:
        st = pipe.transformer._lite_boost.extras["sparse"]
        paths = sorted({e.path for e in st.events})
    lite_boost.parallel.unparallelize(pipe)
    return {"maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
            "ref_abs": ref.abs().max().item(), "cfg_calls": cfg, "sparse_paths": paths, "face_runs": sorted(runs),
            "sequence_degree": par.get("ulysses_degree", 1) * par.get("ring_degree", 1)}


def run_all(rank, world_size, init_method, names):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from lite_boost.parallel import initialize_usp

    meshes = {}

    def mesh_for(par):
        key = tuple(sorted(par.items()))
        if key not in meshes:
            meshes[key] = initialize_usp({"parallel": par}, init_method=init_method)
        return meshes[key]

    results = {}
    for name in names:
        try:
            results[name] = run_case(name, world_size, mesh_for)
        except Exception as exc:  # noqa: BLE001 - reported per case (every rank fails the same case)
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    return results
