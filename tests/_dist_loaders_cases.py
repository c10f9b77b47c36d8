"""Per-rank bodies of the multi-process loader tests (spawned gloo ranks, see test_parallel_loaders.py).

Each LoRA case builds a tiny pipeline from a fixed seed, puts it through the case's LoRA calls in this process
with stock diffusers (the one-process reference: no collectives), then a fresh copy under ``ParallelManager``
with the same LoRA calls made before or after it, and returns the max abs difference of the output latents.
All cases of one world size share one process group (one mesh per layout).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT_S = 120

# name -> family, order ("before" / "after" ParallelManager), parallel config (world 2)
LORA_CASES = {
    "wan_ulysses2_after": ("wan", "after", {}),
    "wan_ulysses2_before": ("wan", "before", {}),
    "wan_ring2_after": ("wan", "after", {"ulysses_degree": 1}),
    "wan_cfg2_before": ("wan", "before", {"cfg_degree": 2}),
    "wan_cfg2_after": ("wan", "after", {"cfg_degree": 2}),
    "wan_fsdp2_before": ("wan", "before", {"fsdp_degree": 2}),
    "flux_ulysses2_after": ("flux", "after", {}),
    "flux_ulysses2_before": ("flux", "before", {}),
    "flux_ring2_before": ("flux", "before", {"ulysses_degree": 1}),
    "flux_cfg2_after": ("flux", "after", {"cfg_degree": 2}),
}
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "ff.net.2"]


def _diff(a, b) -> float:
    return (a - b).abs().max().item() if a.shape == b.shape else float("inf")


def _mesh(cache, parallel, init_method):
    from lite_boost.parallel import initialize_usp

    key = tuple(sorted(parallel.items()))
    if key not in cache:
        cache[key] = initialize_usp({"parallel": dict(parallel, timeout_s=TIMEOUT_S)}, init_method=init_method)
    return cache[key]


def _family(name):
    """(new pipeline, call kwargs, LoRA targets) of a family's tiny CFG pipeline."""
    if name == "wan":
        from conftest import pipeline_kwargs
        from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

        spec = TinyWanSpec(heads=3, head_dim=24)
        return (lambda: tiny_wan_pipeline("t2v", spec=spec),
                lambda: pipeline_kwargs("t2v", height=32, width=80, num_frames=5, steps=2), None)
    import _tiny_flux as tf

    return lambda: tf.pipeline("t2i"), lambda: tf.call_kwargs("t2i"), FLUX_TARGETS


def _frames(pipe, kw):
    out = pipe(**kw)
    return out.frames if hasattr(out, "frames") else out.images


def _loras(pipe, targets):
    from _lora import LORA_TARGETS, lora_state_dict

    targets = targets or LORA_TARGETS
    return (lora_state_dict(pipe.transformer, 1, targets=targets),
            lora_state_dict(pipe.transformer, 2, targets=targets[:3]))


def _load(pipe, loras):
    pipe.load_lora_weights(dict(loras[0]), adapter_name="a")
    pipe.load_lora_weights(dict(loras[1]), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.8, -0.5])


def lora_case(name, meshes, init_method):
    """The stock one-process LoRA run vs the same LoRAs loaded before / after ParallelManager; with the weights
    whole (sequence / CFG parallel) also fuse_lora after ParallelManager; with sharded weights (FSDP2) the
    refusal of a LoRA loaded after sharding, on every rank before any collective."""
    from lite_boost.errors import LoaderError
    from lite_boost.parallel import ParallelManager, unparallelize

    family, order, parallel = LORA_CASES[name]
    make, call, targets = _family(family)
    mesh = _mesh(meshes, parallel, init_method)
    ref_pipe = make()
    loras = _loras(ref_pipe, targets)
    base = _frames(ref_pipe, call())
    _load(ref_pipe, loras)
    ref = _frames(ref_pipe, call())
    pipe = make()
    if order == "before":
        _load(pipe, loras)
    ParallelManager(pipe, {"parallel": dict(parallel, timeout_s=TIMEOUT_S)}, mesh=mesh)
    out = {"lora_effect": _diff(ref, base), "ref_abs": ref.abs().max().item()}
    if order == "after":
        _load(pipe, loras)
    stats = mesh.sequence.enable_stats()
    stats.reset()
    out["diff"] = _diff(_frames(pipe, call()), ref)
    par = pipe.transformer._lite_boost.extras.get("parallel")
    out.update(degrees=(mesh.cfg_degree, mesh.sequence_degree, mesh.ring_degree), calls=dict(stats.calls),
               cfg_calls=dict(par.cfg.calls) if par is not None and par.cfg is not None else None,
               lora_layers=sum(1 for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A.a")))
    mesh.sequence.stats = None
    if parallel.get("fsdp_degree", 1) > 1:
        try:
            pipe.load_lora_weights(dict(loras[0]), adapter_name="c")
            out["refused"] = None
        except LoaderError as e:
            out["refused"] = str(e)
        out["diff_after_refusal"] = _diff(_frames(pipe, call()), ref)  # the ranks are still in step
    else:
        for p in (ref_pipe, pipe):
            p.fuse_lora(lora_scale=0.7)
        ref = _frames(ref_pipe, call())
        out["diff_fused"] = _diff(_frames(pipe, call()), ref)
        for p in (ref_pipe, pipe):
            p.unfuse_lora()
            p.unload_lora_weights()
        out["diff_unloaded"] = _diff(_frames(pipe, call()), base)
    unparallelize(pipe)
    return out


def run_cases(rank, world_size, init_method, names):
    meshes, out = {}, {}
    for name in names:
        out[name] = lora_case(name, meshes, init_method)
    return out
