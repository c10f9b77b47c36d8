"""Compiled FlexAttention from block indices (CPU and CUDA).

Facts this module is built on (torch 2.13, see DESIGN.md section 4):

* eager ``flex_attention`` ignores the block list and computes dense attention, so it is only ever
  called through ``torch.compile``; hitting dynamo's recompile limit (which silently falls back
  to eager) is turned into an error;
* blocks listed only as "full" blocks fail to compile on CPU, so every selected block is listed
  as a partial block with no ``mask_mod``;
* ``create_block_mask`` is slow; the mask is built directly with ``BlockMask.from_kv_blocks``
  (``compute_q_blocks=False``: forward only);
* on CPU the compiled kernel is inference-only and cannot return the log-sum-exp.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import threading

import torch

__all__ = ["FlexKernel", "FLEX"]

logger = logging.getLogger("lite_boost.sparse")

_RECOMPILE_LIMIT = 64  # distinct shapes per process before we refuse (never fall back to eager)


class FlexKernel:
    """Holds the process's compiled ``flex_attention`` (one per device type) and why it may be off.

    A small object instead of module-level dicts: ``probe`` answers availability without
    compiling, ``disable`` records a compile failure so automatic selection stops choosing it.
    """

    def __init__(self, max_entries: int = 4):
        self._lock = threading.Lock()
        self._compiled: dict[str, object] = {}
        self._disabled: dict[str, str] = {}
        self._max = max_entries

    def probe(self, device_type: str) -> str | None:
        """None if compiled FlexAttention can run on ``device_type``, else the reason."""
        if device_type in self._disabled:
            return self._disabled[device_type]
        try:
            from torch.nn.attention import flex_attention as fa  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.flex_attention is unavailable ({exc})"
        import inspect

        from torch.nn.attention.flex_attention import BlockMask

        if "compute_q_blocks" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
            return "this torch's BlockMask.from_kv_blocks lacks compute_q_blocks (needs torch >= 2.6)"
        if device_type == "cpu":
            if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
                return "torch.compile on CPU needs a C++ compiler (g++/clang++) on PATH"
            return None
        if device_type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if importlib.util.find_spec("triton") is None:
                return "triton is not installed (needed to compile FlexAttention on CUDA)"
            return None
        return f"compiled FlexAttention is only used on cpu and cuda, not {device_type}"

    def disable(self, device_type: str, reason: str) -> None:
        """Stop offering the kernel on ``device_type`` (after a compile failure)."""
        with self._lock:
            self._disabled[device_type] = reason

    def _fn(self, device_type: str):
        with self._lock:
            fn = self._compiled.get(device_type)
            if fn is None:
                from torch.nn.attention.flex_attention import flex_attention

                if len(self._compiled) >= self._max:
                    self._compiled.pop(next(iter(self._compiled)))
                fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
                self._compiled[device_type] = fn
            return fn

    def __call__(self, q, k, v, select_idx, select_num, block_shape, scale, need_lse=False):
        """Run one BNSD batch. q (B, N1, Sq, D), k/v (B, N2, Skv, D); select_idx (B, N1, nqb, M)."""
        from torch.nn.attention.flex_attention import BlockMask

        b, n1, sq, _ = q.shape
        skv = k.shape[2]
        bq, bk = block_shape
        nkb = -(-skv // bk)
        m = select_idx.shape[-1]
        idx = select_idx.clamp_min(0).to(torch.int32)
        if m < nkb:  # BlockMask wants room for every KV block
            idx = torch.nn.functional.pad(idx, (0, nkb - m))
        block_mask = BlockMask.from_kv_blocks(
            select_num.to(torch.int32).contiguous(), idx.contiguous(), BLOCK_SIZE=(bq, bk),
            seq_lengths=(sq, skv), compute_q_blocks=False,
        )
        fn = self._fn(q.device.type)
        kwargs = {"block_mask": block_mask, "scale": scale, "enable_gqa": n1 != k.shape[1]}
        if need_lse:
            from torch.nn.attention.flex_attention import AuxRequest

            kwargs["return_aux"] = AuxRequest(lse=True)
        import torch._dynamo.config as dynamo_config

        guard = {k: val for k, val in (("recompile_limit", _RECOMPILE_LIMIT), ("fail_on_recompile_limit_hit", True))
                 if hasattr(dynamo_config, k)}
        with torch.no_grad(), dynamo_config.patch(**guard):
            res = fn(q, k, v, **kwargs)
        if need_lse:
            out, aux = res
            # flex's lse is natural-log based; rows with nothing selected come back as -inf
            return out, aux.lse.float()
        return res, None


FLEX = FlexKernel()
