"""Toy pipelines for the "ordered" and "guider" CFG kinds (spawned gloo ranks, test_adapter_extensions.py).

* ``OrderedToyPipeline`` calls the transformer twice per step, cond then uncond, without
  ``cache_context`` (as HunyuanVideo's image-to-video pipeline); CFG is decided in a local variable
  (recognised from ``encode_prompt`` running twice since ``check_inputs``).
* ``GuiderToyPipeline`` runs one call per condition of a diffusers ``ClassifierFreeGuidance`` guider
  inside ``cache_context(<identifier>)`` (as HunyuanVideo-1.5's pipelines); the guider's ``stop``
  switches CFG off for the later steps, so some steps make one call only.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_adapter_cases import D, ToyTransformer  # noqa: E402

STEPS = 4


class OrderedToyTransformer(ToyTransformer):
    pass


class GuiderToyTransformer(ToyTransformer):
    pass


def _rope(n):
    pos = torch.arange(n, dtype=torch.float32)[:, None].expand(n, D)
    return torch.cos(0.1 * pos), torch.sin(0.1 * pos)


def _call(transformer, x, t, per_token):
    return transformer(hidden_states=x, timestep=t, per_token=per_token, first_n=0, rope=_rope(x.shape[1]),
                       return_dict=False)[0]


class OrderedToyPipeline:
    def __init__(self, transformer):
        self.transformer = transformer

    def check_inputs(self):
        pass

    def encode_prompt(self, per_token):
        return per_token * 1.0

    def __call__(self, x, per_token, negative=None, scale=3.0):
        self.check_inputs()
        cond = self.encode_prompt(per_token)
        cfg = negative is not None
        if cfg:
            uncond = self.encode_prompt(negative)
        for i in range(STEPS):
            t = torch.full((x.shape[0],), 1.0 - i / STEPS)
            out = _call(self.transformer, x, t, cond)
            if cfg:
                un = _call(self.transformer, x, t, uncond)
                out = un + scale * (out - un)
            x = x - 0.1 * out
        return x


class GuiderToyPipeline:
    def __init__(self, transformer, guider):
        self.transformer = transformer
        self.guider = guider

    def __call__(self, x, per_token, negative):
        for i in range(STEPS):
            t = torch.full((x.shape[0],), 1.0 - i / STEPS)
            self.guider.set_state(step=i, num_inference_steps=STEPS, timestep=t)
            state = self.guider.prepare_inputs({"per_token": (per_token, negative)})
            for batch in state:
                self.guider.prepare_models(self.transformer)
                with self.transformer.cache_context(getattr(batch, self.guider._identifier_key)):
                    batch.noise_pred = _call(self.transformer, x, t, batch.per_token)
                self.guider.cleanup_models(self.transformer)
            x = x - 0.1 * self.guider(state)[0]
        return x


def families():
    from lite_boost.adapter import AttentionSite, LiteBoostProcessor, ModelFamily
    from lite_boost.parallel.plan import CfgPlan, PipelinePlan

    site = (AttentionSite("blocks.*.attn", LiteBoostProcessor, "self"),)
    ordered = CfgPlan(kind="ordered", flag=None, encodes="encode_prompt", call_start="check_inputs")
    guided = CfgPlan(kind="guider", guider="guider", cond="pred_cond", uncond="pred_uncond")
    return [ModelFamily("toy-ordered", transformers=("OrderedToyTransformer",), pipelines=("OrderedToyPipeline",),
                        attention=site, pipeline=PipelinePlan(cfg=ordered, prepare_latents=None)),
            ModelFamily("toy-guider", transformers=("GuiderToyTransformer",), pipelines=("GuiderToyPipeline",),
                        attention=site, pipeline=PipelinePlan(cfg=guided, prepare_latents=None))]


def guider(stop=1.0):
    from diffusers.guiders import ClassifierFreeGuidance

    return ClassifierFreeGuidance(guidance_scale=3.0, stop=stop)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 7, 5, generator=g), torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)


def make(kind, stop=1.0):
    torch.manual_seed(0)
    if kind == "ordered":
        return OrderedToyPipeline(OrderedToyTransformer())
    return GuiderToyPipeline(GuiderToyTransformer(), guider(stop))


def cfg_kind_cases(rank, world_size, init_method):
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize
    from lite_boost.registry import SUPPORTED_MODELS, _FAMILIES, register_family

    fams = [register_family(f) for f in families()]
    config = {"parallel": {"cfg_degree": 2, "timeout_s": 60}}
    try:
        mesh = initialize_usp(config, init_method=init_method)
        out = {}
        for name, kind, stop, cfg in (("ordered", "ordered", 1.0, True), ("ordered_no_cfg", "ordered", 1.0, False),
                                      ("guider", "guider", 1.0, True), ("guider_stop", "guider", 0.5, True)):
            x, per_token, negative = inputs()
            negative = negative if cfg else None
            ref_pipe = make(kind, stop)
            lite_boost.boost(ref_pipe)
            with torch.no_grad():
                ref = ref_pipe(x, per_token, negative)
            pipe = make(kind, stop)
            ParallelManager(pipe, config, mesh=mesh)
            with torch.no_grad():
                got = pipe(x, per_token, negative)
                again = pipe(x, per_token, negative)  # the call order restarts with every pipeline call
            par = pipe.transformer._lite_boost.extras["parallel"]
            out[name] = {"maxdiff": max((got - ref).abs().max().item(), (again - ref).abs().max().item()),
                         "ref_abs": ref.abs().max().item(), "cfg_calls": dict(par.cfg.calls)}
            unparallelize(pipe)
        return out
    finally:
        for family in fams:
            for n in family.transformers + family.pipelines:
                SUPPORTED_MODELS.pop(n, None)
            _FAMILIES.pop(family.name, None)
