"""The main job's two runs (stock, then boosted with the CLI's default config), interleaved in one process.

    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_main_job.py [--rounds 2] [--threads 2]

``lite-boost generate`` runs stock once and boosted once, one after the other, so on a shared machine
a change of load between them shows as a speed-up or a slow-down. This script builds the same
pipelines (built-in tiny Wan, ``DEMO_*`` defaults, the config ``lite-boost generate`` would use) and
alternates whole calls (text encode, denoising loop, VAE decode; decoded video), each pipeline warmed
up once with a 1-step call as the command does, and prints the per-phase medians, their ratios, the
loop's share of a call, and the video PSNR boosted vs stock (peak = the stock video's value range).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    import lite_boost
    from lite_boost.cli import _boost_config, build_parser, video_psnr
    from lite_boost.demo import (DEMO_NEGATIVE_PROMPT, DEMO_PROMPT, DEMO_SHAPE, DEMO_SPEC, DEMO_STEPS,
                                 DEMO_VAE_BASE_DIM, tiny_wan_pipeline)
    from lite_boost.timing import PhaseTimer

    load0 = os.getloadavg()
    config = _boost_config(build_parser().parse_args(["generate"]))
    pipes = {"stock": tiny_wan_pipeline("t2v", spec=DEMO_SPEC, vae_base_dim=DEMO_VAE_BASE_DIM),
             "boosted": lite_boost.boost(tiny_wan_pipeline("t2v", spec=DEMO_SPEC, vae_base_dim=DEMO_VAE_BASE_DIM),
                                         config)}
    h, w, f = DEMO_SHAPE
    kw = dict(prompt=DEMO_PROMPT, negative_prompt=DEMO_NEGATIVE_PROMPT, height=h, width=w, num_frames=f,
              num_inference_steps=DEMO_STEPS, guidance_scale=5.0, output_type="np")
    for p in pipes.values():
        with torch.inference_mode():
            p(**{**kw, "num_inference_steps": 1, "output_type": "latent"}, generator=torch.Generator().manual_seed(0))
    times = {n: [] for n in pipes}
    videos = {}
    for _ in range(args.rounds):
        for name, p in pipes.items():
            with torch.inference_mode(), PhaseTimer(p) as timer:
                videos[name] = p(**kw, generator=torch.Generator().manual_seed(0),
                                 callback_on_step_end=timer.callback).frames
            times[name].append(timer.times)
            t = timer.times
            print(f"{name}: step {t.step_median_s:.3f} s, loop {t.denoise_s:.2f} s, VAE {t.vae_decode_s:.2f} s, "
                  f"call {t.total_s:.2f} s", flush=True)
    psnr, peak, diff = video_psnr(videos["boosted"], videos["stock"])
    tokens = ((f - 1) // 4 + 1) * (h // 8 // DEMO_SPEC.patch_size[1]) * (w // 8 // DEMO_SPEC.patch_size[2])
    print(f"\n{h}x{w}, {f} frames, {tokens:,} tokens, {DEMO_STEPS} steps, float32, {args.threads} threads, "
          f"medians of {args.rounds} interleaved calls; load {load0[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| phase | stock | boosted | speed-up |\n|---|---:|---:|---:|")
    med = {n: {k: statistics.median(getattr(t, k) for t in ts)
               for k in ("step_median_s", "denoise_s", "vae_decode_s", "total_s")} for n, ts in times.items()}
    for label, k in (("denoise per step", "step_median_s"), ("denoise total", "denoise_s"),
                     ("VAE decode (not boosted)", "vae_decode_s"), ("total call", "total_s")):
        s, b = med["stock"][k], med["boosted"][k]
        print(f"| {label} | {s:.3f} s | {b:.3f} s | {'-' if 'not boosted' in label else f'{s / b:.2f}x'} |")
    share = {n: med[n]["denoise_s"] / med[n]["total_s"] for n in med}
    print(f"\nloop share of a call: stock {share['stock']:.0%}, boosted {share['boosted']:.0%}; "
          f"video PSNR boosted vs stock {psnr:.1f} dB (peak {peak:.3f}), max |diff| {diff:.3f}")


if __name__ == "__main__":
    main()
