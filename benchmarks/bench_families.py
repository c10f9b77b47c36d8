"""Per-family speed of one transformer block at a released model's dims: stock diffusers vs lite_boost.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py ltx             # LTX 2B, 7,392 tokens
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py ltx --size 13b
    python benchmarks/bench_families.py ltx --quick                                    # small shape, 2 reps

Each benchmark registers a builder (:data:`BENCHES`, by name) that makes one block of the released model twice
from the same weights, stock and boosted (and boosted with block-sparse self-attention for video
families), plus the inputs the block receives inside the transformer. One repetition times, in this
order, the attention modules of the block (what the processor shim replaces), then the whole block,
for every variant (interleaved); the first repetition is a warm-up and is dropped. Also timed: the
RoPE module once per transformer call (stock rebuilds its tables at every call, the boost serves
them from its cache). Medians, ratios, the max abs difference boosted vs stock (fp32), threads and the
load average before / after go to benchmarks/results/families_<bench>_<size>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench_sparse_common import environment, markdown_table, median, timed, write

import lite_boost
from lite_boost.config import BoostConfig, SparseConfig


@dataclass
class Case:
    """One family's benchmark: per-variant callables for the attention part and the whole block."""

    title: str
    shape: str
    attention: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the block's attention modules
    block: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the whole block
    rope: dict[str, Callable[[], object]] = field(default_factory=dict)  # variant -> one RoPE module call
    sparse_state: object = None  # SparseState of the sparse variant (effective sparsity)


BENCHES: dict[str, Callable[[argparse.Namespace], Case]] = {}


def family(name):
    def register(builder):
        BENCHES[name] = builder
        return builder

    return register


# --------------------------------------------------------------------------------------------- LTX-Video
LTX_SIZES = {"2b": (32, 64), "13b": (32, 128)}  # heads x head_dim (scripts/convert_ltx_to_diffusers.py)


@family("ltx")
def ltx_case(args) -> Case:
    """One LTXVideoTransformerBlock: self-attention over the video tokens (RoPE over the inner dim),
    cross-attention to 128 T5 tokens (100 real, 28 padded: the bias mask), feed-forward."""
    from diffusers import LTXVideoTransformer3DModel

    heads, head_dim = LTX_SIZES[args.size]
    inner = heads * head_dim
    grid = tuple(int(x) for x in args.grid.split(","))
    seq, text, batch = math.prod(grid), args.text, args.batch
    torch.manual_seed(0)
    stock = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, num_attention_heads=heads,
                                       attention_head_dim=head_dim, cross_attention_dim=inner, num_layers=1,
                                       caption_channels=inner).eval()
    boosted = lite_boost.boost(copy.deepcopy(stock))
    sparse = lite_boost.boost(copy.deepcopy(stock), BoostConfig(sparse=SparseConfig(
        sparsity=args.sparsity, block_size=args.block_size)))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)
    context = torch.randn(batch, text, inner, generator=g)
    temb = 0.1 * torch.randn(batch, 1, 6 * inner, generator=g)
    mask = torch.ones(batch, text)
    mask[:, args.valid_text:] = 0
    bias = ((1 - mask) * -10000.0).unsqueeze(1)
    rope_args = (hidden, *grid, (8 / 25, 32, 32))  # LTXPipeline's interpolation scale at 25 fps
    state = sparse._lite_boost.extras["sparse"]

    def attention_fn(model, observe=False):
        blk = model.transformer_blocks[0]
        rot = model.rope(*rope_args)

        def run():
            if observe:
                state.observe(grid, torch.tensor(500.0))  # what the transformer's pre-hook records
            out = blk.attn1(hidden_states=hidden, image_rotary_emb=rot)
            return out + blk.attn2(hidden, encoder_hidden_states=context, attention_mask=bias)
        return run

    def block_fn(model, observe=False):
        blk = model.transformer_blocks[0]
        rot = model.rope(*rope_args)

        def run():
            if observe:
                state.observe(grid, torch.tensor(500.0))
            return blk(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rot,
                       encoder_attention_mask=bias)
        return run

    models = {"stock": stock, "boosted": boosted}
    attention = {k: attention_fn(m) for k, m in models.items()}
    block = {k: block_fn(m) for k, m in models.items()}
    if not args.no_sparse:
        attention[f"sparse {args.sparsity}"] = attention_fn(sparse, observe=True)
        block[f"sparse {args.sparsity}"] = block_fn(sparse, observe=True)
    rope = {"stock": lambda: stock.rope(*rope_args), "boosted": lambda: boosted.rope(*rope_args)}
    shape = (f"LTX {args.size.upper()}: {heads} x {head_dim} heads, grid {grid} = {seq:,} video tokens, batch {batch}, "
             f"text {text} ({args.valid_text} real), fp32, sparse block {args.block_size}")
    return Case("LTX-Video block", shape, attention, block, rope, state)


# --------------------------------------------------------------------------------------------- runner
def _max_diff(fns, reference="stock"):
    with torch.no_grad():
        ref = fns[reference]()
        return {k: (fn() - ref).abs().max().item() for k, fn in fns.items() if k != reference}


def run(case: Case, args) -> tuple[str, dict]:
    load_before = os.getloadavg()
    diffs = _max_diff(case.block)
    times = {part: {k: [] for k in fns} for part, fns in (("attention", case.attention), ("block", case.block),
                                                         ("rope", case.rope))}
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # repetition 0: warm-up, dropped
            for part, fns in (("rope", case.rope), ("attention", case.attention), ("block", case.block)):
                for name, fn in fns.items():
                    t, _ = timed(fn)
                    if rep:
                        times[part][name].append(t)
            print(f"repetition {rep}: " + ", ".join(f"{p} {k} {v[-1]:.3f}s" for p, d in times.items()
                                                   for k, v in d.items() if v), flush=True)
    load_after = os.getloadavg()
    effective = None
    if case.sparse_state is not None and case.sparse_state.events:
        effective = case.sparse_state.mean_effective_sparsity()
    rows = []
    for part in ("attention", "block", "rope"):
        base = median(times[part]["stock"])
        for name, ts in times[part].items():
            med = median(ts)
            rows.append([part, name, f"{med:.4f}", f"{base / med:.3f}x", len(ts)])
    text = "\n".join([
        f"### {case.title}: stock diffusers vs lite_boost (`benchmarks/bench_families.py {args.bench}`)",
        "",
        case.shape + ".",
        "",
        markdown_table(["part", "variant", "median s", "speed-up vs stock", "runs"], rows),
        "",
        f"max abs diff vs stock (block output): {', '.join(f'{k} {v:.2e}' for k, v in diffs.items())}"
        + (f"; sparse effective sparsity {effective:.3f}" if effective is not None else ""),
        f"{environment()}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min).",
    ])
    data = {"bench": args.bench, "shape": case.shape, "times": times, "max_abs_diff": diffs,
            "effective_sparsity": effective, "load_before": load_before, "load_after": load_after,
            "threads": torch.get_num_threads()}
    return text, data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="?", choices=sorted(BENCHES), default="ltx")
    ap.add_argument("--family", dest="bench", choices=sorted(BENCHES), help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(LTX_SIZES), default="2b", help="ltx: released model size")
    ap.add_argument("--grid", default="21,16,22", help="ltx: latent grid frames,height,width (512x704x161)")
    ap.add_argument("--text", type=int, default=128)
    ap.add_argument("--valid-text", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--no-sparse", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small grid (3,8,11 = 264 tokens), 2 repetitions")
    ap.add_argument("--out", default=None, help="results name (default families_<bench>_<size>)")
    args = ap.parse_args(argv)
    if args.quick:
        args.grid, args.repeats = "3,8,11", 2
    torch.set_num_threads(args.threads)
    case = BENCHES[args.bench](args)
    text, data = run(case, args)
    write(args.out or f"families_{args.bench}_{args.size}" + ("_quick" if args.quick else ""), text, data)


if __name__ == "__main__":
    main()
