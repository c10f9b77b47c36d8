"""Text-to-video with Wan on N processes: Ulysses sequence parallelism and/or CFG parallelism.

    # built-in tiny random model (runs anywhere, CPU included), 2 ranks on the sequence
    torchrun --standalone --nproc_per_node 2 examples/wan_t2v.py
    # a diffusers Wan folder, 4 GPUs: cfg 2 x sequence 2, 80% block-sparse self-attention
    torchrun --standalone --nproc_per_node 4 examples/wan_t2v.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers \\
        --cfg-degree 2 --sparsity 0.8 --height 480 --width 832 --frames 81 --steps 40 --dtype bf16
    # one process (no torchrun) is the single-device boost
    python examples/wan_t2v.py

Every rank runs this script with the same arguments; only rank 0 writes the video.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser(description: str, default_output: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="tiny", help="diffusers Wan folder / hub id, or 'tiny' (built-in random model)")
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--negative-prompt", default=None)
    ap.add_argument("--height", type=int, default=None, help="default: 32 for tiny, 480 otherwise")
    ap.add_argument("--width", type=int, default=None, help="default: 48 for tiny, 832 otherwise")
    ap.add_argument("--frames", type=int, default=None, help="default: 9 for tiny, 81 otherwise (4k+1)")
    ap.add_argument("--steps", type=int, default=None, help="default: 4 for tiny, 40 otherwise")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequence-degree", type=int, default=None,
                    help="ranks sharing one sequence (default: world size / cfg degree)")
    ap.add_argument("--ulysses-degree", type=int, default=None, help="sequence ranks on Ulysses (all_to_all)")
    ap.add_argument("--ring-degree", type=int, default=None, help="sequence ranks on Ring attention (default 1)")
    ap.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2),
                    help="2: conditional and unconditional passes on different ranks")
    ap.add_argument("--sparsity", type=float, default=0.0, help="block-sparse self-attention, 0 = dense")
    ap.add_argument("--attention-backend", default=None, choices=(None, "fa3", "fa2", "npu", "sdpa"))
    ap.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--fps", type=int, default=16)
    ap.add_argument("--output", default=default_output, help="video path (.mp4 needs imageio-ffmpeg; else .gif)")
    return ap


def boost_config(args):
    from lite_boost.config import BoostConfig, ParallelConfig, SparseConfig

    sparse = SparseConfig(sparsity=args.sparsity) if args.sparsity > 0 else None
    return BoostConfig(
        attention_backend=args.attention_backend,
        sparse=sparse,
        parallel=ParallelConfig(sequence_degree=args.sequence_degree, cfg_degree=args.cfg_degree,
                                ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                                timeout_s=args.timeout),
    )


def fill_defaults(args):
    tiny = args.model == "tiny"
    from lite_boost.demo import DEMO_NEGATIVE_PROMPT, DEMO_PROMPT

    args.prompt = args.prompt or DEMO_PROMPT
    args.negative_prompt = args.negative_prompt if args.negative_prompt is not None else DEMO_NEGATIVE_PROMPT
    args.height = args.height or (32 if tiny else 480)
    args.width = args.width or (48 if tiny else 832)
    args.frames = args.frames or (9 if tiny else 81)
    args.steps = args.steps or (4 if tiny else 40)
    return args


def write_video(frames, path: str, fps: int) -> str:
    """Write frames (list of PIL images or a (T, H, W, 3) array in [0, 1]) to ``path``; returns the path used."""
    import numpy as np

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".mp4"):
        try:
            from diffusers.utils import export_to_video

            export_to_video(frames, path, fps=fps)
            return path
        except Exception as exc:  # noqa: BLE001 - no video encoder installed: fall back to GIF
            print(f"[rank 0] mp4 export unavailable ({exc.__class__.__name__}: {exc}); writing a GIF instead")
            path = path[: -len(".mp4")] + ".gif"
    import PIL.Image

    if not isinstance(frames[0], PIL.Image.Image):
        frames = [PIL.Image.fromarray((np.clip(np.asarray(f), 0, 1) * 255).astype("uint8")) for f in frames]
    frames[0].save(path, save_all=True, append_images=list(frames[1:]), duration=int(1000 / fps), loop=0)
    return path


def run(args, pipe, extra_call_kwargs=None):
    """Parallelise ``pipe`` from the torchrun environment, generate, write the video on rank 0."""
    from lite_boost.parallel import ParallelManager

    config = boost_config(args)
    ParallelManager(pipe, config)  # validates before any collective; world size 1 = single-process boost
    state = getattr(pipe, "_lite_boost_parallel", None)
    rank = state.mesh.rank if state is not None else 0
    world = state.mesh.world_size if state is not None else 1
    device = state.mesh.device if state is not None else torch.device("cpu")
    if state is not None and rank == 0:
        print(f"[rank 0] {state.mesh.describe()}; cfg {state.mesh.cfg_degree} x sequence {state.mesh.sequence_degree}")
    kwargs = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
                  num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=args.guidance,
                  generator=torch.Generator(device="cpu").manual_seed(args.seed))
    kwargs.update(extra_call_kwargs or {})
    t0 = time.perf_counter()
    frames = pipe(**kwargs).frames[0]
    elapsed = time.perf_counter() - t0
    if rank == 0:
        path = write_video(frames, args.output, args.fps)
        print(f"[rank 0] {len(frames)} frames {args.height}x{args.width} in {elapsed:.2f}s on {world} rank(s) "
              f"({device}) -> {path}")
    if state is not None:
        state.mesh.destroy()
    return frames


def load_pipeline(args, kind: str):
    dtype = DTYPES[args.dtype]
    if args.model == "tiny":
        from lite_boost.demo import tiny_wan_pipeline

        return tiny_wan_pipeline(kind, dtype=dtype)
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    cls = WanPipeline if kind == "t2v" else WanImageToVideoPipeline
    vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.float32)
    return cls.from_pretrained(args.model, vae=vae, torch_dtype=dtype)


def main(argv=None):
    args = fill_defaults(build_parser(__doc__.splitlines()[0], "outputs/wan_t2v.mp4").parse_args(argv))
    pipe = load_pipeline(args, "t2v")
    return run(args, pipe)


if __name__ == "__main__":
    main()
