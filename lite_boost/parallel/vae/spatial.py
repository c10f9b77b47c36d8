"""The ``"exact"`` mode: every network call split into row bands, with halo rows exchanged per convolution.

:class:`_SpatialSplit` hooks the modules a :class:`~.adapter.SpatialLayout` names for the duration of one
VAE call: the root splits its input rows (:func:`split_rows`) and gathers the output; halo modules get
their neighbours' boundary rows (one packed all_to_all each, optionally overlapped with the band's
inner rows); modules that mix all positions see the gathered input; GroupNorms take their statistics over
every band (:mod:`.norms`); frame-shaped random draws draw the whole frame; each band's convolution runs with the kernel PyTorch would pick for the full frame.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from typing import Callable

import torch

from ...config import ConfigError
from .adapter import SpatialLayout
from .collectives import _Collectives
from .norms import _group_norm

__all__ = ["split_rows", "band_sizes_out"]

logger = logging.getLogger("lite_boost.parallel.vae")


def split_rows(total: int, parts: int, unit: int = 1) -> list[int] | None:
    """Balanced band heights (multiples of ``unit``) summing to ``total``; None when a band would be empty."""
    if total % unit or total // unit < parts:
        return None
    base, extra = divmod(total // unit, parts)
    return [(base + (1 if r < extra else 0)) * unit for r in range(parts)]


def _tensor_args(args, kwargs):
    """The tensors among a call's positional and keyword arguments, in order, and a function that
    rebuilds (args, kwargs) with replacements for them."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    tensors = [args[i] for i in idx] + [kwargs[k] for k in keys]

    def rebuild(new):
        a, kw = list(args), dict(kwargs)
        for j, i in enumerate(idx):
            a[i] = new[j]
        for j, k in enumerate(keys):
            kw[k] = new[len(idx) + j]
        return tuple(a), kw

    return tensors, rebuild


def _onednn_for_full_frame(module, x: torch.Tensor, weight, bias, full_rows: int) -> bool:
    """True when PyTorch would run this convolution with oneDNN on the full frame (``full_rows`` input
    rows, padding included) but picks another CPU kernel for this band-sized input.

    PyTorch's CPU heuristic chooses oneDNN or its im2col ``slow_conv3d`` / ``thnn_conv2d`` from the
    input size; a band of the full frame can fall below the threshold that the full frame is above,
    and the im2col kernels are several times slower for the VAE's 3x3(x3) convolutions (e.g. 6-10x
    for 16 channels at 240 x 416, measured). Running the band with the full frame's kernel keeps the
    exact mode from turning each rank's half of the work into more than the whole."""
    if x.device.type != "cpu" or x.dim() not in (4, 5) or getattr(module, "transposed", False):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None or getattr(module, "padding_mode", "zeros") != "zeros" or isinstance(module.padding, str):
        return False
    shape = list(x.shape)
    shape[-2] = full_rows
    full = x.narrow(-2, 0, 1).expand(shape)  # a view with the full frame's shape: no memory
    args = (list(module.stride), list(module.padding), list(module.dilation), False, [0] * len(module.stride),
            module.groups, None)
    try:
        onednn = torch._C._ConvBackend.Mkldnn
        return select(full, weight, bias, *args) == onednn and select(x, weight, bias, *args) != onednn
    except (RuntimeError, TypeError, AttributeError):  # private API changed: keep PyTorch's own choice
        return False


# oneDNN reorders a CPU convolution's weight into its blocked layout at every call, so each call costs
# at least that reorder, about 1.4 ms per MB of fp32 weight on one core (measured: 0.17 s for a 3x3x3
# 1024 -> 1024 convolution, 113 MB, producing one output row; 9 ms per edge strip at 256 -> 256, 7 MB).
# The overlapped exchange runs a halo convolution as three calls (inner rows + two edge strips); above
# about 1 MB the two extra calls cost more than the exchange they hide (~3 ms for a gloo all_to_all on
# a CPU host), so such convolutions take the single-call path (Wan2.2-5B's VAE: all but conv_out).
_OVERLAP_MAX_WEIGHT_BYTES_CPU = 1 << 20


def _check_overlap_halo(value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise ConfigError(f"overlap_halo must be one of [True, False, 'auto'], got {value!r}")


def _conv_of(module):
    """The Conv2d / Conv3d a halo module runs: itself, or the only one inside a wrapper module (e.g. a
    causal convolution that pads, then calls its ``Conv3d``); None when there is none or several."""
    if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
        return module
    convs = [m for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    return convs[0] if len(convs) == 1 else None


def _overlap_pays(module) -> bool:
    """Whether the overlapped (three-call) path suits this halo module ("auto" policy): always off the
    CPU, on the CPU only for weights up to ``_OVERLAP_MAX_WEIGHT_BYTES_CPU`` (a wrapper's: its conv's)."""
    weight = getattr(_conv_of(module) or module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
        return True
    return weight.numel() * weight.element_size() <= _OVERLAP_MAX_WEIGHT_BYTES_CPU


def _row_stride(module) -> int:
    """The row (dim -2) stride of a convolution module (1 for anything without a ``stride``)."""
    stride = getattr(module, "stride", 1)
    return stride[-2] if isinstance(stride, (tuple, list)) else int(stride)


class _FullFrameRandom(torch.overrides.TorchFunctionMode):
    """Active while a ``band_random`` module runs on a band: ``torch.randn`` / ``torch.rand`` of a shape
    with this band's rows at ``dim`` draw the full frame's rows and return this rank's."""

    FUNCS = (torch.randn, torch.rand)

    def __init__(self, band: "_Band", rank: int, dim: int):
        super().__init__()
        self.band, self.rank, self.dim = band, rank, dim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCS and args:
            size = list(args[0]) if isinstance(args[0], (tuple, list, torch.Size)) else list(args)
            if len(size) >= -self.dim:
                rows = size[self.dim]
                sizes = self.band.sizes_like(rows, self.rank)
                size[self.dim] = sum(sizes)
                return func(size, **kwargs).narrow(self.dim, sum(sizes[: self.rank]), rows)
        return func(*args, **kwargs)


class _Band:
    """The row split of the network call in progress (None between calls): rank band sizes at root level."""

    def __init__(self):
        self.sizes: list[int] | None = None

    def sizes_like(self, rows_here: int, rank: int) -> list[int]:
        factor = Fraction(rows_here, self.sizes[rank])
        out = [s * factor for s in self.sizes]
        if any(v.denominator != 1 for v in out):
            raise RuntimeError(f"parallel VAE: band sizes {self.sizes} do not scale to {rows_here} rows on this rank")
        return [int(v) for v in out]


class _SpatialSplit:
    """Hooks that make one network run on row bands (installed for the duration of one VAE call).

    ``defer_gather``: the root returns its band (the caller gathers the method's final output once,
    valid when everything after the network calls is row-local); ``root_sizes`` then holds the band
    sizes of the split calls (None when no call was split). ``overlap_halo``: True / False for every
    halo module, or "auto" (per module, :func:`_overlap_pays`); it needs the layout's ``unpad``.
    """

    DIM = -2

    def __init__(self, layout: SpatialLayout, coll: _Collectives, defer_gather: bool = False,
                 overlap_halo: bool | str = "auto"):
        _check_overlap_halo(overlap_halo)
        self.layout = layout
        self.overlap_halo = overlap_halo if layout.unpad is not None else False
        self.patched: list = []  # (module, attribute, had an instance attribute, previous), in patch order
        self.coll = coll
        self.band = _Band()
        self.handles: list = []
        self.warned = False
        self.defer = defer_gather
        self.root_sizes: list[int] | None = None
        self.merged: dict[int, bool] = {}  # id(second of a pair) -> its input carries the halo (this call)
        self.full_rows: dict[int, int] = {}  # id(conv) -> its full-frame input rows, padding included (this call)
        self.onednn: dict[tuple, bool] = {}  # (id(conv), band input shape, full rows) -> run the band with oneDNN
        self.replicate = {id(m) for m in layout.replicate}  # halo modules with replicate row padding
        self.reflect = {id(m) for m in layout.reflect}  # halo modules with reflect row padding
        self.gathered = 0  # gather modules running now (their GroupNorms see the gathered input: run as is)

    # --- root: split the input rows, gather the output rows
    def _root_forward(self, inner):
        comm, band, dim = self.coll.comm, self.band, self.DIM

        def forward(x, *args, **kwargs):
            sizes = split_rows(x.shape[dim], comm.size, self.layout.unit)
            if sizes is None:  # too few rows for every rank: every rank runs the whole call (exact)
                if not self.warned:
                    logger.warning("parallel VAE (exact): %d rows cannot give each of %d ranks a band of a multiple "
                                   "of %d rows; this call runs unsplit on every rank", x.shape[dim], comm.size,
                                   self.layout.unit)
                    self.warned = True
                if self.defer and self.root_sizes is not None:
                    raise RuntimeError("parallel VAE (exact): split and unsplit network calls in one deferred call")
                return inner(x, *args, **kwargs)
            start = sum(sizes[:comm.rank])
            band.sizes = sizes
            # halo rows replace the row padding, in split calls only (an unsplit call keeps the model's)
            undo = [self.layout.unpad(m) for m, _ in self.layout.halo] if self.layout.unpad is not None else []
            try:
                out = inner(x.narrow(dim, start, sizes[comm.rank]), *args, **kwargs)
            finally:
                band.sizes = None
                for u in reversed(undo):
                    u()
            if self.defer:
                if self.root_sizes not in (None, sizes):
                    raise RuntimeError(f"parallel VAE (exact): band sizes changed within one call ({self.root_sizes} "
                                       f"-> {sizes})")
                self.root_sizes = sizes
                return out
            return self.coll.gather_rows(out, dim, band_sizes_out(sizes, out.shape[dim], comm.rank))

        return forward

    def gather_output(self, out: torch.Tensor) -> torch.Tensor:
        """The deferred gather of the wrapped method's final (band) output."""
        if self.root_sizes is None:
            return out
        return self.coll.gather_rows(out, self.DIM, band_sizes_out(self.root_sizes, out.shape[self.DIM],
                                                                   self.coll.comm.rank))

    # --- halo convolutions
    def _halo_extent(self, module, rows, first_of, band_rows) -> tuple[int, bool]:
        """(rows to exchange, merged) for one halo module. The first of a pair (``first_of=(second_module,
        rows2)``) also carries the second's halo when every band has room for both: the same decision on
        every rank (from the global band sizes at this resolution), recorded for the second."""
        sizes = self.band.sizes_like(band_rows, self.coll.comm.rank)
        self.full_rows[id(module)] = sum(sizes) + 2 * rows
        if first_of is None:
            return rows, False
        partner, rows2 = first_of
        self.full_rows[id(partner)] = sum(sizes) + 2 * rows2
        merged = min(sizes) >= rows + rows2
        self.merged[id(partner)] = merged
        return (rows + rows2 if merged else rows), merged

    def _edge(self, module) -> str:
        if id(module) in self.reflect:
            return "reflect"
        return "replicate" if id(module) in self.replicate else "zeros"

    def _zero_outer_rows(self, out: torch.Tensor, rows2: int) -> None:
        """Zero the rows a merged first conv computed beyond the image edge (the second's zero padding)."""
        dim, comm = self.DIM, self.coll.comm
        if comm.rank == 0:
            out.narrow(dim, 0, rows2).zero_()
        if comm.rank == comm.size - 1:
            out.narrow(dim, out.shape[dim] - rows2, rows2).zero_()

    def _halo_hooks(self, rows, first_of: tuple | None = None, second: bool = False):
        """Pre/post hooks of one halo module. ``first_of=(second_module, rows2)``: the first of a pair;
        ``second``: the second of a pair (reads its halo from the first's wider output when merged)."""
        unpadded = self.layout.unpad is not None
        dim = self.DIM

        def pre(module, args, kwargs):
            if self.band.sizes is None:
                return None
            if second and self.merged.get(id(module)):
                return None  # the input (and the cached rows) already carry the halo
            tensors, rebuild = _tensor_args(args, kwargs)
            ext, _ = self._halo_extent(module, rows, first_of, tensors[0].shape[dim])
            halos = self.coll.halo(tensors, dim, ext, ext, edge=self._edge(module))
            return rebuild([torch.cat([p, t, n], dim=dim) for t, (p, n) in zip(tensors, halos)])

        def post(module, args, output):
            if self.band.sizes is None:
                return None
            if not unpadded:
                return output.narrow(dim, rows, output.shape[dim] - 2 * rows)
            if first_of is not None and self.merged.get(id(first_of[0])):
                self._zero_outer_rows(output, first_of[1])
            return None

        return pre, post

    def _halo_forward(self, module, orig, rows, first_of: tuple | None = None, second: bool = False):
        """Forward of an unpadded halo module that overlaps its exchange with compute: it starts the
        exchange, runs the module on its own band (the output rows that need no halo), then on the
        two thin strips at the band edges with the received rows, and concatenates (one exchange, the
        same rows as the hook path; bands of <= 2 * rows rows take the hook path's order)."""
        dim = self.DIM

        def forward(*args, **kwargs):
            if self.band.sizes is None or (second and self.merged.get(id(module))):
                return orig(*args, **kwargs)  # not split / the input already carries the halo
            tensors, rebuild = _tensor_args(args, kwargs)

            def call(ts):
                a, kw = rebuild(ts)
                return orig(*a, **kw)

            ext, merged = self._halo_extent(module, rows, first_of, tensors[0].shape[dim])
            band = tensors[0].shape[dim]
            if band > 2 * rows:
                finish = self.coll.halo(tensors, dim, ext, ext, wait=False, edge=self._edge(module))
                inner = call(tensors)  # output rows [rows, band - rows): no halo needed
                halos = finish()
                top = call([torch.cat([p, t.narrow(dim, 0, 2 * rows)], dim=dim) for t, (p, _) in zip(tensors, halos)])
                bot = call([torch.cat([t.narrow(dim, band - 2 * rows, 2 * rows), n], dim=dim)
                            for t, (_, n) in zip(tensors, halos)])
                out = torch.cat([top, inner, bot], dim=dim)
            else:
                halos = self.coll.halo(tensors, dim, ext, ext, edge=self._edge(module))
                out = call([torch.cat([p, t, n], dim=dim) for t, (p, n) in zip(tensors, halos)])
            if merged:
                self._zero_outer_rows(out, first_of[1])
            return out

        return forward

    def _bottom_pre(self, module, args):
        if self.band.sizes is None:
            return None
        x = args[0]
        # the input carries the model's one row of bottom padding
        self.full_rows[id(module)] = sum(self.band.sizes_like(x.shape[self.DIM] - 1, self.coll.comm.rank)) + 1
        (_, nxt), = self.coll.halo([x], self.DIM, 0, 1)
        if self.coll.comm.rank == self.coll.comm.size - 1:
            return None  # the last band keeps the model's own zero row
        return (torch.cat([x.narrow(self.DIM, 0, x.shape[self.DIM] - 1), nxt], dim=self.DIM),) + tuple(args[1:])

    # --- the full frame's convolution kernel for a band
    def _conv_forward(self, module, orig, halo_module):
        """``module``'s conv kernel call; ``halo_module``: the layout's module it runs in (itself, or a
        wrapper that pads, then calls it), whose full-frame rows it sees."""
        key_id = id(halo_module)

        def conv_forward(x, weight, bias):
            full = self.full_rows.get(key_id) if self.band.sizes is not None else None
            if full is not None:
                key = (id(module), tuple(x.shape), full)
                use = self.onednn.get(key)
                if use is None:
                    use = self.onednn[key] = _onednn_for_full_frame(module, x, weight, bias, full)
                if use:
                    return torch.ops.aten.mkldnn_convolution(x, weight, bias, list(module.padding),
                                                             list(module.stride), list(module.dilation), module.groups)
            return orig(x, weight, bias)

        return conv_forward

    # --- global modules: full input in, own band out
    def _gather_pre(self, module, args):
        if self.band.sizes is None:
            return None
        x = args[0]
        sizes = self.band.sizes_like(x.shape[self.DIM], self.coll.comm.rank)
        full = self.coll.gather_rows(x, self.DIM, sizes)
        self.gathered += 1
        return (full,) + tuple(args[1:])

    def _gather_post(self, module, args, output):
        if self.band.sizes is None:
            return None
        self.gathered -= 1
        # the output covers every band: keep this rank's (band sizes scaled to this resolution)
        sizes = self.band.sizes
        factor = Fraction(output.shape[self.DIM], sum(sizes))
        rank = self.coll.comm.rank
        return output.narrow(self.DIM, int(sum(sizes[:rank]) * factor), int(sizes[rank] * factor))

    # --- GroupNorm: statistics over every band
    def _group_norm_forward(self, module, orig):
        def forward(x):
            if self.band.sizes is None or self.gathered:
                return orig(x)  # unsplit call, or inside a module that sees the gathered input
            return _group_norm(x, module.num_groups, module.weight, module.bias, module.eps, self.coll)

        return forward

    # --- modules that draw frame-shaped random tensors
    def _band_random_forward(self, orig):
        def forward(*args, **kwargs):
            if self.band.sizes is None:
                return orig(*args, **kwargs)
            with _FullFrameRandom(self.band, self.coll.comm.rank, self.DIM):
                return orig(*args, **kwargs)

        return forward

    def _patch(self, mod, name: str, make: Callable) -> None:
        """Set ``mod.<name> = make(current)`` on the instance; ``remove`` restores what was there."""
        self.patched.append((mod, name, name in mod.__dict__, mod.__dict__.get(name)))
        setattr(mod, name, make(getattr(mod, name)))

    def install(self):
        layout = self.layout
        if any(id(m) in self.replicate or id(m) in self.reflect for pair in layout.pairs for m in pair):
            raise ValueError("parallel VAE: a halo module with replicate row padding cannot be one of "
                             "SpatialLayout.pairs (their merged exchange assumes zero padding)")
        bad = [m for m in layout.group_norm if not isinstance(m, torch.nn.GroupNorm)]
        if bad:
            raise ValueError(f"parallel VAE: SpatialLayout.group_norm takes nn.GroupNorm modules, got "
                             f"{type(bad[0]).__name__}")
        self._patch(layout.root, "forward", self._root_forward)
        rows_of = {id(m): r for m, r in layout.halo}
        firsts, seconds = {}, set()
        if layout.unpad is not None:
            for a, b in layout.pairs:
                if id(a) in rows_of and id(b) in rows_of:
                    firsts[id(a)] = (b, rows_of[id(b)])
                    seconds.add(id(b))
        try:
            for mod, rows in layout.halo:
                # a strided convolution's output rows do not line up with its inner rows: hook path only
                if _row_stride(mod) == 1 and (self.overlap_halo is True or
                                              (self.overlap_halo == "auto" and _overlap_pays(mod))):
                    self._patch(mod, "forward", lambda orig, mod=mod, rows=rows: self._halo_forward(
                        mod, orig, rows, first_of=firsts.get(id(mod)), second=id(mod) in seconds))
                    continue
                pre, post = self._halo_hooks(rows, first_of=firsts.get(id(mod)), second=id(mod) in seconds)
                self.handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                self.handles.append(mod.register_forward_hook(post))
            for mod in layout.bottom_halo:
                self.handles.append(mod.register_forward_pre_hook(self._bottom_pre))
            for mod in [m for m, _ in layout.halo] + list(layout.bottom_halo):
                conv = _conv_of(mod)
                if conv is not None:
                    self._patch(conv, "_conv_forward",
                                lambda orig, conv=conv, mod=mod: self._conv_forward(conv, orig, mod))
            for mod in layout.gather:
                self.handles.append(mod.register_forward_pre_hook(self._gather_pre))
                self.handles.append(mod.register_forward_hook(self._gather_post))
            for mod in layout.band_random:
                self._patch(mod, "forward", self._band_random_forward)
            for mod in layout.group_norm:
                self._patch(mod, "forward", lambda orig, mod=mod: self._group_norm_forward(mod, orig))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.patched:  # newest first, the root's forward last
            mod, name, had, prev = self.patched.pop()
            if had:
                setattr(mod, name, prev)
            elif name in mod.__dict__:
                delattr(mod, name)


def band_sizes_out(sizes_in: list[int], rows_out_here: int, rank: int) -> list[int]:
    factor = Fraction(rows_out_here, sizes_in[rank])
    out = [s * factor for s in sizes_in]
    if any(v.denominator != 1 for v in out):
        raise RuntimeError(f"parallel VAE: output rows {rows_out_here} do not scale the bands {sizes_in}")
    return [int(v) for v in out]
