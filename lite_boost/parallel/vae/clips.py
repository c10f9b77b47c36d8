"""Exact mode by whole clips: independent temporal clips spread over the ranks, assembled by the VAE's own code.

For a VAE whose wrapped method (``_decode`` / ``_encode``) cuts its input into temporal clips, runs one
per-clip method on each (``VAEAdapter.clip_method``) with nothing carried from one clip to the next, and then
assembles the clip outputs (concatenation, cross-fades, trims). The clips are independent, so handing them
out is exact:

1. the adapter names the clip inputs the wrapped method will pass, in call order
   (``VAEAdapter.clip_inputs``; no collective);
2. :func:`plan_clips` gives each rank a contiguous run of clips (counts differ by at most one; ranks beyond
   the clip count own none and still take part);
3. each rank runs the stock per-clip method on its clips;
4. three all-gathers: a fixed-size header (status, clip count, dtype, element count) of every rank, then the
   output shapes, then the outputs themselves (flattened, padded to the largest rank's);
5. every rank calls the wrapped method itself, its per-clip method replaced (on the instance, for the call) by
   one that returns the gathered outputs in order after checking that each input is the predicted clip
   (``torch.equal``): the assembly is the VAE's own code, run on every rank.

Nothing carries state between ranks. A rank whose clips fail (or whose clip count disagrees with another
rank's: inputs of different shapes) still joins the header gather, so every rank raises together instead of
one rank waiting for a collective the others never enter. A call with at most one clip runs whole on every
rank (nothing to share). Knows no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import VAEAdapter
from .collectives import VAECollectiveError, _Collectives

__all__ = ["ClipPlan", "plan_clips", "run_clips"]

_MAX_DIMS = 8  # clip outputs of up to 8 dims (a video clip has 5)
# dtypes a clip output may have, by header code
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class ClipPlan:
    """Clips ``ranges[r]`` (a contiguous ``range`` of clip indices) run on rank ``r``."""

    num_clips: int
    ranges: tuple

    def owner(self, index: int) -> int:
        return next(r for r, rg in enumerate(self.ranges) if index in rg)

    def describe(self) -> str:
        parts = [f"r{r}:[{rg.start},{rg.stop})" for r, rg in enumerate(self.ranges)]
        return f"{self.num_clips} clips on {len(self.ranges)} ranks: " + " ".join(parts)


def plan_clips(num_clips: int, world_size: int) -> ClipPlan:
    """Contiguous runs of clips, one per rank, whose lengths differ by at most one (the first
    ``num_clips % world_size`` ranks take one more); with fewer clips than ranks the last ranks own none."""
    if isinstance(num_clips, bool) or not isinstance(num_clips, int) or num_clips < 0:
        raise ValueError(f"num_clips must be an integer >= 0, got {num_clips!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    base, extra = divmod(num_clips, world_size)
    ranges, start = [], 0
    for r in range(world_size):
        stop = start + base + (r < extra)
        ranges.append(range(start, stop))
        start = stop
    return ClipPlan(num_clips, tuple(ranges))


def run_clips(adapter: VAEAdapter, coll: _Collectives, kind: str, inner, inp: torch.Tensor, args: tuple,
              kwargs: dict, *, on_plan=None):
    """One call of the wrapped method ``inner`` with its clips spread over ``coll``'s ranks (see the module).

    ``on_plan(plan)``: told the ClipPlan before the clips run (None: not told)."""
    vae, comm = adapter.vae, coll.comm
    name = adapter.clip_method(kind)
    clips = list(adapter.clip_inputs(inp, kind, *args, **kwargs))
    if len(clips) <= 1:  # nothing to share (every rank has the same input): run it whole, no collective
        return inner(inp, *args, **kwargs)
    plan = plan_clips(len(clips), comm.size)
    if on_plan is not None:
        on_plan(plan)
    run_clip = getattr(vae, name)
    mine = plan.ranges[comm.rank]
    outs, error = [], None
    try:
        for i in mine:
            out = run_clip(clips[i])
            if not isinstance(out, torch.Tensor) or out.ndim > _MAX_DIMS or out.dtype not in _DTYPES:
                what = (out.dtype, out.ndim) if isinstance(out, torch.Tensor) else type(out).__name__
                raise TypeError(f"{type(vae).__name__}.{name} returned {what}; the clip-parallel VAE needs a float "
                                f"tensor of at most {_MAX_DIMS} dims")
            if outs and out.dtype != outs[0].dtype:
                raise TypeError(f"{type(vae).__name__}.{name} returned clips of dtypes {outs[0].dtype} and {out.dtype}")
            outs.append(out)
    except Exception as exc:  # noqa: BLE001 - reported to every rank through the header, re-raised below
        error, outs = exc, []

    # 1. the header: [failed, number of clips, dtype code (-1: none), elements sent]
    device = inp.device
    dtype_code = _DTYPES.index(outs[0].dtype) if outs else -1
    numel = sum(o.numel() for o in outs)
    header = torch.tensor([int(error is not None), len(clips), dtype_code, numel], dtype=torch.int64, device=device)
    headers = coll.gather_equal(header, to_all=True, op="vae_clip_header").cpu().tolist()
    failed = [r for r, h in enumerate(headers) if h[0]]
    if failed:
        if error is not None:
            raise error
        raise VAECollectiveError(f"parallel VAE ({type(vae).__name__}.{name}, clip-parallel {kind}): the clips of "
                                 f"rank(s) {failed} failed (their own error is raised there); every rank stops here")
    counts = sorted({h[1] for h in headers})
    if len(counts) > 1:
        raise VAECollectiveError(f"parallel VAE ({type(vae).__name__}, {kind}): the ranks' inputs give different "
                                 f"clip counts {[h[1] for h in headers]} (inputs of different shapes per rank?); "
                                 "every rank must decode / encode the same input")
    codes = sorted({h[2] for h in headers if h[2] >= 0})
    if len(codes) != 1:
        raise VAECollectiveError(f"parallel VAE ({type(vae).__name__}, {kind}): the ranks' clip outputs have "
                                 f"different dtypes {[_DTYPES[c] for c in codes]}")
    dtype = _DTYPES[codes[0]]

    # 2. the output shapes (ndim, then the sizes), ceil(clips / ranks) slots per rank
    slots = len(plan.ranges[0])
    shapes = torch.zeros(slots, 1 + _MAX_DIMS, dtype=torch.int64, device=device)
    for k, o in enumerate(outs):
        shapes[k, 0] = o.ndim
        shapes[k, 1:1 + o.ndim] = torch.tensor(o.shape, dtype=torch.int64)
    all_shapes = coll.gather_equal(shapes, to_all=True, op="vae_clip_shapes").cpu().tolist()

    # 3. the outputs, flattened and padded to the largest rank's element count
    width = max(h[3] for h in headers)
    local = torch.zeros(width, dtype=dtype, device=device)
    offset = 0
    for o in outs:
        local[offset:offset + o.numel()] = o.reshape(-1)
        offset += o.numel()
    stacked = coll.gather_equal(local, to_all=True, op="vae_clip_gather")
    results = [None] * len(clips)
    for r, rg in enumerate(plan.ranges):
        offset = 0
        for k, i in enumerate(rg):
            row = all_shapes[r][k]
            shape = tuple(row[1:1 + row[0]])
            n = 1
            for s in shape:
                n *= s
            results[i] = outs[k] if r == comm.rank else stacked[r, offset:offset + n].view(shape)
            offset += n

    # 4. the VAE's own assembly, its per-clip method serving the gathered outputs
    served = [0]

    def serve(clip, *a, **kw):
        i = served[0]
        if a or kw or i >= len(clips) or clip.shape != clips[i].shape or not torch.equal(clip, clips[i]):
            raise RuntimeError(f"parallel VAE: {type(vae).__name__}.{_wrapped_name(adapter, kind)} called {name} "
                               f"(call {i + 1}) with an input its adapter did not predict "
                               f"({type(adapter).__name__}.clip_inputs, {len(clips)} clips): the diffusers code "
                               "changed; set vae_parallel='off'")
        served[0] += 1
        return results[i]

    missing = object()
    previous = vae.__dict__.get(name, missing)
    object.__setattr__(vae, name, serve)
    try:
        out = inner(inp, *args, **kwargs)
    finally:
        if previous is missing:
            object.__delattr__(vae, name)
        else:
            object.__setattr__(vae, name, previous)
    if served[0] != len(clips):
        raise RuntimeError(f"parallel VAE: {type(vae).__name__}.{_wrapped_name(adapter, kind)} used {served[0]} of "
                           f"the {len(clips)} clips its adapter predicted: the diffusers code changed; set "
                           "vae_parallel='off'")
    return out


def _wrapped_name(adapter: VAEAdapter, kind: str) -> str:
    return adapter.decode_method if kind == "decode" else adapter.encode_method
