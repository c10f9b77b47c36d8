"""``lite-boost`` command line: ``generate`` a video or an image (stock vs boosted timing), ``env``, ``models``.

    lite-boost generate                       # the built-in tiny random-weight video model on the CPU, no download
    lite-boost generate --image cat.png       # image-to-video
    lite-boost generate --family NAME         # another family's built-in tiny model (`lite-boost models`)
    lite-boost generate --model /path/to/a-diffusers-pipeline --height 480 --width 832 --num-frames 81
                                              # family read from its model_index.json
    lite-boost generate --model /path/to/a-saved-modular-pipeline --steps 8
                                              # modular_model_index.json: video (+ .wav soundtrack)
    lite-boost generate --nproc 2             # same under torchrun, Ulysses sequence parallel
    lite-boost env                            # versions, devices, usable attention backends
    lite-boost models                         # supported model families and the features of each
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser", "write_video", "write_image", "write_audio", "models_report", "installed_classes_report", "detect_family",
           "family_for_pipeline_class", "resolve_family", "check_family_options"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lite-boost", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a video or an image with a boosted pipeline and time it "
                                          "against stock")
    gen.add_argument("--model", default=None,
                     help="diffusers pipeline folder; its family is read from model_index.json, or from "
                          "modular_model_index.json for a modular pipeline (saved with ModularPipeline."
                          "save_pretrained; loaded with diffusers' modular loading, its steps whose components the "
                          "folder lacks, a text encoder say, dropped: the family's random prompt embeddings are "
                          "passed instead) (default: the built-in tiny model of --family)")
    gen.add_argument("--family", default=None,
                     help="model family (`lite-boost models` lists them; default: the --model's, else the family "
                          "of the built-in main job); without --model only families with a built-in tiny model run "
                          "(`lite-boost models`: tiny model)")
    gen.add_argument("--image", default=None, help="conditioning image: image-to-video")
    gen.add_argument("--input", action="append", default=None, metavar="NAME=PATH", dest="inputs",
                     help="another image or video argument of the pipeline, by its name (repeatable), e.g. "
                          "--input pose_video=pose/ --input face_video=face/ (an animation pipeline), --input "
                          "video=control/ --input mask=mask/ (a control-video pipeline): an image file gives one "
                          "image, a folder of image files (in name order) or a video file (.mp4 / .gif, read with "
                          "imageio) a list of frames")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument("--height", type=int, default=None,
                     help="default: the pipeline's own for --model, the built-in tiny model's otherwise")
    gen.add_argument("--width", type=int, default=None,
                     help="default: the pipeline's own for --model, the built-in tiny model's otherwise")
    gen.add_argument("--num-frames", type=int, default=None,
                     help="4k+1 frames, video families only (default: the pipeline's own for --model, the built-in "
                          "tiny model's otherwise)")
    gen.add_argument("--steps", type=int, default=None,
                     help="denoising steps (default: the pipeline's own for --model, 50; 10 for the tiny models)")
    gen.add_argument("--guidance-scale", type=float, default=None,
                     help="classifier-free guidance scale, passed as the family's CFG argument (guidance_scale, or "
                          "true_cfg_scale where the pipeline's guidance_scale is a distilled embedding: `lite-boost "
                          "models`); <= 1 runs no CFG (default: "
                          "the pipeline's own for --model, 5 for the tiny models)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default bfloat16 on GPU/NPU, float32 on CPU")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:N, npu, npu:N (default: the accelerator if "
                                                    "present; `lite-boost env` lists them)")
    gen.add_argument("--attention-backend", default=None, choices=["fa3", "fa2", "npu", "sdpa"])
    gen.add_argument("--attention-precision", default=None, choices=["auto", "int8", "fp8"],
                     help="arithmetic of the sequence self-attention: auto (the model dtype, default), int8 (int8 "
                          "Q K^T after smoothing K, 16-bit P V) or fp8 where the device has it")
    gen.add_argument("--sparsity", type=float, default=None,
                     help="block-sparse self-attention sparsity in [0, 1); 0 = dense (default 0 for --model, "
                          "0.8 for the tiny model, whose main job shows block-sparse attention)")
    gen.add_argument("--cache", default=None, metavar="METHOD[:PARAM=VALUE,...]",
                     help="step caching with a diffusers cache hook: first_block_cache, mag_cache, taylorseer_cache, "
                          "pyramid_attention_broadcast or sea_cache, e.g. first_block_cache:threshold=0.1 "
                          "(lists and ranges with '/': mag_ratios=1/0.98/0.97)")
    gen.add_argument("--quant", default=None, choices=["int8_dynamic", "int8_weight_only", "fp8", "w8a8_npu"],
                     help="quantize the transformer blocks' Linear layers (torchao; w8a8_npu: torch_npu): int8_dynamic "
                          "and int8_weight_only on CPU/CUDA, fp8 on CUDA sm89+ (bf16), w8a8_npu on Ascend")
    gen.add_argument("--offload", action="store_true",
                     help="keep the transformer and text-encoder weights in host memory and upload each block to "
                          "the device as it runs (the next one on a side stream on CUDA / NPU); with --fsdp-degree, "
                          "FSDP2's CPUOffloadPolicy keeps each rank's shards there instead; the stock run is "
                          "skipped on an accelerator (it would need the whole model there)")
    gen.add_argument("--config", default=None, help="YAML BoostConfig (overrides the flags above)")
    gen.add_argument("--nproc", type=int, default=1, help="processes to launch with torchrun (one per device)")
    gen.add_argument("--sequence-degree", type=int, default=None,
                     help="ranks per sequence = ulysses x ring degree (default: nproc / cfg degree)")
    gen.add_argument("--ulysses-degree", type=int, default=None,
                     help="sequence ranks on Ulysses (all_to_all over heads; default: sequence degree / ring degree)")
    gen.add_argument("--ring-degree", type=int, default=None,
                     help="sequence ranks on Ring attention (K/V passed around; default 1, or sequence degree / "
                          "ulysses degree)")
    gen.add_argument("--rotate-method", default="p2p", choices=["p2p", "allgather"],
                     help="how Ring attention moves K/V: p2p (overlapped with compute, default) or allgather")
    gen.add_argument("--cfg-degree", type=int, default=1, choices=[1, 2])
    gen.add_argument("--tp-degree", type=int, default=1,
                     help="tensor parallelism: attention heads and FFN columns split over this many ranks (a mesh "
                          "axis: nproc = cfg x tp x sequence degree; default 1)")
    gen.add_argument("--fsdp-degree", type=int, default=1,
                     help="FSDP2 weight sharding: transformer blocks (and text encoder) split over this many ranks, "
                          "gathered block by block; overlaps the other axes, must divide --nproc (with --tp-degree: "
                          "--nproc / tp degree, FSDP over the ranks with the same tp rank; default 1)")
    gen.add_argument("--vae-parallel", default=None, choices=["exact", "chunked", "off"],
                     help="VAE decode/encode over the ranks (default exact when --nproc > 1)")
    gen.add_argument("--vae-overlap", type=int, default=None,
                     help="warm-up latent frames per chunk with --vae-parallel chunked (default: the model's)")
    gen.add_argument("--no-compare", action="store_true", help="skip the stock diffusers run")
    gen.add_argument("--warmup", type=int, default=1,
                     help="untimed one-step runs (latent output; a modular pipeline: whole calls) before each timed "
                          "run, to exclude one-time costs")
    gen.add_argument("--output", default=None,
                     help="video path (default outputs/lite_boost_<t2v|i2v>.mp4); image families write a PNG "
                          "(default outputs/lite_boost_<t2i|i2i>.png); a pipeline that returns a soundtrack with its "
                          "video (a modular pipeline's audio) also gets it as 16-bit PCM WAV next to the video "
                          "(same name, .wav)")
    gen.add_argument("--overwrite", action="store_true",
                     help="replace an existing --output file (without it an existing --output is refused, and the "
                          "default name is numbered: lite_boost_t2v-1.mp4, -2, ...)")
    gen.add_argument("--fps", type=int, default=None,
                     help="frame rate of the written video (default: the pipeline's own where it has one, a "
                          "modular pipeline's fps; else 16)")
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("-v", "--verbose", action="store_true", help="log backend choices")

    sub.add_parser("env", help="print versions, devices and attention backends")
    sub.add_parser("models", help="list the supported model families and the features each supports")
    _add_plan_parser(sub)
    return parser


# ----------------------------------------------------------------------------------------------- #
# models                                                                                           #
# ----------------------------------------------------------------------------------------------- #


def models_report() -> str:
    """The registered families: classes, joint layout, CFG kind, and each feature (yes / why not)."""
    from lite_boost.adapter.family import FEATURES
    from lite_boost.registry import families

    lines = ["## lite_boost model families", "", "| family | pipelines / transformers | joint | CFG | "
             + " | ".join(FEATURES) + " |", "|---" * (4 + len(FEATURES)) + "|"]
    notes = []
    for fam in families():
        d = fam.describe()
        cells = ["yes" if d["features"][f] is None else "no" for f in FEATURES]
        lines.append(f"| {d['family']} | {', '.join(d['pipelines'] + d['transformers'])} | {d['joint']} | "
                     f"{d['cfg']} | " + " | ".join(cells) + " |")
        why = [f"{f}: {r}" for f, r in d["features"].items() if r is not None]
        tiny = ", ".join(f"{k} {p}" for k, p in d["tiny"].items())
        notes.append(f"- {d['family']}: step caches {', '.join(d['cache_methods']) or 'none'}; default quantized "
                     f"modules {', '.join(d['quant_patterns']) or 'none'}"
                     + (f"; not supported: {'; '.join(why)}" if why else "") + (f"; {d['notes']}" if d["notes"] else "")
                     + f"; makes {d['output'] or 'images or videos (by pipeline)'}; CFG scale argument "
                     f"{d['cfg_argument'] or 'none'}; tiny model (`lite-boost generate --family {d['family']}`): "
                     f"{tiny or 'none'}")
    return "\n".join(lines + [""] + notes + ["", installed_classes_report()])


def installed_classes_report() -> str:
    """Every transformer class of the installed diffusers: its path (a named family, lite_boost's generic path
    through diffusers' attention dispatcher, or why neither) and the features it gets, read from the code."""
    from lite_boost.adapter.family import FEATURES
    from lite_boost.adapter.generic import class_family, installed_transformer_classes
    from lite_boost.registry import SUPPORTED_MODELS, UnsupportedModelError, family_of, load_builtin_adapters

    load_builtin_adapters()
    classes = installed_transformer_classes()
    lines = [f"## installed diffusers transformer classes ({len(classes)})", "",
             "| class | path | " + " | ".join(FEATURES) + " | not supported |", "|---" * (3 + len(FEATURES)) + "|"]
    counts = {"family": 0, "generic": 0, "no": 0}
    always_off = {"cfg_parallel", "parallel_vae"}  # the generic path has none of them yet
    for name, cls in classes.items():
        fn = SUPPORTED_MODELS.get(name)
        fam = family_of(fn) if fn is not None else None
        path = f"family {fam.name}" if fam is not None else None
        if fam is None:
            try:
                fam, path = class_family(cls), "generic"
            except UnsupportedModelError as exc:
                counts["no"] += 1
                lines.append(f"| {name} | no | " + " | ".join("no" for _ in FEATURES)
                             + f" | {str(exc).split(': ', 1)[-1].split(', and no model family')[0]} |")
                continue
        counts["family" if path.startswith("family") else "generic"] += 1
        feats = fam.features
        shown = {f: r for f, r in feats.items() if r is not None and not (path == "generic" and f in always_off)}
        lines.append(f"| {name} | {path} | " + " | ".join("yes" if feats[f] is None else "no" for f in FEATURES)
                     + " | " + "; ".join(f"{f}: {r}" for f, r in shown.items()) + " |")
    lines += ["", f"{counts['family']} by a named family, {counts['generic']} on the generic path, {counts['no']} not "
              "boosted (read from the installed diffusers' code; `lite_boost.boost` checks each instance). The generic "
              "path: lite_boost's attention backend in diffusers' dispatcher, quantization of the _repeated_blocks, "
              "diffusers' step-cache hooks, block-sparse attention over the latent grid, sequence parallelism where the "
              "class carries a diffusers _cp_plan; not yet: "
              + ", ".join(sorted(always_off)) + "."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- #
# env                                                                                              #
# ----------------------------------------------------------------------------------------------- #


def _version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> str:
    import torch

    import lite_boost
    from lite_boost.ops.attention import backend_report

    lines = ["## lite_boost environment", "",
             f"- lite_boost {lite_boost.__version__}, Python {platform.python_version()} ({platform.machine()})"]
    for pkg in ("torch", "diffusers", "transformers", "accelerate", "flash-attn", "flash_attn_3", "torch-npu",
                "imageio", "imageio-ffmpeg"):
        lines.append(f"- {pkg}: {_version(pkg)}")
    lines += ["", "### devices", f"- cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            lines.append(f"- cuda:{i}: {torch.cuda.get_device_name(i)} (sm{cap[0]}{cap[1]})")
    else:
        lines.append("- cuda: not available")
    npu = getattr(torch, "npu", None)
    lines.append(f"- npu: {npu.device_count()} device(s)" if npu is not None and npu.is_available()
                 else "- npu: not available (torch_npu not imported or no device)")
    lines += ["", "### dense attention backends (auto order fa3 -> fa2 -> npu -> sdpa)",
              "| backend | status | detail |", "|---|---|---|"]
    lines += [f"| {n} | {s} | {d} |" for n, s, d in backend_report()]
    lines += ["", "### operator library (csrc: torch.ops.lite_boost)"]
    from lite_boost.ops import _ext

    ext = _ext.status()
    lines.append(f"- {ext.summary()}")
    if ext.loaded:
        for op, keys in ext.kernels.items():
            lines.append(f"- {op}: kernels for {', '.join(keys) if keys else 'no device'}")
    try:  # sparse kernels (optional module of lite_boost.ops)
        from lite_boost.ops import rain_fusion

        report = getattr(rain_fusion, "backend_report", None)
        if report is not None:
            lines += ["", "### block-sparse attention backends", "| backend | status | detail |", "|---|---|---|"]
            lines += [f"| {n} | {s} | {d} |" for n, s, d in report()]
    except ImportError as exc:
        lines += ["", f"block-sparse attention: unavailable ({exc})"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- #
# generate                                                                                         #
# ----------------------------------------------------------------------------------------------- #


def _uint8_for(arr, path):
    """``arr`` in [0, 1] as uint8, and ``path`` as a Path whose folder exists (what the writers below share)."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8), path


def write_video(frames, path: str | os.PathLike, fps: int = 16) -> tuple[Path, str]:
    """Write (T, H, W, 3) frames in [0, 1]; mp4 with imageio-ffmpeg, else GIF (Pillow), else .npy.

    Returns the path written and the format used.
    """
    import numpy as np

    arr = np.asarray(frames)
    if arr.ndim == 5:
        arr = arr[0]
    arr8, path = _uint8_for(arr, path)
    try:
        import imageio.v2 as imageio
        import imageio_ffmpeg  # noqa: F401

        out = path.with_suffix(".mp4")
        with imageio.get_writer(str(out), fps=fps, codec="libx264", macro_block_size=1, quality=8) as writer:
            for frame in arr8:
                writer.append_data(frame)
        return out, "mp4 (imageio-ffmpeg)"
    except Exception:  # noqa: BLE001 - missing package or codec: fall back to GIF
        pass
    try:
        from PIL import Image

        out = path.with_suffix(".gif")
        images = [Image.fromarray(f) for f in arr8]
        images[0].save(out, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        return out, "animated GIF (Pillow; install lite-boost[video] for mp4)"
    except Exception:  # noqa: BLE001
        out = path.with_suffix(".npy")
        np.save(out, arr8)
        return out, "numpy .npy (no imageio-ffmpeg or Pillow)"


def write_image(image, path: str | os.PathLike) -> tuple[Path, str]:
    """Write one (H, W, 3) image in [0, 1] (the first of a batch, or a video's first frame) as PNG (Pillow),
    else .npy. Returns the path written and the format used."""
    import numpy as np

    arr = np.asarray(image)
    while arr.ndim > 3:
        arr = arr[0]
    arr8, path = _uint8_for(arr, path)
    try:
        from PIL import Image

        out = path.with_suffix(".png")
        Image.fromarray(arr8).save(out)
        return out, "PNG (Pillow)"
    except Exception:  # noqa: BLE001 - no Pillow
        out = path.with_suffix(".npy")
        np.save(out, arr8)
        return out, "numpy .npy (no Pillow)"


def write_audio(audio, sampling_rate: int, path: str | os.PathLike) -> Path:
    """Write a soundtrack, (channels, samples) or (1, channels, samples) in [-1, 1] (a tensor or an array), as
    16-bit PCM WAV (the stdlib ``wave`` module). Returns the path written."""
    import wave

    import numpy as np

    arr = np.asarray(audio.detach().float().cpu() if hasattr(audio, "detach") else audio, dtype=np.float32)
    while arr.ndim > 2:
        arr = arr[0]
    if arr.ndim == 1:
        arr = arr[None]
    pcm = (np.clip(arr, -1.0, 1.0) * 32767).round().astype("<i2").T  # (samples, channels): interleaved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(arr.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(sampling_rate))
        out.writeframes(pcm.tobytes())
    return path


# what write_video / write_image may turn a path's suffix into (mp4 -> gif -> npy; png -> npy)
_OUTPUT_SUFFIXES = (".mp4", ".gif", ".npy", ".png", ".wav")


def _taken(path: Path) -> Path | None:
    """The existing file a write to ``path`` could replace (any suffix the writers may use), or None."""
    return next((c for c in (path, *(path.with_suffix(x) for x in _OUTPUT_SUFFIXES)) if c.exists()), None)


def check_output(output: str | None, overwrite: bool) -> None:
    """SystemExit when an explicit ``--output`` exists and ``--overwrite`` is not given (checked before any work)."""
    if output is None or overwrite:
        return
    existing = _taken(Path(output))
    if existing is not None:
        raise SystemExit(f"lite-boost generate: --output {output}: {existing} exists; pass --overwrite to replace it, "
                         "or another --output (without --output the default name is numbered, never overwritten)")


def output_path(output: str | None, default: str) -> Path:
    """``output`` as given (``check_output`` ran), else ``default``, numbered ``-1``, ``-2``, ... past existing files."""
    if output is not None:
        return Path(output)
    path = Path(default)
    n = 0
    while _taken(path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")) is not None:
        n += 1
    return path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")


def usable_devices() -> list[str]:
    """The devices this torch build can run on here: cpu, then cuda:N / npu:N for each visible device."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        found += [f"npu:{i}" for i in range(npu.device_count())]
    return found


def check_device(name: str):
    """``name`` as a torch.device; SystemExit naming the usable devices when it is malformed or not usable here
    (a CPU-only torch build asked for ``cuda``, an index past the visible devices)."""
    import torch

    usable = usable_devices()
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SystemExit(f"lite-boost generate: --device must be a device name such as cpu, cuda or cuda:0, got "
                         f"{name!r}; usable here: {usable}") from None
    if dev.type == "cpu":
        return dev
    why = None
    if not any(u.startswith(dev.type + ":") for u in usable):
        if dev.type == "cuda" and torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
        elif dev.type == "npu" and getattr(torch, "npu", None) is None:
            why = "torch_npu is not installed"
        else:
            why = f"no {dev.type} device is visible"
    elif dev.index is not None and f"{dev.type}:{dev.index}" not in usable:
        why = f"only {sum(u.startswith(dev.type + ':') for u in usable)} {dev.type} device(s) are visible"
    if why is not None:
        raise SystemExit(f"lite-boost generate: --device {name} is not usable here ({why}); usable devices: {usable}")
    return dev


def check_processes(config, nproc: int, world_size: int, from_config: str | None = None) -> None:
    """SystemExit with the launch hint when the parallel degrees need more processes than the run has: one
    process (no --nproc, not under torchrun) cannot split CFG or the sequence."""
    need = config.parallel.processes_needed()
    have = max(nproc, world_size)
    if need <= have or have > 1:  # several processes: resolve_mesh names the degrees that fit the world size
        return
    p = config.parallel
    names = ("cfg_degree", "tp_degree", "fsdp_degree", "sequence_degree", "ulysses_degree", "ring_degree") + (
        ("world_size",) if from_config else ())
    given = [(n, getattr(p, n)) for n in names if getattr(p, n) not in (None, 1)]
    if from_config is not None:
        asked = f"parallel {', '.join(f'{n}={v}' for n, v in given)} (from --config {from_config})"
    else:
        asked = " ".join(f"--{n.replace('_', '-')} {v}" for n, v in given)
    raise SystemExit(f"lite-boost generate: {asked} need {need} processes, but this run has one; add --nproc {need} "
                     f"(lite-boost starts them with torchrun), or launch `torchrun --nproc_per_node {need} -m "
                     "lite_boost.cli generate ...` yourself")


# ----------------------------------------------------------------------------------------------- #
# families: which one a run uses, and what it can do                                              #
# ----------------------------------------------------------------------------------------------- #

def _registered_families() -> dict:
    from lite_boost.registry import families

    return {f.name: f for f in families()}


def family_for_pipeline_class(class_name: str):
    """The registered family of a diffusers pipeline class name (or of its nearest registered base), or None.

    The name is matched against the families' pipeline names first; a subclass is found through diffusers'
    class of that name (importing the class, never weights).
    """
    fams = list(_registered_families().values())
    for fam in fams:
        if class_name in fam.pipelines:
            return fam
    try:
        import diffusers

        cls = getattr(diffusers, class_name, None)
    except Exception:  # noqa: BLE001 - a class whose optional dependencies are missing: not ours either
        cls = None
    for base in (cls.__mro__[1:] if isinstance(cls, type) else ()):
        for fam in fams:
            if base.__name__ in fam.pipelines:
                return fam
    return None


MODULAR_INDEX = "modular_model_index.json"


def index_path(model_dir: str | os.PathLike) -> Path | None:
    """The index of a diffusers pipeline folder: ``model_index.json``, else ``modular_model_index.json`` (a
    modular pipeline saved with ``ModularPipeline.save_pretrained``), else None."""
    return next((p for p in (Path(model_dir, "model_index.json"), Path(model_dir, MODULAR_INDEX)) if p.is_file()), None)


def is_modular(model_dir: str | os.PathLike | None) -> bool:
    """Whether ``model_dir`` is a saved modular pipeline (a ``modular_model_index.json`` and no ``model_index.json``)."""
    return model_dir is not None and index_path(model_dir) == Path(model_dir, MODULAR_INDEX)


def detect_family(model_dir: str | os.PathLike):
    """(family, pipeline class name) of a diffusers pipeline folder, from the ``_class_name`` of its
    ``model_index.json`` (or ``modular_model_index.json``); SystemExit naming the supported pipeline classes
    for one lite_boost does not know."""
    index = index_path(model_dir) or Path(model_dir, "model_index.json")
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"lite-boost generate: --model {model_dir}: cannot read {index} ({exc})") from None
    name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise SystemExit(f"lite-boost generate: --model {model_dir}: {index} names no pipeline class (_class_name)")
    family = family_for_pipeline_class(name)
    if family is None and index.name == MODULAR_INDEX:
        supported = [n for f in _registered_families().values() for n in f.pipelines if n.endswith("ModularPipeline")]
        raise SystemExit(f"lite-boost generate: --model {model_dir} holds a modular {name}, which lite_boost does "
                         f"not support; supported modular pipeline classes: {supported}")
    if family is None:
        family = _generic_pipeline_family(model_dir, name, data)
    return family, name


def _generic_pipeline_family(model_dir, name: str, index: dict):
    """The record of a pipeline no family registers, from the transformer class its model_index.json names:
    that class's family, or lite_boost's generic path; SystemExit saying why when neither takes it."""
    from lite_boost.adapter.generic import PIPELINE_TRANSFORMERS, class_family
    from lite_boost.registry import SUPPORTED_MODELS, UnsupportedModelError, family_of, load_builtin_adapters

    load_builtin_adapters()
    entries = [index.get(a) for a in PIPELINE_TRANSFORMERS if isinstance(index.get(a), list) and index.get(a)[-1]]
    if not entries:
        supported = [n for f in _registered_families().values() for n in f.pipelines]
        raise SystemExit(f"lite-boost generate: --model {model_dir} holds a {name}, which lite_boost does not "
                         f"support; supported pipeline classes: {supported}, and any pipeline whose transformer "
                         f"({' / '.join(PIPELINE_TRANSFORMERS)} in model_index.json) a family or the generic path "
                         "boosts (lite-boost models)")
    import diffusers

    records = []
    for library, cls_name in entries:
        fn = SUPPORTED_MODELS.get(cls_name)
        if fn is not None and family_of(fn) is not None:
            records.append(family_of(fn))
            continue
        cls = getattr(diffusers, cls_name, None) if library == "diffusers" else None
        if cls is None:
            raise SystemExit(f"lite-boost generate: --model {model_dir}: its transformer class {library}.{cls_name} "
                             "is not a class of the installed diffusers")
        try:
            records.append(class_family(cls, pipeline_class=name))
        except UnsupportedModelError as exc:
            raise SystemExit(f"lite-boost generate: --model {model_dir} holds a {name}: {exc}") from None
    if len(records) > 1 and any(r.name != records[0].name for r in records):
        raise SystemExit(f"lite-boost generate: --model {model_dir} holds a {name} whose transformers take different "
                         f"paths ({[r.name for r in records]}); boost it from Python (lite_boost.boost(pipe))")
    return records[0]


def _tiny_families(fams: dict) -> list[str]:
    return [n for n, f in fams.items() if f.tiny]


def default_tiny_family(fams: dict | None = None):
    """The family of a bare ``lite-boost generate``: the one whose record marks a tiny pipeline ``default``."""
    fams = _registered_families() if fams is None else fams
    marked = [f for f in fams.values() if any(t.default for t in f.tiny.values())]
    if len(marked) != 1:
        raise RuntimeError(f"exactly one registered family must mark a built-in tiny pipeline default=True (the run "
                           f"of a bare `lite-boost generate`), found {[f.name for f in marked]}")
    return marked[0]


def resolve_family(args):
    """(family, pipeline class name) of a generate run: the --model's, else the built-in tiny model of --family
    (default: the family whose record marks its tiny pipeline ``default``)."""
    fams = _registered_families()
    if args.family is not None and args.family not in fams:
        raise SystemExit(f"lite-boost generate: --family must be one of {list(fams)}, got {args.family!r}")
    if args.model is not None:
        family, class_name = detect_family(args.model)
        if args.family is not None and args.family != family.name:
            raise SystemExit(f"lite-boost generate: --family {args.family} does not match --model {args.model}, a "
                             f"{class_name} (the {family.name} family); drop --family or pass --family {family.name}")
        return family, class_name
    family = fams[args.family] if args.family is not None else default_tiny_family(fams)
    if not family.tiny:
        raise SystemExit(f"lite-boost generate: --family {family.name} has no built-in tiny model: pass --model PATH "
                         f"(a diffusers {family.name} pipeline folder) or a family with one: {_tiny_families(fams)}")
    kind = _tiny_kind(family, args)
    if kind not in family.tiny:
        conditioned = [n for n, f in fams.items() if set(f.tiny) & {"i2v", "i2i"}]
        raise SystemExit(f"lite-boost generate: --image is not supported by the built-in tiny {family.name} model; "
                         f"built-in image-conditioned models: {conditioned} (or pass --model with a pipeline that "
                         "takes an image)")
    return family, family.tiny[kind].pipeline


def _tiny_kind(family, args) -> str:
    """The kind of a built-in tiny run: text- or image-conditioned (--image), of the family's output."""
    from lite_boost.adapter.family import RUN_KINDS

    text, image = RUN_KINDS[family.output]
    return image if args.image else text


def _pipeline_signature(class_name: str) -> inspect.Signature | None:
    """The signature of a diffusers pipeline class's ``__call__`` (None when the class cannot be imported)."""
    try:
        import diffusers

        return inspect.signature(getattr(diffusers, class_name).__call__)
    except Exception:  # noqa: BLE001 - unknown to this diffusers: the pipeline itself will say what it takes
        return None


def _pipeline_parameters(class_name: str) -> set[str] | None:
    """The argument names of a diffusers pipeline class's ``__call__`` (None when the class cannot be imported)."""
    sig = _pipeline_signature(class_name)
    return set(sig.parameters) if sig is not None else None


# call arguments that have an option of their own (or are set by the command): not for --input
_CLI_ARGUMENTS = {"prompt": "--prompt", "negative_prompt": "--negative-prompt", "image": "--image",
                  "height": "--height", "width": "--width", "num_frames": "--num-frames",
                  "num_inference_steps": "--steps", "generator": "--seed", "output_type": "the command's own"}


def _required_parameters(class_name: str) -> list[str]:
    """The arguments a diffusers pipeline class's ``__call__`` takes without a default (none when unknown)."""
    sig = _pipeline_signature(class_name)
    return [n for n, p in (sig.parameters.items() if sig is not None else ()) if n != "self"
            and p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


# ------------------------------------------------------------------ modular pipelines (modular_model_index.json)
def _saved_components(model_dir) -> set[str]:
    """The components a saved modular pipeline folder's index points at (``[library, class, loading spec]``)."""
    index = json.loads(Path(model_dir, MODULAR_INDEX).read_text(encoding="utf-8"))
    return {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 3
            and v[1] is not None and isinstance(v[2], dict) and v[2].get("pretrained_model_name_or_path")}


def _walk_blocks(blocks):
    yield blocks
    for sub in getattr(blocks, "sub_blocks", {}).values():
        yield from _walk_blocks(sub)


def modular_blocks(model_dir):
    """(blocks, dropped) of a saved modular pipeline: diffusers' blocks of the folder (``ModularPipeline.
    from_pretrained``, no weights loaded), less each top-level step whose pretrained components the folder holds
    none of (a pipeline saved without its text encoder: the text-encoder step); ``dropped`` maps each dropped step
    to the outputs it would have made (the call passes them instead: the family's random prompt embeddings)."""
    from diffusers import ModularPipeline

    saved = _saved_components(model_dir)
    blocks = ModularPipeline.from_pretrained(str(model_dir)).blocks
    dropped = {}
    for name, step in list(blocks.sub_blocks.items()):
        needs = [c.name for c in step.expected_components if c.default_creation_method == "from_pretrained"]
        if needs and not set(needs) & saved:
            dropped[name] = {o.name for b in _walk_blocks(step) for o in b.intermediate_outputs}
            blocks.sub_blocks.pop(name)
    return blocks, dropped


def modular_parameters(blocks) -> tuple[set[str], list[str]]:
    """(argument names, required arguments) of a call of modular ``blocks``: their inputs, and the required ones
    that no step of theirs makes (the outputs of steps :func:`modular_blocks` dropped among them: the call passes
    those)."""
    made = {o.name for b in _walk_blocks(blocks) for o in b.intermediate_outputs}
    names = {i.name for i in blocks.inputs if i.name}
    return names, [n for n in blocks.required_inputs if n not in made]


def _call_parameters(class_name: str, model_dir=None) -> tuple[set[str] | None, list[str], set[str]]:
    """(argument names or None when unknown, required arguments, arguments made by the steps a modular folder
    lacks) of the pipeline a run calls: a modular folder's blocks, else the class's ``__call__``."""
    if is_modular(model_dir):
        blocks, dropped = modular_blocks(model_dir)
        names, required = modular_parameters(blocks)
        return names, required, set().union(*dropped.values()) if dropped else set()
    try:
        import diffusers

        modular_class = issubclass(getattr(diffusers, class_name, object), diffusers.ModularPipeline)
    except Exception:  # noqa: BLE001 - a class diffusers cannot import: the signature lookup says None
        modular_class = False
    if modular_class:  # a built-in tiny modular pipeline: its builder passes what it takes
        return None, [], set()
    return _pipeline_parameters(class_name), _required_parameters(class_name), set()


def _pipe_parameters(pipe) -> set[str]:
    """The argument names of a built pipeline's call: a modular pipeline's block inputs, else ``__call__``'s."""
    from diffusers import ModularPipeline

    if isinstance(pipe, ModularPipeline):
        return {i.name for i in pipe.blocks.inputs if i.name}
    return set(inspect.signature(pipe.__call__).parameters)


def load_modular(model_dir, dtype):
    """A saved modular pipeline with its weights (``load_components``): the blocks of :func:`modular_blocks`."""
    blocks, _ = modular_blocks(model_dir)
    pipe = blocks.init_pipeline(str(model_dir))
    pipe.load_components(dtype=dtype)
    return pipe


def read_input(path: str | os.PathLike):
    """An ``--input`` value: an image file -> a PIL image; a folder of image files (name order) or a video file
    (.mp4 / .gif / ..., read with imageio) -> a list of PIL RGB frames."""
    from PIL import Image

    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".bmp"))
        if not files:
            raise SystemExit(f"lite-boost generate: --input folder {path} holds no image files (.png, .jpg, .jpeg, "
                             ".webp, .bmp)")
        return [Image.open(p).convert("RGB") for p in files]
    if path.suffix.lower() in (".mp4", ".gif", ".webm", ".mov", ".avi", ".mkv"):
        try:
            import imageio.v3 as iio
        except ImportError:
            raise SystemExit(f"lite-boost generate: reading the video {path} needs imageio (pip install imageio "
                             "imageio-ffmpeg), or pass a folder of frames") from None
        return [Image.fromarray(frame).convert("RGB") for frame in iio.imiter(path)]
    return Image.open(path).convert("RGB")


class PlanExit(SystemExit):
    """SystemExit for a refusal of the planner: the message (``str(exc)``), and the exit status ``code``
    (:data:`EXIT_CODES`); :func:`main` prints the message to stderr."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def plan_exit(exc: Exception) -> PlanExit:
    """The command's exit for a planner error: ``lite-boost generate: <message>`` and its exit status."""
    from lite_boost.plan import exit_code

    return PlanExit(f"lite-boost generate: {exc}", exit_code(exc))


def check_family_options(family, class_name: str, args, config, world_size: int) -> None:
    """SystemExit naming the option when the run asks for something the family or pipeline cannot do.

    Runs before torchrun is launched and before any model is built: the planner on paper
    (:func:`lite_boost.plan.make_plan` with the family's record, the options named by their flags), then
    frames for an image pipeline, an image for a pipeline that takes none.
    """
    from lite_boost.plan import PLANNER_ERRORS, make_plan

    def option(flag: str, key: str) -> str:
        return flag if args.config is None else f"{key} (from --config {args.config})"

    p = config.parallel
    names = {
        "sparse": option(f"--sparsity {config.sparse.sparsity:g}" if config.sparse else "--sparsity", "sparse"),
        "cfg_parallel": option(f"--cfg-degree {p.cfg_degree}", "parallel.cfg_degree"),
        "sequence_parallel": lambda draft: option(f"--nproc {world_size} (sequence degree {draft.sequence_degree})",
                                                  "parallel"),
        "parallel_vae": option(f"--vae-parallel {p.vae_parallel}", "parallel.vae_parallel"),
        "cache": option(f"--cache {config.cache.method}" if config.cache else "--cache", "cache"),
        "cache.method": option(f"--cache {config.cache.method}" if config.cache else "--cache", "cache.method"),
        "quant": option(f"--quant {config.quant.method}" if config.quant else "--quant", "quant"),
    }
    try:
        make_plan(None, config, parallel=True, family=family, class_name=class_name, world_size=world_size,
                  option_names=names)
    except PLANNER_ERRORS as exc:
        raise plan_exit(exc) from None
    params, required, made_elsewhere = _call_parameters(class_name, getattr(args, "model", None))
    if params is not None:
        if args.num_frames is not None and "num_frames" not in params:
            what = ("takes no num_frames (the length of its video follows its inputs)" if family.output == "video"
                    else "makes images")
            raise SystemExit(f"lite-boost generate: --num-frames is for video pipelines; {class_name} (the "
                             f"{family.name} family) {what}")
        if args.image is not None and "image" not in params:
            raise SystemExit(f"lite-boost generate: --image is not supported by {class_name}, which takes no "
                             "conditioning image")
        names = [item.partition("=")[0] for item in args.inputs or ()]
        unknown = [n for n in names if n not in params]
        if unknown:
            raise SystemExit(f"lite-boost generate: --input {unknown[0]}=...: {class_name} takes no argument "
                             f"{unknown[0]!r}; its arguments: {sorted(params - {'self'})}")
        given = {opt: v for opt, v in (("image", args.image), ("height", args.height), ("width", args.width),
                                        ("num_frames", args.num_frames), ("num_inference_steps", args.steps))}
        # the command always passes a prompt and the output type; a family with random prompt embeddings passes
        # what a missing text-encoder step would have made
        supplied = set(names) | {"prompt", "output_type", "generator"} | {n for n, v in given.items() if v is not None}
        if any(t.prompt for t in family.tiny.values()):
            supplied |= made_elsewhere
        missing = [n for n in required if n not in supplied]
        if missing:
            hints = {"image": "--image PATH", "height": "--height H", "width": "--width W",
                     "num_frames": "--num-frames N", "num_inference_steps": "--steps N"}
            unmade = [n for n in missing if n in made_elsewhere]
            if unmade:
                raise SystemExit(f"lite-boost generate: {class_name} (the {family.name} family) needs "
                                 f"{', '.join(unmade)}, made by a step whose components {args.model} does not hold "
                                 "(its text encoder, say), and the family has no prompt embeddings to pass instead")
            how = " ".join(hints.get(n, f"--input {n}=PATH") for n in missing)
            raise SystemExit(f"lite-boost generate: {class_name} (the {family.name} family) needs "
                             f"{', '.join(missing)}; pass {how}")
    scale_arg = family.cfg_argument
    if args.guidance_scale is not None and (scale_arg is None or (params is not None and scale_arg not in params)):
        taken = (f"takes no {scale_arg} (the {family.name} family's classifier-free guidance argument)" if scale_arg
                 else f"(the {family.name} family) takes no guidance scale argument (its guider holds it)")
        raise SystemExit(f"lite-boost generate: --guidance-scale is not supported by {class_name}, which {taken}; "
                         "drop --guidance-scale")


def rank_threads(threads: int | None, nproc: int) -> int:
    """Torch threads per rank of an --nproc run: --threads as given (per process), else the CPU cores shared out."""
    return threads if threads else max(1, (os.cpu_count() or 1) // max(1, nproc))


def _torchrun_command(args, argv: list[str]) -> list[str]:
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            "-m", "lite_boost.cli", *rest]


def _validate_generate(args) -> None:
    def bad(name, value, allowed):
        raise SystemExit(f"lite-boost generate: {name} must be {allowed}, got {value!r}")

    if args.nproc < 1:
        bad("--nproc", args.nproc, "a positive integer")
    if args.sparsity is not None and not 0.0 <= args.sparsity < 1.0:
        bad("--sparsity", args.sparsity, "in [0, 1)")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and (v <= 0 or v % 16):
            bad(f"--{name}", v, "a positive multiple of 16")
    if args.num_frames is not None and (args.num_frames < 1 or (args.num_frames - 1) % 4):
        bad("--num-frames", args.num_frames, "4k + 1 (1, 5, 9, ..., 81)")
    if args.warmup < 0:
        bad("--warmup", args.warmup, "a non-negative integer")
    for name in ("sequence_degree", "ulysses_degree", "ring_degree", "tp_degree", "fsdp_degree"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            bad("--" + name.replace("_", "-"), v, "a positive integer")
    world = int(os.environ.get("WORLD_SIZE", "0")) or args.nproc  # under torchrun (no --nproc): the launched world
    if (any(getattr(args, n, None) is not None for n in ("ulysses_degree", "ring_degree"))
            or getattr(args, "tp_degree", 1) > 1 or getattr(args, "fsdp_degree", 1) > 1) \
            and world > 1:  # one process: check_processes gives the launch hint
        from lite_boost.config import ConfigError, ParallelConfig

        try:  # degrees that cannot fit --nproc fail here, before torchrun starts anything
            ParallelConfig(sequence_degree=args.sequence_degree, cfg_degree=args.cfg_degree,
                           ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                           tp_degree=getattr(args, "tp_degree", 1),
                           fsdp_degree=getattr(args, "fsdp_degree", 1)).resolve_mesh(world)
        except ConfigError as exc:
            raise plan_exit(exc) from None
    if getattr(args, "vae_overlap", None) is not None:
        if args.vae_overlap < 1:
            bad("--vae-overlap", args.vae_overlap, "a positive integer")
        if args.vae_parallel != "chunked":
            bad("--vae-overlap", args.vae_overlap, "used only with --vae-parallel chunked")
    if args.steps is not None and args.steps < 1:
        bad("--steps", args.steps, "a positive integer")
    if args.image is not None and not Path(args.image).is_file():
        bad("--image", args.image, "an existing image file")
    for item in args.inputs or ():
        name, sep, path = item.partition("=")
        if not sep or not name.isidentifier() or not path:
            bad("--input", item, "NAME=PATH (a pipeline argument name and a file or folder)")
        if name in _CLI_ARGUMENTS:
            bad("--input", item, f"a pipeline argument that has no option of its own ({name} has: "
                                 f"{_CLI_ARGUMENTS[name]})")
        if not Path(path).exists():
            bad("--input", item, "NAME=PATH with an existing image file, folder of frames or video file")
    if args.model is not None and index_path(args.model) is None:
        bad("--model", args.model, f"a diffusers pipeline folder (with model_index.json, or {MODULAR_INDEX} for a "
                                   "modular pipeline)")
    if args.config is not None and not Path(args.config).is_file():
        bad("--config", args.config, "an existing YAML file")
    check_output(args.output, getattr(args, "overwrite", False))
    if args.device is not None:
        check_device(args.device)
    if args.cache is not None:
        from lite_boost.config import CacheConfig, ConfigError

        try:
            CacheConfig.parse(args.cache)
        except ConfigError as exc:
            raise SystemExit(f"lite-boost generate: --cache: {exc}") from None


def _sparsity(args) -> float:
    """--sparsity, or its default: 0 (dense) with --model, the built-in tiny model's (its record's
    ``TinyPipeline.sparsity``) without."""
    if args.sparsity is not None:
        return args.sparsity
    if getattr(args, "model", None) is None:
        family, _ = resolve_family(args)
        return family.tiny[_tiny_kind(family, args)].sparsity
    return 0.0


def _boost_config(args):
    from lite_boost.config import BoostConfig, CacheConfig, ParallelConfig, QuantConfig, SparseConfig

    precision = getattr(args, "attention_precision", None)
    if args.config:
        config = BoostConfig.from_yaml(args.config)
        if precision is not None:  # the flag overrides the file's attention.precision
            config = config.replace(attention=config.attention.replace(precision=precision))
        return config
    sparsity = _sparsity(args)
    sparse = SparseConfig(sparsity=sparsity) if sparsity > 0 else None
    parallel = ParallelConfig(sequence_degree=args.sequence_degree, cfg_degree=args.cfg_degree,
                              ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                              rotate_method=args.rotate_method, tp_degree=getattr(args, "tp_degree", 1),
                              fsdp_degree=getattr(args, "fsdp_degree", 1),
                              vae_parallel=getattr(args, "vae_parallel", None), vae_overlap=getattr(args, "vae_overlap", None))
    cache = CacheConfig.parse(args.cache) if args.cache else None
    quant = QuantConfig(method=args.quant) if getattr(args, "quant", None) else None
    return BoostConfig(attention_backend=args.attention_backend, sparse=sparse, parallel=parallel, cache=cache,
                       quant=quant, offload=bool(getattr(args, "offload", False)),
                       attention={"precision": precision or "auto"})


def _load_pipeline(args, kind, device, dtype, family, offload: bool = False):
    import torch

    if args.model is None:
        pipe = family.tiny[kind].build(kind, dtype=dtype)
    elif is_modular(args.model):
        pipe = load_modular(args.model, dtype)
    else:
        from diffusers import DiffusionPipeline

        # components saved as None (a pipeline saved without its text encoder, say) load as None
        index = json.loads(Path(args.model, "model_index.json").read_text(encoding="utf-8"))
        absent = {k: None for k, v in index.items() if not k.startswith("_") and v in ([None, None], None)}
        if "text_encoder" in absent:  # called with the record's prompt embeddings: its stand-ins may fill in
            record = next((t for t in family.tiny.values() if t.prompt and t.stand_ins), None)
            absent.update({k: record.stand_in(k) for k in absent if record is not None and k in record.stand_ins})
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype, **absent)
        if getattr(pipe, "vae", None) is not None:
            pipe.vae.to(torch.float32)  # the VAEs run in fp32 (as diffusers' video examples do)
    if not offload:  # offloaded weights stay on the host; the boost uploads them block by block
        pipe.to(device)
    return pipe


def _call_kwargs(args, kind, tiny: bool, family, pipe=None):
    """The pipeline call of a run. Sizes and steps not given: the tiny model's defaults (the family record's
    :class:`~lite_boost.adapter.family.TinyPipeline`), else the pipeline's own."""
    from lite_boost.demo import DEMO_NEGATIVE_PROMPT, DEMO_PROMPT

    params = _pipe_parameters(pipe) if pipe is not None else None
    video = kind in ("t2v", "i2v") and (params is None or "num_frames" in params)
    record = family.tiny[kind] if tiny else None
    shape, steps = (record.shape, record.steps) if record is not None else ((None, None, None), None)
    kw = {}
    scale = args.guidance_scale if args.guidance_scale is not None else (5.0 if tiny else None)
    cfg = scale is None or scale > 1  # None: the pipeline's default scale, CFG on for every registered pipeline
    # a pipeline without a text encoder (the tiny models, a folder saved without one): the prompt as the family's
    # tiny model gives it (random prompt embeddings)
    prompter = record if record is not None else next((t for t in family.tiny.values() if t.prompt), None)
    embeds = (prompter.prompt_kwargs(pipe, cfg=cfg, seed=args.seed) if prompter is not None and pipe is not None
              and getattr(pipe, "text_encoder", None) is None else None)
    if embeds is not None:
        kw.update(embeds)
    else:
        kw["prompt"] = args.prompt or DEMO_PROMPT
        if params is None or "negative_prompt" in params:  # some pipelines take none (they encode "" themselves)
            kw["negative_prompt"] = args.negative_prompt if args.negative_prompt is not None else DEMO_NEGATIVE_PROMPT
    for key, value in (("height", args.height or shape[0]), ("width", args.width or shape[1]),
                       ("num_frames", (args.num_frames or shape[2]) if video else None),
                       ("num_inference_steps", args.steps or steps)):
        if value is not None:
            kw[key] = value
    if scale is not None and family.cfg_argument is not None and (params is None or family.cfg_argument in params):
        kw[family.cfg_argument] = scale  # check_family_options refused a --guidance-scale the pipeline cannot take
    kw["output_type"] = "np"
    if args.image is not None:
        from PIL import Image

        image = Image.open(args.image).convert("RGB")
        if "height" in kw and "width" in kw:
            image = image.resize((kw["width"], kw["height"]))
        kw["image"] = image
    for item in getattr(args, "inputs", None) or ():
        name, _, path = item.partition("=")
        kw[name] = read_input(path)
    kw["_seed"] = args.seed
    return kw


def _run(pipe, kw, device_type, warmup: int = 0, counter=None, audio: dict | None = None):
    """One timed call after ``warmup`` untimed ones (one step, latent output; a modular pipeline: whole calls):
    (frames or images, phase times). ``audio``: a dict that gets the ``audio`` and ``sampling_rate`` a modular
    pipeline returns with its video."""
    import contextlib

    import torch

    from lite_boost.timing import PhaseTimer

    from lite_boost.timing import _sync

    from diffusers import ModularPipeline

    kw = dict(kw)
    seed = kw.pop("_seed")
    modular = isinstance(pipe, ModularPipeline)
    # a modular pipeline runs all its steps (its decode step has no latent output to stop at; its scheduler may
    # want more than one step), so its warm-up is a whole call; it takes no step callback: its steps are timed at
    # the transformer calls, its outputs asked for by name
    outputs = [o.name for o in pipe.blocks.outputs] if modular else None
    warm = []
    for _ in range(warmup):
        _sync(device_type)
        t0 = time.perf_counter()
        with torch.inference_mode():
            generator = torch.Generator(device="cpu").manual_seed(seed)
            if modular:
                pipe(**kw, generator=generator, output=outputs)
            else:
                pipe(**{**kw, "num_inference_steps": 1, "output_type": "latent", "generator": generator})
        _sync(device_type)
        warm.append(time.perf_counter() - t0)
    kw["generator"] = torch.Generator(device="cpu").manual_seed(seed)
    with torch.inference_mode(), PhaseTimer(pipe, device_type) as timer, (counter or contextlib.nullcontext()):
        if modular:
            def step_done(*_):  # returns None: the transformer's output stays as it is
                timer.callback(pipe, 0, None, {})

            hooks = [m.register_forward_hook(step_done) for m in _transformers(pipe)]
            try:
                out = pipe(**kw, output=outputs)
            finally:
                for h in hooks:
                    h.remove()
        else:
            out = pipe(**kw, callback_on_step_end=timer.callback)
    timer.times.warmup_s = warm
    if modular:
        if audio is not None and out.get("audio") is not None:
            audio.update(audio=out["audio"], sampling_rate=out.get("sampling_rate"))
        return out.get("videos", out.get("images")), timer.times
    frames = getattr(out, "frames", None)
    return (out.images if frames is None else frames), timer.times


def one_off_lines(rows: dict, boost_s: float | None, call: str = "1 step") -> list[str]:
    """The one-off costs, kept out of the timing table: boost() itself and the untimed first calls (``call``:
    what one was, ``"1 step"`` or ``"whole call"``)."""
    out = []
    if boost_s is not None:
        out.append(f"boost() itself: {boost_s:.2f} s (patching; quantizing weights when --quant is on)")
    stock, boosted = rows.get("stock"), rows.get("boosted")
    if boosted is not None and boosted.warmup_s:
        first = f"first boosted call ({call}, untimed warm-up): {boosted.warmup_s[0]:.2f} s"
        if stock is not None and stock.warmup_s:
            extra = boosted.warmup_s[0] - stock.warmup_s[0]
            first += (f" against stock's {stock.warmup_s[0]:.2f} s; the boosted excess ({extra:+.2f} s) includes its "
                      "kernels' first use (C++ library load, compilation, the first sparse selection)")
        out.append(first)
    return out


def _statistics_hint(decisions) -> str:
    stats = sorted(d.statistic for d in decisions if d.statistic is not None)
    if not stats:
        return ""
    mid = stats[len(stats) // 2]
    return (f"; its statistic (relative change of the first block's output between steps) ranged {stats[0]:.3f} - "
            f"{stats[-1]:.3f}, median {mid:.3f}: a threshold near {math.ceil(mid * 100) / 100:.2f} reuses about half "
            "the calls (check the PSNR line)")


def advice(pipe, config, work, rows: dict) -> list[str]:
    """Where a feature cannot pay at this shape or these settings: say so and what to try."""
    from lite_boost.config import SPARSE_BREAK_EVEN, SPARSE_BREAK_EVEN_MEASURED_UP_TO

    notes = []
    stock, boosted = rows.get("stock"), rows.get("boosted")
    slower = stock is not None and boosted is not None and boosted.denoise_s >= stock.denoise_s
    states = [getattr(m, "_lite_boost", None) for m in _transformers(pipe)]
    sparse = [st.extras.get("sparse") for st in states if st is not None and st.extras.get("sparse") is not None]
    if config.sparse is not None and config.sparse.sparse_type is not None and sparse:
        events = [e for sp in sparse for e in sp.events if e.path == "sparse"]
        grid = next((sp.grid for sp in sparse if sp.grid), None)
        tokens = math.prod(grid) if grid else None
        backend = next((e.backend for e in events if e.backend), None)
        eff = sum(e.effective_sparsity for e in events) / len(events) if events else 0.0
        measured = backend in SPARSE_BREAK_EVEN
        even = SPARSE_BREAK_EVEN[backend] if measured else None
        below = tokens is not None and measured and (even is None or tokens < even)
        if not events:
            kept = (f"at {tokens:,} tokens " if tokens is not None else "") + "every block is kept"
            notes.append(f"block-sparse attention did not run: {kept} at sparsity {config.sparse.sparsity:g} (too few "
                         "blocks of 128 tokens to skip any), so dense attention ran. Sparse pays from several thousand "
                         "tokens per sequence: a longer video or a larger frame")
        elif below or slower or eff < 0.3:
            why = []
            if tokens is not None:
                why.append(f"{tokens:,} self-attention tokens")
            if measured:
                why.append((f"the {backend} kernel's measured break-even is about {even:,} tokens" if even else
                            f"the {backend} kernel did not beat dense SDPA up to {SPARSE_BREAK_EVEN_MEASURED_UP_TO:,} "
                            "tokens") + " at sparsity 0.8 on this CPU (benchmarks/results/sparse_break_even.md)")
            if events:
                why.append(f"effective sparsity {eff:.2f}: the forced text / first-frame / diagonal blocks are a large "
                           "share of so few blocks")
            verdict = ("cannot pay at this shape: the boosted loop was not faster" if slower else
                       "is at or below its measured break-even at this shape, so its gain here is small or noise")
            notes.append(f"block-sparse attention {verdict} (" + "; ".join(why) + "): selecting blocks and reordering "
                         "tokens cost about what the skipped blocks save. Try --sparsity 0 (dense), or a longer video "
                         "/ larger frame (sparse pays from several thousand tokens per sequence)")
    if config.cache is not None and work is not None and work.calls:
        reused = work.calls - work.ffn_runs
        runtime = next((st.extras.get("cache") for st in states if st is not None and st.extras.get("cache")), None)
        if config.cache.method == "mag_cache" and config.cache.params.get("calibrate"):
            notes.append("mag_cache calibration run: nothing is reused by design; paste the printed mag_cache spec "
                         "(one line, above) as --cache for the real runs")
        elif reused == 0:
            hint = _statistics_hint(runtime.decisions) if runtime is not None else ""
            notes.append(f"the step cache reused nothing ({config.cache.method} with "
                         f"{dict(config.cache.params) or 'its defaults'}): every change between steps was above its "
                         f"threshold{hint}. Raise the threshold (see docs/guides/caching.md)")
        elif slower:
            notes.append(f"the step cache reused {reused} of {work.calls} calls but the loop was not faster: the "
                         "reused calls are too cheap to save more than the cache's own bookkeeping at this shape")
    return notes


def _demo_model_line(pipe, kw, family, kind: str) -> str | None:
    """What the built-in model is (its record's ``TinyPipeline.describe``): random weights, sizes, tokens."""
    return family.tiny[kind].describe_run(pipe, kw)


def video_psnr(frames, ref) -> tuple[float, float, float]:
    """PSNR (dB) of ``frames`` against ``ref`` with the reference video's value range as the peak.

    Returns (psnr, peak, max abs diff). The tiny random-weight VAE does not span [0, 1], so a peak of 1
    would flatter the figure; inf when the videos are identical.
    """
    import math

    import numpy as np

    x, r = np.asarray(frames, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    peak = float(r.max() - r.min())
    mse = float(((x - r) ** 2).mean())
    diff = float(np.abs(x - r).max())
    psnr = math.inf if mse == 0 else (10 * math.log10(peak * peak / mse) if peak > 0 else -math.inf)
    return psnr, peak, diff


def _transformers(pipe) -> list:
    return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None]


def _block_work_counter(counter, models):
    """``counter(models, blocks, ffn, attn)`` with the block list and the feed-forward / self-attention child
    names these transformers have (blocks / ffn / attn1, or transformer_blocks / img_mlp or ff / attn), or None
    when they have none of those."""
    import torch

    names = None
    for m in models:
        blocks_attr = next((a for a in ("blocks", "transformer_blocks")
                            if isinstance(getattr(m, a, None), torch.nn.ModuleList)), None)
        if blocks_attr is None or not len(getattr(m, blocks_attr)):
            return None
        last = getattr(m, blocks_attr)[-1]
        ffn = next((a for a in ("ffn", "ff", "img_mlp") if hasattr(last, a)), None)
        attn = next((a for a in ("attn1", "attn") if hasattr(last, a)), None)
        if ffn is None or attn is None or names not in (None, (blocks_attr, ffn, attn)):
            return None
        names = (blocks_attr, ffn, attn)
    return counter(models, *names) if names is not None else None


def applied_summary(pipe, config, work=None, device=None, dtype=None) -> list[str]:
    """What the boost applied, one line per feature (printed after the timing table)."""
    from lite_boost.ops.attention import available_backends

    models = _transformers(pipe)
    states = [getattr(m, "_lite_boost", None) for m in models]
    lines = []
    # attention backend and why
    m0 = models[0] if models else None
    if config.attention_backend is not None:
        lines.append(f"attention backend: {config.attention_backend} (forced by --attention-backend / config)")
    elif m0 is not None:
        heads = m0.config.num_attention_heads
        head_dim = m0.config.attention_head_dim
        reasons = available_backends(device or "cpu", dtype or m0.dtype, head_dim, heads)
        chosen = next((n for n, r in reasons.items() if r is None), None)
        skipped = "; ".join(f"{n}: {r}" for n, r in reasons.items() if r is not None and
                            list(reasons).index(n) < list(reasons).index(chosen or n))
        lines.append(f"attention backend: {chosen} (first usable of {' -> '.join(reasons)}"
                     f"{'; skipped ' + skipped if skipped else ''})")
    if config.attention.precision != "auto":
        lines.append(f"attention precision: {config.attention.precision} (self / joint attention, dense and "
                     "block-sparse; cross-attention in the model dtype)")
    # RoPE cache
    caches = [st.rope_cache for st in states if st is not None and st.rope_patched]
    if caches:
        hits, misses = sum(c.hits for c in caches), sum(c.misses for c in caches)
        lines.append(f"RoPE tables: cached, {hits} hits / {misses} builds over the runs "
                     f"(stock rebuilds them at every transformer call)")
    else:
        lines.append("RoPE tables: diffusers' own (not cached)")
    # sparsity
    sparse = [st.extras.get("sparse") for st in states if st is not None and st.extras.get("sparse") is not None]
    if config.sparse is None or not sparse:
        lines.append("self-attention: dense")
    else:
        events = [e for sp in sparse for e in sp.events]
        n_sparse = sum(e.path == "sparse" for e in events)
        eff = [e.effective_sparsity for e in events if e.path == "sparse"]
        mean = sum(eff) / len(eff) if eff else 0.0
        lines.append(f"self-attention: block-sparse rf_v2 at sparsity {config.sparse.sparsity:g}, {n_sparse} of "
                     f"{len(events)} calls sparse, effective sparsity {mean:.2f} over them")
    # step cache
    if config.cache is None:
        lines.append("step cache: off")
    else:
        params = ",".join(f"{k}={v}" for k, v in config.cache.params.items())
        what = f"{config.cache.method}{'(' + params + ')' if params else ''}"
        lines.append(f"step cache: {what}: {work.summary() if work is not None else 'on'}")
    # quantization
    quant = [(m, st.extras.get("quant")) for m, st in zip(models, states) if st is not None and st.extras.get("quant")]
    if config.quant is None or not quant:
        lines.append("Linear layers: full precision")
    else:
        lines.append("Linear layers: " + "; ".join(q.summary(m) for m, q in quant))
    # offload
    from lite_boost.offload import offload_summary

    lines.append(offload_summary(pipe))
    # parallel layout
    pstate = getattr(pipe, "_lite_boost_parallel", None)
    if pstate is None:
        lines.append("parallel: one process")
    else:
        mesh = pstate.mesh
        seq = (f"Ulysses sequence degree {mesh.sequence_degree}" if mesh.ring_degree == 1 else
               f"sequence degree {mesh.sequence_degree} (Ulysses {mesh.ulysses_degree} x Ring {mesh.ring_degree}, "
               f"{mesh.rotate_method})")
        shard = "".join(f" x {what} degree {d}" for what, d in (("tensor-parallel", mesh.tp_degree),) if d > 1)
        shard += f", weights FSDP-sharded over {mesh.fsdp_degree} ranks" if mesh.fsdp_degree > 1 else ""
        lines.append(f"parallel: {mesh.world_size} processes, {seq} x CFG degree {mesh.cfg_degree}{shard} over "
                     f"{mesh.backend}")
    return lines


def _run_kind(family, class_name: str, args) -> str:
    """t2v / i2v for video pipelines, t2i / i2i for image pipelines (the family record's ``output``; for a
    record that leaves it open, the pipeline's call signature)."""
    if args.model is None:
        return _tiny_kind(family, args)
    params = _call_parameters(class_name, args.model)[0]
    video = family.output == "video" if family.output is not None else (params is None or "num_frames" in params)
    return ("i2v" if video else "i2i") if args.image else ("t2v" if video else "t2i")


def generate(args, argv: list[str]) -> int:
    from lite_boost.config import ConfigError

    _validate_generate(args)
    family, class_name = resolve_family(args)  # from model_index.json: no weights loaded
    try:
        config = _boost_config(args)
    except ConfigError as exc:
        raise plan_exit(exc) from None
    launching = args.nproc > 1 and "LOCAL_RANK" not in os.environ
    check_processes(config, args.nproc, int(os.environ.get("WORLD_SIZE", "1")), args.config)
    # unsupported combinations stop here, before torchrun starts anything
    check_family_options(family, class_name, args, config,
                         args.nproc if launching else int(os.environ.get("WORLD_SIZE", "1")))
    if launching:
        cmd = _torchrun_command(args, argv)  # torchrun = python -m torch.distributed.run
        env = dict(os.environ)
        # the thread budget split over the ranks, said aloud (torchrun would set 1 thread per rank with a warning)
        env.setdefault("OMP_NUM_THREADS", str(rank_threads(args.threads, args.nproc)))
        print(f"launching ({args.nproc} processes x {env['OMP_NUM_THREADS']} thread(s)):", " ".join(cmd), flush=True)
        return subprocess.call(cmd, env=env)

    import torch

    from lite_boost.timing import format_timing_table

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device:
        device = check_device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif getattr(torch, "npu", None) is not None and torch.npu.is_available():
        device = torch.device("npu", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if config.quant is not None:  # a method this device cannot run: say so before any model is built
        from lite_boost.quant import method_problem, usable_methods

        why = method_problem(config.quant.method, device)
        if why is not None:
            raise SystemExit(f"lite-boost generate: --quant {config.quant.method} cannot run on {device} ({why}); "
                             f"methods that can run on {device.type}: {usable_methods(device)}")
    dtype_name = _DTYPES[args.dtype] if args.dtype else ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    kind = _run_kind(family, class_name, args)
    image_out = kind in ("t2i", "i2i")
    if config.offload is not None and config.offload.onload_device is None:
        config = config.replace(offload=config.offload.replace(onload_device=str(device)))
    pipe = _load_pipeline(args, kind, device, dtype, family, offload=config.offload is not None)
    pipe.set_progress_bar_config(disable=rank != 0)
    kw = _call_kwargs(args, kind, tiny=args.model is None, family=family, pipe=pipe)
    say = print if rank == 0 else (lambda *a, **k: None)
    source = (f"tiny built-in {class_name} (the {family.name} family)" if args.model is None
              else f"{args.model} ({class_name}, the {family.name} family)")
    size = f"{kw.get('height', 'default')}x{kw.get('width', 'default')}"
    frames_txt = f", {kw['num_frames']} frames" if "num_frames" in kw else ""
    say(f"lite-boost generate: {kind}, {source}, {size}{frames_txt}, {kw.get('num_inference_steps', 'default')} "
        f"steps, {device}, {dtype_name}, {world} process(es)")
    line = _demo_model_line(pipe, kw, family, kind) if args.model is None else None
    if line:
        say(line)

    rows = {}
    stock_frames = None
    stock_audio, audio = {}, {}  # what a pipeline that makes sound returns with its video (a modular one's audio)
    if not args.no_compare and config.offload is not None and device.type != "cpu":
        say(f"stock run skipped with --offload on {device} (it would need the whole model there); --device cpu "
            "compares")
    elif not args.no_compare:
        # Every rank runs the stock pass (no collectives in it): a rank-0-only baseline would leave
        # the other ranks waiting at the first collective for as long as it takes.
        say("stock diffusers run" + (f" (on each of the {world} ranks, one device each)" if world > 1 else "") + " ...")
        stock_frames, rows["stock"] = _run(pipe, kw, device.type, args.warmup, audio=stock_audio)
    t0 = time.perf_counter()
    from lite_boost.api import apply_parallel_plan, apply_plan
    from lite_boost.plan import PLANNER_ERRORS, make_plan

    try:  # the same planner as lite_boost.boost / ParallelManager, its refusals as exit codes
        plan = make_plan(pipe, config, parallel=world > 1)
    except PLANNER_ERRORS as exc:
        raise plan_exit(exc) from None
    (apply_parallel_plan if world > 1 else apply_plan)(pipe, plan)
    boost_s = time.perf_counter() - t0
    say("boosted run ...")
    from lite_boost.cache import count_block_work

    work = _block_work_counter(count_block_work, _transformers(pipe))  # work really done in the timed boosted run
    frames, rows["boosted"] = _run(pipe, kw, device.type, args.warmup, counter=work, audio=audio)
    if rank != 0:
        return 0
    if image_out:
        written, fmt = write_image(frames, output_path(args.output, f"outputs/lite_boost_{kind}.png"))
    else:
        fps = args.fps or (pipe_fps if isinstance(pipe_fps := getattr(pipe, "fps", None), int) else 16)
        written, fmt = write_video(frames, output_path(args.output, f"outputs/lite_boost_{kind}.mp4"), fps=fps)
    print(f"\nwrote {written} [{fmt}]")
    if audio.get("audio") is not None:
        wav = write_audio(audio["audio"], audio["sampling_rate"], written.with_suffix(".wav"))
        print(f"wrote {wav} [WAV, {audio['sampling_rate']} Hz, the soundtrack the pipeline made with the video]")
    print()
    # phases the boost leaves alone: their "speed-up" would only be run-to-run noise
    from lite_boost.parallel.vae import parallel_vae_state

    vae_parallel = world > 1 and parallel_vae_state(getattr(pipe, "vae", None)) is not None  # what really ran parallel
    untouched = ("text encode",) + (() if vae_parallel else ("VAE decode",))
    from lite_boost.timing import speedup_line, warmup_line

    from diffusers import ModularPipeline

    whole = isinstance(pipe, ModularPipeline)  # its warm-up calls are whole calls (_run)
    print(warmup_line(rows, args.warmup, call="whole" if whole else "1-step"))
    threads = torch.get_num_threads()
    if world > 1:
        print(f"threads: boosted = {world} processes x {threads} torch thread(s) = {world * threads}; the stock "
              f"column is NOT a one-process baseline with that whole budget: stock ran on each rank, one process "
              f"with {threads} thread(s) (one rank's share). For the one-process stock baseline with the same "
              f"budget run `lite-boost generate --threads {world * threads}` with the same other options and "
              "compare its stock column")
    else:
        print(f"threads: stock and boosted ran in this one process with the same {threads} torch thread(s)"
              + (f" on {device}" if device.type != "cpu" else ""))
    print()
    print(format_timing_table(rows, untouched=untouched))
    if "stock" in rows:
        print("\n" + speedup_line(rows["stock"], rows["boosted"], step_cache=config.cache is not None))
    once = one_off_lines(rows, boost_s, call="whole call" if whole else "1 step")
    if once:
        print("one-off costs (not in the table): " + "; ".join(once))
    if stock_frames is not None:
        psnr, peak, diff = video_psnr(frames, stock_frames)
        what = "image" if image_out else "video"
        print(f"\nmax |boosted - stock| over the {what} (values in [0, 1]): {diff:.2e}"
              + (" (step caching, sparsity and quantization approximate by design)"
                 if config.cache or config.sparse or config.quant else ""))
        print(f"{what} PSNR boosted vs stock: {'inf' if psnr == float('inf') else f'{psnr:.1f}'} dB "
              f"(peak = the stock {what}'s value range, {peak:.3f})")
        if audio.get("audio") is not None and stock_audio.get("audio") is not None:
            sound = (audio["audio"].float() - stock_audio["audio"].float()).abs().max().item()
            print(f"max |boosted - stock| over the audio (samples in [-1, 1]): {sound:.2e}")
    print("\napplied:")
    for line in applied_summary(pipe, config, work, device, dtype):
        print(f"- {line}")
    notes = advice(pipe, config, work, rows)
    if notes:
        print("\nnotes:")
        for line in notes:
            print(f"- {line}")
    return 0


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option is reported with its subcommand's usage (argparse
    reports it with the top-level one) and the closest options that subcommand has."""
    import difflib

    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    sub = next((a.choices[args.command] for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                and getattr(args, "command", None) in a.choices), parser)
    known = [o for a in sub._actions for o in a.option_strings]
    hints = []
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=2, cutoff=0.6)
            if close:
                hints.append(f"{arg}: did you mean {' or '.join(close)}?")
    sub.error(f"unrecognized arguments: {' '.join(extra)}" + ("; " + "; ".join(hints) if hints else ""))


# ----------------------------------------------------------------------------------------------- #
# `lite-boost plan`: per-rank memory of each parallel layout from the configs alone (lite_boost.memory)
def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="per-rank memory of each parallel layout (sequence / cfg / fsdp / tp degrees, "
                                       "offload) from the model's configs alone; marks what fits, recommends one")
    plan.add_argument("--model", default=None, help="diffusers pipeline folder (only model_index.json and the "
                                                    "components' config.json are read)")
    plan.add_argument("--family", default=None, help="a model family's reference model (`lite-boost models`; its "
                                                     "record's reference: a released checkpoint with its text encoder)")
    plan.add_argument("--nproc", type=int, default=1, help="ranks (one device each)")
    plan.add_argument("--device-memory", default=None, metavar="SIZE",
                      help="memory per device, e.g. 24GiB, 80GB, 64G (without it nothing is marked as fitting)")
    plan.add_argument("--height", type=int, default=None, help="default: the family's reference")
    plan.add_argument("--width", type=int, default=None, help="default: the family's reference")
    plan.add_argument("--num-frames", type=int, default=None, help="default: the family's reference")
    plan.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="weights and activations")
    plan.add_argument("--headroom", type=float, default=0.1,
                      help="fraction of the device memory kept free for the framework and the allocator (0.1)")


def plan_command(args) -> int:
    from lite_boost.config import ConfigError, parse_bytes
    from lite_boost.memory import DTYPE_BYTES, dims_for_family, dims_for_model_dir, format_plan, plan_layouts, token_count
    from lite_boost.plan import planner_features

    def bad(msg):
        raise SystemExit(f"lite-boost plan: {msg}")

    if (args.model is None) == (args.family is None):
        bad("give exactly one of --model PATH (a diffusers pipeline folder) or --family NAME "
            f"({list(_registered_families())})")
    if not isinstance(args.nproc, int) or args.nproc < 1:
        bad(f"--nproc must be >= 1, got {args.nproc}")
    for flag, value in (("--height", args.height), ("--width", args.width), ("--num-frames", args.num_frames)):
        if value is not None and value < 1:
            bad(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.headroom < 1:
        bad(f"--headroom must be in [0, 1), got {args.headroom}")
    try:
        memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory is not None else None
        nbytes = DTYPE_BYTES[_DTYPES[args.dtype]]
        if args.family is not None:
            fams = _registered_families()
            if args.family not in fams:
                bad(f"--family must be one of {list(fams)}, got {args.family!r}")
            family = fams[args.family]
            dims, shape = dims_for_family(family, nbytes)
        else:
            index = Path(args.model, "model_index.json")
            name = json.loads(index.read_text(encoding="utf-8")).get("_class_name") if index.is_file() else None
            family = family_for_pipeline_class(name) if isinstance(name, str) else None
            dims = dims_for_model_dir(args.model, nbytes, family)
            shape = tuple((family.reference or {}).get("shape", (81, 480, 832))) if family else (81, 480, 832)
    except ConfigError as exc:
        bad(str(exc))
    shape = (args.num_frames or shape[0], args.height or shape[1], args.width or shape[2])
    tokens = token_count(dims, *shape)
    available, switches = planner_features(family)
    plan = plan_layouts(dims, args.nproc, tokens, memory, headroom=args.headroom, shape=shape,
                        available=available, **switches)
    print(format_plan(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``lite-boost`` command. A refusal of the planner exits with :data:`lite_boost.plan.EXIT_CODES`
    (2: an option or config value, 3: an unsupported model, 4: no parallel plan for it)."""
    try:
        return _main(argv)
    except PlanExit as exc:
        print(exc, file=sys.stderr, flush=True)  # the interpreter prints nothing for an int exit status
        raise


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(build_parser(), argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if getattr(args, "verbose", False):
        from lite_boost import _quiet

        _quiet.uninstall()  # -v: every dependency notice too (import lite_boost filters a few, narrowly)
    if args.command == "env":
        print(env_report())
        return 0
    if args.command == "models":
        print(models_report())
        return 0
    if args.command == "plan":
        return plan_command(args)
    return generate(args, argv)


if __name__ == "__main__":
    sys.exit(main())
