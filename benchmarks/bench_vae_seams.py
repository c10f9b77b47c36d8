"""Seam study of the chunked parallel VAE on the trained small Wan VAE (tests/data/wan_vae_small).

    python benchmarks/bench_vae_seams.py --threads 1

For each overlap (warm-up latent frames before a chunk) and rank count, the chunks of the chunked
mode are replayed in one process with the Wan adapter (exactly what each rank runs) and compared
with the sequential decode / encode of the same VAE. Videos: procedural moving textured shapes
(scripts/train_small_wan_vae.py), 81 frames (21 latent frames), held out (seeds never used in
training); for encode also the I2V conditioning video diffusers' Wan I2V pipeline encodes (the
image, then zero frames).

Decode (latents: the sequential encode's posterior mode):

* seam PSNR: the 4 video frames right after each chunk boundary (the worst place: the warm cache
  has forgotten most there), against the sequential decode, dB with peak-to-peak 2;
* chunk PSNR: all frames of the non-first chunks.

Encode (the posterior mean, the latent diffusers' pipelines use):

* latent seam PSNR: the first latent frame of each non-first chunk (the worst one) against the
  sequential encode, with the sequential latents' peak-to-peak range as the peak;
* max |error| / std: that frame's largest absolute error over the standard deviation of the
  sequential latents;
* decoded seam PSNR: the chunked latents and the sequential latents both decoded sequentially, the
  4 video frames of the seam latent frame compared (what an encode seam does to pixels);
* the same latent seam PSNR on the I2V conditioning video.

The VAE's own reconstruction PSNR (sequential decode of the sequential encode vs the input video)
puts the figures in scale: a seam error well below it is invisible next to the codec's own. The
Wan encoder is a causal network of finite temporal reach (3-tap causal convolutions and stride-2
temporal downsampling), so an overlap reaching back past it makes the encode seam exact; the
last column reports where that happens. Prints Markdown tables.
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


def range_psnr(x, ref, peak):
    err = (x.double() - ref.double()).pow(2).mean().item()
    return float("inf") if err == 0 else 10 * math.log10(peak ** 2 / err)


def fmt(v):
    return "exact" if v == float("inf") else f"{v:.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--videos", type=int, default=3)
    p.add_argument("--overlaps", default="1,2,3,4,6", help="decode overlaps")
    p.add_argument("--encode-overlaps", default="1,2,3,4,5,6,8,10,12,16")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--weights", default=os.path.join(ROOT, "tests", "data", "wan_vae_small"))
    p.add_argument("--first-video", type=int, default=0, help="held-out videos are seeds 1000 + k, k from this")
    p.add_argument("--json", default=None, help="also append the raw per-seam figures to this JSON-lines file")
    p.add_argument("--merge", nargs="*", default=None, help="only print the tables of these JSON-lines files")
    args = p.parse_args(argv)
    if args.merge is not None:
        return print_tables(args, *merge(args.merge))
    torch.set_num_threads(args.threads)
    from diffusers import AutoencoderKLWan
    from train_small_wan_vae import procedural_video, psnr

    from lite_boost.parallel.vae import plan_chunks, vae_adapter_for

    vae = AutoencoderKLWan.from_pretrained(args.weights).eval()
    ad = vae_adapter_for(vae)
    zc = vae.config.z_dim
    overlaps = [int(v) for v in args.overlaps.split(",") if v]
    enc_overlaps = [int(v) for v in args.encode_overlaps.split(",") if v]
    ranks = [int(v) for v in args.ranks.split(",")]
    dec_rows, enc_rows = {}, {}
    recon = []
    t0 = time.monotonic()
    with torch.no_grad():
        for k in range(args.first_video, args.first_video + args.videos):
            video = procedural_video(torch.Generator().manual_seed(1000 + k), 81, args.size, args.size).unsqueeze(0)
            i2v = torch.cat([video[:, :, :1], torch.zeros_like(video[:, :, 1:])], dim=2)  # Wan I2V conditioning
            enc_ref = vae._encode(video)
            z = enc_ref[:, :zc]  # posterior mode = mean
            dec_ref = vae._decode(z).sample
            recon.append(psnr(dec_ref, video))
            i2v_ref = vae._encode(i2v)[:, :zc]
            peak, std = (z.max() - z.min()).item(), z.std().item()
            i2v_peak = (i2v_ref.max() - i2v_ref.min()).item()
            for P in ranks:
                for ov in overlaps:
                    plan = plan_chunks(z.shape[2], P, overlap=ov, cost=ad.chunk_cost_fn("decode"))
                    dec = torch.cat([ad.run_chunk(vae._decode, z, c, "decode") for c in plan.chunks], dim=2)
                    r = dec_rows.setdefault((P, ov), dict(seam=[], chunk=[], plan=plan.describe()))
                    for c in plan.chunks[1:]:
                        a = ad.out_frames(0, c.start, "decode")
                        b = a + ad.out_frames(c.start, c.stop, "decode")
                        r["seam"].append(psnr(dec[:, :, a : a + 4], dec_ref[:, :, a : a + 4]))
                        r["chunk"].append(psnr(dec[:, :, a:b], dec_ref[:, :, a:b]))
                for ov in enc_overlaps:
                    plan = plan_chunks(z.shape[2], P, overlap=ov, cost=ad.chunk_cost_fn("encode"))
                    enc = torch.cat([ad.run_chunk(vae._encode, video, c, "encode") for c in plan.chunks], dim=2)[:, :zc]
                    enc_i2v = torch.cat([ad.run_chunk(vae._encode, i2v, c, "encode") for c in plan.chunks],
                                        dim=2)[:, :zc]
                    dec_enc = vae._decode(enc).sample
                    r = enc_rows.setdefault((P, ov), dict(lat=[], err=[], pix=[], i2v=[], exact=[],
                                                          plan=plan.describe()))
                    for c in plan.chunks[1:]:
                        s = c.start
                        r["lat"].append(range_psnr(enc[:, :, s], z[:, :, s], peak))
                        r["err"].append((enc[:, :, s] - z[:, :, s]).abs().max().item() / std)
                        a = ad.out_frames(0, s, "decode")
                        r["pix"].append(psnr(dec_enc[:, :, a : a + 4], dec_ref[:, :, a : a + 4]))
                        r["i2v"].append(range_psnr(enc_i2v[:, :, s], i2v_ref[:, :, s], i2v_peak))
                        r["exact"].append((enc[:, :, s:c.stop] - z[:, :, s:c.stop]).abs().max().item() <= 1e-5 * max(1.0, z.abs().max().item()))
    meta = dict(videos=list(range(args.first_video, args.first_video + args.videos)), size=args.size,
                threads=args.threads, seconds=round(time.monotonic() - t0), recon=recon)
    if args.json:
        import json

        with open(args.json, "a") as fh:
            fh.write(json.dumps(dict(meta=meta, dec=[[list(k), v] for k, v in dec_rows.items()],
                                     enc=[[list(k), v] for k, v in enc_rows.items()])) + "\n")
    print_tables(args, meta, dec_rows, enc_rows)


def merge(paths):
    import json

    meta, dec_rows, enc_rows = dict(videos=[], recon=[], seconds=0), {}, {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                rec = json.loads(line)
                for key in ("videos", "recon"):
                    meta[key] += rec["meta"][key]
                meta.update(size=rec["meta"]["size"], threads=rec["meta"]["threads"])
                meta["seconds"] += rec["meta"]["seconds"]
                for rows, part in ((dec_rows, "dec"), (enc_rows, "enc")):
                    for k, v in rec[part]:
                        r = rows.setdefault(tuple(k), {name: [] for name in v if name != "plan"} | {"plan": v["plan"]})
                        for name, vals in v.items():
                            if name != "plan":
                                r[name] += vals
    return meta, dec_rows, enc_rows


def print_tables(args, meta, dec_rows, enc_rows):
    recon = meta["recon"]
    print(f"trained small Wan VAE ({os.path.relpath(args.weights, ROOT)}), {len(meta['videos'])} held-out procedural "
          f"videos (seeds {', '.join(str(1000 + k) for k in meta['videos'])}) of 81 x {meta['size']} x {meta['size']} "
          f"(21 latent frames), fp32, {meta['threads']} thread(s), {meta['seconds']}s")
    print(f"VAE reconstruction PSNR (sequential, vs input): {min(recon):.1f} - {max(recon):.1f} dB\n")
    if dec_rows:
        print("Decode\n")
        print("| ranks | overlap | seam PSNR min / mean (dB) | chunk PSNR min (dB) | plan |")
        print("|---|---|---|---|---|")
        for (P, ov), r in sorted(dec_rows.items()):
            print(f"| {P} | {ov} | {fmt(min(r['seam']))} / {fmt(sum(r['seam']) / len(r['seam']))} | "
                  f"{fmt(min(r['chunk']))} | {r['plan']} |")
    if enc_rows:
        print("\nEncode (posterior mean)\n")
        print("| ranks | overlap | latent seam PSNR min / mean (dB) | max abs error / latent std | decoded seam PSNR min "
              "(dB) | I2V conditioning latent seam PSNR min (dB) | every chunk within 1e-5 | plan |")
        print("|---|---|---|---|---|---|---|---|")
        for (P, ov), r in sorted(enc_rows.items()):
            print(f"| {P} | {ov} | {fmt(min(r['lat']))} / {fmt(sum(r['lat']) / len(r['lat']))} | {max(r['err']):.2g} | "
                  f"{fmt(min(r['pix']))} | {fmt(min(r['i2v']))} | {'yes' if all(r['exact']) else 'no'} | {r['plan']} |")


if __name__ == "__main__":
    main()
