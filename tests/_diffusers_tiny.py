"""diffusers' tiny test configurations of its transformer classes (tests/data/diffusers_tiny.pt).

The data comes from diffusers' own model tests (``*TesterConfig.get_init_dict()`` / ``get_dummy_inputs()``),
extracted by ``scripts/extract_diffusers_tiny_models.py``; large float inputs are stored as shapes and drawn
again here from a fixed seed.
"""

from __future__ import annotations

import copy
import functools
import os

import torch

DATA = os.path.join(os.path.dirname(__file__), "data", "diffusers_tiny.pt")


@functools.lru_cache(maxsize=1)
def _cases() -> dict:
    return torch.load(DATA, weights_only=False)


def case_names() -> list[str]:
    return sorted(_cases())


def init_dict(name: str) -> dict:
    return copy.deepcopy(_cases()[name]["init"])


def inputs(name: str, seed: int = 0) -> dict:
    """The dummy inputs of ``name``'s tester, drawn again from ``seed`` where stored as shapes."""
    g = torch.Generator("cpu").manual_seed(seed)

    def make(x):
        if isinstance(x, dict) and set(x) == {"randn", "dtype"}:
            return torch.randn(x["randn"], generator=g, dtype=torch.float32).to(getattr(torch, x["dtype"]))
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, (list, tuple)):
            return type(x)(make(v) for v in x)
        if isinstance(x, dict):
            return {k: make(v) for k, v in x.items()}
        return x

    return make(_cases()[name]["inputs"])


def model_class(name: str):
    import diffusers

    return getattr(diffusers, name, None) or getattr(__import__("diffusers.models.transformers",
                                                                fromlist=[name]), name, None)


def build(name: str, seed: int = 0):
    """A tiny random-weight ``name`` in eval mode (fp32)."""
    torch.manual_seed(seed)
    return model_class(name)(**init_dict(name)).eval()
