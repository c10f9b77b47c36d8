"""Few-step runs: say so when a boosted feature would do nothing (or compute wrongly) at the run's step count.

Few-step schedules (4-8 steps, guidance-free, e.g. a distilled 4-step LoRA) run with every feature; but some
settings made for 30-50 steps cover a short run entirely: dense warm-up / final steps of block-sparse attention,
a step cache's warm-up (TaylorSeer's ``disable_cache_before_step``, MagCache's ``retention_ratio``), a timestep
range no step of the run falls in (Pyramid Attention Broadcast). The step count is known only when the pipeline
runs: a forward pre-hook on a boosted transformer of a pipeline reads the pipeline scheduler's timesteps at the
first transformer call of a run and

* warns (``FewStepWarning``, once per model and step count) when a feature would do nothing at that count,
* raises ``ConfigError`` before the transformer runs when the feature would compute a wrong result (MagCache
  calibrated for another step count).

A transformer boosted on its own (no pipeline) does not know its run's length: nothing is checked.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..cache import step_count_problem
from ..errors import ConfigError
from ..schedule import SparseSchedule

__all__ = ["FewStepWarning", "attach_step_check", "detach_step_check", "step_problems"]

STATE_KEY = "step_check"


class FewStepWarning(UserWarning):
    """A boosted feature does nothing at the run's step count (the message names the option to change)."""


def step_problems(model, config, steps: int, timesteps=None) -> tuple[list[str], list[str]]:
    """([what does nothing], [what would compute wrongly]) for a run of ``steps`` steps of boosted ``model``."""
    idle, wrong = [], []
    sparse = config.sparse
    if sparse is not None and sparse.sparse_type is not None:
        why = SparseSchedule(sparse).step_count_problem(steps)
        if why is not None:
            idle.append(why)
    cfg = getattr(model, "_cache_config", None)
    if config.cache is not None and cfg is not None:
        why, bad = step_count_problem(config.cache.method, cfg, steps, timesteps)
        if why is not None:
            (wrong if bad else idle).append(why)
    return idle, wrong


class _StepCheck:
    def __init__(self, model, config, pipe):
        self.model = weakref.ref(model)
        self.config = config
        self.pipe = weakref.ref(pipe)
        self.checked: set[int] = set()

    def __call__(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # a whole-model compile traces no check (compile-clean); regional: checked
            return None
        return self._check(module)

    def _check(self, module):
        pipe = self.pipe()
        sched = getattr(pipe, "scheduler", None) if pipe is not None else None
        ts = getattr(sched, "timesteps", None)
        if ts is None or getattr(sched, "step_index", None) not in (None, 0):
            return None
        steps = len(ts)
        if steps in self.checked:
            return None
        idle, wrong = step_problems(module, self.config, steps, ts)
        if wrong:
            raise ConfigError(f"{type(module).__name__} boosted by lite_boost cannot run {steps} steps as configured: "
                              + "; ".join(wrong))
        self.checked.add(steps)
        for why in idle:
            warnings.warn(f"{type(module).__name__}, {steps}-step run: {why}", FewStepWarning, stacklevel=2)
        return None


def attach_step_check(model, pipe) -> None:
    """Check each run of ``pipe`` against the boosted ``model``'s sparse / cache settings (nothing to check: no-op)."""
    state = getattr(model, "_lite_boost", None)
    if state is None:
        return
    detach_step_check(model, state)
    config = state.config
    if (config.sparse is None or config.sparse.sparse_type is None) and config.cache is None:
        return
    check = _StepCheck(model, config, pipe)
    state.extras[STATE_KEY] = (check, model.register_forward_pre_hook(check, with_kwargs=True))


def detach_step_check(model, state) -> None:
    entry = state.extras.pop(STATE_KEY, None)
    if entry is not None:
        entry[1].remove()
