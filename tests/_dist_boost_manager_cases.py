"""Per-rank body of the BoostManager parity test (spawned gloo ranks, see test_boost_manager.py)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def yaml_vs_one_process(rank, world_size, init_method, yaml_paths):
    """For each YAML: the one-process boosted video (no collectives) and BoostManager(pipe, yaml) on the ranks."""
    import lite_boost
    from conftest import pipeline_kwargs
    from lite_boost import BoostManager
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel.vae import parallel_vae_state

    spec = TinyWanSpec(heads=3)  # 3 heads on 2 ranks: uneven
    ref = lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec))(**pipeline_kwargs("t2v", output_type="np")).frames
    out = {}
    for path in yaml_paths:
        pipe = tiny_wan_pipeline("t2v", spec=spec)
        got_pipe = BoostManager(pipe, path, init_method=init_method)
        got = pipe(**pipeline_kwargs("t2v", output_type="np")).frames
        mesh = pipe._lite_boost_parallel.mesh
        out[path] = {
            "same_object": got_pipe is pipe,
            "maxdiff": float(abs(torch.as_tensor(got) - torch.as_tensor(ref)).max()),
            "ref_abs": float(abs(torch.as_tensor(ref)).max()),
            "mesh": (mesh.world_size, mesh.ulysses_degree, mesh.ring_degree, mesh.cfg_degree),
            "vae_mode": getattr(parallel_vae_state(pipe.vae), "mode", None),
        }
    return out
