"""The accelerator checks of ``scripts/device_check.sh``, one function per step (see that script).

    python scripts/device_check.py STEP [--dry-run] [--out DIR]

Steps: ``dispatch`` (which dense attention backend runs and why; its output vs SDPA), ``flex``
(block-sparse FlexAttention vs SDPA at S = 32,760), ``wan`` (boosted vs stock Wan transformer on the
device: dense, sparse), ``fp8`` (FP8 vs bf16 on a stack of Wan-sized Linear layers, through
``BoostConfig(quant="fp8")``'s code path). Each prints a markdown section and appends it to
``DIR/device_check.md``. ``--dry-run`` runs the same code on the CPU at tiny sizes (the test suite
does, so the script cannot rot); there FP8 is checked to be refused with the documented message and
int8_dynamic runs the Linear-stack step instead.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Ctx:
    def __init__(self, dry_run: bool, out: Path):
        self.dry = dry_run
        cuda = torch.cuda.is_available() and not dry_run
        self.device = torch.device("cuda") if cuda else torch.device("cpu")
        self.out = out
        self.lines: list[str] = []

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, repeats=3):
        fn()  # warm-up (compiles, autotuning, allocations)
        self.sync()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2], res

    def say(self, text: str = ""):
        print(text, flush=True)
        self.lines.append(text)

    def flush(self):
        self.out.mkdir(parents=True, exist_ok=True)
        with (self.out / "device_check.md").open("a") as fh:
            fh.write("\n".join(self.lines) + "\n\n")


def _device_line(ctx: Ctx) -> str:
    if ctx.device.type == "cuda":
        cap = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU (dry run), torch {torch.__version__}"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------------------------ steps
def step_dispatch(ctx: Ctx):
    from lite_boost.ops.attention import attention, available_backends, select_backend

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    s, n, d = (32760, 12, 128) if not ctx.dry else (256, 2, 64)
    ctx.say(f"### dense attention dispatch ({_device_line(ctx)})")
    ctx.say("")
    ctx.say("| backend | usable here | reason if not |")
    ctx.say("|---|---|---|")
    for name, why in available_backends(ctx.device, dtype, d, n).items():
        ctx.say(f"| {name} | {'yes' if why is None else 'no'} | {why or ''} |")
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v = (torch.randn(1, s, n, d, device=ctx.device, generator=g, dtype=dtype) for _ in range(3))
    chosen = select_backend(q, k, layout="BSND")
    t_ours, out = ctx.timed(lambda: attention(q, k, v, layout="BSND"))
    t_sdpa, ref = ctx.timed(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2)).transpose(1, 2))
    ctx.say("")
    ctx.say(f"automatic choice for (1, {s}, {n}, {d}) {str(dtype).replace('torch.', '')}: **{chosen}**; "
            f"{t_ours * 1e3:.1f} ms vs SDPA {t_sdpa * 1e3:.1f} ms ({t_sdpa / t_ours:.2f}x); "
            f"max abs diff vs SDPA {(out.float() - ref.float()).abs().max().item():.2e}")


def step_flex(ctx: Ctx):
    from lite_boost.ops.rain_fusion import rain_fusion_attention
    from lite_boost.ops.sparse import sparse_attention

    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    backend = "flex" if ctx.device.type == "cuda" else "gather"  # dry run: the same code path, no compile
    grid, n, d = ((21, 30, 52), 12, 128) if not ctx.dry else ((4, 16, 16), 2, 64)
    s = math.prod(grid)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v = (torch.randn(1, n, s, d, device=ctx.device, generator=g, dtype=dtype) for _ in range(3))
    ctx.say(f"### block-sparse ({backend}) vs SDPA, S = {s:,}, {n} heads x {d}, {str(dtype).replace('torch.', '')}")
    ctx.say("")
    t_sdpa, ref = ctx.timed(lambda: F.scaled_dot_product_attention(q, k, v))
    ctx.say("| sparsity | effective | whole sparse_attention call | speed-up vs SDPA | kernel only | kernel speed-up | "
            "kernel max abs diff vs the same blocks through `reference` |")
    ctx.say("|---|---:|---:|---:|---:|---:|---:|")
    for sp in (0.5, 0.8, 0.9):
        kw = dict(head_num=n, sparse_type="rf_v2", block_size=128, latent_shape_q=grid, sparsity=sp,
                  window=(2, 8, 8), backend=backend, return_stats=True)
        t_call, (out, st) = ctx.timed(lambda: sparse_attention(q, k, v, **kw))
        sel = st.selection
        from lite_boost.ops._sparse_layout import token_order

        perm = token_order(grid, kw["window"], 0).perm.to(ctx.device)
        qc, kc, vc = (t.index_select(2, perm) for t in (q, k, v))
        kern = lambda be: rain_fusion_attention(qc, kc, vc, sel.select_idx, sel.select_num, [128, 128],  # noqa: E731
                                                q_input_layout="BNSD", kv_input_layout="BNSD", backend=be)[0]
        t_kern, ko = ctx.timed(lambda: kern(backend))
        hmax = 2 if not ctx.dry else n  # the dense reference of a masked call is big: check 2 heads' worth
        ref_k = rain_fusion_attention(qc[:, :hmax], kc[:, :hmax], vc[:, :hmax], sel.select_idx[:, :hmax],
                                      sel.select_num[:, :hmax], [128, 128], q_input_layout="BNSD",
                                      kv_input_layout="BNSD", backend="reference")[0]
        diff = (ko[:, :hmax].float() - ref_k.float()).abs().max().item()
        ctx.say(f"| {sp} | {st.effective_sparsity:.3f} | {t_call * 1e3:.1f} ms | {t_sdpa / t_call:.2f}x | "
                f"{t_kern * 1e3:.1f} ms | {t_sdpa / t_kern:.2f}x | {diff:.2e} |")
    ctx.say("")
    ctx.say(f"dense SDPA: {t_sdpa * 1e3:.1f} ms")


def _wan(layers, heads, head_dim, ffn, text_dim, dtype, device):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=16, out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn,
                                 num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 eps=1e-6).to(device=device, dtype=dtype).eval()


def step_wan(ctx: Ctx):
    import copy

    import lite_boost
    from lite_boost.config import BoostConfig, SparseConfig

    if ctx.dry:
        dims, grid = dict(layers=2, heads=2, head_dim=64, ffn=256, text_dim=64), (2, 8, 16)
    else:
        dims, grid = dict(layers=2, heads=12, head_dim=128, ffn=8960, text_dim=4096), (21, 30, 52)
    f, h, w = grid
    ctx.say(f"### Wan transformer parity on {ctx.device} ({dims['layers']} layers, {dims['heads']} x "
            f"{dims['head_dim']}, {math.prod(grid):,} tokens)")
    ctx.say("")
    ctx.say("| dtype | variant | step | vs stock | max abs diff vs stock | rel. L2 vs stock |")
    ctx.say("|---|---|---:|---:|---:|---:|")
    for dtype in ((torch.float32, torch.bfloat16) if ctx.device.type == "cuda" else (torch.float32,)):
        stock = _wan(dtype=dtype, device=ctx.device, **dims)
        g = torch.Generator(device=ctx.device).manual_seed(1)
        x = torch.randn(1, 16, f, 2 * h, 2 * w, device=ctx.device, generator=g).to(dtype)
        ctx_t = torch.randn(1, 512, dims["text_dim"], device=ctx.device, generator=g).to(dtype)
        t = torch.tensor([500.0], device=ctx.device)

        def run(m):
            with torch.no_grad():
                return m(x, t, ctx_t).sample

        t_stock, ref = ctx.timed(lambda: run(stock), repeats=2)
        name = str(dtype).replace("torch.", "")
        ctx.say(f"| {name} | stock | {t_stock * 1e3:.1f} ms | 1.00x | - | - |")
        block = 128 if not ctx.dry else 16
        for label, cfg in (("boost dense", None),
                           ("boost sparse 0.8", BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=block)))):
            m = lite_boost.boost(copy.deepcopy(stock), cfg)
            tm, out = ctx.timed(lambda: run(m), repeats=2)
            ctx.say(f"| {name} | {label} | {tm * 1e3:.1f} ms | {t_stock / tm:.2f}x | "
                    f"{(out.float() - ref.float()).abs().max().item():.2e} | {_rel(out, ref):.2e} |")
        del stock


def step_fp8(ctx: Ctx):
    from lite_boost.config import ConfigError, QuantConfig
    from lite_boost.quant import plan_quant, quantize_model

    tokens, dim, ffn, depth = (32760, 1536, 8960, 4) if not ctx.dry else (64, 64, 128, 2)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(dim, ffn), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(ffn, dim)]
    stack = torch.nn.Sequential(*layers).to(device=ctx.device, dtype=dtype).eval()
    x = torch.randn(1, tokens, dim, device=ctx.device).to(dtype)
    method = "fp8"
    ctx.say(f"### {method} vs bf16 on {depth} Wan FFN pairs ({dim} -> {ffn} -> {dim}), {tokens:,} tokens, "
            f"{_device_line(ctx)}")
    ctx.say("")
    if ctx.device.type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        try:
            plan_quant(stack, QuantConfig("fp8"), (r".*",))
            raise AssertionError("fp8 was accepted on a device without FP8 tensor cores")
        except ConfigError as exc:
            assert "cannot run on" in str(exc) and "methods that can run on" in str(exc), exc
            ctx.say(f"fp8 refused here, as documented: `{exc}`")
        if ctx.device.type != "cpu":
            return
        method, dtype = "int8_dynamic", torch.float32  # exercise the same quantize / compile / compare code
        stack, x = stack.float(), x.float()
    import copy

    with torch.no_grad():
        ref = stack(x)
        fp32_ref = copy.deepcopy(stack).float()(x.float())
    quant = copy.deepcopy(stack)
    plan = plan_quant(quant, QuantConfig(method), (r".*",))
    state = quantize_model(quant, QuantConfig(method), plan)
    base = torch.compile(stack, fullgraph=True)
    comp = torch.compile(quant, fullgraph=True)

    def run(m):
        with torch.no_grad():
            return m(x)

    t_b, out_b = ctx.timed(lambda: run(base))
    t_q, out_q = ctx.timed(lambda: run(comp))
    before, after = state.weight_bytes(quant)
    ctx.say("| variant | time (compiled) | speed-up | rel. L2 vs fp32 | cosine vs fp32 | weight bytes |")
    ctx.say("|---|---:|---:|---:|---:|---:|")
    cos = lambda a: F.cosine_similarity(a.double().flatten(), fp32_ref.double().flatten(), dim=0).item()  # noqa: E731
    ctx.say(f"| {str(dtype).replace('torch.', '')} | {t_b * 1e3:.1f} ms | 1.00x | {_rel(out_b, fp32_ref):.2e} | "
            f"{cos(out_b):.6f} | {before / 2**20:.0f} MiB |")
    ctx.say(f"| {method} | {t_q * 1e3:.1f} ms | {t_b / t_q:.2f}x | {_rel(out_q, fp32_ref):.2e} | {cos(out_q):.6f} | "
            f"{after / 2**20:.0f} MiB |")
    del ref


STEPS = {"dispatch": step_dispatch, "flex": step_flex, "wan": step_wan, "fp8": step_fp8}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what the test suite runs)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "device_check"))
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("device_check.py: no CUDA device visible (use --dry-run to run the steps on the CPU)")
    ctx = Ctx(args.dry_run, Path(args.out))
    try:
        STEPS[args.step](ctx)
    finally:
        ctx.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
