"""Rank-consistent step caching under sequence parallelism (diffusers' cache hooks, no model knowledge).

Each rank of a sequence group holds only its shard of the tokens. A cache whose skip decision
depends on the activations would, left alone, decide per shard: ranks could disagree, and a rank
that skips the transformer blocks while another computes them leaves the other's all_to_all waiting
(a hang) or mixes cached and fresh shards (a wrong video). :func:`make_cache_rank_consistent` fixes
that for every cache hook found on a model:

* **First-Block Cache** (data-dependent): the head hook's statistic
  ``mean|r - r_prev| / mean|r_prev|`` is rebuilt from per-rank sums over the *real* tokens of each
  shard (the padded suffix of the last shard(s) is left out), gathered over the sequence group and
  summed in rank order. Every rank then tests the same number against the threshold, equal to the
  single-process statistic up to floating-point reassociation.
* **SeaCache** (data-dependent, but its indicator is computed from the transformer's replicated
  input latents, identical on every rank): no reduction is needed; every decision is checked for
  agreement across the group with one tiny all_gather, and a disagreement raises on every rank
  (never a silent divergence or a hang).
* **MagCache, TaylorSeer, Pyramid Attention Broadcast** (fixed schedules: step counters, timesteps,
  calibrated ratios): identical on every rank, no collective. MagCache's calibration mode measures
  per-shard norms and is refused under sequence parallelism.

CFG parallelism needs nothing extra: each cfg rank runs one branch, and diffusers keeps one state per
``cache_context`` ("cond" / "uncond") as in a single process; the reductions above run inside the
rank's own sequence group. Every rank of a group reaches every collective because every rank takes
the same decision; the collectives carry the mesh's timeout.
"""

from __future__ import annotations

from ..cache import FirstBlockDecision, gather_named, iter_diffusers_hooks
from ..config import ConfigError

__all__ = ["RankConsistentCache", "make_cache_rank_consistent"]


class _SeaAgreement:
    """Wraps a SeaCache shared state's ``resolve_gate``: gather every rank's decision and compare."""

    def __init__(self, shared_state, comm):
        self.shared_state = shared_state
        self.comm = comm
        self.inner = type(shared_state).resolve_gate.__get__(shared_state)

    def __call__(self, state, metadata, indicator, config):
        import torch

        compute = bool(self.inner(state, metadata, indicator, config))
        mine = torch.tensor([[1 if compute else 0]], dtype=torch.int64)
        everyone = mine.new_empty((self.comm.size, 1))
        gather_named(self.comm, everyone, mine, "cache_decision_check", f"SeaCache decision (step {metadata.step_index})")
        votes = [int(v) for v in everyone.flatten().tolist()]
        if len(set(votes)) != 1:
            raise RuntimeError(f"SeaCache decisions differ across the sequence group (compute votes by rank: {votes}); "
                               "its indicator must be computed from replicated inputs")
        return compute


class RankConsistentCache:
    """What :func:`make_cache_rank_consistent` changed on one model; ``remove()`` restores it."""

    def __init__(self, model):
        self.model = model
        self.first_block: list[FirstBlockDecision] = []
        self._restore: list[tuple[object, str, object]] = []  # (object, attribute, previous value or _MISSING)
        self._owners: list = []  # (runtime, decision maker) registrations to undo

    def _set(self, obj, name, value):
        self._restore.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def remove(self) -> None:
        for obj, name, prev in reversed(self._restore):
            if prev is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, prev)
        self._restore.clear()
        for runtime, dec in self._owners:
            if dec in runtime.decision_makers:
                runtime.decision_makers.remove(dec)
        self._owners.clear()
        self.first_block.clear()


_MISSING = object()


def make_cache_rank_consistent(model, comm, info, *, seq_dim: int = 1, runtime=None) -> RankConsistentCache:
    """Make every diffusers cache hook on ``model`` decide identically on all ranks of ``comm``.

    Args:
        model: the (boosted, cached) model whose hooks to adapt.
        comm: the sequence-group communicator (:class:`~lite_boost.parallel.comm.Communicator`).
        info: the :class:`~lite_boost.parallel.ulysses.SequenceShardInfo` the sharding hooks keep
            (real sequence length and shard length of the current call).
        seq_dim: the sequence dimension of the block hidden states.
        runtime: the model's :class:`~lite_boost.cache.CacheRuntime` (its decision log receives the
            group decisions, and it restarts their per-branch call counts with each generation).

    Raises ConfigError, before any computation, for a cache mode that cannot be made consistent.
    """
    import torch
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    from diffusers.hooks.mag_cache import MagCacheHeadHook

    try:
        from diffusers.hooks.sea_cache import SeaCacheLeaderBlockHook
    except ImportError:  # older diffusers without SeaCache
        SeaCacheLeaderBlockHook = ()

    handle = RankConsistentCache(model)
    if comm.size == 1:
        return handle
    hooks = list(iter_diffusers_hooks(model))
    for _, _, hook in hooks:
        if isinstance(hook, MagCacheHeadHook) and getattr(hook.config, "calibrate", False):
            raise ConfigError("cache mag_cache with calibrate=True measures per-shard norms and is not supported under "
                              "sequence parallelism; calibrate in one process, then pass mag_ratios")
    seen_shared = set()
    for _, _, hook in hooks:
        if isinstance(hook, FBCHeadBlockHook):
            dec = FirstBlockDecision(hook, runtime.decisions if runtime is not None else [], comm=comm, info=info,
                                     seq_dim=seq_dim)
            handle._set(hook, "_should_compute_remaining_blocks", torch.compiler.disable(dec))
            handle.first_block.append(dec)
            if runtime is not None:
                runtime.decision_makers.append(dec)
                handle._owners.append((runtime, dec))
        elif SeaCacheLeaderBlockHook and isinstance(hook, SeaCacheLeaderBlockHook):
            shared = hook.shared_state
            if id(shared) not in seen_shared:
                seen_shared.add(id(shared))
                handle._set(shared, "resolve_gate", _SeaAgreement(shared, comm))
    return handle
