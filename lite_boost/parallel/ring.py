"""Ring attention and hybrid Ulysses x Ring (USP) sequence parallelism.

Ring attention: each rank of a ring group of ``r`` ranks keeps its query chunk, and the K/V chunks
travel around the ring: at step ``t`` rank ``i`` attends to chunk ``j = (i - t) mod r`` while it
already sends that chunk on to rank ``i + 1`` and receives chunk ``j - 1`` from rank ``i - 1``
(``rotate_method="p2p"``: one ``batch_isend_irecv`` per step, posted before the step's compute and
waited after it, into the other half of a double buffer). The partial results are merged through
their log-sum-exp in fp32 (:mod:`lite_boost.ops.lse`, -inf safe). ``rotate_method="allgather"``
gathers every chunk once up front and runs the same loop in the same order (bit-identical output,
O(S) memory, nothing to overlap): an option, not the default.

Sequence layout. The sequence group of ``P = u * r`` ranks keeps the equal shards of
:mod:`lite_boost.parallel.comm` (``s = ceil(S / P)`` tokens each, the padding a suffix of the global
sequence) and ``sequence_rank = ring_rank * u + ulysses_rank``. After the Ulysses all_to_all (over the
``u`` contiguous ranks) a rank holds super-chunk ``ring_rank`` of ``L = u * s`` tokens for its heads;
without Ulysses (``u = 1``) the super-chunk is the shard itself. Chunk ``j`` has
``valid(j) = clamp(S - j * L, 0, L)`` real tokens, known on every rank without communication: the
query and every incoming K/V chunk are trimmed to it, so no padded key is ever attended and no mask
is needed; a chunk with no real token is skipped in the compute but still relayed. More ranks than
heads works (the ring splits tokens, not heads).

The inner attention. :class:`RingAttention` wraps the processor's ``attn_fn`` and needs one of:

* ``attn_fn.lse_attention(q, k, v) -> (out, lse)``: the same attention with the natural-log
  log-sum-exp of every query row, (B, S, H, D) and (B, H, S) fp32 (dense attention: the dispatch of
  :func:`lite_boost.ops.attention.attention` with ``return_lse=True``: SDPA's CPU flash kernel,
  FA2 / FA3, CUDA flash / memory-efficient, Ascend fused inference attention);
* ``attn_fn.ring_attention(q, k, v, ring) -> out``: a ring-aware inner that drives the ring itself
  through this object's primitives (:meth:`RingAttention.relay`, :meth:`RingAttention.attention`,
  :meth:`RingAttention.all_gather`, :meth:`RingAttention.exchange_rows`); block-sparse attention does
  (``lite_boost.ops.sparse_attention(..., ring=...)``).

Joint attention (:mod:`lite_boost.ops.joint`): ``ring(q, k, v, joint=JointTokens(...))`` with the text
stream replicated on every rank. The image queries attend to the text keys exactly once (one partial
before the ring steps, never once per step) and to every image chunk; the text queries attend to the
text keys and, on every rank, to its own image chunk only; these per-rank partials are all-gathered
over the ring group and merged in rank order, so every rank ends with the same text output, equal to
attention over all image keys (a keys-only joint stream has no text rows: nothing is gathered). Padded
text keys are left out by an exact masked partial.

Under ``torch.compile`` the dense ring traces: each rotation is a functional ``all_to_all_single``
(rank i sends everything to rank i + 1, :meth:`Communicator.ring_shift_traced`), issued before the
step's compute; the valid lengths are Python ints of the shard info (guarded like Ulysses' sequence
length). A ring-aware inner (block-sparse) runs inside one opaque custom op
(``torch.ops.lite_boost_graph.ring_inner_attention``), as the sparse path already does in one process.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Callable

import torch

from ..config import ConfigError, ROTATE_METHODS
from ..ops.joint import JointTokens
from ..ops.lse import merge_partial, start_partial
from .comm import Communicator
from .ulysses import SequenceShardInfo, UlyssesAttention

__all__ = ["RingAttention", "sequence_parallel_attention", "check_ring_support", "usp_bytes_per_layer",
           "RingSupportError"]


class RingSupportError(TypeError):
    """The inner attention function cannot run under Ring attention (no log-sum-exp form)."""


def _lse_kernel(attn_fn) -> Callable | None:
    fn = getattr(attn_fn, "lse_attention", None)
    return fn if callable(fn) else None


def _valid(seq_len: int, chunk: int, j: int) -> int:
    return max(0, min(chunk, seq_len - j * chunk))


def masked_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   kernel: Callable, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, H, D), lse (B, H, S) fp32) of q over k/v with a (B, T) key mask (True = attend).

    Without a mask: ``kernel(q, k, v)``. With one: exact fp32 math (softmax scale D^-0.5, the
    processors' scale) in chunks of ``rows`` query rows (the joint keys are short), -inf safe: a batch
    element whose keys are all padding gives out 0 and lse -inf.
    """
    if key_mask is None:
        return kernel(q, k, v)
    scale = q.shape[-1] ** -0.5
    qt = q.transpose(1, 2).to(torch.float32)
    kt = k.transpose(1, 2).to(torch.float32)
    vt = v.transpose(1, 2).to(torch.float32)
    bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=q.device)
    bias = bias.masked_fill(~key_mask, float("-inf"))[:, None, None, :]
    outs, lses = [], []
    for r0 in range(0, qt.shape[2], rows):
        logits = torch.matmul(qt[:, :, r0:r0 + rows], kt.transpose(-1, -2)).mul_(scale).add_(bias)
        lse = torch.logsumexp(logits, dim=-1)
        shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        outs.append(torch.matmul(torch.exp(logits - shift[..., None]), vt))
        lses.append(lse)
    out = torch.cat(outs, dim=2).transpose(1, 2).to(q.dtype)
    return out, torch.cat(lses, dim=2)


class RingAttention:
    """Ring attention around an inner attention function (see the module docstring).

    Args:
        attn_fn: the inner attention (a processor's ``attn_fn``) with ``lse_attention`` or
            ``ring_attention`` (raises :class:`RingSupportError` naming both otherwise).
        comm: Communicator over the ring group (``comm.rank`` = index of this rank's chunk).
        shard_info: the model's SequenceShardInfo (real length ``seq_len``, ``shard_len`` per rank of
            the flattened sequence group of ``degree`` ranks), or None when every chunk is full.
        rotate_method: "p2p" (default) or "allgather".
        kernel: override of the per-chunk ``(q, k, v) -> (out, lse)`` function (default
            ``attn_fn.lse_attention``).

    ``ring(q, k, v)`` takes (B, L, H, D) tensors holding this rank's chunk of ``L`` rows (the real
    rows first; L equal on every rank) and returns (B, L, H, D) with zeros in the padded rows. Every
    rank of the group must call it the same number of times (each call is one ring pass).
    ``trace``: set to a list to record ``("post" | "compute" | "wait", step)`` events (tests).
    """

    def __init__(self, attn_fn, comm: Communicator, shard_info: SequenceShardInfo | None = None, *,
                 rotate_method: str = "p2p", kernel: Callable | None = None):
        if not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a lite_boost.parallel.comm.Communicator, got {type(comm).__name__}")
        if rotate_method not in ROTATE_METHODS:
            raise ConfigError(f"rotate_method must be one of {list(ROTATE_METHODS)}, got {rotate_method!r}")
        self.attn_fn = attn_fn
        self.comm = comm
        self.shard_info = shard_info
        self.rotate_method = rotate_method
        self.ring_aware = callable(getattr(attn_fn, "ring_attention", None))
        self.kernel = kernel if kernel is not None else _lse_kernel(attn_fn)
        if self.kernel is None and not self.ring_aware:
            raise RingSupportError(
                f"attn_fn {attn_fn!r} cannot run under Ring attention: it needs `lse_attention(q, k, v) -> (out, "
                "lse)` (the same attention returning its log-sum-exp) or `ring_attention(q, k, v, ring)`; "
                "use ring_degree=1 (Ulysses) for this model")
        self.trace: list | None = None
        self.handle = next(_HANDLES)
        _RINGS[self.handle] = self
        self._key = torch.tensor([self.handle], dtype=torch.int64)

    def __repr__(self) -> str:
        return (f"RingAttention(degree={self.comm.size}, {self.rotate_method}, "
                f"attn_fn={getattr(self.attn_fn, '__name__', self.attn_fn)!r})")

    # ------------------------------------------------------------------ geometry
    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _geometry(self, chunk_len: int) -> int:
        """The real sequence length for chunks of ``chunk_len`` rows (checks the shard info)."""
        info = self.shard_info
        if info is None or info.seq_len is None:
            return chunk_len * self.comm.size
        expected = info.shard_len * (info.degree // self.comm.size)
        if chunk_len != expected:
            raise RuntimeError(f"RingAttention got chunks of {chunk_len} rows, but the sharded sequence gives "
                               f"{expected} ({info}, ring degree {self.comm.size})")
        return info.seq_len

    @property
    def seq_len(self) -> int | None:
        """The real (global) sequence length of the current call (None before the sharding hooks set it)."""
        info = self.shard_info
        return None if info is None else info.seq_len

    # ------------------------------------------------------------------ primitives (ring-aware inners use them)
    def _record(self, event: str, step: int) -> None:
        if self.trace is not None and not torch.compiler.is_compiling():
            self.trace.append((event, step))

    def relay(self, chunk, step: Callable[[int, tuple], None]) -> None:
        """Run ``step(j, (t_1, ...))`` for every chunk of the ring, this rank's first: j = i, i-1, ... (mod r).

        ``chunk``: this rank's tensors of the chunk (e.g. ``(k, v)``), each of one shape and dtype on
        every rank; they are sent as they are and never written. p2p: the exchange of step t + 1 is
        posted before ``step`` runs for step t and waited after it, into a receive buffer (one set at
        ring degree 2, two sets above: the double buffer); the received chunk is sent on at the next
        step. Every rank calls ``relay`` in lockstep (each call is one ring pass).
        """
        comm = self.comm
        r, i = comm.size, comm.rank
        cur = tuple(t if t.is_contiguous() else t.contiguous() for t in
                    ((chunk,) if isinstance(chunk, torch.Tensor) else chunk))
        if r == 1:
            self._record("compute", 0)
            step(i, cur)
            return
        if torch.compiler.is_compiling():  # traced: functional collectives, issued before the compute
            for t in range(r):
                nxt = tuple(comm.ring_shift_traced(x) for x in cur) if t + 1 < r else None
                step((i - t) % r, cur)
                cur = nxt
            return
        if self.rotate_method == "allgather":
            everything = tuple(self.all_gather(x, op="ring_kv_allgather") for x in cur)
            for t in range(r):
                self._record("compute", t)
                j = (i - t) % r
                step(j, tuple(x[j] for x in everything))
            return
        spare = [None, None]  # receive buffers, allocated when first needed
        for t in range(r):
            pending = None
            if t + 1 < r:
                slot = t % 2
                if spare[slot] is None:
                    spare[slot] = tuple(torch.empty_like(x) for x in cur)
                pending = comm.ring_shift_start(cur, spare[slot])
                self._record("post", t + 1)
            self._record("compute", t)
            step((i - t) % r, cur)
            if pending is not None:
                cur = pending.wait()
                self._record("wait", t + 1)

    def all_gather(self, x: torch.Tensor, op: str = "ring_all_gather") -> torch.Tensor:
        """(r, *x.shape): every rank's ``x`` in ring order (x of one shape on every rank)."""
        comm = self.comm
        x = x.contiguous()
        if comm.size == 1:
            return x.unsqueeze(0)
        if torch.compiler.is_compiling():
            import torch.distributed._functional_collectives as funcol

            return funcol.all_gather_tensor(x.unsqueeze(0), 0, group=comm._funcol_group)
        out = x.new_empty((comm.size,) + tuple(x.shape))
        comm.all_gather_into(out, x.unsqueeze(0), op=op)
        return out

    def exchange_rows(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                      op: str = "ring_rows") -> torch.Tensor:
        """All_to_all of the rows (dim 0) of ``rows``: the first ``send_counts[0]`` to ring rank 0, ...;
        returns the received rows, rank 0's first (``sum(recv_counts)`` of them)."""
        comm = self.comm
        if comm.size == 1:
            return rows.clone()
        unit = math.prod(rows.shape[1:])
        flat = rows.reshape(-1)
        got = comm.exchange(flat, [c * unit for c in recv_counts], [c * unit for c in send_counts], op=op)
        return got.view((sum(recv_counts),) + tuple(rows.shape[1:]))

    # ------------------------------------------------------------------ attention
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None,
                 **kwargs):
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"RingAttention expects (B, L, H, D) tensors, got q {tuple(q.shape)}")
        if k.shape[:3] != q.shape[:3] or v.shape[:3] != q.shape[:3]:
            raise ValueError(f"RingAttention needs q, k, v of one (B, L, H): {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if joint is not None:
            joint.check(q, v)
        self._geometry(q.shape[1])
        if self.ring_aware:
            if joint is not None:  # ParallelManager refuses block-sparse Ring for joint-attention families
                raise NotImplementedError(f"{self.attn_fn!r} drives the ring itself and takes no joint tokens")
            if torch.compiler.is_compiling():  # eager inside one opaque op (data-dependent, collectives)
                return torch.ops.lite_boost_graph.ring_inner_attention(q, k, v, self._key)
            return self.attn_fn.ring_attention(q, k, v, self, **kwargs)
        if kwargs:
            raise TypeError(f"RingAttention got unexpected keyword argument(s) {sorted(kwargs)}; the inner "
                            "attention protocol takes (q, k, v) and joint=")
        return self.attention(self.kernel, q, k, v, joint=joint)

    def attention(self, fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None):
        """Dense ring attention of this rank's chunk with ``fn``: an attention function with
        ``lse_attention`` or a ``(q, k, v) -> (out, lse)`` kernel. Returns (B, L, H, D) (zeros in padded
        rows), or ``(out, joint_out)`` with ``joint``."""
        kernel = _lse_kernel(fn) or fn
        B, L, H, _ = q.shape
        dv = v.shape[-1]
        seq_len = self._geometry(L)
        i = self.comm.rank
        vq = _valid(seq_len, L, i)
        qv = q[:, :vq]
        acc: list = []  # [acc_out, acc_lse] once the first part arrived

        def add(out, lse):  # lse (B, H, S) -> the (B, S, H) view matching the output layout
            if not acc:
                acc.extend(start_partial(out, lse.transpose(1, 2)))
            else:
                merge_partial(acc[0], acc[1], out, lse.transpose(1, 2))

        text = None  # the text queries' partial over their own image chunk (joint only)
        if joint is not None and vq > 0:  # image queries x text keys: once, before the ring steps
            add(*masked_partial(qv, joint.k, joint.v, joint.key_mask, kernel))

        def step(j, kv):
            nonlocal text
            vk = _valid(seq_len, L, j)
            if joint is not None and j == i and not joint.keys_only:  # text queries x own image chunk
                text = kernel(joint.q, kv[0][:, :vk], kv[1][:, :vk]) if vk > 0 else None
            if vk == 0 or vq == 0:  # nothing to attend: the chunk is still relayed
                return
            add(*kernel(qv, kv[0][:, :vk], kv[1][:, :vk]))

        self.relay((k, v), step)
        out = q.new_zeros((B, L, H, dv))
        if acc:
            out[:, :vq] = acc[0].to(q.dtype)
        if joint is None:
            return out
        if joint.keys_only:  # no text rows (the same on every rank: no collective)
            return out, joint.q.new_empty(joint.q.shape[:3] + (dv,))
        return out, self._joint_output(joint, kernel, text)

    def _joint_output(self, joint: JointTokens, kernel, text) -> torch.Tensor:
        """Text rows over (text keys + every rank's image chunk), merged in ring order: one all_gather."""
        B, T, H, D = joint.q.shape
        if text is None:  # an empty image chunk on this rank
            out = joint.q.new_zeros((B, T, H, joint.v.shape[-1]), dtype=torch.float32)
            lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=joint.q.device)
        else:
            out, lse = text
        packed = torch.cat([out.to(torch.float32), lse.transpose(1, 2).to(torch.float32)[..., None]], dim=-1)
        parts = self.all_gather(packed, op="ring_joint")  # (r, B, T, H, D + 1)
        self_out, self_lse = masked_partial(joint.q, joint.k, joint.v, joint.key_mask, kernel)  # text x text
        acc, acc_lse = start_partial(self_out, self_lse.transpose(1, 2))
        for j in range(self.comm.size):  # the same order on every rank: the same result everywhere
            merge_partial(acc, acc_lse, parts[j][..., :-1], parts[j][..., -1])
        return acc.to(joint.q.dtype)


# ------------------------------------------------------------------------------------------ factory
def sequence_parallel_attention(attn_fn, ulysses: Communicator, ring: Communicator,
                                shard_info: SequenceShardInfo | None, *, rotate_method: str = "p2p"):
    """The sequence-parallel wrapper of ``attn_fn``: Ulysses, Ring, or Ulysses around Ring (USP).

    ``ulysses`` / ``ring``: the mesh's Ulysses and ring communicators (the same object as the
    sequence group when the other degree is 1).
    """
    if ring.size == 1:
        return UlyssesAttention(attn_fn, ulysses, shard_info)
    inner = RingAttention(attn_fn, ring, shard_info, rotate_method=rotate_method)
    if ulysses.size == 1:
        return inner
    return UlyssesAttention(inner, ulysses, shard_info, chunk=True)


def check_ring_support(config, mesh=None, device=None, *, ring_degree: int | None = None) -> None:
    """Raise ConfigError, before any collective, when ``config`` asks for a kernel without lse under ring.

    ``config``: a BoostConfig; nothing to check unless its ring degree (from ``mesh``, else resolved
    for the world size of the default group or the torchrun environment) is above 1. Dense backends
    all return the log-sum-exp; the block-sparse Ascend operator (``softmax_lse`` unsupported) and
    compiled FlexAttention on CPU do not. ``device``: the rank's device (default: the mesh's, else
    from LOCAL_RANK as ``init_mesh`` picks it). ``ring_degree``: the resolved ring degree when the caller
    (the planner) has it, else it is resolved here.
    """
    sparse = getattr(config, "sparse", None)
    if sparse is None or sparse.sparse_type is None:
        return
    from .groups import default_device, read_torchrun_env

    if mesh is not None:
        ring_degree, device_type = mesh.ring_degree, mesh.device.type
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world, local_rank = dist.get_world_size(), dist.get_rank()
        else:
            _, local_rank, world = read_torchrun_env()
        if ring_degree is None:
            ring_degree = config.parallel.resolve_mesh(world)[2]
        device_type = torch.device(device).type if device is not None else default_device(local_rank).type
    if ring_degree == 1:
        return
    from ..ops import rain_fusion as rf

    requested, how = rf._OVERRIDE.requested(sparse.backend)
    if requested is None:
        return
    no_lse = {"npu": "the Ascend RainFusion operator does not return softmax_lse",
              "flex": "compiled FlexAttention on CPU cannot return softmax_lse"}
    if requested == "flex" and device_type != "cpu":
        return
    if requested in no_lse:
        # the backends this device can run at the config's precision, less those without lse here
        precision = getattr(getattr(config, "attention", None), "precision", "auto")
        runnable = rf.available_sparse_backends(device_type, precision=precision)
        usable = [n for n, why in runnable.items()
                  if why is None and (n not in no_lse or (n == "flex" and device_type != "cpu"))]
        raise ConfigError(
            f"sparse backend {requested!r} ({how}) cannot run under Ring attention (ring_degree > 1): "
            f"{no_lse[requested]}, and Ring merges partial results through it. Usable sparse backends with "
            f"ring_degree > 1 on {device_type}: {usable}; or use ring_degree=1 (Ulysses)")


def usp_bytes_per_layer(seq_len: int, heads: int, head_dim: int, ulysses: int, ring: int, element_size: int = 2,
                        batch: int = 1) -> dict:
    """Bytes one rank sends per self-attention layer (ring.md section 10), by part.

    Ulysses (q, k, v out and the output back over the u Ulysses ranks): 4 (u - 1) / (u^2 r) S H D b;
    Ring (this rank's K/V chunk forwarded r - 1 times): 2 (r - 1) / (u r) S H D b (p2p and allgather
    send the same bytes). ``seq_len`` is the padded length P * ceil(S / P) for an exact count.
    """
    shd = batch * seq_len * heads * head_dim * element_size
    u, r = ulysses, ring
    uly = 4 * (u - 1) / (u * u * r) * shd
    rng = 2 * (r - 1) / (u * r) * shd
    return {"ulysses": uly, "ring": rng, "total": uly + rng}


# ------------------------------------------------------------------------------------------ compile
# A ring-aware inner (data-dependent, with eager collectives) runs inside one opaque custom op. Custom-op
# arguments are tensors and scalars, so the op reaches its RingAttention through an integer handle held
# in a tensor (one graph serves every layer); the table holds weak references only.
_HANDLES = itertools.count()
_RINGS: "weakref.WeakValueDictionary[int, RingAttention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("lite_boost_graph::ring_inner_attention", mutates_args=())
def _ring_inner_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    ring = _RINGS.get(int(key.item()))
    if ring is None:
        raise RuntimeError(f"lite_boost ring attention: no RingAttention with handle {int(key.item())} "
                           "(the model was unparallelized after this graph was compiled)")
    return ring.attn_fn.ring_attention(q, k, v, ring).contiguous()


@_ring_inner_op.register_fake
def _(q, k, v, key):
    return q.new_empty(q.shape[:3] + (v.shape[-1],))
