"""Executable specifications of the optional attention kernels' documented contracts.

Each fake module implements the public signature of the real one in pure PyTorch, checks the
arguments the documentation requires, and computes attention by the documented semantics. They
let the argument translation of lite_boost's FA2 / FA3 / Ascend backends be tested on a CPU: a
wrong layout, a missing scale or a forgotten ``next_tokens`` gives a wrong answer here.
"""

import importlib.machinery
import math
import types

import torch


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def reference_attention(q, k, v, scale=None, allowed=None):
    """fp64 softmax attention on (B, S, N, D) tensors; GQA by repeating KV heads; ``allowed`` (Sq, Sk) bool."""
    n, nk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(n // nk, dim=2)
    v = v.repeat_interleave(n // nk, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqnd,bknd->bnqk", q.double(), k.double()) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", s.softmax(-1), v.double())


def reference_lse(q, k, scale=None, allowed=None):
    """fp64 natural-log log-sum-exp of each query row, (B, N, Sq): what the kernels return as softmax_lse."""
    n, nk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(n // nk, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqnd,bknd->bnqk", q.double(), k.double()) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def _check_half(*ts):
    for t in ts:
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"FlashAttention only supports fp16 and bf16, got {t.dtype}")


def make_flash_attn():
    """flash_attn 2.x: flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ...)."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        _check_half(q, k, v)
        assert q.dim() == 4 and q.shape[-1] <= 256, "q must be (batch, seqlen, nheads, headdim<=256)"
        assert q.shape[2] % k.shape[2] == 0, "nheads must be divisible by nheads_k"
        assert dropout_p == 0.0
        allowed = None
        if causal:
            allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
        out = reference_attention(q, k, v, softmax_scale, allowed).to(q.dtype)
        if return_attn_probs:  # documented: (out, softmax_lse (batch, nheads, seqlen) fp32, S_dmask)
            return out, reference_lse(q, k, softmax_scale, allowed).float(), None
        return out

    return _module("flash_attn", flash_attn_func=flash_attn_func)


def make_flash_attn_interface(return_attn_probs_flag: bool = False):
    """FlashAttention-3: flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...) -> (out, softmax_lse).

    ``return_attn_probs_flag``: the newer interface, which returns ``out`` alone unless called with
    ``return_attn_probs=True`` (then ``(out, softmax_lse)``); else the releases that always return both.
    """

    def _run(q, k, v, softmax_scale, causal):
        _check_half(q, k, v)
        assert not causal
        return reference_attention(q, k, v, softmax_scale).to(q.dtype), reference_lse(q, k, softmax_scale).float()

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), **kwargs):
        return _run(q, k, v, softmax_scale, causal)

    def flash_attn_func_new(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                            v_descale=None, window_size=(-1, -1), return_attn_probs=False):
        out, lse = _run(q, k, v, softmax_scale, causal)
        return (out, lse) if return_attn_probs else out

    return _module("flash_attn_interface",
                   flash_attn_func=flash_attn_func_new if return_attn_probs_flag else flash_attn_func)


def make_torch_npu():
    """torch_npu.npu_prompt_flash_attention as documented (inference-only prompt flash attention)."""

    def npu_prompt_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                                   actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                                   quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                                   pre_tokens=2147473647, next_tokens=0, input_layout="BSH",
                                   num_key_value_heads=0, actual_seq_lengths_kv=None, sparse_mode=0):
        if query.dtype not in (torch.float16, torch.bfloat16, torch.int8):
            raise TypeError(f"query dtype must be float16, bfloat16 or int8, got {query.dtype}")
        if input_layout not in ("BSH", "BSND", "BNSD"):
            raise ValueError(f"input_layout must be BSH, BSND or BNSD, got {input_layout}")
        if input_layout == "BSH":
            q = query.unflatten(-1, (num_heads, -1))
            kvh = num_key_value_heads or num_heads
            k, v = key.unflatten(-1, (kvh, -1)), value.unflatten(-1, (kvh, -1))
        elif input_layout == "BNSD":
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        else:
            q, k, v = query, key, value
        if q.shape[2] != num_heads:
            raise ValueError(f"num_heads={num_heads} does not match the query's {q.shape[2]} heads")
        kvh = num_key_value_heads or num_heads
        if k.shape[2] != kvh or num_heads % kvh:
            raise ValueError(f"num_key_value_heads={num_key_value_heads} does not match key heads {k.shape[2]}")
        if q.shape[-1] > 512 or num_heads > 256:
            raise ValueError("D must be <= 512 and N <= 256")
        if sparse_mode != 0 or atten_mask is not None:
            raise NotImplementedError("spec covers sparse_mode=0 without a mask")
        i = torch.arange(q.shape[1])[:, None]
        j = torch.arange(k.shape[1])[None, :]
        allowed = (j >= i - pre_tokens) & (j <= i + next_tokens)  # sparse_mode 0: band from pre/next tokens
        out = reference_attention(q, k, v, scale_value, allowed).to(query.dtype)
        if input_layout == "BSH":
            return out.flatten(2)
        return out.transpose(1, 2) if input_layout == "BNSD" else out

    def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None, dequant_scale1=None,
                                        quant_scale1=None, dequant_scale2=None, quant_scale2=None,
                                        quant_offset2=None, num_heads=1, scale=1.0, pre_tokens=2147483647,
                                        next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0,
                                        sparse_mode=0, inner_precise=0, block_size=0, softmax_lse_flag=False,
                                        **unused):
        """Documented: (attention_out, softmax_lse); softmax_lse (B, N, S, 1) fp32 when softmax_lse_flag.

        Full quantization (query length > 1, Atlas A2 / A3): int8 query, key and value with the
        per-tensor factors dequant_scale1 (after BMM1, Q K^T), quant_scale1 (before BMM2: the softmax
        probabilities, in [0, 1] before normalisation, are quantized to int8 with it) and dequant_scale2
        (after BMM2), float32 (or uint64), all three present; without quant_scale2 / quant_offset2 the
        output is float16. Inputs containing int8 need a head dim that is a multiple of 32.
        """
        if input_layout != "BSND":
            raise NotImplementedError("spec covers input_layout BSND")
        if unused:
            raise TypeError(f"npu_fused_infer_attention_score() got unexpected keyword arguments {sorted(unused)}")
        quant = (dequant_scale1, quant_scale1, dequant_scale2)
        if query.dtype == torch.int8:
            if key.dtype != torch.int8 or value.dtype != torch.int8:
                raise TypeError("full quantization needs int8 query, key and value")
            if any(t is None for t in quant):
                raise ValueError("int8 inputs need dequant_scale1, quant_scale1 and dequant_scale2 together")
            if quant_scale2 is not None or quant_offset2 is not None:
                raise NotImplementedError("spec covers the float16-output full-quantization scenario")
            for name, t in zip(("dequant_scale1", "quant_scale1", "dequant_scale2"), quant):
                if t.numel() != 1 or t.dtype not in ((torch.float32,) if name == "quant_scale1"
                                                     else (torch.float32, torch.uint64)):
                    raise ValueError(f"{name} must be a per-tensor float32 factor, got {t.dtype} {tuple(t.shape)}")
            if query.shape[-1] % 32:
                raise ValueError(f"int8 inputs need D aligned to 32, got {query.shape[-1]}")
        elif query.dtype in (torch.float16, torch.bfloat16):
            if any(t is not None for t in quant):
                raise ValueError("dequant_scale1 / quant_scale1 / dequant_scale2 are for int8 inputs only")
        else:
            raise TypeError(f"query dtype must be float16, bfloat16 or int8, got {query.dtype}")
        kvh = num_key_value_heads or num_heads
        if query.shape[2] != num_heads or key.shape[2] != kvh:
            raise ValueError("num_heads / num_key_value_heads do not match the tensors")
        if sparse_mode != 0 or atten_mask is not None:
            raise NotImplementedError("spec covers sparse_mode=0 without a mask")
        i = torch.arange(query.shape[1])[:, None]
        j = torch.arange(key.shape[1])[None, :]
        allowed = (j >= i - pre_tokens) & (j <= i + next_tokens)
        if query.dtype != torch.int8:
            out = reference_attention(query, key, value, scale, allowed).to(query.dtype)
            lse = reference_lse(query, key, scale, allowed).float()[..., None] if softmax_lse_flag else torch.zeros(1)
            return out, lse
        g = num_heads // kvh
        k8 = key.double().repeat_interleave(g, dim=2)
        v8 = value.double().repeat_interleave(g, dim=2)
        logits = torch.einsum("bqnd,bknd->bnqk", query.double(), k8) * float(dequant_scale1) * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        m = logits.amax(dim=-1, keepdim=True)
        p = torch.exp(logits - m)
        p8 = torch.round(p * float(quant_scale1)).clamp(-128, 127)
        o = torch.einsum("bnqk,bknd->bqnd", p8, v8) * float(dequant_scale2)
        out = (o / p.sum(-1).permute(0, 2, 1)[..., None]).to(torch.float16)
        lse = (m + torch.log(p.sum(-1, keepdim=True))).float() if softmax_lse_flag else torch.zeros(1)
        return out, lse

    return _module("torch_npu", npu_prompt_flash_attention=npu_prompt_flash_attention,
                   npu_fused_infer_attention_score=npu_fused_infer_attention_score)
