"""End to end: a tiny random-weight Wan T2V pipeline, stock vs boosted with sparse self-attention.

    python benchmarks/bench_sparse_e2e.py           # 480x832, 41 frames (grid 11x30x52 = 17,160 tokens), 6 steps
    python benchmarks/bench_sparse_e2e.py --quick   # 240x416, 9 frames, 3 steps

The transformer is tiny (2 layers, 1 head of 128 channels, small FFN) so self-attention dominates
the denoising loop, as in the real model at 480p. Compared: stock diffusers; boosted with
``SparseConfig(sparsity=0.8)`` (library defaults: reference 8x8 token order, no dense steps); and
boosted with a schedule (window (1, 8, 16), dense for the first third of the steps). Timed: the
denoising loop (``output_type="latent"``: text encoder + transformer, what sparse attention
changes), medians of interleaved runs after a warm-up; the VAE decode is timed once separately.
PSNR: decoded video of each variant vs stock (random weights make it a consistency measure, not a
visual-quality one). Writes benchmarks/results/sparse_e2e.{md,json}.
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, w, frames, steps = (240, 416, 9, 3) if args.quick else (480, 832, 41, 6)
    pipe = tiny_wan_pipeline(spec=TinyWanSpec(heads=1, head_dim=128, layers=2, ffn_dim=64))
    call = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", height=h, width=w,
                num_frames=frames, guidance_scale=5.0, output_type="latent")
    dense_first = max(1, round(steps / 3))
    variants = {
        "stock": None,
        "sparse 0.8, defaults": SparseConfig(sparsity=0.8),
        f"sparse 0.8, window (1,8,16), dense first {dense_first}/{steps} steps":
            SparseConfig(sparsity=0.8, window=(1, 8, 16), dense_steps_first=dense_first),
    }

    def use(cfg):
        if cfg is None:
            lite_boost.unboost(pipe)
        else:
            lite_boost.boost(pipe, BoostConfig(sparse=cfg))

    for cfg in variants.values():  # warm-up: FlexAttention compiles for this shape
        use(cfg)
        pipe(**call, num_inference_steps=dense_first + 1, generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in variants}
    lat, eff = {}, {}
    for _ in range(args.reps):
        for name, cfg in variants.items():
            use(cfg)
            t, out = timed(lambda: pipe(**call, num_inference_steps=steps,
                                        generator=torch.Generator().manual_seed(0)).frames)
            times[name].append(t)
            lat[name] = out
            if cfg is not None:
                eff[name] = pipe.transformer._lite_boost.extras["sparse"].mean_effective_sparsity()
            print(name, f"{t:.2f}s", flush=True)
    lite_boost.unboost(pipe)
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
                         effective_sparsity=eff.get(name, 0.0)))
    text = (f"### End to end: tiny Wan T2V pipeline, stock vs sparse self-attention\n\n{environment()}; "
            f"{h}x{w}, {frames} frames (token grid {grid}, {math.prod(grid)} tokens), {steps} steps with CFG, "
            f"transformer 2 layers x 1 head x 128; denoising loop timed (output_type='latent'), medians of "
            f"{args.reps} interleaved runs after a warm-up; VAE decode (not affected) {decode_s:.1f} s once.\n\n"
            + markdown_table(["variant", "denoising s", "speed-up", "video PSNR vs stock (dB)",
                              "mean effective sparsity"], rows))
    write("sparse_e2e_quick" if args.quick else "sparse_e2e", text, data)


if __name__ == "__main__":
    main()
