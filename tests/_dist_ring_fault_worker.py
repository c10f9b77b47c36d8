"""A rank of a Ring-attention fault run (started by test_ring_faults.py with the torchrun variables).

Usage: python _dist_ring_fault_worker.py MODE FAULTY_RANK TIMEOUT_S
MODE: die (the faulty rank exits inside a ring step, after posting its next transfer), hang (it
stalls there and never posts again), ok (no fault). Every rank runs Ring attention over all ranks
(ring_degree = world size) in a loop; a healthy rank must exit non-zero (never hang), its error
naming the collective, the group and the time it waited.
"""

import os
import sys
import time

import torch


def main():
    mode, faulty, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    from lite_boost.config import ParallelConfig
    from lite_boost.models.wan import DenseAttention
    from lite_boost.parallel import SequenceShardInfo, init_mesh
    from lite_boost.parallel.ring import RingAttention

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_mesh(ParallelConfig(ring_degree=world, timeout_s=timeout_s))  # env:// from RANK/WORLD_SIZE/MASTER_*
    rank = mesh.rank
    info = SequenceShardInfo(mesh.sequence_degree)
    info.set(8 * world + 1)
    dense = DenseAttention()
    calls = [0]

    def kernel(q, k, v):
        calls[0] += 1
        if rank == faulty and calls[0] == 2 * world + 2:  # third pass, second step: mid-ring
            if mode == "die":
                os._exit(3)
            if mode == "hang":
                time.sleep(3600)
        return dense.lse_attention(q, k, v)

    ring = RingAttention(dense, mesh.ring, info, kernel=kernel)
    q = torch.randn(1, info.shard_len, 3, 8)
    for _ in range(6):
        q = ring(q, q, q)
    mesh.destroy()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
