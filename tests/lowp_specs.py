"""Executable specifications of the low-precision attention kernels' documented APIs (pure PyTorch, CPU).

Each ``make_*`` returns a fake module that implements the public signature of the real package,
checks what its documentation requires of the arguments, and computes the documented result with
the documented quantization (coarsest granularity the documentation allows, so the error level
seen here bounds the real kernel's). They let lite_boost's argument mapping (layout, scale, K
smoothing, descale factors, block masks, log-sum-exp) be tested on a CPU: a wrong layout string, a
missing scale or a descale of the wrong shape gives a wrong answer or an error here.

Written from the packages' documentation and docstrings:
* SageAttention 2.x ``sageattention`` (``sageattn_qk_int8_pv_fp16_cuda``, ``sageattn_qk_int8_pv_fp8_cuda``,
  ``sageattn_qk_int8_pv_fp8_cuda_sm90``): q/k/v (B, H, S, D) for ``tensor_layout="HND"`` or (B, S, H, D)
  for "NHD", float16/bfloat16, last axis contiguous, head_dim <= 128, H_q % H_kv == 0; Q and K int8
  (per 128-token query block / 64-token key block at the coarsest), K smoothed by its mean over the
  tokens when ``smooth_k``; P V in fp16 (or FP8 e4m3 with V scaled per channel); ``sm_scale`` default
  head_dim ** -0.5; with ``return_lse`` also the natural-log log-sum-exp of ``Q K^T * sm_scale``
  (B, H_q, S_q).
* FlashAttention-3 ``flash_attn_interface.flash_attn_func(q, k, v, softmax_scale=None, causal=False,
  qv=None, q_descale=None, k_descale=None, v_descale=None, ..., return_attn_probs=False)``: (B, S, H, D);
  float16, bfloat16 or float8_e4m3fn (one dtype); FP8: descale factors float32 of shape
  (batch, num_heads_k), head_dim a multiple of 16 and <= 256, output bfloat16; softmax_lse (B, H, S_q).
* SpargeAttn ``spas_sage_attn.block_sparse_sage2_attn_cuda(q, k, v, mask_id=None, dropout_p=0.0,
  scale=None, smooth_k=True, pvthreshd=50, attention_sink=False, tensor_layout="HND",
  output_dtype=torch.float16, return_sparsity=False)``: per-head block mask ``mask_id`` of 0/1,
  shape (B, H, ceil(S_q / BLKQ), ceil(S_k / BLKK)) with 128 x 64 blocks (64 x 128 on sm90, where the
  package quantizes Q per 64 and K per 128 tokens); q length >= 128; head_dim 64 or 128; int8 Q / K,
  16-bit P V. ``pvthreshd`` skips the P V product of a block whose largest logit lies that far below the
  row maximum (a contribution below 2 ** -50 at the default; the spec computes it). The output of a
  row whose mask selects nothing is not specified: the spec returns NaN there.
"""

from __future__ import annotations

import torch
from attention_specs import _module

INT8 = 127.0
E4M3 = 448.0


def _quant_int8_blocks(x, block):
    """(B, H, S, D) -> int8 values (as float64) and per-(B, H, block) scales, expanded to tokens."""
    b, h, s, d = x.shape
    nb = -(-s // block)
    xf = torch.nn.functional.pad(x.double(), (0, 0, 0, nb * block - s)).view(b, h, nb, block, d)
    scale = xf.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-30) / INT8
    q = torch.round(xf / scale).clamp(-INT8, INT8)
    return q.view(b, h, nb * block, d)[:, :, :s], scale.expand(b, h, nb, block, 1).reshape(b, h, nb * block, 1)[:, :, :s]


def _fp8(x):
    return x.float().clamp(-E4M3, E4M3).to(torch.float8_e4m3fn).double()


def _quantized_attention(q, k, v, scale, smooth, blkq, blkk, pv, allowed=None):
    """HND fp64 attention with int8 Q/K per block, P V in ``pv`` ("fp16" or "fp8"); returns (out, lse)."""
    g = q.shape[1] // k.shape[1]
    k = k.double()
    km = k.mean(dim=2, keepdim=True) if smooth else torch.zeros_like(k[:, :, :1])
    qi, qs = _quant_int8_blocks(q, blkq)
    ki, ks = _quant_int8_blocks(k - km, blkk)
    ki, ks, v = (t.repeat_interleave(g, dim=1) for t in (ki, ks, v.double()))
    logits = (qi @ ki.transpose(-1, -2)) * qs * ks.transpose(-1, -2) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    m = logits.amax(dim=-1, keepdim=True)
    p = torch.exp(logits - m)  # in [0, 1]: the kernel's unnormalised probabilities
    rowsum = p.sum(dim=-1, keepdim=True)
    if pv == "fp16":
        o = p.half().double() @ v.half().double()
    else:  # FP8 e4m3: P scaled by 448, V per channel (B, H, D) by amax / 448
        vs = v.abs().amax(dim=2, keepdim=True).clamp_min(1e-30) / E4M3
        o = (_fp8(p * E4M3) / E4M3) @ (_fp8(v / vs) * vs)
    out = o / rowsum
    correction = scale * (q.double() @ km.repeat_interleave(g, dim=1).transpose(-1, -2)).squeeze(-1)
    lse = (m + torch.log(rowsum)).squeeze(-1) + correction
    return out, lse


# ------------------------------------------------------------------------------------ sageattention


def make_sageattention(arch: tuple[int, int] = (9, 0), calls: list | None = None):
    """``sageattention`` 2.x on a GPU of compute capability ``arch``; ``calls`` records (name, kwargs)."""

    def _check(q, k, v, tensor_layout, sm_scale, is_causal):
        if tensor_layout not in ("HND", "NHD"):
            raise ValueError(f"tensor_layout must be HND or NHD, got {tensor_layout!r}")
        if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
            raise AssertionError("Input tensors must be in dtype of torch.float16 or torch.bfloat16")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise AssertionError("Last dim of qkv must be contiguous.")
        if q.size(-1) > 128:
            raise ValueError(f"Unsupported head_dim: {q.size(-1)}")
        if is_causal:
            raise NotImplementedError("the spec covers non-causal attention")
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            raise AssertionError(f"bad shapes for layout {tensor_layout}: q {tuple(q.shape)}, k {tuple(k.shape)}")
        return q, k, v, (q.size(-1) ** -0.5 if sm_scale is None else sm_scale)

    def _finish(out, lse, dtype, tensor_layout, return_lse):
        out = out.to(dtype)
        if tensor_layout == "NHD":
            out = out.transpose(1, 2)
        return (out, lse.float()) if return_lse else out

    def sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread",
                                      sm_scale=None, pv_accum_dtype="fp32", smooth_k=True, smooth_v=False,
                                      return_lse=False, **kwargs):
        assert arch >= (8, 0), "SM80 kernel is not available"
        assert qk_quant_gran in ("per_warp", "per_thread")
        if pv_accum_dtype not in ("fp16", "fp16+fp32", "fp32"):
            raise ValueError(f"Unsupported pv_accum_dtype: {pv_accum_dtype}")
        if calls is not None:
            calls.append(("sageattn_qk_int8_pv_fp16_cuda", dict(tensor_layout=tensor_layout, sm_scale=sm_scale,
                                                                pv_accum_dtype=pv_accum_dtype, smooth_k=smooth_k)))
        qh, kh, vh, scale = _check(q, k, v, tensor_layout, sm_scale, is_causal)
        out, lse = _quantized_attention(qh, kh, vh, scale, smooth_k, 128, 64, "fp16")
        return _finish(out, lse, q.dtype, tensor_layout, return_lse)

    def _fp8_kernel(name, allowed_accum, supported):
        def fn(q, k, v, tensor_layout="HND", is_causal=False, qk_quant_gran="per_thread", sm_scale=None,
               pv_accum_dtype=allowed_accum[-1], smooth_k=True, return_lse=False, **kwargs):
            assert supported(arch), f"{name}: kernel not available on sm{arch[0]}{arch[1]}"
            assert qk_quant_gran in ("per_warp", "per_thread")
            if pv_accum_dtype not in allowed_accum:
                raise ValueError(f"Unsupported pv_accum_dtype: {pv_accum_dtype}")
            if calls is not None:
                calls.append((name, dict(tensor_layout=tensor_layout, sm_scale=sm_scale,
                                         pv_accum_dtype=pv_accum_dtype, smooth_k=smooth_k)))
            qh, kh, vh, scale = _check(q, k, v, tensor_layout, sm_scale, is_causal)
            out, lse = _quantized_attention(qh, kh, vh, scale, smooth_k, 128, 64, "fp8")
            return _finish(out, lse, q.dtype, tensor_layout, return_lse)

        return fn

    return _module(
        "sageattention",
        sageattn_qk_int8_pv_fp16_cuda=sageattn_qk_int8_pv_fp16_cuda,
        sageattn_qk_int8_pv_fp8_cuda=_fp8_kernel("sageattn_qk_int8_pv_fp8_cuda", ("fp32", "fp32+fp32", "fp32+fp16"),
                                                 lambda a: a == (8, 9) or a[0] == 12),
        sageattn_qk_int8_pv_fp8_cuda_sm90=_fp8_kernel("sageattn_qk_int8_pv_fp8_cuda_sm90", ("fp32", "fp32+fp32"),
                                                      lambda a: a == (9, 0)),
    )


# ----------------------------------------------------------------------------------- FlashAttention-3


def make_flash_attn_interface_fp8(return_attn_probs_flag: bool = True):
    """FlashAttention-3 with FP8 inputs; ``return_attn_probs_flag`` as in attention_specs (newer interface)."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError("FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        assert not causal and qv is None and softcap == 0.0 and window_size == (-1, -1)
        b, sq, h, d = q.shape
        hk = k.shape[2]
        assert h % hk == 0, "Number of heads in key/value must divide number of heads in query"
        fp8 = q.dtype == torch.float8_e4m3fn
        if d > 256 or d % (16 if fp8 else 8):
            raise RuntimeError(f"head_dim {d} unsupported (multiple of {16 if fp8 else 8}, <= 256)")
        tensors = []
        for name, t, ds in (("q", q, q_descale), ("k", k, k_descale), ("v", v, v_descale)):
            x = t.double()
            if ds is not None:
                if ds.dtype != torch.float32 or tuple(ds.shape) != (b, hk):
                    raise RuntimeError(f"{name}_descale must be float32 of shape (batch_size, num_heads_k) = "
                                       f"({b}, {hk}), got {ds.dtype} {tuple(ds.shape)}")
                per_head = ds.double().repeat_interleave(t.shape[2] // hk, dim=1)
                x = x * per_head[:, None, :, None]
            tensors.append(x)
        qf, kf, vf = tensors
        g = h // hk
        kf, vf = kf.repeat_interleave(g, dim=2), vf.repeat_interleave(g, dim=2)
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        logits = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
        out = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), vf)
        out = out.to(torch.bfloat16 if fp8 else q.dtype)
        lse = torch.logsumexp(logits, dim=-1).float()
        if return_attn_probs_flag:
            return (out, lse) if return_attn_probs else out
        return out, lse

    return _module("flash_attn_interface", flash_attn_func=flash_attn_func)


# ------------------------------------------------------------------------------------------ SpargeAttn


def make_spas_sage_attn(arch: tuple[int, int] = (8, 9), calls: list | None = None):
    """``spas_sage_attn`` with ``block_sparse_sage2_attn_cuda`` on a GPU of compute capability ``arch``."""
    blkq, blkk = (64, 128) if arch == (9, 0) else (128, 64)

    def block_sparse_sage2_attn_cuda(q, k, v, mask_id=None, dropout_p=0.0, scale=None, smooth_k=True, pvthreshd=50,
                                     attention_sink=False, tensor_layout="HND", output_dtype=torch.float16,
                                     return_sparsity=False):
        assert tensor_layout in ("HND", "NHD")
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        assert q.size(-2) >= 128, "seq_len should be not less than 128."
        d = q.size(-1)
        assert d in (64, 128), "headdim should be in [64, 128]."
        assert q.shape[1] == k.shape[1] == v.shape[1], "the spec covers equal query and key/value head counts"
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float16
        b, h, sq, _ = q.shape
        sk = k.shape[2]
        shape = (b, h, -(-sq // blkq), -(-sk // blkk))
        if mask_id is None or tuple(mask_id.shape) != shape or not mask_id.is_contiguous():
            raise AssertionError(f"mask_id must be a contiguous 0/1 tensor of shape {shape}")
        if mask_id.dtype not in (torch.bool, torch.int8, torch.int32, torch.int64) or bool(((mask_id != 0) &
                                                                                               (mask_id != 1)).any()):
            raise AssertionError("mask_id must hold 0 and 1")
        if calls is not None:
            calls.append(dict(scale=scale, smooth_k=smooth_k, tensor_layout=tensor_layout, shape=shape))
        allowed = mask_id.bool().repeat_interleave(blkq, dim=2)[:, :, :sq].repeat_interleave(blkk, dim=3)[..., :sk]
        scale = d ** -0.5 if scale is None else scale
        out, _ = _quantized_attention(q.to(dtype), k.to(dtype), v.half(), scale, smooth_k, blkq, blkk, "fp16",
                                      allowed)
        out = out.to(dtype)  # rows with an empty mask: NaN (0 / 0), unspecified by the package
        if tensor_layout == "NHD":
            out = out.transpose(1, 2)
        if return_sparsity:
            return out, 1.0 - mask_id.float().mean().item()
        return out

    return _module("spas_sage_attn", block_sparse_sage2_attn_cuda=block_sparse_sage2_attn_cuda)


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def rel_l1(a, ref) -> float:
    """The SageAttention papers' relative L1 error: sum |a - ref| / sum |ref|."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().sum() / ref.abs().sum())


def reference_lse_hnd(q, k, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    return torch.logsumexp((q.double() @ k.double().repeat_interleave(g, dim=1).transpose(-1, -2)) * scale, dim=-1)


__all__ = ["make_sageattention", "make_flash_attn_interface_fp8", "make_spas_sage_attn", "cosine", "rel_l1",
           "reference_lse_hnd"]
