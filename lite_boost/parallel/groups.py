"""Process-group mesh (cfg x ring x ulysses x tp, plus the fsdp weight-sharding groups) from the torchrun environment.

``init_mesh(config)`` reads ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` (and ``MASTER_ADDR`` /
``MASTER_PORT`` for the default ``env://`` rendezvous), validates the requested degrees against the
world size, picks the device from ``LOCAL_RANK`` and the backend from the device (nccl on CUDA, hccl
on Ascend, gloo on CPU), initialises the default process group with a finite timeout unless the user
already did, and builds the sub-groups of the mesh. Every validation happens before the first
collective, so a bad setting fails identically and immediately on every rank.

Rank layout: ``rank = (cfg_rank * sequence_degree + sequence_rank) * tp_degree + tp_rank`` and, inside
a sequence group, ``sequence_rank = ring_rank * ulysses_degree + ulysses_rank``. The tensor-parallel ranks
(``tp_degree``, an all-reduce per block: the chattiest traffic) are the innermost, contiguous ones; with
``tp_degree`` 1 the layout is ``rank = cfg_rank * sequence_degree + sequence_rank``. The ranks of one Ulysses group are
contiguous (the chatty all_to_all traffic stays inside a node when a node holds a whole Ulysses
group); a ring group holds every ``ulysses_degree``-th rank of a sequence group (its point-to-point
K/V traffic is the part that crosses nodes, hidden behind compute); a cfg group holds the ranks with
the same ``sequence_rank``. With this order the sequence shards stay contiguous and equal in the
flattened sequence group: the split hooks, the RoPE rows and the final gather are the same for any
(ulysses, ring) split, and after the Ulysses all_to_all a rank holds super-chunk ``ring_rank`` of the
sequence for its heads.

FSDP weight sharding does not add an axis: ``fsdp_degree`` ranks that already do different work
(tokens, CFG branch) share one copy of the weights. Its groups are contiguous blocks of
``fsdp_degree`` ranks (with ``tp_degree > 1``: of ``fsdp_degree`` cfg x sequence positions, one group
per tp rank, i.e. the ranks ``(o + i) * tp_degree + tp_rank``, so FSDP shards each tp shard further), so a group lies inside one sequence group when ``fsdp_degree <=
sequence_degree`` (the ranks that run the same number of blocks per step, whatever a data-dependent
step cache decides, since those decisions are made once per sequence group) and spans the CFG
branches beyond that. :meth:`ParallelMesh.device_mesh` wraps the fsdp and tp groups as named
``torch.distributed.device_mesh.DeviceMesh`` objects for ``fully_shard`` and ``parallelize_module`` (with
both degrees > 1: the two dimensions of one 2-D mesh, FSDP2's 2-D pattern).

Nothing here is a process-wide singleton: the mesh is an ordinary object owned by whoever created it
(``ParallelManager`` keeps it on the boosted model's state). The only global state touched is
torch.distributed's own default group, which is reused when it already exists.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from ..config import ConfigError, ParallelConfig
from .comm import Communicator

__all__ = ["ParallelMesh", "init_mesh", "read_torchrun_env", "default_device", "backend_for_device"]

_BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_DEVICES_FOR_BACKEND = {"nccl": ("cuda",), "hccl": ("npu",), "gloo": ("cpu", "cuda")}


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"environment variable {name} must be >= 0, got {value}")
    return value


def read_torchrun_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """Return ``(rank, local_rank, world_size)`` from the torchrun variables (defaults 0, 0, 1).

    Raises ConfigError naming the variable when a value is malformed or inconsistent.
    """
    env = os.environ if env is None else env
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    if world_size < 1:
        raise ConfigError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
    if rank >= world_size:
        raise ConfigError(f"environment variable RANK={rank} must be < WORLD_SIZE={world_size}")
    return rank, local_rank, world_size


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device)
    except (ImportError, RuntimeError, OSError):
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def default_device(local_rank: int) -> torch.device:
    """The device a rank should use: ``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK`` or ``cpu``."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return torch.device("cuda", local_rank % count)
    if _npu_available():
        count = torch.npu.device_count()
        return torch.device("npu", local_rank % count)
    return torch.device("cpu")


def backend_for_device(device: torch.device) -> str:
    """nccl for CUDA, hccl for Ascend NPU, gloo for CPU."""
    try:
        return _BACKEND_FOR_DEVICE[device.type]
    except KeyError:
        raise ConfigError(
            f"no torch.distributed backend known for device type {device.type!r}; "
            f"supported device types: {sorted(_BACKEND_FOR_DEVICE)} (or pass ParallelConfig(backend=...))"
        ) from None


@dataclass(eq=False)
class ParallelMesh:
    """The cfg x sequence process mesh of one rank.

    Attributes:
        world_size, rank, local_rank: this process in the world.
        cfg_degree, sequence_degree: the mesh shape (``cfg_degree * sequence_degree == world_size``).
        ulysses_degree, ring_degree: the split of the sequence ranks (product = sequence_degree).
        cfg_rank, sequence_rank, ulysses_rank, ring_rank: this rank's coordinates in the mesh.
        device, backend, timeout_s: where tensors live, which backend runs the collectives, and the
            collective timeout.
        sequence: Communicator over the ranks sharing this rank's sequence (the flattened
            ulysses x ring group: sequence split and gather).
        ulysses: Communicator over this rank's Ulysses group (all_to_all over heads).
        ring: Communicator over this rank's ring group (K/V passed around).
        cfg: Communicator over the ranks that hold the same sequence shard of the other CFG branch.
        world: Communicator over all ranks (latent broadcast).
        rotate_method: how Ring attention moves K/V ("p2p" or "allgather").
        tp_degree, tp: tensor-parallel degree and the Communicator over this rank's TP group.
        fsdp_degree, fsdp: FSDP weight-sharding degree and the Communicator over this rank's FSDP group.
        owns_default_group: True when this mesh created the default process group (``destroy`` then
            tears it down).
    """

    world_size: int
    rank: int
    local_rank: int
    cfg_degree: int
    sequence_degree: int
    device: torch.device
    backend: str | None
    timeout_s: float
    sequence: Communicator
    cfg: Communicator
    world: Communicator
    owns_default_group: bool = False
    ulysses_degree: int | None = None  # None: every sequence rank on Ulysses (ring_degree 1)
    ring_degree: int = 1
    ulysses: Communicator | None = None
    ring: Communicator | None = None
    rotate_method: str = "p2p"
    tp_degree: int = 1
    tp: Communicator | None = None
    fsdp_degree: int = 1
    fsdp: Communicator | None = None
    _destroyed: bool = field(default=False, repr=False)
    _device_meshes: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.ulysses_degree is None:
            self.ulysses_degree = self.sequence_degree // self.ring_degree
        if self.ulysses_degree * self.ring_degree != self.sequence_degree:
            raise ValueError(f"ulysses_degree={self.ulysses_degree} x ring_degree={self.ring_degree} must equal "
                             f"sequence_degree={self.sequence_degree}")
        if self.ulysses is None and self.ring_degree == 1:
            self.ulysses = self.sequence
        if self.ring is None and self.ulysses_degree == 1:
            self.ring = self.sequence
        if self.ulysses is None or self.ring is None:
            raise ValueError("a mesh with both ulysses_degree and ring_degree > 1 needs its ulysses and ring communicators")
        for name in ("tp", "fsdp"):
            if getattr(self, name) is None:
                if getattr(self, f"{name}_degree") > 1:
                    raise ValueError(f"a mesh with {name}_degree > 1 needs its {name} communicator")
                setattr(self, name, Communicator(None, 1, 0, name=name, ranks=(self.rank,)))

    @property
    def cfg_rank(self) -> int:
        return self.rank // (self.sequence_degree * self.tp_degree)

    @property
    def sequence_rank(self) -> int:
        return (self.rank // self.tp_degree) % self.sequence_degree

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_degree

    def device_mesh(self, name: str):
        """The ``torch.distributed`` ``DeviceMesh`` of this rank's ``name`` group ("tp" or "fsdp"), with that
        dimension name (built once, on the mesh's existing process groups: no collective).

        With both ``tp_degree`` and ``fsdp_degree`` > 1 the two are the named dimensions of one 2-D mesh
        (``("fsdp", "tp")``, rows = fsdp group rank, columns = tp rank: :meth:`device_mesh_2d`), as FSDP2
        requires for DTensor parameters; each is returned as its slice of that mesh."""
        from torch.distributed.device_mesh import DeviceMesh

        if name not in ("tp", "fsdp"):
            raise ValueError(f"device_mesh name must be 'tp' or 'fsdp', got {name!r}")
        comm = getattr(self, name)
        if comm.size == 1:
            raise ValueError(f"{name}_degree is 1: no {name} device mesh")
        if name not in self._device_meshes:
            if self.tp_degree > 1 and self.fsdp_degree > 1:
                self._device_meshes[name] = self.device_mesh_2d()[name]
            else:
                group = comm.group if comm.group is not None else dist.group.WORLD
                self._device_meshes[name] = DeviceMesh.from_group(group, self.device.type, mesh=list(comm.ranks),
                                                                  mesh_dim_names=(name,))
        return self._device_meshes[name]

    def device_mesh_2d(self):
        """The 2-D ``DeviceMesh`` ("fsdp", "tp") of this rank's fsdp x tp block of ranks (tp_degree and
        fsdp_degree > 1): entry ``[i][k]`` is the global rank with fsdp group rank ``i`` and tp rank ``k``; its
        dimensions use the mesh's existing fsdp and tp process groups (no collective)."""
        from torch.distributed.device_mesh import DeviceMesh

        if self.tp_degree == 1 or self.fsdp_degree == 1:
            raise ValueError(f"tp_degree={self.tp_degree}, fsdp_degree={self.fsdp_degree}: a 2-D fsdp x tp device "
                             "mesh needs both > 1")
        if "2d" not in self._device_meshes:
            t = self.tp_degree
            ranks = [[(r // t) * t + k for k in range(t)] for r in self.fsdp.ranks]
            self._device_meshes["2d"] = DeviceMesh.from_group([self.fsdp.group, self.tp.group], self.device.type,
                                                              mesh=ranks, mesh_dim_names=("fsdp", "tp"))
        return self._device_meshes["2d"]

    @property
    def ulysses_rank(self) -> int:
        return self.sequence_rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        return self.sequence_rank // self.ulysses_degree

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        split = ""
        if self.ring_degree > 1:
            split = (f" = ring {self.ring_rank}/{self.ring_degree} x ulysses {self.ulysses_rank}/{self.ulysses_degree}"
                     f", {self.rotate_method}")
        extra = ""
        if self.tp_degree > 1:
            extra += f", tp {self.tp_rank}/{self.tp_degree}"
        if self.fsdp_degree > 1:
            extra += f", fsdp {self.fsdp.rank}/{self.fsdp_degree}"
        return (
            f"rank {self.rank}/{self.world_size} (cfg {self.cfg_rank}/{self.cfg_degree}, "
            f"sequence {self.sequence_rank}/{self.sequence_degree}{split}{extra}) on {self.device} via "
            f"{self.backend or 'none'}"
        )

    def destroy(self) -> None:
        """Destroy the sub-groups, and the default group when this mesh created it. Idempotent.

        Collective: call it on every rank. A barrier (bounded by the timeout) first lets every peer
        finish its last exchange; tearing gloo down while a peer still sends can abort the process.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if not dist.is_available() or not dist.is_initialized():
            return
        if self.world_size > 1:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a dead peer: tear down anyway
                pass
        comms = {id(c): c for c in (self.sequence, self.cfg, self.ulysses, self.ring, self.tp, self.fsdp)
                 if c is not None}
        for comm in comms.values():
            if comm.group is not None and comm.owns_group:
                try:
                    dist.destroy_process_group(comm.group)
                except Exception:  # noqa: BLE001 - best effort on teardown
                    pass
        if self.owns_default_group:
            dist.destroy_process_group()


def _mesh_ranks(cfg_degree: int, sequence_degree: int, ulysses_degree: int | None = None, tp_degree: int = 1,
                fsdp_degree: int = 1):
    """Global ranks of every (sequence, cfg, ulysses, ring, tp, fsdp) group, each list in group-rank order."""
    u = sequence_degree if ulysses_degree is None else ulysses_degree
    r = sequence_degree // u
    t = tp_degree
    world = cfg_degree * sequence_degree * t

    def g(c, s, k):  # global rank of (cfg rank, sequence rank, tp rank)
        return (c * sequence_degree + s) * t + k

    seq_groups = [[g(c, s, k) for s in range(sequence_degree)] for c in range(cfg_degree) for k in range(t)]
    cfg_groups = [[g(c, s, k) for c in range(cfg_degree)] for s in range(sequence_degree) for k in range(t)]
    uly_groups = [[g(c, i * u + j, k) for j in range(u)] for c in range(cfg_degree) for i in range(r) for k in range(t)]
    ring_groups = [[g(c, i * u + j, k) for i in range(r)] for c in range(cfg_degree) for j in range(u) for k in range(t)]
    tp_groups = [[g(c, s, k) for k in range(t)] for c in range(cfg_degree) for s in range(sequence_degree)]
    # fsdp: contiguous blocks of fsdp_degree "outer" ranks (cfg x sequence position), one group per tp rank
    outer = world // t
    fsdp_groups = [[(o + i) * t + k for i in range(fsdp_degree)] for o in range(0, outer, fsdp_degree)
                   for k in range(t)]
    return seq_groups, cfg_groups, uly_groups, ring_groups, tp_groups, fsdp_groups


def init_mesh(
    config: ParallelConfig | Mapping | None = None,
    *,
    init_method: str | None = None,
    device: torch.device | str | None = None,
    env: Mapping[str, str] | None = None,
    degrees: tuple[int, int, int] | None = None,
) -> ParallelMesh:
    """Create the cfg x sequence mesh for this process.

    Args:
        config: ParallelConfig (or mapping); degrees default to all ranks on the sequence.
        init_method: rendezvous URL for ``init_process_group`` (default ``env://``, i.e. the torchrun
            variables ``MASTER_ADDR`` / ``MASTER_PORT``); e.g. ``file:///tmp/rdzv`` in tests.
        device: override the device (default: from ``LOCAL_RANK`` and what is available).
        env: environment mapping to read instead of ``os.environ`` (tests).
        degrees: (cfg, ulysses, ring) degrees already resolved for this world size (``lite_boost.plan``);
            default: resolved here from ``config``.

    Reuses an existing default process group (its world size and rank win over the environment).
    All validation happens before the first collective.
    """
    if config is None:
        config = ParallelConfig()
    elif isinstance(config, Mapping):
        config = ParallelConfig.from_dict(config)
    elif not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be a ParallelConfig, a mapping or None, got {type(config).__name__}")
    env = os.environ if env is None else env

    already = dist.is_available() and dist.is_initialized()
    if already:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        local_rank = _env_int(env, "LOCAL_RANK", None)
        if local_rank is None:
            local_rank = rank
    else:
        rank, local_rank, world_size = read_torchrun_env(env)

    if degrees is None:
        degrees = config.resolve_mesh(world_size)
    cfg_degree, ulysses_degree, ring_degree = degrees
    sequence_degree = ulysses_degree * ring_degree
    tp_degree, fsdp_degree = config.tp_degree, config.fsdp_degree

    if device is None:
        device = default_device(local_rank)
    device = torch.device(device)
    backend = config.backend
    if already:
        backend = dist.get_backend()
    elif world_size > 1:
        if backend is None:
            backend = backend_for_device(device)
        allowed = _DEVICES_FOR_BACKEND.get(backend, ())
        if device.type not in allowed:
            raise ConfigError(
                f"backend={backend!r} cannot run collectives on device {device}; "
                f"valid device types for {backend!r}: {list(allowed)}"
            )
        method = init_method or "env://"
        if method == "env://":
            missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
            if missing:
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: launch with "
                    "`torchrun --nproc_per_node N script.py` or pass init_method='tcp://host:port' / 'file:///path'"
                )

    timeout = datetime.timedelta(seconds=float(config.timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)

    owns_default = False
    if world_size > 1 and not already:
        kwargs = dict(backend=backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                      timeout=timeout)
        if device.type in ("cuda", "npu"):
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        owns_default = True

    world_group = dist.group.WORLD if world_size > 1 else None
    timeout_s = float(config.timeout_s)
    comms = {name: Communicator(None, size=1, rank=0, name=name, ranks=(rank,), timeout_s=timeout_s)
             for name in ("sequence", "cfg", "ulysses", "ring", "tp", "fsdp")}
    if world_size > 1:
        seq_groups, cfg_groups, uly_groups, ring_groups, tp_groups, fsdp_groups = _mesh_ranks(
            cfg_degree, sequence_degree, ulysses_degree, tp_degree, fsdp_degree)
        layout = [("sequence", seq_groups, sequence_degree), ("cfg", cfg_groups, cfg_degree)]
        if ring_degree > 1 and ulysses_degree > 1:  # else the sequence group serves both (no extra groups)
            layout += [("ulysses", uly_groups, ulysses_degree), ("ring", ring_groups, ring_degree)]
        # (appended last: the groups a mesh without tp / fsdp creates keep their order)
        layout += [("tp", tp_groups, tp_degree), ("fsdp", fsdp_groups, fsdp_degree)]
        # Every rank creates every sub-group in the same order (new_group is collective).
        for name, ranks_list, degree in layout:
            for ranks in ranks_list:
                if degree == world_size:
                    group, owns = dist.group.WORLD, False
                elif degree == 1:
                    group, owns = None, False
                else:
                    group, owns = dist.new_group(ranks, timeout=timeout), True
                if rank in ranks and degree > 1:
                    comms[name] = Communicator(group, size=degree, rank=ranks.index(rank), owns_group=owns, name=name,
                                               ranks=ranks, timeout_s=timeout_s)
    seq_comm = comms["sequence"]
    if ring_degree == 1:
        comms["ulysses"] = seq_comm
    if ulysses_degree == 1:  # the same process group, its own name (errors say "ring") and counters
        comms["ring"] = (Communicator(seq_comm.group, size=seq_comm.size, rank=seq_comm.rank, name="ring",
                                      ranks=seq_comm.ranks, timeout_s=timeout_s) if ring_degree > 1 else seq_comm)
    if world_size > 1:
        world_comm = Communicator(world_group, size=world_size, rank=rank, name="world", timeout_s=timeout_s)
    else:
        world_comm = Communicator(None, 1, 0, name="world")
    return ParallelMesh(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        cfg_degree=cfg_degree,
        sequence_degree=sequence_degree,
        device=device,
        backend=backend if world_size > 1 else None,
        timeout_s=timeout_s,
        sequence=seq_comm,
        cfg=comms["cfg"],
        world=world_comm,
        owns_default_group=owns_default,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        ulysses=comms["ulysses"],
        ring=comms["ring"],
        rotate_method=config.rotate_method,
        tp_degree=tp_degree,
        tp=comms["tp"],
        fsdp_degree=fsdp_degree,
        fsdp=comms["fsdp"],
    )
