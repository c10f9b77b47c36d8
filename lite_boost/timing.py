"""Phase timing of one diffusers video pipeline call: text encode, denoise steps, VAE decode.

``PhaseTimer(pipe)`` wraps ``pipe.encode_prompt`` and ``pipe.vae.decode`` on the instance for the
duration of a ``with`` block and records step boundaries through ``callback_on_step_end``; the
wrappers are removed on exit, so the pipeline is left exactly as it was.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

__all__ = ["PhaseTimes", "PhaseTimer", "format_timing_table", "speedup_line", "warmup_line"]


def _sync(device_type: str | None) -> None:
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
    elif device_type == "npu" and hasattr(torch, "npu"):
        torch.npu.synchronize()  # type: ignore[attr-defined]


@dataclass
class PhaseTimes:
    text_encode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    vae_decode_s: float = 0.0
    total_s: float = 0.0
    warmup_s: list[float] = field(default_factory=list)  # untimed warm-up calls before this run (one-off costs)

    @property
    def denoise_s(self) -> float:
        return sum(self.step_s)

    @property
    def step_median_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else 0.0


class PhaseTimer:
    """Context manager timing the phases of pipeline calls made inside it.

    Pass ``timer.callback`` as ``callback_on_step_end`` to the pipeline call.
    """

    def __init__(self, pipe, device_type: str | None = None):
        self.pipe = pipe
        self.device_type = device_type
        self.times = PhaseTimes()
        self._patched: list[tuple[object, str]] = []
        self._mark = 0.0

    def _wrap(self, owner, name: str, attr: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            _sync(self.device_type)
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            _sync(self.device_type)
            setattr(self.times, attr, getattr(self.times, attr) + time.perf_counter() - t0)
            if attr == "text_encode_s":
                self._mark = time.perf_counter()  # denoising starts after the prompt is encoded
            return out

        setattr(owner, name, timed)
        self._patched.append((owner, name))

    def __enter__(self) -> "PhaseTimer":
        if callable(getattr(self.pipe, "encode_prompt", None)):  # a modular pipeline has none (a step encodes)
            self._wrap(self.pipe, "encode_prompt", "text_encode_s")
        if getattr(self.pipe, "vae", None) is not None:
            self._wrap(self.pipe.vae, "decode", "vae_decode_s")
        self._start = time.perf_counter()
        self._mark = self._start
        return self

    def callback(self, pipe, step, timestep, callback_kwargs):
        _sync(self.device_type)
        now = time.perf_counter()
        self.times.step_s.append(now - self._mark)
        self._mark = now
        return {}

    def __exit__(self, *exc) -> None:
        _sync(self.device_type)
        self.times.total_s = time.perf_counter() - self._start
        for owner, name in reversed(self._patched):
            if name in owner.__dict__:
                delattr(owner, name)
        self._patched.clear()


PHASES = ("text encode", "denoise", "VAE decode")


def format_timing_table(rows: dict[str, PhaseTimes], untouched: tuple[str, ...] = ()) -> str:
    """Markdown table: one column per run (e.g. "stock", "boosted"), plus speed-up vs the first.

    ``untouched``: phases (from ``PHASES``) the boost does not change; they are labelled "not boosted"
    and get no speed-up figure (any difference there is run-to-run noise, not an effect).
    """
    bad = [p for p in untouched if p not in PHASES]
    if bad:
        raise ValueError(f"untouched must name phases from {list(PHASES)}, got {bad}")
    names = list(rows)
    base = rows[names[0]]
    lines = ["| phase | " + " | ".join(names) + (" | speed-up |" if len(names) > 1 else " |"),
             "|---|" + "---:|" * len(names) + ("---:|" if len(names) > 1 else "")]

    def line(label, get, phase=None):
        vals = [get(rows[n]) for n in names]
        cells = " | ".join(f"{v:.3f} s" for v in vals)
        speed = ""
        if phase in untouched:
            label = f"{label} (not boosted)"
            speed = " | - |" if len(names) > 1 else ""
            return f"| {label} | {cells}{speed}" + ("" if len(names) > 1 else " |")
        if len(names) > 1:
            speed = f" | {get(base) / vals[-1]:.2f}x" if vals[-1] > 0 else " | -"
        return f"| {label} | {cells}{speed} |"

    lines.append(line("text encode", lambda t: t.text_encode_s, "text encode"))
    lines.append(line(f"denoise total (the whole loop, {len(base.step_s)} steps)", lambda t: t.denoise_s, "denoise"))
    lines.append(line(f"denoise per step (median of {len(base.step_s)})", lambda t: t.step_median_s, "denoise"))
    lines.append(line("VAE decode", lambda t: t.vae_decode_s, "VAE decode"))
    lines.append(line("total", lambda t: t.total_s))
    return "\n".join(lines)


def speedup_line(stock: PhaseTimes, boosted: PhaseTimes, step_cache: bool = False) -> str:
    """The speed-ups side by side: the whole loop (what a user waits for), the median step, the whole call."""
    def r(a, b):
        return f"{a / b:.2f}x" if b > 0 else "-"

    text = (f"speed-up: denoising loop {r(stock.denoise_s, boosted.denoise_s)} (whole loop), median step "
            f"{r(stock.step_median_s, boosted.step_median_s)}, whole call {r(stock.total_s, boosted.total_s)}")
    if step_cache:
        text += ("; with a step cache the loop figure is the one that counts (a reused step is nearly free, so "
                 "the median step flatters the cache)")
    return text


def warmup_line(rows: dict[str, PhaseTimes], warmup: int, call: str = "1-step") -> str:
    """What ran before the timed runs, and where the one-off costs went. ``call``: what one warm-up call was
    (``"1-step"``, or ``"whole"`` where the pipeline cannot stop early)."""
    if warmup <= 0:
        return ("no warm-up (--warmup 0): one-off costs (kernel library load, compilation, the first sparse call) "
                "are inside the timed runs")
    names = " and ".join(rows)
    return (f"both sides warmed up before their timed run: {names} each made {warmup} untimed {call} call(s) first "
            "(one-off costs listed below, not in the table)")
