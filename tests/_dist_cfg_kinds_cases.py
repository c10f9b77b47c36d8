"""A toy pipeline for the "guider" CFG kind (spawned gloo ranks, test_adapter_extensions.py).

``GuiderToyPipeline`` runs one call per condition of a diffusers ``ClassifierFreeGuidance`` guider
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


class GuiderToyTransformer(ToyTransformer):
    pass


def _rope(n):
    pos = torch.arange(n, dtype=torch.float32)[:, None].expand(n, D)
    return torch.cos(0.1 * pos), torch.sin(0.1 * pos)


def _call(transformer, x, t, per_token):
    return transformer(hidden_states=x, timestep=t, per_token=per_token, first_n=0, rope=_rope(x.shape[1]),
                       return_dict=False)[0]


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
    guided = CfgPlan(kind="guider", guider="guider", cond="pred_cond", uncond="pred_uncond")
    return [ModelFamily("toy-guider", transformers=("GuiderToyTransformer",), pipelines=("GuiderToyPipeline",),
                        attention=site, pipeline=PipelinePlan(cfg=guided, prepare_latents=None))]


def guider(stop=1.0):
    from diffusers.guiders import ClassifierFreeGuidance

    return ClassifierFreeGuidance(guidance_scale=3.0, stop=stop)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 7, 5, generator=g), torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)


def make(stop=1.0):
    torch.manual_seed(0)
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
        for name, stop in (("guider", 1.0), ("guider_stop", 0.5)):
            x, per_token, negative = inputs()
            ref_pipe = make(stop)
            lite_boost.boost(ref_pipe)
            with torch.no_grad():
                ref = ref_pipe(x, per_token, negative)
            pipe = make(stop)
            ParallelManager(pipe, config, mesh=mesh)
            with torch.no_grad():
                got = pipe(x, per_token, negative)
                again = pipe(x, per_token, negative)  # the guider's state restarts with every pipeline call
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
