"""Per-rank bodies of the multi-process loader tests (spawned gloo ranks, see test_parallel_loaders.py).

Each LoRA case builds a tiny pipeline from a fixed seed, puts it through the case's LoRA calls in this process
with stock diffusers (the one-process reference: no collectives), then a fresh copy under ``ParallelManager``
with the same LoRA calls made before or after it, and returns the max abs difference of the output latents.
All cases of one world size share one process group (one mesh per layout).

The adapter cases (``run_adapter_cases``, a process group of their own) run a ControlNet pipeline or a Flux.1
pipeline with an IP-Adapter stock in this process and a fresh copy under ``ParallelManager`` (Ulysses 2 / Ring 2),
and record what the transformer took, the collectives and the ControlNet's attention calls; the cfg_degree 2
refusals run first, before the process group exists.
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


# ------------------------------------------------------------------------------- ControlNet pipelines, IP-Adapter
# Each case: the stock one-process pipeline (no collectives) against a fresh copy under ParallelManager (world 2).
SEQ_LAYOUTS = {"ulysses2": {}, "ring2": {"ulysses_degree": 1, "ring_degree": 2}}
CONTROLNET_CASES = {f"{kind}_{layout}": (kind, layout) for kind in ("flux", "flux_multi", "qwen", "qwen_multi")
                    for layout in SEQ_LAYOUTS}
# flux_ip: 3 x 5 image tokens (8 / 7 per rank) attend to the 4 IP tokens; flux_ip_even: 2 x 4 image tokens, as many
# per rank as the IP-Adapter has tokens (the IP call then looks like self-attention by its lengths)
IP_ADAPTER_CASES = {f"{kind}_{layout}": (kind, layout) for kind in ("flux_ip", "flux_ip_even")
                    for layout in SEQ_LAYOUTS}
IP_TOKENS = {"flux_ip": 15, "flux_ip_even": 8}  # image tokens of the call
CFG_REFUSAL_CASES = {f"{kind}_cfg2_refused": (kind, "cfg2") for kind in ("flux", "qwen", "flux_ip")}
# the refusals first: the process group does not exist yet, so a refusal before any collective leaves it so
ADAPTER_CASES = {**CFG_REFUSAL_CASES, **CONTROLNET_CASES, **IP_ADAPTER_CASES}


def _ip_pipeline():
    import _tiny_flux as tf

    pipe = tf.pipeline("t2i")
    pipe.load_ip_adapter(tf.ip_adapter(pipe.transformer, 1), weight_name="ip_adapter.safetensors",
                         image_encoder_pretrained_model_name_or_path=None)
    pipe.set_ip_adapter_scale(0.7)
    return pipe


def _ip_kwargs(shift=0.0, even=False):
    import torch

    import _tiny_flux as tf

    emb = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(3)) + shift
    size = dict(height=8, width=16) if even else {}
    return dict(tf.call_kwargs("t2i", **size), ip_adapter_image_embeds=[emb],
                negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 8)])


def _adapter_kind(kind):
    """(new pipeline, call kwargs, call kwargs without the adapter's effect) of a ControlNet / IP-Adapter case."""
    if kind.startswith("flux_ip"):
        even = kind == "flux_ip_even"
        return _ip_pipeline, (lambda: _ip_kwargs(even=even)), lambda: _ip_kwargs(shift=3.0, even=even)
    import _tiny_controlnet as tc

    def off():
        kw = tc.call_kwargs(kind)
        multi = isinstance(kw["control_image"], list)
        kw["controlnet_conditioning_scale"] = [0.0] * len(kw["control_image"]) if multi else 0.0
        return kw

    return (lambda: tc.pipeline(kind)), (lambda: tc.call_kwargs(kind)), off


def _cfg_refusal(kind, init_method):
    """cfg_degree 2: refused when planning, before the mesh (and any collective) exists."""
    import torch.distributed as dist

    import lite_boost
    from lite_boost.api import is_boosted
    from lite_boost.parallel import ParallelManager

    make, _, _ = _adapter_kind(kind)
    pipe = make()
    out = {"initialized_before": dist.is_initialized()}
    try:
        ParallelManager(pipe, {"parallel": {"cfg_degree": 2, "timeout_s": TIMEOUT_S}}, init_method=init_method)
        out["refused"] = None
    except lite_boost.ConfigError as e:
        out["refused"] = str(e)
    out.update(initialized_after=dist.is_initialized(), boosted=is_boosted(pipe))
    return out


def adapter_case(name, meshes, init_method):
    """A ControlNet / IP-Adapter pipeline under ParallelManager (Ulysses 2 or Ring 2) vs the stock one-process run."""
    from lite_boost.adapter.generic import generic_context
    from lite_boost.parallel import ParallelManager, unparallelize

    kind, layout = ADAPTER_CASES[name]
    if layout == "cfg2":
        return _cfg_refusal(kind, init_method)
    parallel = SEQ_LAYOUTS[layout]
    make, call, off = _adapter_kind(kind)
    ref_pipe = make()
    ref = ref_pipe(**call()).images
    out = {"effect": _diff(ref_pipe(**off()).images, ref), "ref_abs": ref.abs().max().item()}
    del ref_pipe
    mesh = _mesh(meshes, parallel, init_method)
    pipe = make()
    ParallelManager(pipe, {"parallel": dict(parallel, timeout_s=TIMEOUT_S)}, mesh=mesh)
    seen = []  # (image tokens, ControlNet residual tokens) the transformer takes, after its own split hooks

    def record(mod, args, kwargs):
        res = kwargs.get("controlnet_block_samples")
        seen.append((kwargs["hidden_states"].shape[1], res[0].shape[1] if res else None))

    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    ctx = generic_context(pipe.controlnet) if hasattr(pipe, "controlnet") else None
    cn_calls = []  # the ControlNet's self-attention calls through lite_boost's backend (whole sequence)
    if ctx is not None:
        inner = ctx.self_attn_fn
        ctx.self_attn_fn = lambda q, *a: (cn_calls.append(q.shape[1]), inner(q, *a))[1]
    stats = mesh.sequence.enable_stats()
    stats.reset()
    out["diff"] = _diff(pipe(**call()).images, ref)
    handle.remove()
    if ctx is not None:
        ctx.self_attn_fn = inner
    out.update(degrees=(mesh.cfg_degree, mesh.sequence_degree, mesh.ring_degree), calls=dict(stats.calls),
               seen=sorted(set(seen)), family=pipe.transformer._lite_boost.family.name,
               controlnet_calls=sorted(set(cn_calls)) if ctx is not None else None)
    mesh.sequence.stats = None
    unparallelize(pipe)
    return out


def run_adapter_cases(rank, world_size, init_method, names):
    meshes, out = {}, {}
    for name in names:
        out[name] = adapter_case(name, meshes, init_method)
    return out
