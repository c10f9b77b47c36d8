"""Image-to-video with Wan on N processes: Ulysses sequence parallelism and/or CFG parallelism.

    # built-in tiny random model and a synthetic input image, 2 ranks
    torchrun --standalone --nproc_per_node 2 examples/wan_i2v.py
    # a diffusers Wan I2V folder on 4 GPUs, cfg 2 x sequence 2
    torchrun --standalone --nproc_per_node 4 examples/wan_i2v.py --model Wan-AI/Wan2.1-I2V-14B-480P-Diffusers \\
        --image input.jpg --cfg-degree 2 --height 480 --width 832 --frames 81 --steps 40 --dtype bf16

Flags are those of wan_t2v.py plus --image. Only rank 0 writes the video.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wan_t2v import build_parser, fill_defaults, load_pipeline, run  # noqa: E402


def load_image(path: str | None, height: int, width: int):
    """The input image resized to the output size, or a synthetic gradient when no path is given."""
    import numpy as np
    import PIL.Image

    if path:
        return PIL.Image.open(path).convert("RGB").resize((width, height))
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), 0.5 + 0 * x], axis=-1)
    return PIL.Image.fromarray((rgb * 255).astype("uint8"))


def main(argv=None):
    ap = build_parser(__doc__.splitlines()[0], "outputs/wan_i2v.mp4")
    ap.add_argument("--image", default=None, help="input image (default: a synthetic gradient)")
    args = fill_defaults(ap.parse_args(argv))
    pipe = load_pipeline(args, "i2v")
    image = load_image(args.image, args.height, args.width)
    # diffusers' Wan processor assumes a 512-token text context for I2V
    return run(args, pipe, {"image": image, "max_sequence_length": 512})


if __name__ == "__main__":
    main()
