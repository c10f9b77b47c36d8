"""A toy family for the generic plan machinery (spawned gloo ranks, test_adapter_layer.py).

The toy transformer has what real families declare and Wan / Qwen-Image do not all exercise: a
per-token tensor passed unsharded to every block (``"blocks.*"`` split), a rank-dependent scalar
(``RankArg``: the first ``first_n`` tokens are treated differently, as HunyuanVideo-I2V's first-frame
tokens), a tuple output of which only one element is token-wise (``SplitOutput(index=0)``), RoPE
tables passed in as a tuple argument (CogVideoX), and a pipeline that batches CFG
(``CfgPlan(kind="batched")``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

H, D = 3, 4


class ToyAttention(nn.Module):
    """Self-attention whose attention itself is the processor's ``attn_fn`` (like the shims)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)
        self.processor = None

    def set_processor(self, processor):  # as diffusers': a module processor leaves the module tree when replaced
        if isinstance(self._modules.get("processor"), nn.Module) and not isinstance(processor, nn.Module):
            self._modules.pop("processor")
        self.processor = processor

    def forward(self, x, freqs, rope):
        q, k, v = (t.unflatten(-1, (H, D)) for t in self.qkv(x).chunk(3, dim=-1))
        q = q * freqs[None, :, None, :]  # a toy per-token "rotation"
        k = k * rope[0][None, :, None, :] + rope[1][None, :, None, :]
        return self.processor.attn_fn(q, k, v).flatten(2)


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ToyAttention()

    def forward(self, hidden_states, freqs, per_token, first_n: int, rope):
        out = hidden_states + self.attn(hidden_states, freqs, rope) + per_token[..., None]
        scale = torch.ones_like(out[..., :1])
        scale[:, :first_n] = 2.0  # the first first_n tokens of the sequence: a different modulation
        return out * scale


class ToyPositions(nn.Module):
    def forward(self, n: int):
        pos = torch.arange(n, dtype=torch.float32)
        return 1.0 + 0.01 * pos[:, None].expand(n, D), torch.tensor(float(n))  # (token-wise, scalar)


class ToyTransformer(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Linear(5, H * D)
        self.pos = ToyPositions()
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(layers))
        self.proj_out = nn.Linear(H * D, 5)

    @contextlib.contextmanager
    def cache_context(self, name):
        yield

    def forward(self, hidden_states, timestep=None, per_token=None, first_n: int = 0, rope=None, return_dict=False):
        x = self.embed(hidden_states)
        freqs, _ = self.pos(x.shape[1])
        if timestep is not None:
            x = x + timestep[:, None, None]
        for block in self.blocks:
            x = block(hidden_states=x, freqs=freqs, per_token=per_token, first_n=first_n, rope=rope)
        return (self.proj_out(x),)


class ToyPipeline:
    do_classifier_free_guidance = True

    def __init__(self, transformer):
        self.transformer = transformer

    def __call__(self, x, t, per_token, first_n):
        pos = torch.arange(x.shape[1], dtype=torch.float32)[:, None].expand(x.shape[1], D)
        rope = (torch.cos(0.1 * pos), torch.sin(0.1 * pos))  # tables the pipeline passes in, as CogVideoX's
        with self.transformer.cache_context("cond_uncond"):
            return self.transformer(hidden_states=x, timestep=t, per_token=per_token, first_n=first_n, rope=rope,
                                    return_dict=False)[0]


class ToyOrderPipeline:
    """A pipeline with true CFG as two unnamed transformer calls per step (Flux Img2Img / Kontext style):
    the decision is local, seen only as ``encode_prompt`` running twice after ``check_inputs``."""

    def __init__(self, transformer):
        self.transformer = transformer

    def check_inputs(self):
        pass

    def encode_prompt(self, per_token):
        return per_token

    def __call__(self, x, t, per_token, first_n, cfg=True, steps=2):
        self.check_inputs()
        cond = self.encode_prompt(per_token)
        uncond = self.encode_prompt(per_token * 0.5 - 1.0) if cfg else None
        pos = torch.arange(x.shape[1], dtype=torch.float32)[:, None].expand(x.shape[1], D)
        rope = (torch.cos(0.1 * pos), torch.sin(0.1 * pos))
        for _ in range(steps):
            out = self.transformer(hidden_states=x, timestep=t, per_token=cond, first_n=first_n, rope=rope,
                                   return_dict=False)[0]
            if cfg:
                neg = self.transformer(hidden_states=x, timestep=t, per_token=uncond, first_n=first_n, rope=rope,
                                       return_dict=False)[0]
                out = neg + 3.0 * (out - neg)
            x = x - 0.1 * out
        return x


class ToyOrderTransformer(ToyTransformer):
    pass


def toy_order_family():
    """The toy transformer with a pipeline whose CFG passes are told apart by call order."""
    from lite_boost.adapter import AttentionSite, LiteBoostProcessor, ModelFamily
    from lite_boost.parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput

    plan = ShardingPlan(split_inputs=(SplitInput("blocks.0", "hidden_states", dim=1),
                                      SplitInput("blocks.*", "per_token", dim=1, ndim=2),
                                      SplitInput("blocks.*", "rope", dim=0)),
                        gather_outputs=(GatherOutput("proj_out", dim=1),))
    cfg = CfgPlan(flag=None, encodes="encode_prompt", call_start="check_inputs", by_call_order=True)
    return ModelFamily("toy-order", transformers=("ToyOrderTransformer",), pipelines=("ToyOrderPipeline",),
                       attention=(AttentionSite("blocks.*.attn", LiteBoostProcessor, "self"),), sharding=plan,
                       pipeline=PipelinePlan(transformers=("transformer",), cfg=cfg, prepare_latents=None))


def toy_family():
    from lite_boost.adapter import AttentionSite, LiteBoostProcessor, ModelFamily
    from lite_boost.parallel.plan import (CfgPlan, GatherOutput, PipelinePlan, RankArg, ShardingPlan, SplitInput,
                                          SplitOutput)

    plan = ShardingPlan(
        split_inputs=(SplitInput("blocks.0", "hidden_states", dim=1),
                      SplitInput("blocks.*", "per_token", dim=1, ndim=2),
                      SplitInput("blocks.*", "rope", dim=0)),  # a (cos, sin) tuple argument
        split_outputs=(SplitOutput("pos", dim=0, index=0),),
        gather_outputs=(GatherOutput("proj_out", dim=1),),
        rank_args=(RankArg("blocks.*", "first_n", lambda n, start, stop: max(0, min(n - start, stop - start))),),
    )
    cfg = CfgPlan(kind="batched", cond="cond_uncond", batch_args=("hidden_states", "timestep", "per_token"))
    return ModelFamily("toy", transformers=("ToyTransformer",), pipelines=("ToyPipeline",),
                       attention=(AttentionSite("blocks.*.attn", LiteBoostProcessor, "self"),), sharding=plan,
                       pipeline=PipelinePlan(transformers=("transformer",), cfg=cfg, prepare_latents=None))


def inputs(batch=2, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, 5, generator=g), torch.rand(batch, generator=g),
            torch.randn(batch, seq, generator=g), 4)


def toy_cases(rank, world_size, init_method):
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp
    from lite_boost.registry import SUPPORTED_MODELS, _FAMILIES, register_family

    family = register_family(toy_family())
    order_family = register_family(toy_order_family())
    try:
        out = {}
        # separate CFG passes told apart by call order (no cache_context): cfg rank 0 computes cond, rank 1
        # uncond, and a call without CFG (one encode) computes everything on both
        mesh = initialize_usp({"parallel": {"cfg_degree": 2, "timeout_s": 60}}, init_method=init_method)
        for name, cfg_on in (("order_cfg", True), ("order_no_cfg", False)):
            torch.manual_seed(0)
            ref_pipe = ToyOrderPipeline(lite_boost.boost(ToyOrderTransformer()))
            x, t, per_token, first_n = inputs()
            with torch.no_grad():
                ref = ref_pipe(x, t, per_token, first_n, cfg=cfg_on)
            torch.manual_seed(0)
            pipe = ToyOrderPipeline(ToyOrderTransformer())
            ParallelManager(pipe, {"parallel": {"cfg_degree": 2, "timeout_s": 60}}, mesh=mesh)
            with torch.no_grad():
                got = [pipe(x, t, per_token, first_n, cfg=cfg_on) for _ in range(2)]  # the order restarts per call
            par = pipe.transformer._lite_boost.extras["parallel"]
            out[name] = {"maxdiff": max((g - ref).abs().max().item() for g in got), "ref_abs": ref.abs().max().item(),
                         "cfg_calls": dict(par.cfg.calls)}
        for name, cfg_degree, batch in (("ulysses", 1, 2), ("batched_cfg", 2, 2), ("batched_cfg_batch1", 2, 1)):
            torch.manual_seed(0)
            ref_pipe = ToyPipeline(lite_boost.boost(ToyTransformer()))
            x, t, per_token, first_n = inputs(batch=batch)
            with torch.no_grad():
                ref = ref_pipe(x, t, per_token, first_n)
            torch.manual_seed(0)
            pipe = ToyPipeline(ToyTransformer())
            mesh = initialize_usp({"parallel": {"cfg_degree": cfg_degree, "timeout_s": 60}}, init_method=init_method)
            ParallelManager(pipe, {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 60}}, mesh=mesh)
            seen = []
            hook = pipe.transformer.blocks[1].register_forward_pre_hook(
                lambda m, a, kw: seen.append((kw["hidden_states"].shape[:2], kw["per_token"].shape, kw["first_n"])),
                with_kwargs=True)
            with torch.no_grad():
                got = pipe(x, t, per_token, first_n)
            hook.remove()
            par = pipe.transformer._lite_boost.extras["parallel"]
            out[name] = {"maxdiff": (got - ref).abs().max().item(), "ref_abs": ref.abs().max().item(), "seen": seen,
                         "cfg_calls": dict(par.cfg.calls) if par.cfg is not None else None}
        return out
    finally:
        for fam in (family, order_family):
            for n in fam.transformers + fam.pipelines:
                SUPPORTED_MODELS.pop(n, None)
            _FAMILIES.pop(fam.name, None)
