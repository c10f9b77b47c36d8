"""Joint attention: one attention over two token streams, as in MMDiT blocks (image + text).

Dual-stream transformers (Qwen-Image, Flux, HunyuanVideo, CogVideoX, ...) project their image /
video tokens and their text tokens separately, then run ONE attention over the concatenation
([text, image] or [image, text]) and split the output again. lite_boost keeps the two streams apart
up to the attention call so that sequence parallelism can shard the image stream while the text
stream, replicated on every rank, never travels through the all_to_all (each text key would then
appear once per rank and bias the softmax).

The attention-function protocol used by every processor, sparse path and sequence-parallel wrapper::

    attn_fn(q, k, v)                       -> out          # (B, S, H, D) -> (B, S, H, D)
    attn_fn(q, k, v, joint=JointTokens(..)) -> (out, joint_out)

``q, k, v`` are the main (image / video) stream, ``joint`` the second stream with all of the heads
``q`` has. ``joint_out`` is the attention output of the joint tokens, (B, T, H, D). A joint stream
whose ``q`` has no rows (:attr:`JointTokens.keys_only`) is attended as keys only: its tokens have no
queries in this call (a prefix whose own rows the processor attends elsewhere, as Qwen-Image 2.1's
block-causal text) and ``joint_out`` has no rows either. Wrappers that
change the head count (Ulysses) slice ``joint`` to their heads with :meth:`JointTokens.heads` and
reassemble ``joint_out`` themselves, so an inner function always sees matching heads.

:func:`joint_attention` is the plain single-device composition (concatenate in the stream order,
one key-padding mask, one attention call, split) that dense inner functions use, and the reference
the parallel paths are tested against.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["JointTokens", "concat_joint", "split_joint", "joint_attention", "joint_key_mask"]


class JointTokens(NamedTuple):
    """A second token stream attended jointly with the main stream.

    q, k, v: (B, T, H, D) tensors (same B, H, D as the main stream).
    key_mask: (B, T) bool, True where the joint token is real (may be attended), or None (all real).
        Padded joint tokens are never attended as keys; their query rows are still computed.
    first: True when the joint tokens precede the main stream in the joint sequence ([text, image]:
        Qwen-Image, Flux, CogVideoX), False when they follow it ([image, text]: HunyuanVideo).

    ``q`` may have no rows (B, 0, H, D) while ``k`` / ``v`` have T: the joint tokens are then keys only
    (:attr:`keys_only`), and the joint output is (B, 0, H, D).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: torch.Tensor | None = None
    first: bool = True

    @property
    def length(self) -> int:
        """Rows of the joint queries (0 for a keys-only stream)."""
        return self.q.shape[1]

    @property
    def keys_only(self) -> bool:
        """True when the joint tokens are attended as keys only (``q`` has no rows, ``k`` has some)."""
        return self.q.shape[1] == 0 and self.k.shape[1] > 0

    def heads(self, start: int, stop: int) -> "JointTokens":
        """The same stream restricted to heads [start, stop) (views, no copy)."""
        return JointTokens(self.q[:, :, start:stop], self.k[:, :, start:stop], self.v[:, :, start:stop],
                           self.key_mask, self.first)

    def check(self, q: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ValueError when this stream does not fit a main stream with query ``q``, value ``v``."""
        for name, x, ref in (("q", self.q, q), ("k", self.k, q), ("v", self.v, v)):
            if x.ndim != 4 or x.shape[0] != ref.shape[0] or x.shape[2:] != ref.shape[2:]:
                raise ValueError(
                    f"joint.{name} must be (B, T, H, D) = ({ref.shape[0]}, T, {ref.shape[2]}, {ref.shape[3]}) like the "
                    f"main stream, got {tuple(x.shape)}"
                )
        t = self.k.shape[1]
        if self.v.shape[1] != t or self.q.shape[1] not in (0, t):
            raise ValueError(f"joint q, k, v need one length T (or q with no rows: keys only), got "
                             f"{self.q.shape[1]}, {self.k.shape[1]}, {self.v.shape[1]}")
        m = self.key_mask
        if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (q.shape[0], t)):
            raise ValueError(f"joint.key_mask must be a bool tensor of shape (B, T) = ({q.shape[0]}, "
                             f"{t}), got {m.dtype} {tuple(m.shape)}")


def joint_key_mask(joint: JointTokens, main_len: int) -> torch.Tensor | None:
    """(B, T + S) bool key mask of the joint sequence in stream order, or None when nothing is padded."""
    if joint.key_mask is None:
        return None
    m = joint.key_mask
    ones = m.new_ones((m.shape[0], main_len))
    return torch.cat([m, ones] if joint.first else [ones, m], dim=1)


def concat_joint(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens):
    """Concatenate main and joint streams along the sequence in the joint order.

    Returns ``(q_all, k_all, v_all, key_mask)`` with ``key_mask`` as :func:`joint_key_mask`.
    """
    def cat(main, extra):
        return torch.cat([extra, main] if joint.first else [main, extra], dim=1)

    return cat(q, joint.q), cat(k, joint.k), cat(v, joint.v), joint_key_mask(joint, k.shape[1])


def split_joint(out: torch.Tensor, joint: JointTokens, main_len: int):
    """Inverse of :func:`concat_joint` on an output: ``(main_out, joint_out)`` (no joint rows when the
    joint stream is keys only)."""
    t = joint.length
    if joint.first:
        return out[:, t:t + main_len], out[:, :t]
    return out[:, :main_len], out[:, main_len:main_len + t]


def joint_attention(attn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    joint: JointTokens | None = None):
    """Attention of the main stream, jointly with ``joint`` when given, through one call of ``attn``.

    ``attn(q, k, v, key_mask=None) -> out`` works on (B, S, H, D); ``key_mask`` is (B, S_k) bool or
    None. Without ``joint`` this is ``attn(q, k, v)``; with it, the two streams are concatenated in
    their order and ``(out, joint_out)`` is returned.
    """
    if joint is None:
        return attn(q, k, v)
    joint.check(q, v)
    qa, ka, va, mask = concat_joint(q, k, v, joint)
    out = attn(qa, ka, va, key_mask=mask) if mask is not None else attn(qa, ka, va)
    return split_joint(out, joint, q.shape[1])
