"""Per-rank bodies of the Wan parity tests (spawned gloo ranks, see test_parallel_wan.py).

Each case builds a tiny pipeline from a fixed seed, runs it single-process with ``lite_boost.boost``
(the reference, on every rank: no collectives), then runs a fresh copy under ``ParallelManager``
and returns the max abs difference of the output latents. Many cases share one process group so
the process start-up (torch + diffusers imports) is paid once per world size.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> kind, heads, (height, width, num_frames), cfg_degree, two_stage, sparsity
# token grids with patch (1, 2, 2) and the 8x VAE: 32x80x5 -> 2x2x5 = 20 tokens, 48x80x9 -> 3x3x5 = 45
CASES = {
    "t2v_h3_tok20": ("t2v", 3, (32, 80, 5), 1, False, None),  # uneven heads on 2, even tokens on 2
    "t2v_h4_tok45": ("t2v", 4, (48, 80, 9), 1, False, None),  # even heads on 2, uneven tokens on 2
    "t2v_h3_tok45": ("t2v", 3, (48, 80, 9), 1, False, None),
    "t2v_h5_tok20": ("t2v", 5, (32, 80, 5), 1, False, None),  # 5 heads on 3, 20 tokens on 3
    "t2v_h2_tok20": ("t2v", 2, (32, 80, 5), 1, False, None),  # fewer heads than ranks on 3
    "i2v_h3_tok20": ("i2v", 3, (32, 80, 5), 1, False, None),
    "i2v_h5_tok45": ("i2v", 5, (48, 80, 9), 1, False, None),
    "t2v_two_stage_h3": ("t2v", 3, (48, 80, 9), 1, True, None),  # Wan2.2 A14B layout
    "t2v_cfg2_h3_tok45": ("t2v", 3, (48, 80, 9), 2, False, None),
    "i2v_cfg2_two_stage_h3": ("i2v", 3, (32, 80, 5), 2, True, None),
    "t2v_sparse0_h3": ("t2v", 3, (48, 80, 9), 1, False, 0.0),
    "t2v_sparse08_h3": ("t2v", 3, (48, 80, 9), 1, False, 0.8),
    "t2v_sparse08_h5": ("t2v", 5, (48, 80, 9), 1, False, 0.8),
    "t2v_cfg2_sparse08_h3": ("t2v", 3, (48, 80, 9), 2, False, 0.8),
    "t2v_cfg2_guidance1_h3": ("t2v", 3, (32, 80, 5), 2, False, None),  # no CFG in the call: nothing deferred
    "t2v_diffusers_rope_h3": ("t2v", 3, (48, 80, 9), 1, False, None),  # diffusers' own (cos, sin) RoPE kept
}
# transformer-level cases (no pipeline): name -> (heads, latent grid (F, H, W) in tokens)
TRANSFORMER_CASES = {
    "ti2v_per_token_timestep_h3": (3, (3, 3, 5)),  # Wan2.2 TI2V: timestep of shape (B, S)
}


def _spec(kind, heads):
    from lite_boost.demo import TinyWanSpec

    return TinyWanSpec(heads=heads, head_dim=24)


def _call_kwargs(kind, hwf, generator=True):
    from conftest import pipeline_kwargs

    h, w, f = hwf
    kw = pipeline_kwargs(kind, height=h, width=w, num_frames=f, steps=2)
    if not generator:
        kw.pop("generator")
    return kw


def _config(cfg_degree, sparsity):
    cfg = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}}
    if sparsity is not None:
        # dense-sized blocks so the tiny grids have several blocks to drop
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4}
    return cfg


def transformer_case(name, mesh):
    """Direct transformer calls (batch 2, per-token timesteps) vs the single-process boost."""
    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    heads, (f, h, w) = TRANSFORMER_CASES[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, f, 2 * h, 2 * w, generator=g)
    t = (torch.rand(2, f * h * w, generator=g) * 900).round()  # a different timestep per token
    ctx = torch.randn(2, 512, 32, generator=g)
    ref_model = lite_boost.boost(tiny_wan_transformer(TinyWanSpec(heads=heads)))
    model = ParallelManager(tiny_wan_transformer(TinyWanSpec(heads=heads)), {"parallel": {"timeout_s": 120}}, mesh=mesh)
    with torch.no_grad():
        ref = ref_model(x, t, ctx).sample
        got = model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
    return {"maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
            "ref_abs": ref.abs().max().item()}


def _keep_diffusers_rope(pipe):
    """Undo the cached RoPE of a boosted pipeline (as when the RoPE module is not recognised)."""
    for m in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if m is not None and "forward" in m.rope.__dict__:
            del m.rope.forward
            m._lite_boost.rope_patched = False


def run_cases(rank, world_size, init_method, names):
    import lite_boost
    from lite_boost.demo import tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager, initialize_usp
    from lite_boost.parallel.comm import head_split

    mesh_cache = {}
    out = {}
    for name in names:
        if name in TRANSFORMER_CASES:
            if 1 not in mesh_cache:
                mesh_cache[1] = initialize_usp(_config(1, None), init_method=init_method)
            out[name] = transformer_case(name, mesh_cache[1])
            continue
        kind, heads, hwf, cfg_degree, two_stage, sparsity = CASES[name]
        config = _config(cfg_degree, sparsity)
        ref_pipe = tiny_wan_pipeline(kind, spec=_spec(kind, heads), two_stage=two_stage)
        ref_cfg = dict(config, parallel={"timeout_s": 120})
        lite_boost.boost(ref_pipe, ref_cfg)
        if "diffusers_rope" in name:
            _keep_diffusers_rope(ref_pipe)
        call = _call_kwargs(kind, hwf)
        if "guidance1" in name:
            call["guidance_scale"] = 1.0
        ref = ref_pipe(**call).frames
        pipe = tiny_wan_pipeline(kind, spec=_spec(kind, heads), two_stage=two_stage)
        if cfg_degree not in mesh_cache:  # share sub-groups between cases of one mesh shape
            mesh_cache[cfg_degree] = initialize_usp(config, init_method=init_method)
        ParallelManager(pipe, config, mesh=mesh_cache[cfg_degree])
        if "diffusers_rope" in name:  # the split-output hook on `rope` must then shard the tables
            _keep_diffusers_rope(pipe)
        models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
        stats = mesh_cache[cfg_degree].sequence.enable_stats()
        stats.reset()
        call = _call_kwargs(kind, hwf)
        if "guidance1" in name:
            call["guidance_scale"] = 1.0
        got = pipe(**call).frames
        cfg_calls = [dict(m._lite_boost.extras["parallel"].cfg.calls) for m in models
                     if m._lite_boost.extras["parallel"].cfg is not None]
        def sparse_paths(p):
            st = p.transformer._lite_boost.extras.get("sparse")
            if st is None:
                return None
            return {"paths": sorted({e.path for e in st.events}), "effective": st.mean_effective_sparsity()}

        out[name] = {
            "sparse_ref": sparse_paths(ref_pipe),
            "sparse_par": sparse_paths(pipe),
            # heads this rank attends under Ulysses (the sparse stats average over these heads only)
            "local_heads": head_split(heads, mesh_cache[cfg_degree].sequence_degree)[
                mesh_cache[cfg_degree].sequence_rank],
            "maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
            "ref_abs": ref.abs().max().item(),
            "calls": dict(stats.calls),
            "layers": sum(len(m.blocks) for m in models),
            "cfg_calls": cfg_calls,
        }
        mesh_cache[cfg_degree].sequence.stats = None
        lite_boost.parallel.unparallelize(pipe)
    return out


def same_latents_without_generator(rank, world_size, init_method):
    """No generator: every rank must still start from (and end with) identical latents.

    Also: the user created the process group first; ParallelManager reuses it and leaves it alive.
    """
    import datetime

    import torch.distributed as dist

    from lite_boost.demo import tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(1000 + rank)  # deliberately different global RNG state per rank
    pipe = tiny_wan_pipeline("t2v", spec=_spec("t2v", 3))
    ParallelManager(pipe, _config(1, None))
    got = pipe(**_call_kwargs("t2v", (32, 80, 5), generator=False)).frames
    mesh = pipe._lite_boost_parallel.mesh
    both = got.new_empty((world_size,) + tuple(got.shape))
    mesh.world.all_gather_into(both, got.unsqueeze(0))
    reused = not mesh.owns_default_group
    mesh.destroy()
    return {"spread": max((both[r] - both[0]).abs().max().item() for r in range(world_size)),
            "reused_user_group": reused, "user_group_alive": dist.is_initialized()}


def diffusers_crosscheck(rank, world_size, init_method):
    """Ours vs diffusers' own Ulysses (enable_parallelism) vs single process, on a config both run."""
    import lite_boost
    from diffusers import ContextParallelConfig
    from lite_boost.demo import tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    torch.accelerator.device_count = lambda: 1  # diffusers computes rank % device_count on CPU
    hwf = (32, 80, 5)  # 20 tokens, 4 heads: divisible by 2 (diffusers needs both)
    ref_pipe = tiny_wan_pipeline("t2v", spec=_spec("t2v", 4))
    ref = ref_pipe(**_call_kwargs("t2v", hwf)).frames  # stock diffusers, one process
    ours = tiny_wan_pipeline("t2v", spec=_spec("t2v", 4))
    ParallelManager(ours, _config(1, None), init_method=init_method)
    got_ours = ours(**_call_kwargs("t2v", hwf)).frames
    theirs = tiny_wan_pipeline("t2v", spec=_spec("t2v", 4))
    theirs.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    got_theirs = theirs(**_call_kwargs("t2v", hwf)).frames
    return {
        "ours_vs_single": (got_ours - ref).abs().max().item(),
        "theirs_vs_single": (got_theirs - ref).abs().max().item(),
        "ours_vs_theirs": (got_ours - got_theirs).abs().max().item(),
    }
