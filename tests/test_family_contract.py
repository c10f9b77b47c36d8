"""The family contract, one row per model family: what every boosted transformer promises.

Each row is a tiny transformer of the family (random weights, built offline, awkward sizes: 3 heads, odd
token grids) with the inputs of one call, and what the family claims. Every row is checked for:

- parity: the boosted model's output equals stock diffusers' within ``parity`` in fp32 (0.0 = bit-equal);
- determinism: two boosted calls give the same output, bit for bit (``return_dict`` tuple = dict);
- reversibility: ``unboost`` gives back the stock objects (the same processors, no instance attribute,
  hook or parameter left behind, no class touched) and the stock output, bit for bit; boosting twice
  with the same config is a no-op;
- save / load: a boosted model saves the stock weights (``save_pretrained``), loads as a stock model of
  its class with stock output, and boosts again to the same output; ``copy.deepcopy`` gives an independent
  boosted copy (refused with a TypeError on the generic path); ``.to()`` keeps it boosted and exact;
- bf16: a boosted bf16 model runs (finite output) and stays close to the fp32 stock output (relative L2
  error below ``bf16``, and no worse than the stock bf16 model's by more than a small margin);
- compile: no graph break added (none where stock has none: one graph), and diffusers' regional compile
  recipe (``compile_repeated_blocks(fullgraph=True)``, inductor) equals the eager boosted output at two
  timesteps.

A new family costs one row here (docs/models/adding-a-family.md); ``test_every_family_has_a_row`` fails until
it has one. Family-specific behaviour (pipelines, CFG plans, sparse layouts, caches, RoPE forms) is tested
in the family's own test file.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import lite_boost
from lite_boost.api import is_boosted


@dataclass(frozen=True)
class Row:
    """One family's tiny model and its claims.

    family: the registered family name, or "generic" (lite_boost's generic path, no family record).
    model: ``model(dtype) -> nn.Module``: a fresh tiny transformer, the same weights at every call.
    inputs: ``inputs(dtype) -> dict``: the keyword arguments of one forward call.
    parity: max |boosted - stock| in fp32 (0.0 = bit-equal).
    bf16: max relative L2 error of the boosted bf16 output against the fp32 stock output.
    stock_breaks: stock diffusers' forward has graph breaks of its own (the boost must add none).
    steps: the timesteps of the regional-compile check (``timestep`` of the inputs replaced, same shape).
    blocks: the block class names regional compile compiles, for a class whose ``_repeated_blocks`` names none
        (set on the instance), or None.
    """

    family: str
    model: Callable[[torch.dtype], torch.nn.Module]
    inputs: Callable[[torch.dtype], dict]
    parity: float = 1e-5
    bf16: float = 0.02
    stock_breaks: bool = False
    steps: tuple[float, float] = (900.0, 600.0)
    blocks: tuple[str, ...] | None = None


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _floats(inputs: Callable[[], dict], keep=("timestep",)):
    """``inputs(dtype)``: the float tensors of ``inputs()`` (timesteps kept in fp32, as the pipelines pass them)."""
    def make(dtype=torch.float32):
        return {k: v if k in keep else _cast(v, dtype) for k, v in inputs().items()}

    return make


# ----------------------------------------------------------------------------------------------------- rows
def _wan():
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer

    def inputs():
        g = torch.Generator().manual_seed(0)
        return dict(hidden_states=torch.randn(1, 16, 3, 10, 14, generator=g), timestep=torch.tensor([700.0]),
                    encoder_hidden_states=torch.randn(1, 7, 32, generator=g))  # 3 x 5 x 7 tokens

    return Row("wan", lambda dtype: tiny_wan_transformer(TinyWanSpec(heads=3), dtype=dtype), _floats(inputs))


def _wan_ti2v_5b():
    from _tiny_wan5b import tiny_wan5b_transformer

    def inputs():  # Wan2.2-TI2V-5B: per-token timesteps, the conditioning frame's tokens at 0
        g = torch.Generator().manual_seed(0)
        ts = torch.full((1, 3 * 3 * 5), 700.0)
        ts[:, :15] = 0.0
        return dict(hidden_states=torch.randn(1, 48, 3, 6, 10, generator=g), timestep=ts,
                    encoder_hidden_states=torch.randn(1, 7, 32, generator=g))

    return Row("wan", lambda dtype: tiny_wan5b_transformer().to(dtype), _floats(inputs))


def _qwen_image():
    import _qwen_cases as cases
    from lite_boost.demo import TinyQwenImageSpec, tiny_qwen_image_transformer

    spec = TinyQwenImageSpec(heads=3)
    return Row("qwen-image", lambda dtype: tiny_qwen_image_transformer(spec, dtype=dtype),
               _floats(lambda: cases.transformer_inputs(spec, grid=(3, 5))), steps=(0.9, 0.6))


def _qwen_image_21():
    import _tiny_qwen21 as t

    return Row("qwen-image-2.1", lambda dtype: t.transformer(dtype=dtype),
               _floats(lambda: t.transformer_inputs(layout="one_condition", target=(2, 6), pad=[2])),
               stock_breaks=True, steps=(0.9, 0.6))


def _flux():
    import _tiny_flux as tf

    spec = tf.TinyFluxSpec()
    return Row("flux", lambda dtype: tf.transformer(spec, dtype=dtype),
               _floats(lambda: tf.transformer_inputs(spec, text_ids="random"), keep=("timestep", "img_ids", "txt_ids")),
               steps=(0.9, 0.6))


def _flux2():
    import _tiny_flux2 as t2

    return Row("flux2", lambda dtype: t2.transformer(dtype=dtype),
               _floats(lambda: t2.transformer_inputs(text_ids="random", reference=(2, 3))), steps=(0.9, 0.6))


def _ltx():
    import _tiny_ltx as tl

    return Row("ltx", lambda dtype: tl.tiny_ltx_transformer(dtype=dtype), _floats(lambda: tl.transformer_inputs()))


def _ltx2():
    import _tiny_ltx2 as t

    # audio + video: the row's output is the video; tests/test_ltx2.py checks the audio as well
    return Row("ltx2", lambda dtype: t.tiny_ltx2_transformer(dtype=dtype), _floats(lambda: t.transformer_inputs()))


def _cogvideox():
    import _tiny_cogvideox as T

    spec = T.TinyCogSpec("5b")
    return Row("cogvideox", lambda dtype: T.tiny_transformer(spec, dtype=dtype),
               _floats(lambda: T.transformer_inputs(spec, batch=1)), blocks=("CogVideoXBlock",))  # diffusers names none


def _hunyuan_video():
    import _tiny_hunyuan as hy

    # bf16: stock diffusers' bf16 model is itself 5.3e-2 from fp32 on this tiny config (its double-stream blocks)
    return Row("hunyuan-video", lambda dtype: hy.hunyuan_transformer(dtype=dtype),
               _floats(lambda: hy.transformer_inputs(), keep=()), bf16=0.08)


def _hunyuan_video_15():
    import _tiny_hunyuan as hy

    spec = hy.Hy15Spec()
    # 1.5's forward reorders the text with boolean indexing (data-dependent shapes): stock breaks outside the blocks
    return Row("hunyuan-video-1.5", lambda dtype: hy.hunyuan15_transformer(spec, dtype=dtype),
               _floats(lambda: hy.transformer_inputs_15(spec, valid=[(4, 3)]), keep=()), stock_breaks=True)


def _wan_derived(family, frames=3, per_frame=False):
    """The Wan-derived families (tests/_tiny_wan_derived.py): ChronoEdit's two-frame edit, SkyReels-V2's
    per-frame timesteps (diffusion forcing), Wan VACE's control latents, Wan Animate's pose / face inputs."""
    def make():
        import _tiny_wan_derived as tiny

        return Row(family, lambda dtype: tiny.transformer(family).to(dtype),
                   _floats(lambda: tiny.transformer_inputs(family, frames=frames, per_frame=per_frame)))

    return make


def _minimax_h3():
    import _tiny_minimax_h3 as mm

    # one packed sequence of text, a keyframe condition, audio and 3 x 3 x 5 video tokens (the pipeline's layout)
    return Row("minimax-h3", lambda dtype: mm.transformer(dtype=dtype),
               _floats(lambda: mm.transformer_inputs(), keep=("timestep", "position_ids")), steps=(0.9, 0.6))


def _generic():
    from _diffusers_tiny import build, inputs

    # a Flux-derived image DiT with no family of its own (diffusers' tiny config and inputs): the generic path
    name = "ChromaTransformer2DModel"
    return Row("generic", lambda dtype: build(name).to(dtype),
               _floats(lambda: inputs(name), keep=("timestep", "img_ids", "txt_ids")), steps=(0.9, 0.6))


ROWS = {
    "wan": _wan,
    "wan-ti2v-5b": _wan_ti2v_5b,
    "qwen-image": _qwen_image,
    "qwen-image-2.1": _qwen_image_21,
    "flux": _flux,
    "flux2": _flux2,
    "ltx": _ltx,
    "ltx2": _ltx2,
    "cogvideox": _cogvideox,
    "hunyuan-video": _hunyuan_video,
    "hunyuan-video-1.5": _hunyuan_video_15,
    "chronoedit": _wan_derived("chronoedit", frames=2),
    "skyreels-v2": _wan_derived("skyreels-v2", per_frame=True),
    "wan-vace": _wan_derived("wan-vace"),
    "wan-animate": _wan_derived("wan-animate"),
    "minimax-h3": _minimax_h3,
    "generic": _generic,
}


@pytest.fixture(params=list(ROWS))
def row(request) -> Row:
    return ROWS[request.param]()


# ----------------------------------------------------------------------------------------------------- helpers
def _out(model, inputs, **kw):
    out = model(**inputs, **kw)
    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else out.to_tuple()
    return out


def _close(a, b, tol):
    assert a.shape == b.shape
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= tol, f"max |diff| {diff:.3g} > {tol:g}"


def _snapshot(model) -> dict:
    """What a boost may touch and unboost must give back: processors, instance attributes, hooks, parameters,
    buffers (the same objects), and the forward of every module class."""
    modules = dict(model.named_modules())
    return {
        "processors": {n: id(p) for n, p in model.attn_processors.items()},
        "backends": {n: getattr(m.processor, "_attention_backend", None) for n, m in modules.items()
                     if hasattr(m, "processor")},
        "attrs": {n: sorted(m.__dict__) for n, m in modules.items()},
        "hooks": {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in modules.items()},
        "params": {n: id(p) for n, p in model.named_parameters()},
        "buffers": {n: id(b) for n, b in model.named_buffers()},
        "classes": {cls: cls.__dict__.get("forward") for cls in {type(m) for m in modules.values()}},
    }


def test_every_family_has_a_row():
    from lite_boost.registry import families

    missing = {f.name for f in families()} - {r().family for r in ROWS.values()}
    assert not missing, (f"families without a row in tests/test_family_contract.py: {sorted(missing)} (a new family "
                         "is a record, its shims and one row: docs/models/adding-a-family.md)")


# ----------------------------------------------------------------------------------------------------- checks
@torch.no_grad()
def test_boosted_equals_stock_and_is_deterministic(row):
    from lite_boost.adapter.generic import generic_context

    model, x = row.model(torch.float32), row.inputs(torch.float32)
    stock = _out(model, x)
    assert stock.abs().max() > 0
    assert lite_boost.boost(model) is model and is_boosted(model)
    if row.family == "generic":
        assert generic_context(model) is not None  # diffusers' processors call lite_boost's registered backend
    else:
        assert model._lite_boost.family.name == row.family
    first, second = _out(model, x), _out(model, x)
    _close(first, stock, row.parity)
    assert torch.equal(first, second), "two boosted calls differ"
    assert torch.equal(first, _out(model, x, return_dict=False))


@torch.no_grad()
def test_unboost_gives_back_stock_objects_and_output(row):
    model, x = row.model(torch.float32), row.inputs(torch.float32)
    before = _snapshot(model)
    stock = _out(model, x)
    lite_boost.boost(model)
    state = model._lite_boost
    assert lite_boost.boost(model) is model and model._lite_boost is state  # same config: a no-op
    boosted = _snapshot(model)
    assert boosted["classes"] == before["classes"], "the boost patched a class (patch instances only)"
    assert boosted["processors"] != before["processors"] or boosted["backends"] != before["backends"]
    _out(model, x)
    lite_boost.unboost(model)
    assert not is_boosted(model)
    after = _snapshot(model)
    for key in before:
        assert after[key] == before[key], f"unboost left {key} changed"
    assert torch.equal(_out(model, x), stock)


@torch.no_grad()
def test_save_load_and_to(row, tmp_path):
    model, x = row.model(torch.float32), row.inputs(torch.float32)
    stock = _out(model, x)
    lite_boost.boost(model)
    boosted = _out(model, x)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    # safetensors loads some weights at unaligned (mmap) addresses, where CPU kernels take another SIMD path and
    # round differently in the last bit (stock diffusers alike); aligned copies make the comparison bit-exact
    for param in loaded.parameters():
        param.data = param.data.clone()
    assert not is_boosted(loaded)
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert list(saved) == list(reloaded) and all(torch.equal(saved[k], reloaded[k]) for k in saved)
    assert torch.equal(_out(loaded, x), stock)  # what was saved is the stock model
    lite_boost.boost(loaded)
    assert torch.equal(_out(loaded, x), boosted)
    if row.family == "generic":  # its attention backend is registered for the one instance: refused clearly
        with pytest.raises(TypeError, match="generic path is not supported.*Copy the model before boosting"):
            copy.deepcopy(model)
    else:  # a copy is boosted on its own: unboosting it leaves the original boosted
        twin = copy.deepcopy(model)
        assert is_boosted(twin) and torch.equal(_out(twin, x), boosted)
        lite_boost.unboost(twin)
        assert not is_boosted(twin) and is_boosted(model) and torch.equal(_out(model, x), boosted)
    model.to("cpu").to(torch.float64).to(torch.float32).eval()
    assert is_boosted(model)
    _close(_out(model, x), stock, row.parity)


@torch.no_grad()
def test_bf16_runs_and_stays_close_to_fp32_stock(row):
    ref = _out(row.model(torch.float32), row.inputs(torch.float32)).float()
    model, x = row.model(torch.bfloat16), row.inputs(torch.bfloat16)
    stock = _out(model, x).float()
    lite_boost.boost(model)
    got = _out(model, x)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    rel_stock = ((stock - ref).norm() / ref.norm()).item()
    assert rel < row.bf16 and rel <= 1.5 * rel_stock + 2e-3, (rel, rel_stock)


@torch.no_grad()
def test_no_new_graph_break(row, fresh_dynamo):
    x = row.inputs(torch.float32)
    stock = torch._dynamo.explain(row.model(torch.float32))(**x)
    torch._dynamo.reset()
    boosted = torch._dynamo.explain(lite_boost.boost(row.model(torch.float32)))(**x)
    reasons = [r.reason.splitlines()[0] for r in boosted.break_reasons]
    assert (stock.graph_break_count > 0) == row.stock_breaks, [r.reason for r in stock.break_reasons]
    if row.stock_breaks:
        assert boosted.graph_break_count <= stock.graph_break_count, reasons
    else:
        assert boosted.graph_break_count == 0 and boosted.graph_count == 1, reasons


@pytest.mark.slow
@torch.no_grad()
def test_regional_compile_equals_eager(row, fresh_dynamo):
    """diffusers' regional compile recipe (inductor, fullgraph: a graph break in a block fails) on the boosted model."""
    model, x = lite_boost.boost(row.model(torch.float32)), row.inputs(torch.float32)
    calls = [{**x, "timestep": torch.full_like(x["timestep"], t) if x["timestep"].ndim < 2 else
              x["timestep"].clamp(max=t)} for t in row.steps]
    eager = [_out(model, c) for c in calls]
    if row.blocks is not None:
        model._repeated_blocks = row.blocks
    model.compile_repeated_blocks(fullgraph=True)
    _close(_out(model, calls[0]), eager[0], 1e-4)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a new timestep value is no new graph
        _close(_out(model, calls[1]), eager[1], 1e-4)


def test_the_adding_a_family_guide_shows_a_real_row():
    """docs/models/adding-a-family.md shows the Qwen-Image row as it is in this table."""
    import inspect
    from pathlib import Path

    guide = Path(__file__).resolve().parents[1].joinpath("docs", "models", "adding-a-family.md").read_text("utf-8")
    assert inspect.getsource(_qwen_image).rstrip() in guide
