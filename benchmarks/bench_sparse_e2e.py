"""End to end: a tiny random-weight Wan T2V pipeline, stock vs boosted with sparse self-attention.

    python benchmarks/bench_sparse_e2e.py           # 480x832, 41 frames (grid 11x30x52 = 17,160 tokens), 6 steps
    python benchmarks/bench_sparse_e2e.py --quick   # 240x416, 9 frames, 3 steps

The transformer is tiny (2 layers, 1 head of 128 channels, small FFN) so self-attention dominates
the denoising loop, as in the real model at 480p. Compared: stock diffusers, and boosted with
``SparseConfig(sparsity=s, selector=sel)`` for each ``--variants`` entry ``sel:s``
(library defaults otherwise: reference 8x8 token order, forced blocks on top of the top-k, no dense
steps). Timed: the denoising loop (``output_type="latent"``: text encoder + transformer, what
sparse attention changes), medians of interleaved runs after a warm-up; the VAE decode is timed
once separately. PSNR: decoded video of each variant vs stock (random weights make it a
consistency measure, not a visual-quality one). Writes benchmarks/results/sparse_e2e.{md,json,png}
(PSNR vs speed-up, one line per selector).
"""

import argparse
import math

import numpy as np
import torch

from bench_sparse_common import environment, markdown_table, median, timed, write

import lite_boost
from lite_boost import BoostConfig, SparseConfig
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline


def psnr(a, b):
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def decode(pipe, latents):
    """The pipeline's own decode step (WanPipeline.__call__ after the loop), for the PSNR."""
    vae = pipe.vae
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents)
    with torch.no_grad():
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type="np")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="subblock:0.5,subblock:0.7,subblock:0.8,subblock:0.9,reference:0.8",
                    help="comma list of selector:sparsity")
    ap.add_argument("--lock", default=None,
                    help="hold an exclusive flock on this file during the warm-up and the timed runs only "
                         "(the decode for the PSNR runs after it is released)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, w, frames, steps = (240, 416, 9, 3) if args.quick else (480, 832, 41, 6)
    pipe = tiny_wan_pipeline(spec=TinyWanSpec(heads=1, head_dim=128, layers=2, ffn_dim=64))
    call = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", height=h, width=w,
                num_frames=frames, guidance_scale=5.0, output_type="latent")
    variants = {"stock": None}
    for item in args.variants.split(","):
        sel, sp = item.split(":")
        variants[f"{sel} {float(sp)}"] = SparseConfig(sparsity=float(sp), selector=sel)

    def use(cfg):
        if cfg is None:
            lite_boost.unboost(pipe)
        else:
            lite_boost.boost(pipe, BoostConfig(sparse=cfg))

    lock = None
    if args.lock:
        import fcntl

        lock = open(args.lock, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        print("lock acquired", flush=True)
    for cfg in list(variants.values())[:2]:  # warm-up (a compiled kernel compiles for this shape)
        use(cfg)
        pipe(**call, num_inference_steps=1, generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in variants}
    lat, eff, backends = {}, {}, {}
    for _ in range(args.reps):
        for name, cfg in variants.items():
            use(cfg)
            t, out = timed(lambda: pipe(**call, num_inference_steps=steps,
                                        generator=torch.Generator().manual_seed(0)).frames)
            times[name].append(t)
            lat[name] = out
            if cfg is not None:
                state = pipe.transformer._lite_boost.extras["sparse"]
                eff[name] = state.mean_effective_sparsity()
                backends[name] = sorted({e.backend for e in state.events if e.backend})
            print(name, f"{t:.2f}s", flush=True)
    lite_boost.unboost(pipe)
    if lock is not None:
        lock.close()  # releases the flock
    decode_s, ref_video = timed(lambda: decode(pipe, lat["stock"]))
    grid = (1 + (frames - 1) // 4, h // 16, w // 16)
    base = median(times["stock"])
    rows, data = [], []
    for name in variants:
        m = median(times[name])
        p = psnr(decode(pipe, lat[name]), ref_video) if name != "stock" else float("inf")
        rows.append([name, f"{m:.2f}", f"{base / m:.2f}x", "inf" if math.isinf(p) else f"{p:.1f}",
                     f"{eff.get(name, 0.0):.3f}"])
        data.append(dict(variant=name, seconds=times[name], median=m, speedup=base / m, psnr=p,
                         effective_sparsity=eff.get(name, 0.0), backends=backends.get(name, [])))
    used = sorted({b for bs in backends.values() for b in bs})
    text = (f"### End to end: tiny Wan T2V pipeline, stock vs sparse self-attention\n\n{environment()}; "
            f"{h}x{w}, {frames} frames (token grid {grid}, {math.prod(grid)} tokens), {steps} steps with CFG, "
            f"transformer 2 layers x 1 head x 128; denoising loop timed (output_type='latent'), medians of "
            f"{args.reps} interleaved runs after a warm-up; VAE decode (not affected) {decode_s:.1f} s once; "
            f"block-sparse kernel: {', '.join(used) or 'none'}.\n\n"
            + markdown_table(["variant", "denoising s", "speed-up", "video PSNR vs stock (dB)",
                              "mean effective sparsity"], rows))
    stem = "sparse_e2e_quick" if args.quick else "sparse_e2e"
    write(stem, text, data)
    plot(data, stem, used)


def plot(data, stem, used):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is optional
        print("matplotlib not installed: no plot")
        return
    from bench_sparse_common import RESULTS

    fig, ax = plt.subplots(figsize=(6, 4))
    groups = {}
    for d in data:
        if d["variant"] == "stock":
            continue
        sel, sp = d["variant"].rsplit(" ", 1)
        groups.setdefault(sel, []).append((d["speedup"], d["psnr"], sp))
    for sel, pts in groups.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"selector={sel!r}")
        for x, y, sp in pts:
            ax.annotate(sp, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("denoising speed-up vs stock")
    ax.set_ylabel("video PSNR vs stock (dB)")
    ax.set_title(f"tiny Wan T2V, 17k tokens, 6 steps + CFG ({', '.join(used)} kernel)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
