"""Quality of rf_v2 block-sparse attention on structured, video-like inputs.

    python benchmarks/bench_sparse_quality.py           # grid 9x30x52 (14,040 tokens), 2 seeds
    python benchmarks/bench_sparse_quality.py --quick   # grid 5x16x24, 1 seed

i.i.d. noise gives nearly uniform attention (any mask looks fine), so Q/K are built on the
(t, h, w) grid from smooth random fields (trilinear upsampling of coarse noise), plus a shared
offset vector added to Q and K before 3-D RoPE (the offset's RoPE term is a relative-position
bias: nearby tokens attend to each other), plus first-frame "sink" keys aligned with the mean query.
V is a smooth field too. For sparsity 0.5 / 0.8 / 0.9 and each token order (raster, the
reference 8x8 spatial windows, our (t, h, w) windows) the table reports, against dense attention:
per-token output cosine similarity (mean and worst 1%), relative L1 error and attention-mass recall
(fraction of the dense softmax mass inside the kept blocks). Defaults: block 128, keep_sink and
keep_recent on. Writes benchmarks/results/sparse_quality.{md,json}.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench_sparse_common import environment, markdown_table, write

from lite_boost.ops import rain_fusion as rf
from lite_boost.ops._sparse_layout import token_order
from lite_boost.ops._sparse_mask import forced_blocks
from lite_boost.ops.sparse import sparse_attention

ORDERS = [("raster", "raster"), ("reference 8x8", None), ("ours (2,8,8)", (2, 8, 8)), ("ours (4,4,8)", (4, 4, 8)),
          ("ours (1,8,16)", (1, 8, 16))]


def _field(gen, ch, grid, coarse=(2, 4, 4)):
    t, h, w = grid
    size = (max(2, t // coarse[0] + 1), h // coarse[1] + 1, w // coarse[2] + 1)
    x = torch.randn(1, ch, *size, generator=gen)
    x = F.interpolate(x, size=grid, mode="trilinear", align_corners=True)[0]
    return x.reshape(ch, -1).t()  # (S, ch)


def _rope(x, grid, theta=10000.0):
    """3-D RoPE on interleaved pairs, Wan's channel split (t gets the rest, h = w = 2 * (D // 6))."""
    s, n, d = x.shape
    dh = 2 * (d // 6)
    dt = d - 2 * dh
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1).view(-1, 3)
    angles = []
    for axis, dim in enumerate((dt, dh, dh)):
        freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles.append(pos[:, axis:axis + 1].double() * freqs)
    ang = torch.cat(angles, 1).float()  # (S, D/2)
    xc = torch.view_as_complex(x.float().reshape(s, n, d // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    return torch.view_as_real(xc * rot).reshape(s, n, d)


def structured_qkv(grid, heads, d, seed, noise=0.5, offset=0.5, sink=0.3, temperature=12.0):
    """Q and K share one smooth field (so q(x).k(y) is high for nearby x, y), plus independent noise,
    a shared offset, 3-D RoPE and first-frame sink keys; V is another smooth field. BNSD tensors."""
    gen = torch.Generator().manual_seed(seed)
    s = math.prod(grid)
    base = _field(gen, heads * d, grid).view(s, heads, d)
    base = base / base.std()
    q = base + noise * torch.randn(s, heads, d, generator=gen)
    k = base + noise * torch.randn(s, heads, d, generator=gen)
    v = _field(gen, heads * d, grid).view(s, heads, d)
    c = torch.randn(1, heads, d, generator=gen)
    q, k = q + offset * c, k + offset * c
    q, k = _rope(q, grid), _rope(k, grid)
    q = q * temperature / q.norm(dim=-1, keepdim=True).mean()
    k = k * math.sqrt(d) / k.norm(dim=-1, keepdim=True).mean()
    f0 = grid[1] * grid[2]
    qdir = q.mean(0, keepdim=True)
    k[:f0] += sink * math.sqrt(d) * qdir / qdir.norm(dim=-1, keepdim=True)
    return tuple(t.transpose(0, 1)[None].contiguous() for t in (q, k, v))  # BNSD


def _normalise(q, k, d, temperature):
    q = q * temperature / q.norm(dim=-1, keepdim=True).mean()
    k = k * math.sqrt(d) / k.norm(dim=-1, keepdim=True).mean()
    return q, k


def _bnsd(*ts):
    return tuple(t.transpose(0, 1)[None].contiguous() for t in ts)


def objects_qkv(grid, heads, d, seed, temperature=12.0, n_objects=6, speed=3.0, noise=0.5, offset=0.3):
    """Sharp object boundaries with fast motion: a label map of ``n_objects`` ellipses moving
    ``speed`` tokens per frame (wrapping around) over a background; Q and K share one embedding per
    label (a token attends to its own object wherever it is in space and time), plus noise, a weak
    shared offset and 3-D RoPE (a mild preference for nearby tokens). No sink. BNSD tensors."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    s = math.prod(grid)
    yy, xx = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    labels = torch.zeros(t, h, w, dtype=torch.long)
    for o in range(1, n_objects + 1):
        cy, cx = float(torch.rand(1, generator=gen)) * h, float(torch.rand(1, generator=gen)) * w
        ry, rx = (0.12 + 0.2 * torch.rand(2, generator=gen)) * torch.tensor([h, w]).float()
        ang = float(torch.rand(1, generator=gen)) * 2 * math.pi
        vy, vx = speed * math.sin(ang), speed * math.cos(ang)
        for f in range(t):
            dy = (yy - cy - vy * f + h / 2) % h - h / 2
            dx = (xx - cx - vx * f + w / 2) % w - w / 2
            labels[f][(dy / ry) ** 2 + (dx / rx) ** 2 <= 1] = o
    emb = torch.randn(n_objects + 1, heads, d, generator=gen)
    base = emb[labels.view(-1)]
    q = base + noise * torch.randn(s, heads, d, generator=gen)
    k = base + noise * torch.randn(s, heads, d, generator=gen)
    v = _field(gen, heads * d, grid).view(s, heads, d) + 0.5 * emb[labels.view(-1)]
    c = torch.randn(1, heads, d, generator=gen)
    q, k = _rope(q + offset * c, grid), _rope(k + offset * c, grid)
    q, k = _normalise(q, k, d, temperature)
    return _bnsd(q, k, v)


def pan_qkv(grid, heads, d, seed, temperature=12.0, pan=2.0, n_sinks=4, sink_tokens=6, sink=0.6, noise=0.5):
    """A camera pan with attention mostly local in time and a few small scattered sinks: content is
    one wide smooth texture that slides ``pan`` tokens per frame; a temporal code in a quarter of
    the channels (sum of cosines of the frame distance) makes Q.K fall off with the frame gap; and
    ``n_sinks`` compact groups of ``sink_tokens`` key tokens at random places in space and time
    (not frame 0) carry a component along the mean query (registers / sinks that a 128-token block
    mean dilutes). No 3-D RoPE. BNSD tensors."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = grid
    s = math.prod(grid)
    wide = int(w + pan * t) + 2
    tex = _field(gen, heads * d, (2, h, wide), coarse=(1, 3, 3)).view(2, h, wide, heads, d)[0]
    xs = (torch.arange(w)[None, :] + (pan * torch.arange(t)).long()[:, None])  # (t, w)
    content = tex[:, xs].permute(1, 0, 2, 3, 4).reshape(s, heads, d)  # (t, h, w) order
    content = content / content.std()
    dt = d // 4
    frame = torch.arange(t).repeat_interleave(h * w).double()
    freqs = torch.linspace(0.05, 1.2, dt // 2, dtype=torch.float64)
    code = torch.cat([torch.cos(frame[:, None] * freqs), torch.sin(frame[:, None] * freqs)], 1).float()
    code = code[:, None, :].expand(s, heads, dt) * 1.5
    q = content + noise * torch.randn(s, heads, d, generator=gen)
    k = content + noise * torch.randn(s, heads, d, generator=gen)
    q[..., d - dt:] += code
    k[..., d - dt:] += code
    v = _field(gen, heads * d, grid).view(s, heads, d)
    q, k = _normalise(q, k, d, temperature)
    qdir = q.mean(0, keepdim=True)
    qdir = qdir / qdir.norm(dim=-1, keepdim=True)
    for _ in range(n_sinks):
        f = 1 + int(torch.randint(max(1, t - 1), (1,), generator=gen))
        y, x = int(torch.randint(h, (1,), generator=gen)), int(torch.randint(max(1, w - sink_tokens), (1,), generator=gen))
        i0 = (min(f, t - 1) * h + y) * w + x
        k[i0:i0 + sink_tokens] += sink * math.sqrt(d) * 3 * qdir
    return _bnsd(q, k, v)


def smooth_qkv(grid, heads, d, seed, temperature=12.0):
    return structured_qkv(grid, heads, d, seed, temperature=temperature)


GENERATORS = {"smooth": smooth_qkv, "objects": objects_qkv, "pan": pan_qkv}


def recall(q, k, stats, grid, window, block, chunk=1024, forced=None):
    """(recall, oracle recall[, forced-oracle recall]), means over query tokens.

    recall: dense softmax mass inside the kept blocks. oracle: the mass an ideal selector would keep
    with the same number of blocks per query block (top blocks by true aggregated mass), so
    recall / oracle measures the selector and the oracle itself measures how concentrated the
    attention is in this token order. With ``forced`` ((nkb,) bool forced key blocks, diagonal
    included per row when keep_recent): also the best possible selection that keeps the forced
    blocks and the same number of blocks per query block (what any selector can reach under the
    forced-block rule).
    """
    b, n, s, d = q.shape
    order = token_order(grid, window, 0)
    blk = order.inv // block  # input token -> block in the reordered sequence
    nqb, nkb = stats.q_blocks, stats.kv_blocks
    sel = torch.zeros(nqb, n, nkb + 1, dtype=torch.bool)
    si, sn = stats.selection.select_idx, stats.selection.select_num
    valid = torch.arange(si.shape[-1]) < sn[..., None]
    sel.scatter_(2, torch.where(valid, si, torch.full_like(si, nkb)), True)
    sel = sel[..., :nkb]
    total = oracle = oracle_forced = 0.0
    for h in range(n):
        qb_mass = torch.zeros(nqb, nkb, dtype=torch.float64)
        for i0 in range(0, s, chunk):
            p = torch.softmax(q[0, h, i0:i0 + chunk] @ k[0, h].t() * d ** -0.5, -1)
            mass = torch.zeros(p.shape[0], nkb).index_add_(1, blk, p)
            total += float((mass * sel[blk[i0:i0 + chunk], h].float()).sum())
            qb_mass.index_add_(0, blk[i0:i0 + chunk], mass.double())
        sorted_mass = qb_mass.sort(dim=1, descending=True).values.cumsum(1)
        keep = sn[:, h].clamp(1, nkb).long() - 1
        oracle += float(sorted_mass.gather(1, keep[:, None]).sum())
        if forced is not None:
            f = forced.expand(nqb, nkb)
            free = qb_mass.masked_fill(f, -1.0).sort(dim=1, descending=True).values.clamp_min(0).cumsum(1)
            n_free = (sn[:, h].long() - f.sum(1)).clamp_min(0)
            best_free = torch.where(n_free > 0, free.gather(1, (n_free - 1).clamp_min(0)[:, None])[:, 0], 0.0)
            oracle_forced += float((qb_mass * f).sum() + best_free.sum())
    out = (total / (n * s), oracle / (n * s))
    return out + (oracle_forced / (n * s),) if forced is not None else out


def forced_mask(grid, window, block, keep_sink=True, keep_recent=True):
    """(nqb, nkb) bool: the blocks sparse_attention forces for a self-attention call on ``grid``."""
    o = token_order(grid, window, 0)
    nb = -(-math.prod(grid) // block)
    cols = forced_blocks(o.is_sink if keep_sink else torch.zeros_like(o.is_sink), block)
    f = cols[None, :].expand(nb, nb).clone()
    if keep_recent:
        f[torch.arange(nb), torch.arange(nb)] = True
    return f


class _NoKernel:
    """Context: sparse_attention builds its mask but skips the kernel (density search only)."""

    def __enter__(self):
        self._orig = rf._dispatch
        rf._dispatch = lambda q, k, v, si, sn, problem, lse, backend: (q.new_zeros(q.shape), None, "skipped")

    def __exit__(self, *exc):
        rf._dispatch = self._orig


def match_density(q, k, grid, window, block, target_eff, heads, selector, budget="reference"):
    """Largest kept density of ``selector`` not above 1 - target_eff (never more compute than the
    baseline): returns the sparsity to use, or None. Bisection over the blocks kept per row (the
    kept set only grows with it: top-k by a stable sort plus fixed forced blocks)."""
    nkb = -(-q.shape[2] // block)

    def spars(keep):
        return 1.0 - (keep - 0.5) / nkb  # ceil((1 - spars) * nkb) == keep

    def fits(keep):
        _, st = sparse_attention(q, k, q, head_num=heads, sparse_type="rf_v2", block_size=block,
                                 latent_shape_q=grid, sparsity=spars(keep), window=window, return_stats=True,
                                 selector=selector, budget=budget)
        return st.effective_sparsity + 1e-12 >= target_eff

    with _NoKernel():
        if not fits(1):
            return None
        lo, hi = 1, nkb - 1  # fits(lo); keep = nkb would be the dense path
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return spars(lo)


def compare_selectors(grid, heads, d, seeds, generators, temperatures, sparsity=0.8, block=128, window=None):
    """Reference selector at ``sparsity`` vs "subblock" at the same or lower kept density."""
    rows, data = [], []
    forced = forced_mask(grid, window, block)
    for gen_name in generators:
        for temp in temperatures:
            acc = {}
            for seed in seeds:
                q, k, v = GENERATORS[gen_name](grid, heads, d, seed, temperature=temp)
                dense = F.scaled_dot_product_attention(q, k, v)
                runs = {}
                for label, selector, budget in (("reference", "reference", "reference"),
                                                ("subblock", "subblock", "reference"),
                                                ("reference, total", "reference", "total"),
                                                ("subblock, total", "subblock", "total")):
                    spars = sparsity
                    if label == "subblock":  # equal compute: match the reference's kept density
                        spars = match_density(q, k, grid, window, block, runs["reference"]["eff"], heads, selector)
                        if spars is None:  # even one free block per row is denser than the reference
                            runs[label] = {key: float("nan") for key in runs["reference"]}
                            continue
                    out, st = sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=block,
                                               latent_shape_q=grid, sparsity=spars, window=window,
                                               return_stats=True, selector=selector, budget=budget)
                    cos = F.cosine_similarity(out.double(), dense.double(), dim=-1).flatten()
                    r, o, of = recall(q, k, st, grid, window, block, forced=forced)
                    runs[label] = dict(eff=st.effective_sparsity, sparsity=spars, cos=float(cos.mean()),
                                       cos_p1=float(torch.quantile(cos, 0.01)), recall=r, oracle=o, oracle_forced=of)
                for label, m in runs.items():
                    for key, val in m.items():
                        acc.setdefault(label, {}).setdefault(key, []).append(val)
            mean = {lab: {key: sum(v) / len(v) for key, v in m.items()} for lab, m in acc.items()}
            for budget_tag, ref_l, new_l in (("reference", "reference", "subblock"),
                                             ("total", "reference, total", "subblock, total")):
                r, n_ = mean[ref_l], mean[new_l]
                gap = (n_["recall"] - r["recall"]) / max(1e-9, r["oracle"] - r["recall"])
                gap_f = (n_["recall"] - r["recall"]) / max(1e-9, r["oracle_forced"] - r["recall"])
                rows.append([gen_name, temp, budget_tag, f"{r['eff']:.3f} / {n_['eff']:.3f}",
                             f"{r['cos']:.4f} / **{n_['cos']:.4f}**", f"{r['cos_p1']:.3f} / {n_['cos_p1']:.3f}",
                             f"{r['recall']:.3f} / **{n_['recall']:.3f}**", f"{r['oracle']:.3f}",
                             f"{r['oracle_forced']:.3f}", f"{gap:.0%}", f"{gap_f:.0%}"])
                print(rows[-1], flush=True)
            data.append(dict(generator=gen_name, temperature=temp, grid=grid, seeds=list(seeds), runs=mean))
    return rows, data


def run(grid, heads, d, seeds, sparsities, block=128, temperatures=(12.0,)):
    rows, data = [], []
    for temp in temperatures:
        for sp in sparsities:
            for name, window in ORDERS:
                if window not in ("raster", None) and math.prod(window) != block:
                    continue
                acc = {"cos": [], "cos_p1": [], "l1": [], "recall": [], "oracle": [], "eff": []}
                for seed in seeds:
                    q, k, v = structured_qkv(grid, heads, d, seed, temperature=temp)
                    dense = F.scaled_dot_product_attention(q, k, v)
                    out, stats = sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=block,
                                                  latent_shape_q=grid, sparsity=sp, window=window, return_stats=True)
                    # default selector ("subblock") and budget ("reference")
                    cos = F.cosine_similarity(out.double(), dense.double(), dim=-1).flatten()
                    acc["cos"].append(float(cos.mean()))
                    acc["cos_p1"].append(float(torch.quantile(cos, 0.01)))
                    acc["l1"].append(float((out - dense).abs().sum() / dense.abs().sum()))
                    r, o = recall(q, k, stats, grid, window, block)
                    acc["recall"].append(r)
                    acc["oracle"].append(o)
                    acc["eff"].append(stats.effective_sparsity)
                m = {key: sum(vals) / len(vals) for key, vals in acc.items()}
                data.append(dict(grid=grid, temperature=temp, sparsity=sp, order=name, window=window, **m,
                                 seeds=list(seeds)))
                rows.append([temp, sp, name, f"{m['eff']:.3f}", f"{m['cos']:.4f}", f"{m['cos_p1']:.4f}",
                             f"{m['l1']:.4f}", f"{m['recall']:.4f}", f"{m['oracle']:.4f}"])
                print(rows[-1], flush=True)
    return rows, data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=("selectors", "orders"), default="selectors",
                    help="selectors: reference vs subblock at equal kept density on every generator; "
                         "orders: token orders x sparsities with the default selector")
    ap.add_argument("--generators", default=",".join(GENERATORS), help=f"comma list of {list(GENERATORS)}")
    ap.add_argument("--temperatures", default="12,24,36",
                    help="comma list of query-norm temperatures (attention concentration)")
    ap.add_argument("--sparsities", default="0.5,0.8,0.9", help="orders mode")
    ap.add_argument("--name", default=None, help="results file stem")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grid, seeds = ((5, 16, 24), [0]) if args.quick else ((9, 30, 52), [0, 1])
    heads, d = 2, 64
    temps = [float(x) for x in args.temperatures.split(",")]
    suffix = "_quick" if args.quick else ""
    setup = (f"{environment()}; grid {grid} ({math.prod(grid)} tokens), {heads} heads, D={d}, block 128, "
             f"keep_sink/keep_recent on, mean over seeds {seeds}. temperature = mean query norm with |k| = sqrt(D), "
             f"i.e. the logit scale: higher means more concentrated attention.")
    if args.mode == "orders":
        rows, data = run(grid, heads, d, seeds, [float(x) for x in args.sparsities.split(",")], temperatures=temps)
        headers = ["temperature", "sparsity", "token order", "effective sparsity", "cosine (mean)",
                   "cosine (worst 1%)", "rel L1", "attention-mass recall", "oracle recall (same block budget)"]
        text = (f"### rf_v2 quality vs dense attention on structured inputs (token orders)\n\n{setup} Default "
                f"selector and budget. The oracle column is the mass the best possible block selector would keep "
                f"with the same number of blocks per query block (true top blocks).\n\n"
                + markdown_table(headers, rows))
        write(args.name or f"sparse_quality{suffix}", text, data)
        return
    gens = args.generators.split(",")
    rows, data = compare_selectors(grid, heads, d, seeds, gens, temps)
    headers = ["generator", "temperature", "budget", "effective sparsity ref / ours", "cosine ref / ours",
               "cosine worst 1% ref / ours", "recall ref / ours", "oracle", "oracle with forced blocks",
               "gap to oracle closed", "gap to forced oracle closed"]
    text = (f"### Block selectors at equal kept density: RainFusion 2.0 mean pooling vs subblock\n\n{setup} "
            f"Reference-order tokens (window=None). budget 'reference': the reference selector runs at sparsity "
            f"0.8 (forced blocks on top) and ours at the sparsity that keeps the most blocks without exceeding "
            f"the reference's kept density (never more compute); budget 'total': both at sparsity 0.8 with the "
            f"forced blocks inside the budget, so exactly the same blocks per row. recall = dense softmax mass "
            f"inside the kept blocks; oracle = the true top blocks with the reference's count per query block; "
            f"oracle with forced blocks = the forced blocks plus the true top free blocks, the same count (the "
            f"best any selector can do under the forced-block rule). gap closed = (ours - ref) / (oracle - ref)."
            f"\n\n" + markdown_table(headers, rows))
    write(args.name or f"sparse_selectors{suffix}", text, data)


if __name__ == "__main__":
    main()
