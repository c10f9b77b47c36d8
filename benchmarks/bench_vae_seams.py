"""Seam study of the chunked parallel VAE on the trained small Wan VAE (tests/data/wan_vae_small).

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_vae_seams.py --threads 1

For each overlap (warm-up latent frames before a chunk) and rank count, the chunks of the chunked
mode are replayed in one process with the Wan adapter (exactly what each rank runs) and compared
with the sequential decode / encode of the same VAE:

* decode seam PSNR: the 4 video frames right after each chunk boundary (the worst place: the warm
  cache has forgotten most there), against the sequential decode, dB with peak-to-peak 2;
* decode chunk PSNR: all frames of the non-first chunks;
* encode seam SNR: the first latent frame of each non-first chunk against the sequential encode
  (10 log10 of signal power over error power);
* the VAE's own reconstruction PSNR (sequential decode of the sequential encode vs the input video)
  puts the seam figures in scale: a seam error well below it is invisible next to the codec's own.

Videos: procedural moving textured shapes (scripts/train_small_wan_vae.py), 81 frames (21 latent
frames), held out (seeds never used in training). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)


def snr_db(x, ref):
    err = (x.double() - ref.double()).pow(2).mean().item()
    sig = ref.double().pow(2).mean().item()
    return float("inf") if err == 0 else 10 * math.log10(sig / err)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--videos", type=int, default=2)
    p.add_argument("--overlaps", default="1,2,3,4,6")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--weights", default=os.path.join(ROOT, "tests", "data", "wan_vae_small"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from diffusers import AutoencoderKLWan
    from train_small_wan_vae import procedural_video, psnr

    from lite_boost.parallel.vae import plan_chunks, vae_adapter_for

    vae = AutoencoderKLWan.from_pretrained(args.weights).eval()
    ad = vae_adapter_for(vae)
    overlaps = [int(v) for v in args.overlaps.split(",")]
    ranks = [int(v) for v in args.ranks.split(",")]
    rows = {}
    recon = []
    t0 = time.monotonic()
    with torch.no_grad():
        for k in range(args.videos):
            video = procedural_video(torch.Generator().manual_seed(1000 + k), 81, args.size, args.size).unsqueeze(0)
            enc_ref = vae._encode(video)
            z = enc_ref[:, :16]  # posterior mode
            dec_ref = vae._decode(z).sample
            recon.append(psnr(dec_ref, video))
            for P in ranks:
                for ov in overlaps:
                    plan = plan_chunks(z.shape[2], P, overlap=ov)
                    dec = torch.cat([ad.run_chunk(vae._decode, z, c, "decode") for c in plan.chunks], dim=2)
                    enc = torch.cat([ad.run_chunk(vae._encode, video, c, "encode") for c in plan.chunks], dim=2)
                    r = rows.setdefault((P, ov), dict(seam=[], chunk=[], enc=[], plan=plan.describe()))
                    for c in plan.chunks[1:]:
                        a = ad.out_frames(0, c.start, "decode")
                        b = a + ad.out_frames(c.start, c.stop, "decode")
                        r["seam"].append(psnr(dec[:, :, a : a + 4], dec_ref[:, :, a : a + 4]))
                        r["chunk"].append(psnr(dec[:, :, a:b], dec_ref[:, :, a:b]))
                        r["enc"].append(snr_db(enc[:, :, c.start], enc_ref[:, :, c.start]))
    print(f"trained small Wan VAE ({args.weights}), {args.videos} held-out procedural videos of 81 x "
          f"{args.size} x {args.size} (21 latent frames), fp32, {args.threads} thread(s), "
          f"{time.monotonic() - t0:.0f}s")
    print(f"VAE reconstruction PSNR (sequential, vs input): {min(recon):.1f} - {max(recon):.1f} dB\n")
    print("| ranks | overlap | decode seam PSNR min / mean (dB) | decode chunk PSNR min (dB) | encode seam SNR min (dB) | plan |")
    print("|---|---|---|---|---|---|")
    for (P, ov), r in sorted(rows.items()):
        print(f"| {P} | {ov} | {min(r['seam']):.1f} / {sum(r['seam']) / len(r['seam']):.1f} | {min(r['chunk']):.1f} | "
              f"{min(r['enc']):.1f} | {r['plan']} |")


if __name__ == "__main__":
    main()
