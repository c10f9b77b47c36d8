"""Distribution for diffusers video DiTs: Ulysses and Ring sequence parallelism (and both: USP), CFG parallelism.

    # torchrun --nproc_per_node 4 script.py
    from lite_boost.parallel import ParallelManager
    pipe = ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})   # cfg 2 x sequence 2
    pipe = ParallelManager(pipe, {"parallel": {"ulysses_degree": 2, "ring_degree": 2}})   # USP 2 x 2

This package knows nothing of any particular model: model families declare a sharding plan
(:class:`lite_boost.parallel.plan.ShardingPlan`) that the generic hooks here execute, and the
composition "boost, then parallelise" (``ParallelManager``) lives in the public surface
(``lite_boost.api``): it is re-exported here, the one import from this package up to ``lite_boost.api``
(an ``ignore_imports`` entry of the import contracts in ``pyproject.toml``).
"""

from .comm import CollectiveError, CommStats, Communicator, head_split, shard_length
from .groups import ParallelMesh, init_mesh
from .plan import CfgPlan, GatherOutput, PipelinePlan, PlanError, RankArg, ShardingPlan, SplitInput, SplitOutput
from .ring import RingAttention, RingSupportError, sequence_parallel_attention
from .ulysses import SequenceShardInfo, UlyssesAttention
from .vae import ParallelVAE, UnsupportedVAEError, parallelize_vae, plan_chunks, register_vae_adapter, unparallelize_vae

__all__ = [
    "CfgPlan",
    "GatherOutput",
    "PipelinePlan",
    "PlanError",
    "RankArg",
    "ShardingPlan",
    "SplitInput",
    "SplitOutput",
    "CollectiveError",
    "CommStats",
    "Communicator",
    "RingAttention",
    "RingSupportError",
    "sequence_parallel_attention",
    "ParallelManager",
    "ParallelMesh",
    "ParallelVAE",
    "UnsupportedVAEError",
    "parallelize_vae",
    "plan_chunks",
    "register_vae_adapter",
    "unparallelize_vae",
    "SequenceShardInfo",
    "UlyssesAttention",
    "head_split",
    "init_mesh",
    "initialize_usp",
    "parallelize",
    "shard_length",
    "unparallelize",
]


def __getattr__(name):  # the manager imports diffusers-facing code; load it on first use
    if name == "ParallelManager":
        from ..api import ParallelManager  # the documented exception: the public composition, re-exported

        return ParallelManager
    if name in ("initialize_usp", "unparallelize", "parallelize"):
        from . import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'lite_boost.parallel' has no attribute {name!r}")
