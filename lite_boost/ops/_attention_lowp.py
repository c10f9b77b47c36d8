"""Low-precision dense attention backends (int8 / fp8) for the dense dispatch in ``attention.py``.

Each backend translates lite_boost's call (BSND tensors, softmax scale, optional log-sum-exp) into
the documented API of one optional package; the packages are imported lazily and probed, never
required. Inputs of float32 are fed to the kernels as bfloat16 and the output is returned in the
input dtype.

* ``sage`` (precision "int8"): ``sageattention.sageattn_qk_int8_pv_fp16_cuda(q, k, v,
  tensor_layout="NHD", is_causal=False, sm_scale=..., pv_accum_dtype="fp32", smooth_k=True,
  return_lse=...)``: Q and K in int8 (per thread of a 128-token query / 64-token key block, K
  smoothed by its mean over tokens), P and V in fp16 with fp32 accumulation. CUDA, compute
  capability >= 8.0, head_dim <= 128 (the package pads smaller head dims), float16 / bfloat16.
  ``return_lse=True`` returns the natural-log log-sum-exp of the unsmoothed logits, (B, N, S).
* ``sage_fp8`` (precision "fp8"): int8 Q / K and FP8 (e4m3) P and V:
  ``sageattn_qk_int8_pv_fp8_cuda_sm90`` on sm90, ``sageattn_qk_int8_pv_fp8_cuda`` on sm89 and
  sm120/sm121, both with ``pv_accum_dtype="fp32+fp32"`` (fp32 accumulation into an fp32 buffer).
* ``fa3_fp8`` (precision "fp8"): ``flash_attn_interface.flash_attn_func(q8, k8, v8,
  softmax_scale=..., causal=False, q_descale=..., k_descale=..., v_descale=...)`` with q, k, v in
  ``torch.float8_e4m3fn`` and float32 descale factors of shape (batch, num_heads_k) (FlashAttention-3,
  Hopper; the output comes back in bfloat16). K is smoothed by its mean before quantization (the
  softmax is unchanged; the log-sum-exp is shifted back by ``scale * q . mean(k)``); head_dim a
  multiple of 16, <= 256.
* ``npu_int8`` (precision "int8"): the documented full-quantization mode of
  ``torch_npu.npu_fused_infer_attention_score`` (Atlas A2 / A3, query length > 1): int8 query, key
  and value with per-tensor ``dequant_scale1`` (after BMM1, Q K^T), ``quant_scale1`` (before BMM2, on
  the softmax probabilities) and ``dequant_scale2`` (after BMM2, P V), float32; the output is float16.
  K is smoothed first (as above); P in [0, 1] is quantized with ``quant_scale1 = 127``; head_dim a
  multiple of 32 (int8 inputs), <= 512, at most 256 heads. CANN documents no FP8 input for Atlas A2 /
  A3 and its int8 mode quantizes P and V per tensor as well (coarser than SageAttention's 16-bit
  P V).
"""

from __future__ import annotations

import torch

from ._lowp import INT8_MAX, fp8_per_kv_head, int8_per_tensor, kernel_dtype, lse_shift, smooth_k
from ._optional import cuda_capability, import_optional, module_or_none

__all__ = ["probe_sage", "probe_sage_fp8", "probe_fa3_fp8", "sage_impl", "sage_lse", "sage_fp8_impl",
           "sage_fp8_lse", "fa3_fp8_impl", "fa3_fp8_lse", "npu_int8_impl", "npu_int8_lse"]

_FULL_WINDOW = 2147483647


def _accepts(fn, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# ----------------------------------------------------------------------------------------- probes


def _sage_module(fn_name: str):
    mod = import_optional("sageattention")
    if isinstance(mod, str):
        return mod
    if not hasattr(mod, fn_name):
        return f"sageattention has no {fn_name} (needs SageAttention 2.x)"
    return mod


def probe_sage() -> str | None:
    mod = _sage_module("sageattn_qk_int8_pv_fp16_cuda")
    if isinstance(mod, str):
        return mod
    cap = cuda_capability()
    if cap is None:
        return "CUDA is not available"
    if cap < (8, 0):
        return f"SageAttention's int8 CUDA kernels need compute capability >= 8.0, found sm{cap[0]}{cap[1]}"
    return None


def _sage_fp8_name(cap) -> str | None:
    if cap == (9, 0):
        return "sageattn_qk_int8_pv_fp8_cuda_sm90"
    if cap == (8, 9) or (cap is not None and cap[0] == 12):
        return "sageattn_qk_int8_pv_fp8_cuda"
    return None


def probe_sage_fp8() -> str | None:
    mod = import_optional("sageattention")
    if isinstance(mod, str):
        return mod
    cap = cuda_capability()
    if cap is None:
        return "CUDA is not available"
    name = _sage_fp8_name(cap)
    if name is None:
        return f"SageAttention's FP8 P V kernels need sm89, sm90 or sm120, found sm{cap[0]}{cap[1]}"
    mod = _sage_module(name)
    return mod if isinstance(mod, str) else None


def probe_fa3_fp8() -> str | None:
    mod = import_optional("flash_attn_interface")
    if isinstance(mod, str):
        return mod
    if not _accepts(mod.flash_attn_func, "q_descale"):
        return "flash_attn_interface.flash_attn_func takes no q_descale (FP8 needs a newer FlashAttention-3)"
    cap = cuda_capability()
    if cap is None:
        return "CUDA is not available"
    if cap[0] != 9:
        return f"FlashAttention-3 FP8 needs a Hopper GPU (sm90), found sm{cap[0]}{cap[1]}"
    return None


# ------------------------------------------------------------------------------------------ sage


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _sage(fn_name: str, q, k, v, scale, need_lse, **extra):
    fn = getattr(module_or_none("sageattention"), fn_name)
    dt = q.dtype
    kd = kernel_dtype(dt)
    q, k, v = (_last_dim_contiguous(t.to(kd)) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    res = fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True, return_lse=need_lse,
             **extra)
    if need_lse:
        out, lse = res
        return out.to(dt), lse.float()
    return res.to(dt)


def sage_impl(q, k, v, scale, key_mask=None):
    return _sage("sageattn_qk_int8_pv_fp16_cuda", q, k, v, scale, False, pv_accum_dtype="fp32")


def sage_lse(q, k, v, scale):
    return _sage("sageattn_qk_int8_pv_fp16_cuda", q, k, v, scale, True, pv_accum_dtype="fp32")


def _sage_fp8_fn(q) -> str:
    name = _sage_fp8_name(cuda_capability(q.device))
    return name or "sageattn_qk_int8_pv_fp8_cuda"


def sage_fp8_impl(q, k, v, scale, key_mask=None):
    return _sage(_sage_fp8_fn(q), q, k, v, scale, False, pv_accum_dtype="fp32+fp32")


def sage_fp8_lse(q, k, v, scale):
    return _sage(_sage_fp8_fn(q), q, k, v, scale, True, pv_accum_dtype="fp32+fp32")


# --------------------------------------------------------------------------------------- fa3 fp8


def _fa3_fp8(q, k, v, scale, need_lse):
    fn = module_or_none("flash_attn_interface").flash_attn_func
    dt = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kv_heads = k.shape[2]
    ks, km = smooth_k(k, seq_dim=1)
    q8, q_descale = fp8_per_kv_head(q, kv_heads)
    k8, k_descale = fp8_per_kv_head(ks, kv_heads)
    v8, v_descale = fp8_per_kv_head(v, kv_heads)
    kw = dict(softmax_scale=scale, causal=False, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if need_lse and _accepts(fn, "return_attn_probs"):
        kw["return_attn_probs"] = True  # newer FA3 returns out alone unless asked
    res = fn(q8, k8, v8, **kw)
    out = res[0] if isinstance(res, tuple) else res
    if not need_lse:
        return out.to(dt)
    if not isinstance(res, tuple) or len(res) < 2:
        from ._errors import AttentionBackendError

        raise AttentionBackendError("flash_attn_interface.flash_attn_func returned no softmax_lse")
    return out.to(dt), res[1].float() + lse_shift(q, km, scale)


def fa3_fp8_impl(q, k, v, scale, key_mask=None):
    return _fa3_fp8(q, k, v, scale, False)


def fa3_fp8_lse(q, k, v, scale):
    return _fa3_fp8(q, k, v, scale, True)


# -------------------------------------------------------------------------------------- npu int8


def _npu_int8(q, k, v, scale, need_lse):
    fn = module_or_none("torch_npu").npu_fused_infer_attention_score
    dt = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    ks, km = smooth_k(k, seq_dim=1)
    q8, q_scale = int8_per_tensor(q)
    k8, k_scale = int8_per_tensor(ks)
    v8, v_scale = int8_per_tensor(v)
    p_scale = torch.full((1,), INT8_MAX, dtype=torch.float32, device=q.device)  # P in [0, 1] -> [0, 127]
    kw = dict(dequant_scale1=q_scale * k_scale, quant_scale1=p_scale, dequant_scale2=v_scale / INT8_MAX,
              num_heads=q.shape[2], num_key_value_heads=k.shape[2], input_layout="BSND", pre_tokens=_FULL_WINDOW,
              next_tokens=_FULL_WINDOW, sparse_mode=0, softmax_lse_flag=need_lse)
    try:  # the scale keyword is ``scale`` in recent torch_npu, ``scale_value`` in older releases
        out, lse = fn(q8, k8, v8, scale=scale, **kw)
    except TypeError:
        out, lse = fn(q8, k8, v8, scale_value=scale, **kw)
    if not need_lse:
        return out.to(dt)
    lse = lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()
    return out.to(dt), lse + lse_shift(q, km, scale)


def npu_int8_impl(q, k, v, scale, key_mask=None):
    return _npu_int8(q, k, v, scale, False)


def npu_int8_lse(q, k, v, scale):
    return _npu_int8(q, k, v, scale, True)
