"""HunyuanVideo / HunyuanVideo-1.5 benchmarks: attention processors against stock diffusers at the released dims.

Every timed comparison runs stock and lite_boost in one process, interleaved, after a warm-up, and
reports medians and ratios (hold ``/tmp/lite_boost_cpu.lock`` while timing: the cores are shared).

* ``hunyuan-video``: one HunyuanVideo dual-stream and one single-stream block's attention processor
  (24 heads x 128, 256 text tokens padded, ``--valid`` real) at a video token grid, stock
  ``HunyuanVideoAttnProcessor2_0`` (with the (cos, sin) tables diffusers' RoPE module builds every forward)
  vs ``HunyuanVideoJointProcessor`` (cached phasors); plus the RoPE module's cost per transformer forward
  (rebuilt by diffusers, a cache hit with lite_boost) and the whole blocks.
* ``hunyuan-video-sparse``: the dual block's processor, dense vs block-sparse (``--sparsity``) at one shape.
* ``hunyuan-video-1.5-memory``: peak memory of ONE HunyuanVideo-1.5 attention call (stock: dense
  (B, 1, S, S) mask built per call; lite_boost: (B, T) key-padding mask), at several token counts, each
  variant in a fresh process: peak bytes the CPU allocator held during the call (torch.profiler memory
  events) and the peak RSS increase; the dense-mask bytes extrapolated analytically to 480p.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_hunyuan.py --family hunyuan-video --grid 5,32,40
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_hunyuan.py --family hunyuan-video-sparse --grid 5,32,40
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_hunyuan.py --family hunyuan-video-1.5-memory \
        --tokens 4096,8192,16384
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from bench_sparse_common import markdown_table as _table
from bench_sparse_common import timed as _timed
from bench_sparse_common import write

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _environment(threads: int) -> str:
    load = os.getloadavg()
    return (f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} visible cores, load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min; cores shared with other jobs: "
            "compare the ratios)")


# ------------------------------------------------------------------------------------------ HunyuanVideo
class _HunyuanSetup:
    """A dual and a single HunyuanVideo block at the released dims, their inputs, both RoPE forms."""

    def __init__(self, grid, heads, head_dim, text, valid, dtype, seed=0):
        from diffusers.models.transformers.transformer_hunyuan_video import (HunyuanVideoRotaryPosEmbed,
                                                                             HunyuanVideoSingleTransformerBlock,
                                                                             HunyuanVideoTransformerBlock)

        from lite_boost.adapter.boost import BoostState
        from lite_boost.config import BoostConfig
        from lite_boost.models.hunyuan_video import CachedHunyuanRope
        from lite_boost.ops.rope import RopeCache

        torch.manual_seed(seed)
        dim = heads * head_dim
        self.dual = HunyuanVideoTransformerBlock(heads, head_dim, mlp_ratio=4.0).to(dtype).eval()
        self.single = HunyuanVideoSingleTransformerBlock(heads, head_dim, mlp_ratio=4.0).to(dtype).eval()
        self.stock_procs = (self.dual.attn.processor, self.single.attn.processor)
        f, h, w = grid
        self.tokens = f * h * w
        g = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(1, self.tokens, dim, generator=g).to(dtype)
        self.text = torch.randn(1, text, dim, generator=g).to(dtype)
        self.temb = torch.randn(1, dim, generator=g).to(dtype)
        self.mask = torch.ones(1, 1, 1, self.tokens + text, dtype=torch.bool)
        self.mask[..., self.tokens + valid:] = False
        axes = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)  # (16, 56, 56) at 128
        self.rope = HunyuanVideoRotaryPosEmbed(2, 1, list(axes), 256.0)
        self.latent = torch.zeros(1, 1, f, 2 * h, 2 * w)  # patch 1 x 2 x 2
        self.cached_rope = CachedHunyuanRope(self.rope, BoostState(config=BoostConfig(), rope_cache=RopeCache()))

    def use(self, which: str, attn_fn=None):
        """Install stock processors ("stock") or the shims ("lite_boost", optionally with ``attn_fn``)."""
        from lite_boost.models.hunyuan_video import HunyuanVideoJointProcessor

        for layer, (block, stock) in enumerate(zip((self.dual, self.single), self.stock_procs)):
            if which == "stock":
                block.attn.set_processor(stock)
            else:
                proc = HunyuanVideoJointProcessor(layer, "joint")
                proc.text_first = False  # [image, text], as the boost sets it
                if attn_fn is not None:
                    proc.attn_fn = attn_fn(layer, proc.attn_fn)
                block.attn.set_processor(proc)

    def rope_tables(self, which: str):
        return self.rope(self.latent) if which == "stock" else self.cached_rope(self.latent)

    def attention(self, block, emb):
        """The block's attention call (its processor) on inputs of the shapes the block hands it."""
        with torch.no_grad():
            return block.attn(hidden_states=self.hidden, encoder_hidden_states=self.text, attention_mask=self.mask,
                              image_rotary_emb=emb)

    def block(self, block, emb):
        with torch.no_grad():
            return block(self.hidden, self.text, self.temb, self.mask, emb)


def _max_rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench_hunyuan_video(args) -> None:
    dtype = DTYPES[args.dtype]
    grid = tuple(int(x) for x in args.grid.split(","))
    s = _HunyuanSetup(grid, args.heads, args.head_dim, args.text, args.valid, dtype)
    times = {k: [] for k in ("rope", "dual_attn", "single_attn", "dual_block", "single_block")}
    times = {v: {k: [] for k in times} for v in ("stock", "lite_boost")}
    outs = {}
    order = ["stock", "lite_boost"]
    for rep in range(args.repeats + 1):  # repeat 0 = warm-up (not counted)
        for which in (order if rep % 2 == 0 else order[::-1]):
            s.use(which)
            t_rope, emb = _timed(lambda: s.rope_tables(which))
            t_da, out_d = _timed(lambda: s.attention(s.dual, emb))
            t_sa, out_s = _timed(lambda: s.attention(s.single, emb))
            t_db, _ = _timed(lambda: s.block(s.dual, emb)) if args.blocks else (float("nan"), None)
            t_sb, _ = _timed(lambda: s.block(s.single, emb)) if args.blocks else (float("nan"), None)
            outs[which] = (out_d, out_s)
            if rep:
                for k, t in zip(times[which], (t_rope, t_da, t_sa, t_db, t_sb)):
                    times[which][k].append(t)
            print(f"rep {rep} {which}: rope {t_rope * 1e3:.1f} ms, dual attn {t_da:.2f} s, single attn {t_sa:.2f} s, "
                  f"dual block {t_db:.2f} s, single block {t_sb:.2f} s", flush=True)
    err = max(_max_rel(a, b) for pair in zip(outs["lite_boost"], outs["stock"]) for a, b in zip(*pair))
    med = {v: {k: statistics.median(x) if x else float("nan") for k, x in t.items()} for v, t in times.items()}
    rows = []
    labels = {"rope": "RoPE tables per transformer forward", "dual_attn": "dual-stream block attention (processor)",
              "single_attn": "single-stream block attention (processor)", "dual_block": "dual-stream block",
              "single_block": "single-stream block"}
    for k, label in labels.items():
        a, b = med["stock"][k], med["lite_boost"][k]
        if a != a:  # nan: not measured
            continue
        unit, scale = ("ms", 1e3) if k == "rope" else ("s", 1.0)
        rows.append((label, f"{a * scale:.3f} {unit}", f"{b * scale:.3f} {unit}", f"{a / b:.2f}x"))
    per_forward = (med["stock"]["dual_attn"] * 20 + med["stock"]["single_attn"] * 40 + med["stock"]["rope"],
                   med["lite_boost"]["dual_attn"] * 20 + med["lite_boost"]["single_attn"] * 40 + med["lite_boost"]["rope"])
    text = (f"## HunyuanVideo attention processors vs stock diffusers\n\n"
            f"{args.heads} heads x {args.head_dim}, video grid {grid} = {s.tokens:,} tokens + {args.text} text tokens "
            f"({args.valid} real, key-padding mask), {args.dtype}, batch 1; medians of {args.repeats} interleaved "
            f"repeats after a warm-up; max relative difference of the outputs {err:.1e}.\n"
            f"{_environment(torch.get_num_threads())}\n\n"
            + _table(("", "stock", "lite_boost", "speed-up"), rows)
            + f"\n\nPer transformer forward (20 dual + 40 single attention calls + RoPE, blocks' MLPs excluded): "
              f"stock {per_forward[0]:.1f} s, lite_boost {per_forward[1]:.1f} s ({per_forward[0] / per_forward[1]:.3f}x).")
    write(f"families_hunyuan_video_{args.dtype}", text, {"args": vars(args), "medians": med, "max_rel_err": err})


def bench_hunyuan_video_sparse(args) -> None:
    from lite_boost.adapter.sparse import ScheduledSparseAttention, SparseState
    from lite_boost.config import SparseConfig
    from lite_boost.schedule import SparseSchedule

    dtype = DTYPES[args.dtype]
    grid = tuple(int(x) for x in args.grid.split(","))
    s = _HunyuanSetup(grid, args.heads, args.head_dim, args.text, args.valid, dtype)
    cfg = SparseConfig(sparsity=args.sparsity, block_size=args.block_size)
    state = SparseState(cfg, SparseSchedule(cfg))
    state.grid = grid
    variants = {"stock": None, "lite_boost dense": None,
                f"lite_boost sparse {args.sparsity}": lambda layer, fn: ScheduledSparseAttention(layer, state, fn)}
    times = {v: [] for v in variants}
    names = list(variants)
    for rep in range(args.repeats + 1):
        for name in (names if rep % 2 == 0 else names[::-1]):
            s.use("stock" if name == "stock" else "lite_boost", variants[name])
            emb = s.rope_tables("stock" if name == "stock" else "lite_boost")
            t, _ = _timed(lambda: s.attention(s.dual, emb))
            if rep:
                times[name].append(t)
            print(f"rep {rep} {name}: {t:.2f} s", flush=True)
    ev = [e for e in state.events if e.path == "sparse"]
    eff = statistics.mean(e.effective_sparsity for e in ev) if ev else 0.0
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["stock"]
    rows = [(k, f"{v:.3f} s", f"{base / v:.2f}x") for k, v in med.items()]
    text = (f"## HunyuanVideo block-sparse attention (dual-stream block processor)\n\n"
            f"{args.heads} heads x {args.head_dim}, video grid {grid} = {s.tokens:,} tokens + {args.text} text tokens "
            f"({args.valid} real; the padded ones are left out of the sparse call, text rows / columns dense), "
            f"{args.dtype}, rf_v2 block {args.block_size}, sparsity {args.sparsity} (effective {eff:.2f}, kernel "
            f"{ev[-1].backend if ev else '-'}); medians of {args.repeats} interleaved repeats after a warm-up.\n"
            f"{_environment(torch.get_num_threads())}\n\n"
            + _table(("processor", "time", "vs stock"), rows))
    write(f"families_hunyuan_video_sparse_{args.dtype}", text, {"args": vars(args), "medians": med,
                                                                  "effective_sparsity": eff})


# ------------------------------------------------------------------------------------------ HunyuanVideo-1.5
TEXT_15 = 1000 + 256 + 729  # Qwen2.5-VL + ByT5 + SigLIP text-side tokens of the pipelines
TOKENS_480P = 31 * 30 * 53  # 480 x 848 x 121: (121 - 1) / 4 + 1 latent frames, 16x spatial, patch 1


def _one_15_call(args) -> dict:
    """(in a fresh process) one HunyuanVideo-1.5 attention call: allocator peak and RSS increase."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    from torch.profiler import ProfilerActivity, profile

    from lite_boost.models.hunyuan_video import HunyuanVideo15JointProcessor

    dtype = DTYPES[args.dtype]
    dim = args.heads * args.head_dim
    torch.manual_seed(0)
    attn = Attention(query_dim=dim, cross_attention_dim=None, added_kv_proj_dim=dim, dim_head=args.head_dim,
                     heads=args.heads, out_dim=dim, context_pre_only=False, bias=True, qk_norm="rms_norm",
                     eps=1e-6).to(dtype).eval()
    proc = HunyuanVideo15AttnProcessor2_0() if args.variant == "stock" else HunyuanVideo15JointProcessor(0, "joint")
    proc.text_first = False
    g = torch.Generator().manual_seed(0)
    image = torch.randn(1, args.tokens_one, dim, generator=g).to(dtype)
    text = torch.randn(1, TEXT_15, dim, generator=g).to(dtype)
    mask = torch.zeros(1, TEXT_15, dtype=dtype)
    mask[0, :args.valid] = 1  # the model puts the real text tokens first
    with torch.no_grad():
        proc(attn, image[:, :64], text, mask)  # warm-up at a small size (kernels, allocator)
        rss0 = _rss_bytes()
        peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            t0 = time.perf_counter()
            proc(attn, image, text, mask)
            seconds = time.perf_counter() - t0
        peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.nbytes())
    live = top = 0
    for _, n in events:
        live += n
        top = max(top, live)
    return {"variant": args.variant, "tokens": args.tokens_one, "allocator_peak": top,
            "rss_peak_increase": max(0, peak1 - max(rss0, peak0)), "seconds": seconds}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fit_15(results, s480: int) -> str:
    """Exact fit of each variant's allocator peak over S = video + text tokens (bytes = a + b S + c S^2,
    through three measured token counts), evaluated at 480p; '' with fewer than three counts."""
    lines = []
    for variant in ("stock", "lite_boost"):
        rows = sorted((r["tokens"] + TEXT_15, r["allocator_peak"]) for r in results
                      if r["variant"] == variant and "allocator_peak" in r)
        if len(rows) < 3:
            return ""
        (x0, y0), (x1, y1), (x2, y2) = rows[0], rows[len(rows) // 2], rows[-1]
        c = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)  # divided differences
        b = (y1 - y0) / (x1 - x0) - c * (x0 + x1)
        a = y0 - b * x0 - c * x0 * x0
        lines.append(f"{variant}: {a / 2**20:.1f} MiB + {b:,.0f} S + {c:.2f} S^2 bytes -> "
                     f"{(a + b * s480 + c * s480 * s480) / 2**30:.2f} GiB at S = {s480:,}")
    return ("\n\nFit of the allocator peak through the measured rows (S = video + text tokens), evaluated at "
            "480p: " + "; ".join(lines) + ".")


def bench_hunyuan_video_15_memory(args) -> None:
    results = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        for variant in ("stock", "lite_boost"):
            cmd = [sys.executable, __file__, "_hunyuan-video-1.5-one", "--variant", variant, "--tokens-one",
                   str(tokens), "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
                   "--valid", str(args.valid), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{variant} at {tokens} tokens failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
                results.append({"variant": variant, "tokens": tokens, "failed": proc.returncode})
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(res)
            print(res, flush=True)
    esize = DTYPES[args.dtype].itemsize
    rows = []
    by = {(r["variant"], r["tokens"]): r for r in results}
    for tokens in sorted({r["tokens"] for r in results}):
        s = tokens + TEXT_15
        st, lb = by.get(("stock", tokens), {}), by.get(("lite_boost", tokens), {})
        if "allocator_peak" not in st or "allocator_peak" not in lb:
            continue
        rows.append((f"{tokens:,} + {TEXT_15:,}", f"{st['allocator_peak'] / 2**30:.2f} GiB",
                     f"{lb['allocator_peak'] / 2**30:.3f} GiB", f"{st['rss_peak_increase'] / 2**30:.2f} GiB",
                     f"{lb['rss_peak_increase'] / 2**30:.3f} GiB", f"{(2 + esize) * s * s / 2**30:.2f} GiB",
                     f"{st['seconds']:.1f} / {lb['seconds']:.1f} s"))
    s480 = TOKENS_480P + TEXT_15
    fit = _fit_15(results, s480)
    text = (f"## HunyuanVideo-1.5: peak memory of one attention call\n\n"
            f"{args.heads} heads x {args.head_dim}, {args.dtype}, batch 1, text side {TEXT_15:,} tokens "
            f"(1000 Qwen + 256 ByT5 + 729 SigLIP, {args.valid} real), each variant in a fresh process after a small "
            f"warm-up call. Allocator peak: the most bytes the CPU allocator held during the call (torch.profiler "
            f"memory events), inputs and weights excluded; RSS: the peak resident-set increase. Stock builds two "
            f"(B, 1, S, S) bool masks (the repeated mask and the `&` result) and SDPA converts the boolean mask to a "
            f"{args.dtype} additive one: (2 + {esize}) bytes x S^2.\n{_environment(args.threads)}\n\n"
            + _table(("video + text tokens", "stock allocator peak", "lite_boost allocator peak", "stock RSS increase",
                      "lite_boost RSS increase", "(2 + e) S^2 mask bytes", "time stock / lite_boost"), rows)
            + f"\n\nAt 480p (480 x 848 x 121 -> {TOKENS_480P:,} video tokens + {TEXT_15:,} = {s480:,}) the dense mask "
              f"alone is (2 + {esize}) x {s480:,}^2 bytes = {(2 + esize) * s480 * s480 / 2**30:.1f} GiB per attention "
              f"call in {args.dtype} (one {s480:,}^2 bool mask = {s480 * s480 / 2**30:.2f} GiB), extrapolated "
              "analytically from the measured rows; the key-padding mask is (B, T) bools." + fit)
    write(f"families_hunyuan_video15_memory_{args.dtype}", text, {"args": vars(args), "results": results})


BENCHES = {"hunyuan-video": bench_hunyuan_video, "hunyuan-video-sparse": bench_hunyuan_video_sparse,
           "hunyuan-video-1.5-memory": bench_hunyuan_video_15_memory}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="?", choices=[*BENCHES, "_hunyuan-video-1.5-one"])
    ap.add_argument("--family", choices=list(BENCHES), help="the benchmark (same as the positional name)")
    ap.add_argument("--grid", default="5,30,40", help="video token grid frames,height,width (after patching)")
    ap.add_argument("--heads", type=int, default=None, help="default: the released model's (24; 1.5: 16)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--text", type=int, default=256, help="text tokens (HunyuanVideo pads to 256)")
    ap.add_argument("--valid", type=int, default=None, help="real text tokens (default 120; 1.5: 200)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", action="store_true", help="also time the whole blocks (MLPs included)")
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--tokens", default="4096,8192,16384", help="1.5 memory: video token counts")
    ap.add_argument("--variant", choices=["stock", "lite_boost"], default="stock")
    ap.add_argument("--tokens-one", type=int, default=4096)
    args = ap.parse_args(argv)
    args.bench = args.bench or args.family
    if args.bench is None:
        ap.error(f"name a benchmark: --family one of {list(BENCHES)}")
    fifteen = "1.5" in args.bench
    args.heads = args.heads or (16 if fifteen else 24)
    args.valid = args.valid if args.valid is not None else (200 if fifteen else 120)
    torch.set_num_threads(args.threads)
    if args.bench == "_hunyuan-video-1.5-one":
        print(json.dumps(_one_15_call(args)))
        return
    BENCHES[args.bench](args)


if __name__ == "__main__":
    main()
