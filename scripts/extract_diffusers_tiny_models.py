"""Extract diffusers' tiny test configurations of its transformer classes into tests/data (run offline, once).

    python scripts/extract_diffusers_tiny_models.py /path/to/diffusers/tests [tests/data/diffusers_tiny.pt]

diffusers' own model tests (``tests/models/transformers/test_models_transformer_*.py`` of the diffusers
repository; they ship in the repository, not in the wheel) describe a tiny configuration of every class:
``*TesterConfig.get_init_dict()`` / ``get_dummy_inputs()`` (older files:
``prepare_init_args_and_inputs_for_common()``). This script imports each file from a checkout of that
folder, calls them and stores, per model class, the init dict and the dummy inputs (tensors, and the
plain values some models take) in one ``torch.save`` file, so the test suite runs without the repository
or network (large float inputs are stored as shapes and drawn again). Classes the installed diffusers lacks, or whose tester fails to build inputs here, are
reported and left out.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

import torch


def _configs(module):
    for _, obj in vars(module).items():
        if not inspect.isclass(obj) or obj.__module__ != module.__name__:
            continue
        if hasattr(obj, "get_init_dict") and hasattr(obj, "get_dummy_inputs") and obj.__name__.endswith("TesterConfig"):
            yield obj, "new"
        elif hasattr(obj, "prepare_init_args_and_inputs_for_common") and "model_class" in vars(obj):
            yield obj, "old"


EXACT_FLOATS = 256  # float tensors up to this size are kept as they are (timesteps, small tables)


def _plain(x):
    """Inputs made storable: integer / bool tensors and small float tensors as they are; larger float tensors
    (latents, embeddings) as ``{"randn": shape, "dtype": name}``, drawn again at test time (what the parity
    test compares is stock vs boosted on the same input, not diffusers' exact values)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.numel() > EXACT_FLOATS:
            return {"randn": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}
        return x.detach().cpu().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def extract(tests_root: Path) -> dict:
    sys.path.insert(0, str(tests_root.parent))
    out, problems = {}, {}
    folder = tests_root / "models" / "transformers"
    for path in sorted(folder.glob("test_models_*.py")):
        name = f"tests.models.transformers.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a test file for a class the installed diffusers lacks
            problems[path.stem] = f"import: {type(exc).__name__}: {exc}"
            continue
        for cfg_cls, style in _configs(module):
            try:
                cfg = cfg_cls()
                if style == "new":
                    model_class, init, inputs = cfg.model_class, cfg.get_init_dict(), cfg.get_dummy_inputs()
                else:
                    model_class = cfg_cls.model_class
                    init, inputs = cfg.prepare_init_args_and_inputs_for_common()
            except Exception as exc:  # noqa: BLE001
                problems[cfg_cls.__name__] = f"{type(exc).__name__}: {exc}"
                continue
            key = model_class.__name__
            if key in out:
                continue
            out[key] = {"init": _plain(dict(init)), "inputs": _plain(dict(inputs)), "source": f"{path.name}::{cfg_cls.__name__}"}
    return out, problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tests_root = Path(argv[0]).resolve()
    dest = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "tests" / "data" / "diffusers_tiny.pt"
    data, problems = extract(tests_root)
    torch.save(data, dest)
    print(f"{len(data)} classes -> {dest} ({dest.stat().st_size / 1024:.0f} KiB)")
    for k, v in problems.items():
        print(f"  left out {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
