"""Per-rank bodies of the generic sequence-parallel tests (spawned gloo ranks, see test_parallel_generic.py).

One spawn per world size runs every case: a tiny diffusers transformer that takes lite_boost's generic path
and carries a diffusers ``_cp_plan`` runs under ``ParallelManager`` (Ulysses or Ring over all ranks), and
its output is compared with the stock model's one-process output of the same weights and inputs. Token
counts are chosen not to divide the world size.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 60


def _inputs(name: str, tokens: str):
    from _diffusers_tiny import inputs

    x = inputs(name)
    g = torch.Generator().manual_seed(1)
    if name == "ChronoEditTransformer3DModel" and tokens == "uneven":
        x["hidden_states"] = torch.randn(1, 16, 1, 10, 14, generator=g)  # 1 x 5 x 7 = 35 tokens
    if name == "Flux2Transformer2DModel" and tokens == "uneven":
        x["hidden_states"] = torch.randn(1, 17, 4, generator=g)
        x["encoder_hidden_states"] = torch.randn(1, 7, 32, generator=g)
        x["img_ids"] = torch.randint(0, 4, (1, 17, 4), generator=g)
        x["txt_ids"] = torch.randint(0, 4, (1, 7, 4), generator=g)
    return x


# name -> (model class, init overrides, tokens, parallel degrees as a function of the world size)
CASES = {
    "chronoedit_ulysses": ("ChronoEditTransformer3DModel", {}, "uneven", lambda w: {"ulysses_degree": w}),
    "chronoedit_h3_ulysses": ("ChronoEditTransformer3DModel", {"num_attention_heads": 3}, "uneven",
                              lambda w: {"ulysses_degree": w}),
    "chronoedit_ring": ("ChronoEditTransformer3DModel", {}, "uneven", lambda w: {"ring_degree": w}),
    "flux2_ulysses": ("Flux2Transformer2DModel", {}, "uneven", lambda w: {"ulysses_degree": w}),
    "flux2_ring": ("Flux2Transformer2DModel", {}, "uneven", lambda w: {"ring_degree": w}),
    # the other generic _cp_plan carriers, at diffusers' own test inputs: Helios (128 video tokens plus its
    # history latents; its plan names the 40 blocks of the released model, the tiny one has 2), MiniMax-H3 (18
    # packed video / audio / text tokens). LTX-2's plan has a gap (PLAN_GAPS; refused, test_parallel_generic.py).
    "helios_ulysses": ("HeliosTransformer3DModel", {}, "default", lambda w: {"ulysses_degree": w}),
    "helios_ring": ("HeliosTransformer3DModel", {}, "default", lambda w: {"ring_degree": w}),
    "minimax_h3_ulysses": ("MiniMaxH3Transformer3DModel", {}, "default", lambda w: {"ulysses_degree": w}),
    "minimax_h3_ring": ("MiniMaxH3Transformer3DModel", {}, "default", lambda w: {"ring_degree": w}),
}


def run_case(name, mesh_for, world):
    import lite_boost
    from _diffusers_tiny import init_dict, model_class

    cls_name, over, tokens, par = CASES[name]
    torch.manual_seed(0)
    model = model_class(cls_name)(**{**init_dict(cls_name), **over}).eval()
    x = _inputs(cls_name, tokens)
    with torch.no_grad():
        ref = model(**x, return_dict=False)[0]
        lite_boost.ParallelManager(model, {"parallel": dict(par(world), timeout_s=TIMEOUT)}, mesh=mesh_for(par(world)))
        out = model(**x, return_dict=False)[0]
        again = model(**x, return_dict=False)[0]  # a second call (the hooks reset per forward)
        lite_boost.unboost(model)
        back = model(**x, return_dict=False)[0]
    return {"shape": tuple(out.shape), "ref_shape": tuple(ref.shape), "err": (out - ref).abs().max().item(),
            "err_again": (again - ref).abs().max().item(), "err_unboost": (back - ref).abs().max().item(),
            "procs_restored": all(getattr(m.processor, "__dict__", {}).get("_parallel_config") is None
                                  for m in model.modules() if hasattr(m, "processor"))}


def run_all(rank, world_size, init_method):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from lite_boost import registry

    # ChronoEdit and Flux.2 have families (lite_boost.models.chronoedit, .flux2); here they stand for models
    # without one (this rank's process only)
    registry.load_builtin_adapters()
    for name in ("chronoedit", "flux2"):
        family = registry._FAMILIES.pop(name)
        for cls in (*family.transformers, *family.pipelines):
            registry.SUPPORTED_MODELS.pop(cls)
    from lite_boost.parallel import initialize_usp

    meshes = {}

    def mesh_for(par):
        key = tuple(sorted(par.items()))
        if key not in meshes:
            meshes[key] = initialize_usp({"parallel": dict(par, timeout_s=TIMEOUT)}, init_method=init_method)
        return meshes[key]

    results = {}
    only = os.environ.get("LB_SP_CASES")
    for name in (only.split(",") if only else CASES):
        try:
            results[name] = run_case(name, mesh_for, world_size)
        except Exception as exc:  # noqa: BLE001 - reported per case (every rank fails the same case)
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    return results
