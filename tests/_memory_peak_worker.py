"""Measured memory of one boosted Wan transformer call, for tests/test_memory_plan.py and benchmarks/bench_memory.py.

Run as a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` in its environment: glibc then maps every
allocation of 64 KiB and more on its own and returns it when freed, so the resident set follows the live
tensors. The peak of one call is read from the kernel's high-water mark (``VmHWM``), reset just before
the call (``/proc/self/clear_refs``); no Python-level tracing. Prints one JSON line.

usage: python _memory_peak_worker.py HEADS FFN LAYERS FRAMESxHEIGHTxWIDTH [DTYPE]
"""

import json
import os
import sys

import torch


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure(heads: int, ffn: int, layers: int, frames: int, height: int, width: int, dtype=torch.bfloat16) -> dict:
    from diffusers import WanTransformer3DModel

    import lite_boost
    from lite_boost.memory import Layout, ModelDims, estimate, token_count

    # One-off process costs (the modules boost imports, the operator library it loads) are paid on a tiny model
    # first, so that the weights' measurement below holds the weights and little else.
    warm = WanTransformer3DModel(num_attention_heads=1, attention_head_dim=16, ffn_dim=16, num_layers=2,
                                 text_dim=16, freq_dim=16, in_channels=4, out_channels=4)
    lite_boost.boost(warm)
    del warm
    torch.manual_seed(0)
    base = _status("VmRSS")
    with torch.device("meta"):  # the weights are allocated once, directly in the run dtype
        model = WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=128, ffn_dim=ffn, num_layers=layers)
    model = model.to_empty(device="cpu").to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    lite_boost.boost(model)
    built = _status("VmRSS")
    lat = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, dtype=dtype)
    ctx = torch.randn(1, 512, 4096, dtype=dtype)
    t = torch.tensor([500.0])

    def call():
        with torch.no_grad():
            return model(hidden_states=lat, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]

    call()  # warm-up: RoPE tables, kernels' first-use state
    before = _status("VmRSS")
    _reset_peak()
    call()
    peak = _status("VmHWM")
    dims = ModelDims.from_module(model, dtype_bytes=torch.empty(0, dtype=dtype).element_size())
    tokens = token_count(dims, frames, height, width)
    est = estimate(dims, Layout(), tokens)
    return {"tokens": tokens, "weights_measured": built - base, "weights_predicted": est.weights,
            "call_peak_measured": peak - before, "activations_predicted": est.activations,
            "total_measured": peak - base, "total_predicted": est.weights + est.activations,
            "runtime_overhead": before - built}


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    h, f, L = (int(x) for x in sys.argv[1:4])
    fr, hh, ww = (int(x) for x in sys.argv[4].split("x"))
    dt = getattr(torch, sys.argv[5]) if len(sys.argv) > 5 else torch.bfloat16
    print(json.dumps(measure(h, f, L, fr, hh, ww, dt)))
