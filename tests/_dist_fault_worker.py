"""A rank of a fault-injection run (started by test_parallel_faults.py with the torchrun variables).

Usage: python _dist_fault_worker.py MODE FAULTY_RANK TIMEOUT_S
MODE: raise (the faulty rank raises before the first exchange), die (os._exit mid-run),
hang (the faulty rank stalls and never joins the collective), ok (no fault);
pipe_raise / pipe_die / pipe_hang: the same inside a tiny Wan pipeline under ParallelManager
(cfg 2 when the world size is even: the hang then stalls the CFG exchange).
fsdp_raise / fsdp_die / fsdp_hang: a tiny Wan transformer under fsdp_degree = world size; the faulty rank
fails as its second forward starts the patch embedding's weight all-gather (the first collective of a
forward); the healthy ranks print the error they raise (it must name the all-gather and the fsdp group).
fsdptp_die: the same under tp_degree 2 x fsdp_degree = world size / 2 (the fsdp groups hold the ranks with the
same tp rank: the error names that group's global ranks).
tp_die: a tiny Wan transformer under tp_degree = world size; the faulty rank dies as its second forward
reaches blocks.0.attn1.to_out.0, whose row-wise output all-reduce the healthy ranks then wait for.
Every healthy rank runs Ulysses attention in a loop; it must exit non-zero (never hang) on a fault.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F


def attn(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def inject(mode):
    if mode.endswith("raise"):
        raise RuntimeError("injected failure on the faulty rank")
    if mode.endswith("die"):
        os._exit(3)
    if mode.endswith("hang"):
        time.sleep(3600)


def pipeline_main(mode, faulty, timeout_s):
    from lite_boost.demo import tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    world = int(os.environ["WORLD_SIZE"])
    pipe = tiny_wan_pipeline("t2v")
    cfg = 2 if world % 2 == 0 else 1
    ParallelManager(pipe, {"parallel": {"cfg_degree": cfg, "timeout_s": timeout_s}})
    rank = pipe._lite_boost_parallel.mesh.rank
    calls = [0]

    def fault(module, args):
        calls[0] += 1
        if rank == faulty and calls[0] == 3:
            inject(mode)

    pipe.transformer.blocks[1].register_forward_pre_hook(fault)
    pipe(prompt="a fox", negative_prompt="blur", height=32, width=48, num_frames=5, num_inference_steps=3,
         guidance_scale=5.0, output_type="latent")
    print(f"rank {rank} done", flush=True)


def fsdp_main(mode, faulty, timeout_s):
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    world = int(os.environ["WORLD_SIZE"])
    if mode.startswith("fsdptp"):  # tp 2 x fsdp world/2 on the 2-D mesh: fsdp groups = ranks of one tp rank
        heads, parallel = 4, {"tp_degree": 2, "fsdp_degree": world // 2}
    else:
        heads, parallel = 2, {"fsdp_degree": world}
    model = ParallelManager(tiny_wan_transformer(TinyWanSpec(heads=heads)),
                            {"parallel": dict(parallel, timeout_s=timeout_s)})
    rank = model._lite_boost.extras["parallel"].mesh.rank
    group = model.patch_embedding._get_fsdp_state()._fsdp_param_group
    inner, calls = group.unshard, [0]

    def unshard(*args, **kwargs):
        calls[0] += 1
        if rank == faulty and calls[0] == 2:
            inject(mode)
        return inner(*args, **kwargs)

    group.unshard = unshard
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 512, 32)
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x, t, ctx)
    except Exception as exc:  # noqa: BLE001 - reported for the test to read, then the exit code says it
        print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
        raise
    print(f"rank {rank} done", flush=True)


def tp_main(mode, faulty, timeout_s):
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer
    from lite_boost.parallel import ParallelManager

    world = int(os.environ["WORLD_SIZE"])
    model = ParallelManager(tiny_wan_transformer(TinyWanSpec(heads=2)),
                            {"parallel": {"tp_degree": world, "timeout_s": timeout_s}})
    rank = model._lite_boost.extras["parallel"].mesh.rank
    calls = [0]

    def fault(module, args):
        calls[0] += 1
        if rank == faulty and calls[0] == 2:
            inject(mode)

    model.blocks[0].attn1.to_out[0].register_forward_pre_hook(fault, prepend=True)
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 512, 32)
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x, t, ctx)
    except Exception as exc:  # noqa: BLE001 - reported for the test to read, then the exit code says it
        print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
        raise
    print(f"rank {rank} done", flush=True)


def main():
    mode, faulty, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    if mode.startswith("pipe"):
        return pipeline_main(mode, faulty, timeout_s)
    if mode.startswith("fsdp"):
        return fsdp_main(mode, faulty, timeout_s)
    if mode.startswith("tp"):
        return tp_main(mode, faulty, timeout_s)
    from lite_boost.config import ParallelConfig
    from lite_boost.parallel import SequenceShardInfo, UlyssesAttention, init_mesh

    mesh = init_mesh(ParallelConfig(timeout_s=timeout_s))  # env:// from RANK/WORLD_SIZE/MASTER_*
    rank = mesh.rank
    info = SequenceShardInfo(mesh.sequence_degree)
    info.set(33)
    uly = UlyssesAttention(attn, mesh.sequence, info)
    q = torch.randn(1, info.shard_len, 3, 8)
    for step in range(6):
        if rank == faulty and step == 2:
            inject(mode)
        q = uly(q, q, q)
    mesh.destroy()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
