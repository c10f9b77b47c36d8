"""Train a small Wan-architecture VAE on procedural videos (for the parallel-VAE seam study).

    flock /tmp/lite_boost_cpu.lock python scripts/train_small_wan_vae.py --minutes 9 --threads 2

Long runs on a shared machine go in short segments that resume from a checkpoint (model, optimizer,
data generator, step and training time), so each locked run stays short:

    for i in $(seq 12); do flock /tmp/lite_boost_cpu.lock python scripts/train_small_wan_vae.py \
        --minutes 42 --segment-minutes 3.5 --checkpoint /tmp/vae_train.pt; done

``--minutes`` is the whole training budget (the learning-rate schedule runs over it); each call trains
at most ``--segment-minutes`` of it, saves the checkpoint and writes the weights so far to ``--out``.

The model is diffusers' ``AutoencoderKLWan`` at a reduced width (base_dim 16, dim_mult [1, 2, 2, 2],
one residual block per level, z_dim 16: 8x spatial / 4x temporal compression like Wan2.1's VAE,
0.83 M parameters). The data are generated on the fly (:func:`procedural_video`): a drifting
two-colour gradient with a moving sinusoidal texture and 2-4 shapes (discs, boxes, rings) with
striped or checkered textures, each moving at its own constant velocity and spinning. Loss: L1 + MSE
of the reconstruction from the posterior mode (a sampled posterior does not converge in a few CPU
minutes), plus a small KL term. The weights are written with
``save_pretrained`` (safetensors) to ``tests/data/wan_vae_small`` by default, with a JSON summary
of the run (steps, wall time, held-out reconstruction PSNR).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

SMALL_WAN_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True])


def procedural_video(gen: torch.Generator, frames: int, height: int, width: int) -> torch.Tensor:
    """One video (3, frames, height, width) in [-1, 1] of moving, textured shapes."""

    def u(lo=0.0, hi=1.0, *shape):
        return lo + (hi - lo) * torch.rand(*shape or (1,), generator=gen)

    t = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1)
    yy, xx = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    yy, xx = yy.expand(frames, -1, -1), xx.expand(frames, -1, -1)
    # background: a drifting gradient between two colours and a faint moving texture
    ang = u(0, 2 * math.pi)
    ramp = ((xx - u(-0.3, 0.3) * t) * torch.cos(ang) + yy * torch.sin(ang)) / max(height, width)
    c0, c1 = u(-1, 1, 3).view(3, 1, 1, 1), u(-1, 1, 3).view(3, 1, 1, 1)
    a = ramp.clamp(0, 1).unsqueeze(0)
    video = c0 * (1 - a) + c1 * a
    kx, ky, w = u(0.2, 0.9), u(0.2, 0.9), u(-0.4, 0.4)
    video = video + 0.15 * torch.sin(kx * xx + ky * yy + w * t).unsqueeze(0)
    for _ in range(int(u(2, 5).item())):
        cy, cx = u(0, height), u(0, width)
        vy, vx = u(-1.5, 1.5), u(-1.5, 1.5)
        r = u(3, max(4.0, min(height, width) / 3))
        spin = u(-0.2, 0.2)
        py, px = yy - (cy + vy * t), xx - (cx + vx * t)
        rot = u(0, math.pi) + spin * t
        qy, qx = py * torch.cos(rot) - px * torch.sin(rot), py * torch.sin(rot) + px * torch.cos(rot)
        kind = int(u(0, 3).item())
        if kind == 0:
            mask = (qy ** 2 + qx ** 2) < r ** 2
        elif kind == 1:
            mask = (qy.abs() < r) & (qx.abs() < r * u(0.4, 1.0))
        else:
            d = (qy ** 2 + qx ** 2).sqrt()
            mask = (d < r) & (d > r * 0.5)
        f = u(0.4, 1.5)
        if u().item() < 0.5:
            tex = torch.sin(f * qx) > 0
        else:
            tex = (torch.sin(f * qx) > 0) ^ (torch.sin(f * qy) > 0)
        col_a, col_b = u(-1, 1, 3).view(3, 1, 1, 1), u(-1, 1, 3).view(3, 1, 1, 1)
        shape = torch.where(tex.unsqueeze(0), col_a, col_b)
        video = torch.where(mask.unsqueeze(0), shape, video)
    return video.clamp(-1, 1)


def batch(gen, n, frames, height, width):
    return torch.stack([procedural_video(gen, frames, height, width) for _ in range(n)])


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB for videos in [-1, 1] (peak-to-peak 2)."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """diffusers' frame-by-frame causal decode without the final clamp (which would zero the gradient
    of every saturated pixel and let training drift)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        outs.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                first_chunk=(i == 0)))
    vae.clear_cache()
    return torch.cat(outs, dim=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=9.0, help="wall-clock training budget (all segments)")
    p.add_argument("--segment-minutes", type=float, default=None,
                   help="train at most this long in this call, then checkpoint (default: the whole budget)")
    p.add_argument("--checkpoint", default=None, help="resume from / save to this file (model, optimizer, step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", type=int, default=32, help="training crop height = width (multiple of 8)")
    p.add_argument("--frames", type=int, default=13, help="frames per training clip (4k+1)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kl", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "wan_vae_small"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from diffusers import AutoencoderKLWan

    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(**SMALL_WAN_VAE)
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    held = batch(torch.Generator().manual_seed(12345), 2, 21, args.size, args.size)
    budget = args.minutes * 60
    trained, step, log = 0.0, 0, []
    if args.checkpoint and os.path.exists(args.checkpoint):
        ck = torch.load(args.checkpoint, weights_only=False)
        vae.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        trained, step, log = ck["trained_s"], ck["step"], ck["log"]
        print(f"resumed at step {step}, {trained:.0f}s of {budget:.0f}s trained", flush=True)
    if trained >= budget:
        print("training budget already spent; writing the weights", flush=True)
    segment = budget - trained if args.segment_minutes is None else min(budget - trained, args.segment_minutes * 60)
    t0 = time.monotonic()
    while time.monotonic() - t0 < segment:
        frac = (trained + time.monotonic() - t0) / budget
        for g in opt.param_groups:  # warm-up then cosine decay over the wall-clock budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        x = batch(gen, args.batch, args.frames, args.size, args.size)
        post = vae.encode(x).latent_dist
        z = post.mode()  # deterministic: a sampled posterior drowns the young latents in unit noise
        rec = decode_unclamped(vae, z)
        loss = (rec - x).abs().mean() + (rec - x).pow(2).mean() + args.kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            log.append((step, round(trained + time.monotonic() - t0, 1), round(loss.item(), 4)))
            print(f"step {step} t={trained + time.monotonic() - t0:.0f}s loss={loss.item():.4f}", flush=True)
    trained += time.monotonic() - t0
    if args.checkpoint:
        tmp = args.checkpoint + ".tmp"
        torch.save(dict(model=vae.state_dict(), opt=opt.state_dict(), gen=gen.get_state(), trained_s=trained,
                        step=step, log=log), tmp)
        os.replace(tmp, args.checkpoint)
    vae.eval()
    with torch.no_grad():
        rec = vae.decode(vae.encode(held).latent_dist.mode()).sample
    summary = dict(config=SMALL_WAN_VAE, steps=step, wall_s=round(trained, 1), budget_s=round(budget, 1),
                   done=trained >= budget - 1, threads=args.threads,
                   train_clip=[args.batch, 3, args.frames, args.size, args.size], lr=args.lr, kl=args.kl,
                   heldout_recon_psnr_db=round(psnr(rec, held), 2), heldout_shape=list(held.shape), log=log[-10:])
    os.makedirs(args.out, exist_ok=True)
    vae.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "training.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}))


if __name__ == "__main__":
    main()
