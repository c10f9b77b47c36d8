"""What every lite_boost attention processor shares: the replaceable ``attn_fn`` and dense attention.

A family's processor shim (one class per processor family, in ``lite_boost.models``) subclasses
:class:`LiteBoostProcessor`. It reuses the attention module's own projections and norms, rotates q
and k with the cached fp32 RoPE (:func:`rotate_qk`), and hands the attention itself to
``self.attn_fn`` in the protocol of :mod:`lite_boost.ops.joint`::

    out = self.attn_fn(q, k, v)                                   # self-attention, (B, S, H, D)
    out, text_out = self.attn_fn(q, k, v, joint=JointTokens(...))   # joint image + text attention

``attn_fn`` is :class:`DenseAttention` after boosting; the generic machinery wraps it for
block-sparse attention (:mod:`lite_boost.adapter.sparse`) and sequence parallelism
(:class:`~lite_boost.parallel.ulysses.UlyssesAttention`) without the shim knowing.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ops.attention import attention
from ..ops.joint import JointTokens, joint_attention
from ..ops.rope import RotaryEmbedding, phasors_from_complex, phasors_from_cos_sin, rotate

__all__ = ["ROLES", "DenseAttention", "LiteBoostProcessor", "rotate_qk"]

# self: self-attention over the (shardable) token sequence; attn_fn is wrapped (sparse, Ulysses).
# joint: the same, with a second (text) stream through ``joint=``.
# cross: attention to a context that every rank holds whole (text, image embeddings); never wrapped.
# split_kv: attention from queries every rank holds whole to keys / values of the (shardable) token sequence
#   (LTX-2's video-to-audio attention); under sequence parallelism its attn_fn attends this rank's keys and the
#   partial results are merged over the group (lite_boost.parallel.split_kv); never sparse.
ROLES = ("self", "joint", "cross", "split_kv")


class DenseAttention:
    """Default ``attn_fn``: dense attention through the backend dispatch (``lite_boost.ops.attention``).

    Without ``joint`` it attends q to k, v; with it, the two streams are concatenated in their order
    (:func:`lite_boost.ops.joint.joint_attention`) with the joint stream's key-padding mask.
    ``precision`` ("auto", "int8", "fp8"; see :mod:`lite_boost.ops.precision`) applies to the calls
    without a key-padding mask (a padded joint text runs in the input dtype).
    """

    def __init__(self, backend: str | None = None, precision: str = "auto"):
        self.backend = backend
        self.precision = precision

    def _attend(self, q, k, v, key_mask=None):
        precision = self.precision if key_mask is None else "auto"
        return attention(q, k, v, layout="BSND", backend=self.backend, key_mask=key_mask, precision=precision)

    def lse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The same attention with the log-sum-exp (B, H, S) of each row: what Ring attention merges."""
        return attention(q, k, v, layout="BSND", backend=self.backend, return_lse=True, precision=self.precision)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None):
        if joint is None:
            return self._attend(q, k, v)
        return joint_attention(self._attend, q, k, v, joint)

    def __repr__(self) -> str:
        extra = f", precision={self.precision!r}" if self.precision != "auto" else ""
        return f"DenseAttention(backend={self.backend!r}{extra})"


class LiteBoostProcessor:
    """Base of the processor shims: layer index, role, dense backend and the replaceable ``attn_fn``.

    Args:
        layer_idx: index of the block (the ``*`` of the attention site's path), for per-layer policies.
        role: "self", "joint", "cross" or "split_kv" (see :data:`ROLES`).
        backend: dense attention backend name or None (automatic).

    ``text_first`` (joint role) is set from the family's ``joint`` layout when the processor is installed.
    ``state``: the :class:`~lite_boost.adapter.BoostState` of the model it is installed in (set by
    ``boost_model``; None outside one), for a shim that reads facts of the call in progress
    (``state.call``) or this rank's token range (``state.serve_range``).
    """

    # diffusers' AttentionModuleMixin.set_attention_backend / parallel config write these.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer_idx: int, role: str = "self", backend: str | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
        self.layer_idx = layer_idx
        self.role = role
        self.backend = backend
        self.text_first = True
        self.state = None
        self.attn_fn: Callable[..., torch.Tensor] = DenseAttention(backend)

    @property
    def is_self_attention(self) -> bool:
        """True for the roles whose ``attn_fn`` sees the token sequence (self and joint)."""
        return self.role in ("self", "joint")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer_idx}, {self.role}, attn_fn={self.attn_fn!r})"


def _as_phasors(emb) -> torch.Tensor:
    """complex64 (1, S, 1, D/2) phasors from a RotaryEmbedding, a complex (S, D/2) table or diffusers'
    interleaved real (cos, sin) tables (S, D)."""
    if isinstance(emb, RotaryEmbedding):
        return emb.freqs
    if isinstance(emb, torch.Tensor) and emb.is_complex() and emb.dim() == 2:
        return phasors_from_complex(emb).freqs
    if isinstance(emb, (tuple, list)) and len(emb) == 2:
        cos, sin = emb
        if isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and not cos.is_complex() and cos.dim() == 2:
            return phasors_from_cos_sin(cos, sin).freqs
    raise TypeError("expected a RotaryEmbedding, a complex (S, D/2) table or interleaved (cos, sin) tables (S, D), "
                    f"got {type(emb).__name__}")


def rotate_qk(q: torch.Tensor, k: torch.Tensor, emb) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate fresh q and k (B, S, H, D) in place, in fp32, by ``emb`` (RotaryEmbedding, complex table, or
    diffusers' interleaved real (cos, sin) tables).

    Only for q and k the caller owns (outputs of the projections / norms): the rotation overwrites them.
    """
    freqs = _as_phasors(emb)
    return rotate(q, freqs, inplace=True), rotate(k, freqs, inplace=True)
