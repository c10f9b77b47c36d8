"""Step / layer schedule of block-sparse attention, driven by the denoising loop itself.

Dense warm-up steps, dense final steps, dense layers and block-mask reuse are the main quality and
speed levers of training-free sparse attention. :class:`StepTracker` follows the denoising step
from what a transformer call sees (the pipeline scheduler's ``step_index`` when the pipeline is
known, else the sequence of timesteps), so users never touch the loop; :class:`SparseSchedule`
answers "dense or sparse?" and "recompute the mask?" from a :class:`~lite_boost.config.SparseConfig`.
Both are deterministic functions of the scheduler state and the call order, which are identical on
every rank of a parallel run, so all ranks take the same path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .config import SparseConfig

__all__ = ["SparseSchedule", "StepTracker"]


@dataclass(frozen=True)
class SparseSchedule:
    """Which (step, layer) run dense, and how long a block mask is reused."""

    config: SparseConfig

    def dense_reason(self, step: int, total_steps: int | None, layer: int) -> str | None:
        """Why this call must be dense (a short reason), or None if it may be sparse."""
        c = self.config
        if c.sparse_type is None:
            return "sparse_type=None"
        if layer in c.dense_layers:
            return f"layer {layer} in dense_layers"
        if step < c.dense_steps_first:
            return f"step {step} < dense_steps_first={c.dense_steps_first}"
        if total_steps is not None and c.dense_steps_last and step >= total_steps - c.dense_steps_last:
            return f"step {step} in the last dense_steps_last={c.dense_steps_last} of {total_steps}"
        return None

    def step_count_problem(self, total_steps: int) -> str | None:
        """Why block-sparse attention would never run in a run of ``total_steps`` steps (None: it runs)."""
        c = self.config
        if c.sparse_type is None or c.dense_steps_first + c.dense_steps_last < total_steps:
            return None
        return (f"sparse: dense_steps_first={c.dense_steps_first} + dense_steps_last={c.dense_steps_last} cover all "
                f"{total_steps} steps of this run, so block-sparse attention never runs; for a few-step schedule "
                f"lower them (SparseConfig(dense_steps_first=..., dense_steps_last=...), together below {total_steps})")

    def reuse(self, step: int, computed_at: int | None) -> bool:
        """True if a mask computed at step ``computed_at`` may serve ``step``."""
        return computed_at is not None and 0 <= step - computed_at < self.config.mask_reuse_steps


def _noise_level(timestep) -> float:
    """The call's noise level: the largest timestep (Wan2.2 TI2V image-to-video gives the first frame's
    tokens timestep 0 and the others the step's timestep, in a per-token (B, S) tensor)."""
    if isinstance(timestep, torch.Tensor):
        return float(timestep.detach().max()) if timestep.numel() else 0.0
    return float(timestep)


class StepTracker:
    """Current denoising step and call-within-step of one transformer.

    ``observe(timestep)`` is called at the start of every transformer forward. With a pipeline
    attached (:meth:`attach`), the step is its scheduler's ``step_index`` (None before the first
    ``scheduler.step`` = step 0) and the total is ``len(scheduler.timesteps)``; otherwise the step
    counts distinct consecutive timesteps. A timestep larger than the previous one (noise goes
    up), or a scheduler step index lower than the previous one, starts a new generation. ``call``
    numbers the forwards inside one step (0 = conditional, 1 = unconditional with classifier-free
    guidance), so masks are never shared across CFG branches.
    """

    def __init__(self):
        self._pipe = None
        self.step = 0
        self.call = -1
        self.total: int | None = None
        self.generation = 0
        self._last_t: float | None = None

    def attach(self, pipeline) -> None:
        """Follow ``pipeline.scheduler`` (read at each call, so swapping the scheduler works)."""
        self._pipe = weakref.ref(pipeline)

    def _scheduler(self):
        pipe = self._pipe() if self._pipe is not None else None
        return getattr(pipe, "scheduler", None) if pipe is not None else None

    def observe(self, timestep) -> None:
        t = _noise_level(timestep)
        restart = self._last_t is None or t > self._last_t
        sched = self._scheduler()
        if sched is not None:
            idx = getattr(sched, "step_index", None)
            step = 0 if idx is None else int(idx)
            restart = restart or step < self.step
            ts = getattr(sched, "timesteps", None)
            self.total = len(ts) if ts is not None else None
        else:
            step = 0 if restart else (self.step if t == self._last_t else self.step + 1)
            self.total = None
        if restart and self._last_t is not None:
            self.generation += 1
        self.call = self.call + 1 if (step == self.step and not restart) else 0
        self.step = step
        self._last_t = t
