"""Quality of quantized Linear layers: transformer output vs fp32 stock at Wan2.1-1.3B dims, and video PSNR
vs stock on the main job (``lite-boost generate``'s built-in pipeline).

    python benchmarks/bench_quant_quality.py                 # both parts
    python benchmarks/bench_quant_quality.py --part transformer --tokens 32760 --layers 1

Part "transformer": a ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's dimensions (12 x 128 heads, ffn 8960,
text_dim 4096), random weights (seed 0), ``--layers`` blocks at ``--tokens`` tokens (4,096 = 4 x 32 x 32 by
default), one call at timestep 500; relative L2 error and cosine of the output against the fp32 stock
model, for each method:

* ``int8_dynamic``, ``int8_weight_only``: ``lite_boost.boost(model, {"quant": method})`` (torchao, CPU, fp32);
* ``w8a8_npu``: the lite_boost path on a bfloat16 model with torch_npu replaced by the executable
  specification of its two operators (``tests/quant_specs.py``): the arithmetic the Ascend operators
  document, not a run on an NPU;
* ``fp8``: emulated (torchao's FP8 kernels need a GPU with FP8 tensor cores): bfloat16 model, weights
  and activations rounded to float8_e4m3 with per-row / per-token scales ``max|x| / 448`` (torchao's
  per-row scheme), products in fp32;
* ``bf16 stock``: the bfloat16 model itself, for scale (w8a8_npu and fp8 include its error).

Part "video": the main job's pipeline (tiny random-weight Wan T2V, 192 x 256, 25 frames, 10 steps, CFG),
each variant's decoded video against stock's (PSNR with the stock video's value range as peak).

Random weights give random activations: outlier channels, which make real checkpoints harder to quantize,
are absent, while the diffuse attention of random weights hides nothing either. These figures can
understate or overstate the error on trained weights, by an amount that was not measured here (no
weights can be downloaded).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"


def _rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _fp8_fake_linears(model, names):
    """float8_e4m3 weights (per output channel) x activations (per token), scales max|x| / 448, fp32 products."""
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def q(x, dim):
        x = x.float()
        s = (x.abs().amax(dim=dim, keepdim=True) / fmax).clamp_min(1e-12)
        return (x / s).to(torch.float8_e4m3fn).float() * s

    for n in names:
        mod = model.get_submodule(n)
        wq = q(mod.weight.detach(), 1)

        def forward(x, mod=mod, wq=wq):
            y = q(x, -1) @ wq.t()
            if mod.bias is not None:
                y = y + mod.bias.float()
            return y.to(x.dtype)

        mod.forward = forward


def transformer_part(args):
    import lite_boost
    import lite_boost.quant as Q
    from bench_dit_step import GRIDS, build_stock, inputs
    from quant_specs import make_torch_npu_quant

    grid = GRIDS[args.tokens]
    stock = build_stock(args.layers)
    x = inputs(grid)

    def run(m, dtype=torch.float32):
        with torch.no_grad():
            return m(x[0].to(dtype), x[1], x[2].to(dtype)).sample

    ref = run(stock)
    rows = []
    for method in ("int8_dynamic", "int8_weight_only"):
        m = lite_boost.boost(copy.deepcopy(stock), {"quant": method})
        rows.append((method, "torchao on CPU, fp32 model", *_rel(run(m), ref), Q.quant_state(m).summary(m)))
        del m
    bf16 = copy.deepcopy(stock).to(torch.bfloat16)
    rows.append(("bf16 stock (for scale)", "bfloat16 model, no quantization", *_rel(run(bf16, torch.bfloat16), ref), ""))
    names = [n for n, mod in stock.named_modules() if isinstance(mod, torch.nn.Linear) and n.startswith("blocks.")]
    # w8a8_npu: lite_boost's path with torch_npu = the operator specification, the device gate opened for the CPU
    sys.modules["torch_npu"] = make_torch_npu_quant()
    real = Q.method_problem
    Q.method_problem = lambda m, d: None if m == "w8a8_npu" else real(m, d)
    try:
        m = lite_boost.boost(copy.deepcopy(bf16), {"quant": "w8a8_npu"})
        rows.append(("w8a8_npu", "lite_boost path, torch_npu = operator spec, bf16 model", *_rel(run(m, torch.bfloat16), ref),
                     Q.quant_state(m).summary(m)))
        del m
    finally:
        Q.method_problem = real
        sys.modules.pop("torch_npu", None)
    m = copy.deepcopy(bf16)
    _fp8_fake_linears(m, names)
    rows.append(("fp8 (emulated)", "e4m3 fake-quantization, bf16 model", *_rel(run(m, torch.bfloat16), ref), ""))
    f, h, w = grid
    head = (f"Wan2.1-1.3B dims (12 x 128 heads, ffn 8960, text 4096), {args.layers} block(s), {args.tokens:,} tokens "
            f"({f} x {h} x {w}), random weights (seed 0), timestep 500, output vs fp32 stock, torch {torch.__version__}")
    lines = [head, "", "| method | how it ran | rel. L2 error | cosine | layers / weights |", "|---|---|---:|---:|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.2e} | {r[3]:.7f} | {r[4]} |" for r in rows]
    return "\n".join(lines), [dict(method=r[0], how=r[1], rel_err=r[2], cosine=r[3]) for r in rows]


def video_part(args):
    import lite_boost
    from lite_boost.cli import video_psnr
    from lite_boost.config import BoostConfig, QuantConfig, SparseConfig
    from lite_boost.demo import (DEMO_NEGATIVE_PROMPT, DEMO_PROMPT, DEMO_SHAPE, DEMO_SPARSITY, DEMO_SPEC, DEMO_STEPS,
                                 DEMO_VAE_BASE_DIM, tiny_wan_pipeline)

    h, w, f = DEMO_SHAPE
    kw = dict(prompt=DEMO_PROMPT, negative_prompt=DEMO_NEGATIVE_PROMPT, height=h, width=w, num_frames=f,
              num_inference_steps=DEMO_STEPS, guidance_scale=5.0, output_type="np")
    variants = {
        "stock": None,
        "int8_dynamic (dense)": BoostConfig(quant=QuantConfig("int8_dynamic")),
        "int8_weight_only (dense)": BoostConfig(quant=QuantConfig("int8_weight_only")),
        f"sparse {DEMO_SPARSITY} (the main job's default)": BoostConfig(sparse=SparseConfig(sparsity=DEMO_SPARSITY)),
        f"sparse {DEMO_SPARSITY} + int8_dynamic": BoostConfig(sparse=SparseConfig(sparsity=DEMO_SPARSITY),
                                                             quant=QuantConfig("int8_dynamic")),
    }
    videos = {}
    for name, cfg in variants.items():
        pipe = tiny_wan_pipeline("t2v", spec=DEMO_SPEC, vae_base_dim=DEMO_VAE_BASE_DIM)
        if cfg is not None:
            lite_boost.boost(pipe, cfg)
        with torch.inference_mode():
            videos[name] = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
        print(f"video {name} done", flush=True)
    lines = [f"Main job pipeline (tiny random-weight Wan T2V, {h} x {w}, {f} frames, {DEMO_STEPS} steps, CFG, fp32, CPU); "
             "decoded video vs stock", "", "| variant | video PSNR vs stock | max abs pixel diff |", "|---|---:|---:|"]
    data = []
    for name, v in videos.items():
        if name == "stock":
            continue
        psnr, peak, diff = video_psnr(v, videos["stock"])
        lines.append(f"| {name} | {psnr:.1f} dB | {diff:.3f} |")
        data.append(dict(variant=name, psnr_db=psnr, peak=peak, max_abs_diff=diff))
    return "\n".join(lines), data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("transformer", "video", "both"), default="both")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    texts, data = [], {}
    if args.part in ("transformer", "both"):
        t, d = transformer_part(args)
        print(t, flush=True)
        texts.append(t)
        data[f"transformer_{args.tokens}_{args.layers}"] = d
    if args.part in ("video", "both"):
        t, d = video_part(args)
        print(t, flush=True)
        texts.append(t)
        data["video"] = d
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"quant_quality_{args.part}" + (f"_{args.tokens}" if args.part != "video" else "")
    (RESULTS / f"{stem}.md").write_text("\n\n".join(texts) + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
