"""Dense attention dispatch: FA3 -> FA2 -> Ascend prompt flash attention -> PyTorch SDPA.

With ``precision="int8"`` the order is SageAttention (CUDA) -> Ascend fused attention in its int8
mode -> the C++ CPU kernel with every block selected (``cpu_int8``, :mod:`lite_boost.ops.precision`);
with ``precision="fp8"`` FlashAttention-3 FP8 -> SageAttention FP8 (both CUDA); see
``_attention_lowp.py`` for the argument mapping of each. No silent fallback to full precision: a
precision nothing here can run raises and says why for each backend.

Each backend declares the devices, dtypes and head dims it accepts and how to find out whether it
is installed. ``attention(q, k, v)`` picks the first backend that can run the call; the choice is
cached per (device, dtype, head_dim, key mask, request) signature and logged once with the reason.
``key_mask`` (B, S_k) bool excludes padded keys (joint text + image attention with padded text);
only backends that declare ``supports_key_mask`` take it (SDPA, with a broadcast boolean mask). A backend
can be forced per call (``backend="sdpa"``), for a block of code (``with attention_backend("fa2")``)
or for the process (environment variable ``LITE_BOOST_ATTN_BACKEND``). Forcing a backend that
cannot run raises :class:`AttentionBackendError` saying why and listing the usable ones.

Optional packages (flash_attn, flash_attn_interface, sageattention, torch_npu) are imported lazily, on the first
call that could use them; their absence never breaks ``import lite_boost``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKEND_NAMES
from . import _attention_lowp as _lowp_impl
from ._checks import check_qkv_tensors
from ._errors import AttentionBackendError
from ._lowp import PRECISIONS, check_precision
from ._optional import import_optional as _import_optional
from ._optional import module_or_none as _module_or_none
from ._override import BackendOverride, raise_when_run
from .precision import cpu_attention, cpu_int8_reason, cpu_precision_reason

__all__ = [
    "precision_reason",
    "AttentionBackendError",
    "BackendSpec",
    "BACKENDS",
    "ENV_VAR",
    "LAYOUTS",
    "PRECISIONS",
    "attention",
    "attention_backend",
    "available_backends",
    "backend_report",
    "select_backend",
    "validate_qkv",
]

logger = logging.getLogger("lite_boost.attention")

ENV_VAR = "LITE_BOOST_ATTN_BACKEND"
LAYOUTS = ("BSND", "BNSD")
_AUTO_ORDER = ("fa3", "fa2", "npu", "sdpa")
# Automatic order per requested precision ("auto" = full precision, today's behaviour). Low-precision
# backends are only chosen when a precision asks for them (or when forced by name).
_ORDERS = {
    "auto": _AUTO_ORDER,
    "int8": ("sage", "npu_int8", "cpu_int8"),
    "fp8": ("fa3_fp8", "sage_fp8"),
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_LOWP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float32 runs the kernel in bfloat16
_FULL_WINDOW = 2147483647  # pre/next tokens for full bidirectional attention on Ascend



# --------------------------------------------------------------------------------------------- #
# Optional-package probing                                                                       #
# --------------------------------------------------------------------------------------------- #


def _probe_fa3() -> str | None:
    mod = _import_optional("flash_attn_interface")
    if isinstance(mod, str):
        return mod
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return f"FlashAttention-3 needs a Hopper GPU (sm90), found sm{major}x"
    return None


def _probe_fa2() -> str | None:
    mod = _import_optional("flash_attn")
    if isinstance(mod, str):
        return mod
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def _probe_npu() -> str | None:
    mod = _import_optional("torch_npu")
    if isinstance(mod, str):
        return mod
    try:
        ok = bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return f"torch_npu imported but torch.npu.is_available() failed ({exc})"
    return None if ok else "torch_npu is installed but no Ascend NPU is visible"


def _probe_sdpa() -> str | None:
    return None if hasattr(F, "scaled_dot_product_attention") else "torch has no scaled_dot_product_attention"


# --------------------------------------------------------------------------------------------- #
# Backend implementations. All take and return (B, S, N, D) tensors.                            #
# --------------------------------------------------------------------------------------------- #


def _fa3_impl(q, k, v, scale, key_mask=None):
    mod = _module_or_none("flash_attn_interface")
    out = mod.flash_attn_func(q, k, v, softmax_scale=scale, causal=False)
    return out[0] if isinstance(out, tuple) else out


def _fa2_impl(q, k, v, scale, key_mask=None):
    mod = _module_or_none("flash_attn")
    return mod.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False)


def _pfa_op():
    """``torch.ops.lite_boost.prompt_flash_attention`` when its Ascend kernel (csrc/npu) is built, else None."""
    from . import _ext_npu

    if _ext_npu.npu_kernel_reason("prompt_flash_attention") is not None:
        return None
    return torch.ops.lite_boost.prompt_flash_attention


def _npu_impl(q, k, v, scale, key_mask=None):
    # The documented default scale_value is 1.0 (not head_dim ** -0.5): always pass it.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    op = _pfa_op()
    if op is not None:  # lite_boost's Ascend kernel: aclnnPromptFlashAttentionV3, as torch_npu calls it
        return op(q, k, v, num_heads=q.shape[2], num_key_value_heads=k.shape[2], input_layout="BSND",
                  scale_value=scale, pre_tokens=_FULL_WINDOW, next_tokens=_FULL_WINDOW)
    # Fallback when the lite_boost NPU library is not built: torch_npu's own operator (same aclnn entry).
    torch_npu = _module_or_none("torch_npu")
    return torch_npu.npu_prompt_flash_attention(
        q,
        k,
        v,
        num_heads=q.shape[2],
        num_key_value_heads=k.shape[2],
        input_layout="BSND",
        scale_value=scale,
        pre_tokens=_FULL_WINDOW,
        next_tokens=_FULL_WINDOW,
        sparse_mode=0,
    )


def _sdpa_impl(q, k, v, scale, key_mask=None):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = {"enable_gqa": True} if qt.shape[1] != kt.shape[1] else {}
    mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S_k): True = attend
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, **gqa)
    return out.transpose(1, 2)


# ----------------------------------------------------------------- with the log-sum-exp (Ring attention)
# Each returns (out (B, S, N, D) in the input dtype, lse (B, N, S) float32: the natural-log
# log-sum-exp of each query row's scaled logits). Inputs are BSND with at least one key.


def _repeat_kv(q, k, v):
    if k.shape[2] != q.shape[2]:  # GQA: kernels below take equal head counts
        g = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    return k, v


def _fa3_lse(q, k, v, scale):
    fn = _module_or_none("flash_attn_interface").flash_attn_func
    if _accepts(fn, "return_attn_probs"):  # newer FA3 returns out alone unless asked
        res = fn(q, k, v, softmax_scale=scale, causal=False, return_attn_probs=True)
    else:  # FA3 releases that always return (out, softmax_lse)
        res = fn(q, k, v, softmax_scale=scale, causal=False)
    if not isinstance(res, tuple) or len(res) < 2:
        raise AttentionBackendError("flash_attn_interface.flash_attn_func returned no softmax_lse")
    return res[0], res[1].float()


def _fa2_lse(q, k, v, scale):
    mod = _module_or_none("flash_attn")
    out, lse, _ = mod.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False,
                                      return_attn_probs=True)
    return out, lse.float()


def _npu_lse(q, k, v, scale):
    # torch_npu's fused inference attention returns softmax_lse (B, N, S, 1) with softmax_lse_flag;
    # the scale keyword is ``scale`` in recent torch_npu, ``scale_value`` in older releases.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn = _module_or_none("torch_npu").npu_fused_infer_attention_score
    kw = dict(num_heads=q.shape[2], num_key_value_heads=k.shape[2], input_layout="BSND", pre_tokens=_FULL_WINDOW,
              next_tokens=_FULL_WINDOW, sparse_mode=0, softmax_lse_flag=True)
    try:
        out, lse = fn(q, k, v, scale=scale, **kw)
    except TypeError:
        out, lse = fn(q, k, v, scale_value=scale, **kw)
    return out, lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def _sdpa_lse(q, k, v, scale):
    k, v = _repeat_kv(q, k, v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    s = q.shape[1]
    if q.device.type == "cpu":  # the CPU flash kernel behind SDPA (fp32 lse for every input dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, False, scale=scale)
    elif q.device.type == "cuda" and q.dtype in _HALF_DTYPES:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, False, False, scale=scale)[:2]
    elif q.device.type == "cuda":  # float32: the memory-efficient kernel (lse padded to a multiple of 32)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, False,
                                                                          scale=scale)[:2]
    else:  # other devices: exact math in fp32 (materialises the S x S logits of this call)
        logits = torch.matmul(qt.float(), kt.float().transpose(-1, -2)).mul_(q.shape[-1] ** -0.5 if scale is None
                                                                             else scale)
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.matmul(torch.exp(logits - lse[..., None]), vt.float()).to(q.dtype)
    return out.transpose(1, 2), lse[..., :s].float()


@functools.lru_cache(maxsize=None)
def _accepts_cached(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _accepts(fn, name: str) -> bool:
    try:
        return _accepts_cached(fn, name)
    except TypeError:  # unhashable callable
        return False


@dataclass(frozen=True)
class BackendSpec:
    """What a dense attention backend accepts and how to run it."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int
    head_dim_multiple: int
    max_heads: int | None
    supports_gqa: bool
    probe: Callable[[], str | None]
    impl: Callable[..., torch.Tensor]
    description: str
    lse_impl: Callable[..., tuple] | None = None  # (out, lse) variant for Ring attention; None = no lse
    supports_key_mask: bool = False  # takes a (B, S_k) boolean key-padding mask
    precision: str = "auto"  # "auto" = full precision; "int8" / "fp8": what the kernel computes in

    def rejects(self, device_type: str, dtype: torch.dtype, head_dim: int, heads: int, gqa: bool,
                masked: bool = False, need_lse: bool = False, precision: str = "auto") -> str | None:
        """The reason this backend cannot run the call, or None. Cheap checks first, probing last."""
        if precision != "auto" and self.precision != precision:
            return (f"computes in {'full precision' if self.precision == 'auto' else self.precision}, "
                    f"not {precision} (precision={precision!r})")
        if need_lse and self.lse_impl is None:
            return "cannot return the log-sum-exp (needed by Ring attention)"
        if device_type not in self.devices:
            return f"wrong device: needs {'/'.join(self.devices)}, got {device_type}"
        if dtype not in self.dtypes:
            return f"unsupported dtype {str(dtype).replace('torch.', '')}: accepts " + ", ".join(
                str(d).replace("torch.", "") for d in self.dtypes
            )
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (
                f"unsupported head dim {head_dim}: needs <= {self.max_head_dim}"
                + (f" and a multiple of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else "")
            )
        if self.max_heads is not None and heads > self.max_heads:
            return f"unsupported head count {heads}: needs <= {self.max_heads}"
        if gqa and not self.supports_gqa:
            return "grouped-query attention (fewer KV heads) not supported"
        if masked and not self.supports_key_mask:
            return "no key-padding mask support (key_mask given)"
        return self.probe()


def _cpu_int8_impl(q, k, v, scale, key_mask=None):
    return cpu_attention(q, k, v, "BSND", scale, False, "int8")


def _cpu_int8_lse(q, k, v, scale):
    return cpu_attention(q, k, v, "BSND", scale, True, "int8")


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("fa3", ("cuda",), _HALF_DTYPES, 256, 8, None, True, _probe_fa3, _fa3_impl,
                    "FlashAttention-3 (flash_attn_interface.flash_attn_func), Hopper GPUs", _fa3_lse),
        BackendSpec("fa2", ("cuda",), _HALF_DTYPES, 256, 8, None, True, _probe_fa2, _fa2_impl,
                    "FlashAttention-2 (flash_attn.flash_attn_func)", _fa2_lse),
        BackendSpec("npu", ("npu",), _HALF_DTYPES, 512, 1, 256, True, _probe_npu, _npu_impl,
                    "Ascend prompt flash attention (torch.ops.lite_boost.prompt_flash_attention when its NPU kernel "
                    "is built, else torch_npu.npu_prompt_flash_attention), BSND, full bidirectional; with the "
                    "log-sum-exp: torch_npu.npu_fused_infer_attention_score(softmax_lse_flag=True)", _npu_lse),
        BackendSpec("sdpa", ("cpu", "cuda", "npu", "mps", "xpu"), _FLOAT_DTYPES, 1 << 16, 1, None, True,
                    _probe_sdpa, _sdpa_impl, "torch.nn.functional.scaled_dot_product_attention; with the "
                    "log-sum-exp: aten's CPU flash / CUDA flash or memory-efficient kernel", _sdpa_lse,
                    supports_key_mask=True),
        BackendSpec("sage", ("cuda",), _LOWP_DTYPES, 128, 1, None, True, _lowp_impl.probe_sage,
                    _lowp_impl.sage_impl, "SageAttention int8 Q/K (K smoothed), fp16 P/V, fp32 accumulation "
                    "(sageattention.sageattn_qk_int8_pv_fp16_cuda), compute capability >= 8.0",
                    _lowp_impl.sage_lse, precision="int8"),
        BackendSpec("sage_fp8", ("cuda",), _LOWP_DTYPES, 128, 1, None, True, _lowp_impl.probe_sage_fp8,
                    _lowp_impl.sage_fp8_impl, "SageAttention int8 Q/K, FP8 P/V (sageattention."
                    "sageattn_qk_int8_pv_fp8_cuda[_sm90]), sm89 / sm90 / sm120", _lowp_impl.sage_fp8_lse,
                    precision="fp8"),
        BackendSpec("fa3_fp8", ("cuda",), _LOWP_DTYPES, 256, 16, None, True, _lowp_impl.probe_fa3_fp8,
                    _lowp_impl.fa3_fp8_impl, "FlashAttention-3 on float8_e4m3 Q/K/V with per-(batch, KV head) "
                    "descale factors (flash_attn_interface.flash_attn_func), Hopper GPUs", _lowp_impl.fa3_fp8_lse,
                    precision="fp8"),
        BackendSpec("npu_int8", ("npu",), _LOWP_DTYPES, 512, 32, 256, True, _probe_npu, _lowp_impl.npu_int8_impl,
                    "Ascend fused inference attention in its documented full-quantization mode (int8 Q/K/V, "
                    "per-tensor dequant_scale1 / quant_scale1 / dequant_scale2; torch_npu."
                    "npu_fused_infer_attention_score)", _lowp_impl.npu_int8_lse, precision="int8"),
        BackendSpec("cpu_int8", ("cpu",), _LOWP_DTYPES, 1 << 16, 1, None, True, cpu_int8_reason, _cpu_int8_impl,
                    "the C++ rain_fusion kernel (torch.ops.lite_boost) with every block selected: int8 Q K^T after "
                    "smoothing K (oneDNN u8 x s8 brgemm, AVX512-VNNI / AVX-VNNI / AMX-INT8), fp32 softmax, bf16 "
                    "P V (fp32 without AVX512-BF16)", _cpu_int8_lse, precision="int8"),
    )
}
assert tuple(BACKENDS) == ATTENTION_BACKEND_NAMES


# --------------------------------------------------------------------------------------------- #
# Selection                                                                                      #
# --------------------------------------------------------------------------------------------- #


# Per-call argument > ``with attention_backend(...)`` > LITE_BOOST_ATTN_BACKEND.
_OVERRIDE = BackendOverride(ATTENTION_BACKEND_NAMES, ENV_VAR, "attention_backend(...)")


# Why a device has no kernel of a precision at all (documented facts, added to the refusal).
_PRECISION_NOTES = {
    ("npu", "fp8"): "CANN documents no FP8 input for Ascend's fused attention (npu_fused_infer_attention_score) "
                    "on Atlas A2 / A3; its int8 mode is precision='int8'",
}


@functools.lru_cache(maxsize=512)
def _decide(device_type: str, dtype: torch.dtype, head_dim: int, heads: int, gqa: bool,
            requested: str | None, how: str, masked: bool = False,
            need_lse: bool = False, precision: str = "auto") -> tuple[str | None, str | None]:
    """(backend name, None) or (None, error message) for a call signature; logs each choice once."""
    order = _ORDERS[precision]
    reasons = {}  # probed lazily: a backend outside the order is only probed for an error message

    def why(n):
        if n not in reasons:
            reasons[n] = BACKENDS[n].rejects(device_type, dtype, head_dim, heads, gqa, masked, need_lse, precision)
        return reasons[n]

    sig = (f"{device_type}/{str(dtype).replace('torch.', '')}/head_dim={head_dim}/heads={heads}"
           + ("/key_mask" if masked else "") + ("/with lse" if need_lse else "")
           + (f"/precision={precision}" if precision != "auto" else ""))
    if requested is not None:
        reason = why(requested)
        if reason is not None:
            usable = [n for n in order + tuple(n for n in BACKENDS if n not in order) if why(n) is None]
            return None, (f"attention backend {requested!r} ({how}) is unavailable for {sig}: {reason}. "
                          f"Usable backends for this call: {usable}")
        logger.info("lite_boost attention: using %r for %s (%s)", requested, sig, how)
        return requested, None
    for name in order:
        if why(name) is None:
            skipped = "; ".join(f"{n}: {reasons[n]}" for n in order[: order.index(name)])
            logger.info(
                "lite_boost attention: using %r for %s (first usable in %s%s)",
                name, sig, " -> ".join(order), f"; skipped {skipped}" if skipped else "",
            )
            return name, None
    msg = f"no attention backend can run {sig}: " + "; ".join(f"{n}: {reasons[n]}" for n in order)
    if precision != "auto":
        full = [n for n in _AUTO_ORDER
                if BACKENDS[n].rejects(device_type, dtype, head_dim, heads, gqa, masked, need_lse) is None]
        note = _PRECISION_NOTES.get((device_type, precision))
        msg += (f". No {precision} attention kernel is available for {device_type} here"
                + (f" ({note})" if note else "") + f"; precision='auto' (full precision) would run this call on {full}")
    return None, msg


# Under torch.compile the choice is made once, in Python, while the graph is traced, and enters the graph
# as a constant (dynamo does not trace the probes). Its inputs (device, dtype, shapes, the requested
# backend) are already guarded, so a different signature or override retraces.
@torch.compiler.assume_constant_result
def _decide_traced(*signature) -> tuple[str | None, str | None]:
    return _decide(*signature)


def _signature(q: torch.Tensor, k: torch.Tensor | None, layout: str, backend: str | None,
               masked: bool = False, need_lse: bool = False, precision: str = "auto") -> tuple:
    heads_axis = 2 if layout == "BSND" else 1
    kv_heads = (k if k is not None else q).shape[heads_axis]
    requested, how = _OVERRIDE.requested(backend)
    return (q.device.type, q.dtype, q.shape[-1], q.shape[heads_axis], kv_heads != q.shape[heads_axis], requested, how,
            masked, need_lse, precision)


def select_backend(q: torch.Tensor, k: torch.Tensor | None = None, *, layout: str = "BSND",
                   backend: str | None = None, masked: bool = False, return_lse: bool = False,
                   precision: str = "auto") -> str:
    """Name of the backend ``attention`` would use for these tensors (raises if a forced one cannot run).

    ``masked``: the call passes a ``key_mask`` (only backends with key-padding mask support qualify);
    ``return_lse``: the call asks for the log-sum-exp (only backends that return it qualify);
    ``precision``: "auto", "int8" or "fp8" (see :func:`attention`).
    """
    layout = _check_layout(layout)
    precision = check_precision(precision)
    name, error = _decide(*_signature(q, k, layout, backend, masked, return_lse, precision))
    if error is not None:
        raise AttentionBackendError(error)
    return name


def available_backends(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       head_dim: int = 128, heads: int = 8, masked: bool = False,
                       precision: str = "auto") -> dict[str, str | None]:
    """Map backend name -> None if usable for this signature (``masked``: with a key mask), else why not.

    ``precision="auto"`` lists the full-precision backends; "int8" / "fp8" those of that precision.
    """
    # a device name torch may not know yet ("npu" before torch_npu is imported) is taken as written
    device_type = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    precision = check_precision(precision)
    return {n: BACKENDS[n].rejects(device_type, dtype, head_dim, heads, False, masked, False, precision)
            for n in _ORDERS[precision]}


def precision_reason(device_type: str, precision: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                     heads: int = 8) -> str | None:
    """None when attention at ``precision`` can run on ``device_type``, else why not (the planning check of
    ``BoostConfig(attention={"precision": ...})``). CPU: the C++ kernel's modes; elsewhere: whether a dense
    backend of that precision is usable for the signature."""
    precision = check_precision(precision)
    if precision == "auto":
        return None
    if device_type == "cpu":
        return cpu_precision_reason(precision)
    reasons = available_backends(device_type, dtype, head_dim, heads, precision=precision)
    if any(r is None for r in reasons.values()):
        return None
    note = _PRECISION_NOTES.get((device_type, precision))
    return f"no {precision} attention kernel can run on {device_type} here (" + "; ".join(
        f"{n}: {r}" for n, r in reasons.items()) + ")" + (f": {note}" if note else "")


def backend_report() -> list[tuple[str, str, str]]:
    """(name, 'usable'/'unavailable', detail) per backend, probing installation only (for `lite-boost env`)."""
    rows = []
    for name in BACKENDS:
        spec = BACKENDS[name]
        why = spec.probe()
        status = "installed" if why is None else "unavailable"
        rows.append((name, status, spec.description if why is None else why))
    return rows


def attention_backend(name: str | None):
    """Force a dense attention backend inside a ``with`` block (``None`` restores automatic choice)."""
    return _OVERRIDE.force(name)


# --------------------------------------------------------------------------------------------- #
# Entry point                                                                                    #
# --------------------------------------------------------------------------------------------- #


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return layout.upper()


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "BSND") -> str:
    """Check q/k/v ranks, dtypes, devices and shapes for ``layout``; return the normalised layout."""
    layout = _check_layout(layout)
    check_qkv_tensors(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be a rank-4 tensor in layout {layout}, got shape {tuple(t.shape)}")
    s_ax, n_ax = (1, 2) if layout == "BSND" else (2, 1)
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(
            f"q, k and v must share the head dim (last axis), got q={q.shape[-1]}, k={k.shape[-1]}, v={v.shape[-1]}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[s_ax] != v.shape[s_ax]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[s_ax]} and {v.shape[s_ax]}")
    if k.shape[n_ax] != v.shape[n_ax]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[n_ax]} and {v.shape[n_ax]}")
    if q.shape[n_ax] % k.shape[n_ax]:
        raise ValueError(
            f"query heads ({q.shape[n_ax]}) must be a multiple of key/value heads ({k.shape[n_ax]}) in layout {layout}"
        )
    return layout


def _check_key_mask(key_mask, k: torch.Tensor, layout: str) -> None:
    s_ax = 1 if layout == "BSND" else 2
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = attend) or None, got "
                        f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}")
    if tuple(key_mask.shape) != (k.shape[0], k.shape[s_ax]):
        raise ValueError(f"key_mask must have shape (B, S_k) = ({k.shape[0]}, {k.shape[s_ax]}), "
                         f"got {tuple(key_mask.shape)}")
    if key_mask.device != k.device:
        raise ValueError(f"key_mask must be on the device of k ({k.device}), got {key_mask.device}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "BSND",
              scale: float | None = None, backend: str | None = None,
              key_mask: torch.Tensor | None = None, return_lse: bool = False, precision: str = "auto"):
    """Full (non-causal) scaled dot-product attention, output in the input layout and dtype.

    Args:
        q, k, v: rank-4 tensors in ``layout`` ("BSND" = batch, sequence, heads, head_dim, the layout of
            diffusers' attention processors, or "BNSD"). k/v may have fewer heads than q (GQA).
        scale: softmax scale; None = head_dim ** -0.5.
        backend: force one of "fa3", "fa2", "npu", "sdpa" (full precision) or "sage", "sage_fp8",
            "fa3_fp8", "npu_int8", "cpu_int8" (low precision); None = context manager, env var, automatic.
        key_mask: (B, S_k) bool, True where a key may be attended (padded text tokens False), or None.
            Every query row needs at least one True key. Only backends with key-mask support run it
            (automatic choice skips the others; a forced one without support raises and lists the
            usable backends).
        return_lse: also return the natural-log log-sum-exp of every query row, float32 (B, N, S)
            (what Ring attention merges partial results with): SDPA's CPU flash kernel, CUDA flash /
            memory-efficient kernels, FA2 / FA3 (``softmax_lse``), Ascend
            ``npu_fused_infer_attention_score(softmax_lse_flag=True)``. Needs at least one key; not
            combined with ``key_mask`` (Ring attention masks its joint keys itself).
        precision: "auto" (default: full precision, the backends above), "int8" (int8 Q / K after
            smoothing K by its mean over tokens, 16-bit P / V: SageAttention on CUDA, the documented
            int8 mode of Ascend's fused attention on NPU, the C++ kernel on CPU) or "fp8" (FlashAttention-3 FP8 on Hopper,
            then SageAttention's int8 Q / K with FP8 P / V on sm89 / sm90 / sm120). A precision that
            no backend can run here raises :class:`AttentionBackendError` naming each backend's
            reason (never a silent full-precision fallback); a forced backend of another precision
            is refused too. Low-precision backends take no ``key_mask``.

    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    layout = validate_qkv(q, k, v, layout)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    if key_mask is not None:
        _check_key_mask(key_mask, k, layout)
        if return_lse:
            raise ValueError("attention: key_mask and return_lse=True cannot be combined; pass one of them")
    precision = check_precision(precision)
    sig = _signature(q, k, layout, backend, key_mask is not None, return_lse, precision)
    name, error = _decide_traced(*sig) if torch.compiler.is_compiling() else _decide(*sig)
    if error is not None:  # eager: raises now; traced: raises when the compiled graph runs
        out = raise_when_run("attention", error, q)  # output has the shape of q
        if not return_lse:
            return out
        lse = out[..., 0].float()  # (B, N, S) placeholder of the right shape
        return out, (lse.transpose(1, 2) if layout == "BSND" else lse)
    if layout == "BNSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if return_lse:
        if k.shape[1] == 0 or q.shape[1] == 0:
            raise ValueError(f"attention(return_lse=True) needs at least one query and one key, got q length "
                             f"{q.shape[1]}, k length {k.shape[1]}")
        out, lse = BACKENDS[name].lse_impl(q, k, v, scale)
        return (out.transpose(1, 2) if layout == "BNSD" else out), lse
    impl = BACKENDS[name].impl
    out = impl(q, k, v, scale) if key_mask is None else impl(q, k, v, scale, key_mask)
    return out.transpose(1, 2) if layout == "BNSD" else out


def clear_caches() -> None:
    """Forget probed packages and cached choices (after installing a package mid-process, and in tests)."""
    _import_optional.cache_clear()
    _decide.cache_clear()
