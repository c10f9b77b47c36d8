"""A rank of a cached-run fault test (started by test_cache_parallel.py with the torchrun variables).

Usage: python _dist_cache_fault_worker.py MODE FAULTY_RANK TIMEOUT_S
MODE: raise (the faulty rank raises inside the First-Block-Cache decision, just before the group
reduction of its statistic), die (os._exit there), hang (it stalls there and never joins), ok.
Every healthy rank runs a cached tiny Wan pipeline under ParallelManager; it must exit non-zero
(never hang) when a peer fails.
"""

import os
import sys
import time

import torch


def main():
    mode, faulty, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    ParallelManager(pipe, {"parallel": {"timeout_s": timeout_s}, "cache": "first_block_cache:threshold=0.14"})
    rank = pipe._lite_boost_parallel.mesh.rank
    [dec] = pipe.transformer._lite_boost.extras["parallel"].cache.first_block
    inner = dec.__call__
    calls = [0]

    def faulty_decision(residual):
        calls[0] += 1
        if rank == faulty and calls[0] == 4:  # mid-run, with a previous residual: the reduction comes next
            if mode == "raise":
                raise RuntimeError("injected failure on the faulty rank")
            if mode == "die":
                os._exit(3)
            if mode == "hang":
                time.sleep(3600)
        return inner(residual)

    hook = dec.hook
    hook._should_compute_remaining_blocks = torch.compiler.disable(faulty_decision)
    pipe(prompt="a fox", negative_prompt="blur", height=48, width=80, num_frames=9, num_inference_steps=6,
         guidance_scale=5.0, output_type="latent")
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
