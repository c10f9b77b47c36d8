"""Shared test setup: offline hub, deterministic threads, tiny Wan pipeline call helpers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pipeline_kwargs(kind: str, *, height=32, width=48, num_frames=5, steps=2, seed=0, output_type="latent"):
    """Arguments of one tiny pipeline call (CFG on) with a fixed generator."""
    kw = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry low quality", height=height,
              width=width, num_frames=num_frames, num_inference_steps=steps, guidance_scale=5.0,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if kind == "i2v":
        import PIL.Image

        rng = np.random.RandomState(seed)
        kw["image"] = PIL.Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))
        kw["max_sequence_length"] = 512
    return kw


@pytest.fixture
def tiny_kwargs():
    return pipeline_kwargs


# what torchrun sets in a rank's environment; tests that must run as one plain process clear it
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single_process_env(monkeypatch):
    """No launcher variables during the test, and no process group left behind by it."""
    import torch.distributed as dist

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized()


@pytest.fixture
def fresh_dynamo():
    """A clean torch._dynamo state (compile caches) before and after the test, compile warnings muted."""
    import warnings

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


def check_regional_compile(model, inputs, steps, *, sparse=False, tol=1e-4):
    """diffusers' regional compile recipe (``compile_repeated_blocks(fullgraph=True)``, inductor) on a boosted
    transformer equals its eager output at every timestep of ``steps`` (the rest of the call from ``inputs``);
    with ``sparse``, every attention took the sparse path."""
    with torch.no_grad():
        ref = [model(**{**inputs, "timestep": t}).sample for t in steps]
        model.compile_repeated_blocks(fullgraph=True)
        out = [model(**{**inputs, "timestep": t}).sample for t in steps]
    for r, o in zip(ref, out):
        assert (o - r).abs().max().item() <= tol
    if sparse:
        assert {e.path for e in model._lite_boost.extras["sparse"].events} == {"sparse"}


def without_family(monkeypatch, name: str) -> None:
    """Unregister the family ``name`` for one test (restored after it): its classes then take the generic path,
    as a model without a family of its own does."""
    from lite_boost import registry

    registry.load_builtin_adapters()
    family = registry._FAMILIES[name]
    # a new dict without it (restored whole afterwards: deleting and re-adding the key would move the family to
    # the end of the registration order, which the generated docs follow)
    monkeypatch.setattr(registry, "_FAMILIES", {k: v for k, v in registry._FAMILIES.items() if k != name})
    for cls in (*family.transformers, *family.pipelines):
        monkeypatch.delitem(registry.SUPPORTED_MODELS, cls)
