"""What a VAE class says to be decoded / encoded in parallel: the adapter API and its registry.

:class:`VAEAdapter` (one subclass per VAE class, in ``lite_boost.models``) tells the runner how a
latent-frame range maps to output frames, which method to wrap and, for the exact mode, which modules
need halos (:class:`SpatialLayout`) or, for a VAE made of independent temporal clips, which per-clip method to
hand out (:meth:`VAEAdapter.clip_method`). :func:`register_vae_adapter` records a subclass under the VAE
class names it serves; :func:`vae_adapter_for` finds the adapter of a VAE instance (its class or the
nearest registered base). Nothing here runs a collective or knows a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...config import ConfigError
from ...registry import add_vae_adapter, vae_adapter_class, vae_adapter_names

__all__ = ["VAE_MODES", "VAE_GATHER", "SpatialLayout", "UnsupportedVAEError", "VAEAdapter", "check_vae_mode",
           "register_vae_adapter", "vae_adapter_for"]

VAE_MODES = ("exact", "chunked", "off")
VAE_GATHER = ("all", "rank0")


# ------------------------------------------------------------------------------------------ errors
class UnsupportedVAEError(TypeError):
    """The VAE's class (and none of its bases) has a registered parallel-VAE adapter."""


# ------------------------------------------------------------------------------------------ registry
# The table lives in lite_boost.registry (the one registry), filled at import by the adapters' decorators.
def register_vae_adapter(*class_names: str, replace: bool = False):
    """Class decorator: register a :class:`VAEAdapter` subclass for the named VAE classes."""
    if not class_names or not all(isinstance(n, str) and n for n in class_names):
        raise ValueError(f"register_vae_adapter needs one or more class names, got {class_names!r}")

    def deco(cls):
        add_vae_adapter(cls, class_names, replace=replace)
        return cls

    return deco


def vae_adapter_for(vae) -> "VAEAdapter":
    """The adapter instance for ``vae`` (its class or nearest registered base), or UnsupportedVAEError."""
    adapter_cls = vae_adapter_class(type(vae))
    if adapter_cls is not None:
        return adapter_cls(vae)
    raise UnsupportedVAEError(
        f"lite_boost has no parallel-VAE adapter for {type(vae).__name__}; VAE classes with one: "
        f"{vae_adapter_names()}. Set ParallelConfig(vae_parallel='off') to leave this VAE sequential, or "
        "register an adapter with lite_boost.parallel.vae.register_vae_adapter."
    )


# ------------------------------------------------------------------------------------------ adapter API
@dataclass
class SpatialLayout:
    """Which modules of one network (decoder or encoder) the exact mode hooks, and how.

    root: the network module; each of its calls is split by rows (dim -2) and gathered after.
    unit: the root input's rows per band must be a multiple of this (the network's spatial
        downsampling factor, so every band stays aligned at every resolution).
    halo: modules with a symmetric spatial kernel (stride 1, zero padding ``p`` rows each side):
        every tensor argument gets ``p`` neighbour rows each side, the output is trimmed by ``p``.
        With ``unpad``, a convolution of row stride ``s`` > 1 (kernel ``2p + 1``) fits too
        when every band is a multiple of ``s`` rows at its input (``unit``): the band plus ``p`` rows
        each side, unpadded, yields exactly the band's output rows; such modules always take the
        hook path (``overlap_halo`` does not apply).
    bottom_halo: stride-2 convolutions fed by an explicit (0, 1, 0, 1) zero pad: the padded last
        row is replaced by the next band's first row.
    gather: modules that mix all positions (attention): they see the gathered input and keep their
        band of the output (computed redundantly on every rank; keep these small).
    unpad: ``unpad(module) -> undo`` sets a halo module's row padding to 0 for the duration of the
        call (and returns what restores it). With it the halo rows (zeros at the image edges) stand
        in for the padding, so a convolution computes exactly its band (no extra rows to trim), and
        ``pairs`` can share one exchange. Without it each halo output is trimmed.
    pairs: ``(first, second)`` halo modules with only row-local, zero-preserving operations between
        them (norm without bias, SiLU, dropout in eval), the second fed by the first only: ONE
        exchange of ``rows(first) + rows(second)`` rows before the first replaces the two, the first
        computes ``rows(second)`` extra rows each side (zero beyond the image edge, as the second's
        padding would be), and the second reads them (its causal cache, stored by the model from its
        input, carries them too). Needs ``unpad`` and bands of at least that many rows (else the two
        exchange separately).
    replicate: halo modules whose row padding replicates the edge row (``F.pad(mode="replicate")``)
        instead of adding zeros: at the image's top and bottom edges their halo rows are copies of the
        band's edge row (with ``unpad`` they then stand in for that padding exactly). Not for ``pairs``.
    reflect: halo modules whose row padding reflects the rows next to the edge (``F.pad(mode="reflect")``):
        at the image's top and bottom edges their halo rows are the band's rows 1.. mirrored (with ``unpad``
        they stand in for that padding exactly). Not for ``pairs``.
    group_norm: ``nn.GroupNorm`` modules whose statistics span all rows: in a split call each one computes its
        groups' statistics over every rank's band (one small all-gather, :mod:`.norms`) and normalises its own
        band; inside a ``gather`` module (which sees the gathered input) it runs as is.
    band_random: modules that draw random tensors shaped like their input's frame (``torch.randn`` /
        ``torch.rand`` with the rows at dim -2, e.g. a decoder's noise injection): in a split call such
        a draw of the band's rows draws the whole frame's (the same random stream as one process, given
        the same generator state on every rank) and keeps this rank's rows.
    """

    root: torch.nn.Module
    unit: int = 1
    halo: list = field(default_factory=list)  # [(module, rows)]
    bottom_halo: list = field(default_factory=list)  # [module]
    gather: list = field(default_factory=list)  # [module]
    unpad: Callable[[torch.nn.Module], Callable[[], None]] | None = None
    pairs: list = field(default_factory=list)  # [(first, second)]
    replicate: list = field(default_factory=list)  # [halo module]
    reflect: list = field(default_factory=list)  # [halo module]
    band_random: list = field(default_factory=list)  # [module]
    group_norm: list = field(default_factory=list)  # [nn.GroupNorm]


class VAEAdapter:
    """What the runner needs to know about one VAE class (subclass per model, in ``models/``).

    The frame axis is dim 2 of inputs and outputs (B, C, T, H, W). ``kind`` is "decode" or "encode".
    """

    decode_method = "_decode"  # instance method wrapped for decode (called per batch slice)
    encode_method = "_encode"
    modes = ("exact", "chunked")  # the parallel modes this VAE supports (:func:`check_vae_mode`)
    default_overlap = 1  # chunked-mode warm-up latent frames when the config leaves it None (decode)
    default_encode_overlap = 1  # the same for encode

    def __init__(self, vae):
        self.vae = vae

    # frame bookkeeping
    def num_units(self, inp: torch.Tensor, kind: str) -> int:
        """Number of latent frames the call covers (the unit chunks are made of)."""
        raise NotImplementedError

    def out_frames(self, start: int, stop: int, kind: str) -> int:
        """Output frames of the latent-frame range [start, stop)."""
        raise NotImplementedError

    def out_shape(self, inp: torch.Tensor, kind: str) -> tuple[int, ...]:
        """Shape of the whole call's output tensor."""
        raise NotImplementedError

    # running
    def check_input(self, inp: torch.Tensor, kind: str) -> None:
        """Raise (ValueError, naming the input) for a call the VAE cannot take, before the parallel call runs
        any collective. Default: accept every input (the VAE's own checks run inside the call)."""

    def run_chunk(self, inner: Callable, inp: torch.Tensor, chunk: "Chunk", kind: str) -> torch.Tensor:
        """Output frames of ``chunk`` (warm-up done and dropped) with ``inner`` = the wrapped method."""
        raise NotImplementedError

    def unwrap(self, out, kind: str) -> torch.Tensor:
        """The tensor inside the wrapped method's return value."""
        return out

    def row_local_tail(self, inp: torch.Tensor, kind: str) -> bool:
        """True when the wrapped method does nothing but row-local work around its network calls for
        this input (e.g. no spatial tiling): exact mode then gathers the final output once instead of
        each network call's output. Default False (gather per call)."""
        return False

    def wrap(self, tensor: torch.Tensor, kind: str, *args, **kwargs):
        """Build the wrapped method's return value around ``tensor``."""
        return tensor

    def spatial_layout(self, kind: str) -> SpatialLayout:
        raise NotImplementedError

    # exact mode by whole clips (:mod:`.clips`) instead of row bands
    def clip_method(self, kind: str) -> str | None:
        """The instance method the wrapped method calls once per temporal clip, when the clips are independent
        (nothing carried from one to the next): exact mode then spreads the clips over the ranks and lets the
        wrapped method assemble the gathered outputs. None (default): exact mode splits rows
        (:meth:`spatial_layout`)."""
        return None

    def clip_inputs(self, inp: torch.Tensor, kind: str, *args, **kwargs) -> list:
        """The inputs the wrapped method will pass to :meth:`clip_method` for this call, in call order (each
        checked with ``torch.equal`` when the call makes it). Needed when :meth:`clip_method` names one."""
        raise NotImplementedError

    # planning
    def chunk_cost(self, warm_start: int, start: int, stop: int, kind: str) -> float:
        """Compute of one chunk run (warm-up on [warm_start, start), then [start, stop)) in units of one
        later latent frame; the chunked plan balances the ranks by it. Default: one unit per frame."""
        return float(stop - warm_start)

    def chunk_cost_fn(self, kind: str) -> Callable[[int, int, int], float]:
        return lambda w, s, e: self.chunk_cost(w, s, e, kind)


def check_vae_mode(adapter: VAEAdapter, mode: str | None) -> None:
    """ConfigError when ``mode`` ("exact" / "chunked"; None = "exact") is not among the adapter's ``modes``."""
    mode = "exact" if mode is None else mode
    if mode in ("exact", "chunked") and mode not in adapter.modes:
        raise ConfigError(f"vae_parallel={mode!r} is not supported for {type(adapter.vae).__name__} "
                          f"({type(adapter).__name__}); valid vae_parallel here: {list(adapter.modes) + ['off']}")
