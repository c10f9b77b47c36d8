"""Low-precision attention (``precision="int8"``) above the kernel: the option, the ops, the boosted model.

The kernel itself (every GEMM path and layout against the fp64 reference) is tested in test_csrc_ops.py; here:
``BoostConfig(attention={"precision": ...})`` (validation, equality with ``attention_backend``, YAML, CLI,
refusal of what the device cannot run), dense ``attention`` and ``sparse_attention`` at int8 against fp64
references, the backend choice, and a boosted tiny Wan (self-attention only, with block-sparse attention,
int8 Linear layers, step caching, torch.compile without graph breaks). Ring x sparse x int8 runs in
test_ring.py's 2-rank spawn.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lite_boost
from lite_boost.config import AttentionConfig, BoostConfig
from lite_boost.errors import ConfigError
from lite_boost.ops import _ext
from lite_boost.ops.attention import AttentionBackendError, attention, select_backend
from lite_boost.ops.attention import precision_reason
from lite_boost.ops.precision import cpu_int8_reason
from lite_boost.ops.rain_fusion import SparseBackendError, available_sparse_backends, rain_fusion_attention
from lite_boost.ops.sparse import sparse_attention

# int8 bounds against fp64 (relative L1, lse): see test_csrc_ops.INT8_* (same recipe, dense shapes here)
REL_L1, LSE_TOL = 1.3e-2, 2.5e-2


@pytest.fixture(scope="module")
def int8_cpu():
    why = cpu_int8_reason()
    if why is not None:
        pytest.skip(f"int8 attention cannot run on this CPU: {why}")


def _rel_l1(out, ref) -> float:
    return ((out.double() - ref.double()).abs().sum() / ref.double().abs().sum()).item()


def _dense_reference(q, k, v, scale=None):
    """fp64 attention of BSND q, k, v (GQA by repetition) and its lse (B, N, S)."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    g = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    return (torch.softmax(s, -1) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


def _qkv(seed, b, s, n1, n2, d, offset=4.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, n1, d, generator=g)
    k = torch.randn(b, s, n2, d, generator=g) + offset * torch.randn(d, generator=g)  # DiT-like key offsets
    v = torch.randn(b, s, n2, d, generator=g)
    return q, k, v


# --------------------------------------------------------------------------------------------- #
# the option                                                                                     #
# --------------------------------------------------------------------------------------------- #


def test_attention_config_values_and_backend_alias(tmp_path):
    assert BoostConfig().attention == AttentionConfig(None, "auto")
    cfg = BoostConfig(attention={"precision": "int8", "backend": "sdpa"})
    assert cfg.attention.precision == "int8" and cfg.attention_backend == "sdpa"
    # attention_backend and attention.backend are one setting: equal configs whichever was given
    assert BoostConfig(attention_backend="sdpa") == BoostConfig(attention={"backend": "sdpa"})
    assert BoostConfig.coerce(AttentionConfig(precision="int8")) == BoostConfig(attention={"precision": "int8"})
    assert cfg.replace(attention_backend="fa2").attention.backend == "fa2"
    assert cfg.replace(attention=AttentionConfig(precision="int8")).attention_backend is None
    with pytest.raises(ConfigError, match=r"attention.precision must be one of \['auto', 'int8', 'fp8'\], got 'int4'"):
        BoostConfig(attention={"precision": "int4"})
    with pytest.raises(ConfigError, match="attention_backend='sdpa' and attention.backend='fa2' disagree"):
        BoostConfig(attention_backend="sdpa", attention={"backend": "fa2"})
    with pytest.raises(ConfigError, match=r"unknown AttentionConfig key\(s\) \['precison'\]"):
        BoostConfig(attention={"precison": "int8"})
    # YAML round trip
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "boost.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert BoostConfig.from_yaml(str(path)) == cfg
    path.write_text("attention:\n  precision: int8\n")
    assert BoostConfig.from_yaml(str(path)).attention.precision == "int8"


def test_cli_attention_precision_flag(tmp_path):
    from lite_boost.cli import _boost_config, build_parser

    parser = build_parser()
    assert _boost_config(parser.parse_args(["generate"])).attention.precision == "auto"
    assert _boost_config(parser.parse_args(["generate", "--attention-precision", "int8"])).attention.precision == "int8"
    path = tmp_path / "c.yaml"
    path.write_text("attention:\n  backend: sdpa\n")
    cfg = _boost_config(parser.parse_args(["generate", "--config", str(path), "--attention-precision", "int8"]))
    assert cfg.attention == AttentionConfig("sdpa", "int8")
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--attention-precision", "int4"])


def test_precision_the_device_cannot_run_is_refused_before_boosting():
    from lite_boost.demo import tiny_wan_transformer

    model = tiny_wan_transformer()
    before = {n: type(m.processor) for n, m in model.named_modules() if hasattr(m, "processor")}
    with pytest.raises(ConfigError, match=r"attention.precision='fp8' cannot run on cpu: .*FP8.* must be one of "
                                          r"\[.*'auto'.*\] here \(allowed values: \['auto', 'int8', 'fp8'\]\)"):
        lite_boost.boost(model, {"attention": {"precision": "fp8"}})
    assert {n: type(m.processor) for n, m in model.named_modules() if hasattr(m, "processor")} == before
    assert precision_reason("cuda", "int8")  # no kernel registered for another device in this build


# --------------------------------------------------------------------------------------------- #
# ops                                                                                            #
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_dense_attention_int8_matches_fp64(int8_cpu, layout):
    """Dense int8 attention (the kernel with every block selected): GQA, a partial last block, a custom scale,
    the lse Ring merges with, either layout."""
    q, k, v = _qkv(1, 2, 300, 4, 2, 64)
    ref, ref_lse = _dense_reference(q, k, v, scale=0.1)
    if layout == "BNSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = attention(q, k, v, layout=layout, scale=0.1, return_lse=True, precision="int8")
    if layout == "BNSD":
        out = out.transpose(1, 2)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert _rel_l1(out, ref) < REL_L1
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL
    plain = attention(*(t.transpose(1, 2) for t in (q, k, v)) if layout == "BNSD" else (q, k, v), scale=0.1,
                      precision="int8")
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


@pytest.mark.parametrize("s", [3, 45, 301])
def test_int8_attention_at_odd_token_counts(int8_cpu, s):
    """Odd token counts make odd reductions in P V; on AMX CPUs oneDNN's bf16 micro-kernel faults on an odd
    reduction length, so the kernel rounds it up to even against V's zero pad row: still the fp64 result."""
    q, k, v = _qkv(5, 1, s, 3, 3, 24)
    ref, ref_lse = _dense_reference(q, k, v)
    out, lse = attention(q, k, v, return_lse=True, precision="int8")
    assert _rel_l1(out, ref) < REL_L1
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL
    kw = dict(head_num=3, input_layout="BSND", sparse_type="rf_v2", block_size=7, latent_shape_q=(1, 1, s),
              backend="cpp")  # an odd block size: one P V product per block
    sparse8 = sparse_attention(q, k, v, sparsity=0.5, precision="int8", **kw)
    assert _rel_l1(sparse8, sparse_attention(q, k, v, sparsity=0.5, **kw)) < REL_L1


def test_dense_attention_precision_refusals(int8_cpu):
    q, k, v = _qkv(2, 1, 16, 2, 2, 8)
    with pytest.raises(ValueError, match=r"precision must be one of \['auto', 'int8', 'fp8'\], got 'bf16'"):
        attention(q, k, v, precision="bf16")
    with pytest.raises(AttentionBackendError, match="cpu_int8: no key-padding mask support"):
        attention(q, k, v, precision="int8", key_mask=torch.ones(1, 16, dtype=torch.bool))
    with pytest.raises(AttentionBackendError, match="No fp8 attention kernel is available for cpu"):
        attention(q, k, v, precision="fp8")
    with pytest.raises(AttentionBackendError, match="cpu_int8: unsupported dtype float64"):
        attention(q.double(), k.double(), v.double(), precision="int8")
    assert select_backend(q, k, precision="int8") == "cpu_int8"


def test_rain_fusion_int8_backend_choice(int8_cpu):
    """int8 runs on the C++ kernel; the full-precision backends refuse it when forced and are skipped otherwise."""
    usable = available_sparse_backends("cpu", torch.float32, precision="int8")
    assert usable["cpp"] is None and all(usable[n] for n in ("flex", "gather", "reference", "npu"))
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(3, 1, 40, 2, 2, 16))
    idx = torch.arange(5).expand(5, 2, 5)
    num = torch.full((5, 2), 5)
    out, _ = rain_fusion_attention(q, k, v, idx, num, [8, 8], q_input_layout="BNSD", kv_input_layout="BNSD",
                                   precision="int8")
    ref, _ = _dense_reference(*(t.transpose(1, 2) for t in (q, k, v)))
    assert _rel_l1(out.transpose(1, 2), ref) < REL_L1
    with pytest.raises(SparseBackendError, match=r"'gather'.*precision='int8'.*Usable backends: \['cpp'\]"):
        rain_fusion_attention(q, k, v, idx, num, [8, 8], q_input_layout="BNSD", kv_input_layout="BNSD",
                              precision="int8", backend="gather")
    with pytest.raises(ValueError, match=r"precision must be one of \['auto', 'int8', 'fp8'\]"):
        rain_fusion_attention(q, k, v, idx, num, [8, 8], q_input_layout="BNSD", kv_input_layout="BNSD",
                              precision="int4")


def test_sparse_attention_int8_same_selection_and_bound(int8_cpu):
    """sparse_attention at int8 selects exactly the blocks of the full-precision call and stays within the int8
    bound of it (the full-precision call equals the fp64 reference of its selection, tested elsewhere); at
    sparsity 0 the dense path runs the same int8 kernel with every block selected."""
    grid = (2, 8, 8)
    q, k, v = _qkv(4, 1, math.prod(grid), 2, 2, 32)
    kw = dict(head_num=2, input_layout="BSND", sparse_type="rf_v2", block_size=16, latent_shape_q=grid,
              return_stats=True, backend="cpp")
    ref, st = sparse_attention(q, k, v, sparsity=0.6, **kw)
    out, st8 = sparse_attention(q, k, v, sparsity=0.6, precision="int8", **kw)
    assert st8.path == "sparse" and st8.backend == "cpp"
    assert torch.equal(st8.selection.select_idx, st.selection.select_idx)
    assert _rel_l1(out, ref) < REL_L1 and not torch.equal(out, ref)
    dense8, st0 = sparse_attention(q, k, v, sparsity=0.0, precision="int8", **kw)
    assert st0.path == "dense"
    torch.testing.assert_close(dense8, attention(q, k, v, precision="int8"), atol=0, rtol=0)
    assert _rel_l1(dense8, _dense_reference(q, k, v)[0]) < REL_L1
    with pytest.raises(ValueError, match="precision='int8' supports neither attn_mask nor is_causal"):
        sparse_attention(q, k, v, is_causal=True, head_num=2, input_layout="BSND", precision="int8")


# --------------------------------------------------------------------------------------------- #
# boosted model                                                                                  #
# --------------------------------------------------------------------------------------------- #


def _wan_inputs(grid=(3, 8, 9)):
    g = torch.Generator().manual_seed(0)
    f, h, w = grid
    return torch.randn(1, 16, f, 2 * h, 2 * w, generator=g), torch.tensor([700.0]), torch.randn(1, 512, 32, generator=g)


def _cos(a, b) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def test_boosted_wan_int8_self_attention_only(int8_cpu):
    """Self-attention takes the int8 kernel (dense and block-sparse), cross-attention to the text stays in fp32;
    with int8 Linear layers too, the output stays near the same boost at full precision."""
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer

    spec = TinyWanSpec(heads=2, head_dim=32)
    args = _wan_inputs()
    with torch.no_grad():
        stock = tiny_wan_transformer(spec)(*args, return_dict=False)[0]
        model = lite_boost.boost(tiny_wan_transformer(spec), {"attention": {"precision": "int8"}})
        procs = model._lite_boost.processors.values()
        assert {p.attn_fn.precision for p in procs if p.role == "self"} == {"int8"}
        assert {p.attn_fn.precision for p in procs if p.role == "cross"} == {"auto"}
        dense8 = model(*args, return_dict=False)[0]
        assert _cos(dense8, stock) > 0.999 and not torch.equal(dense8, stock)
        sparse = {"sparsity": 0.5, "block_size": 16, "backend": "cpp", "dense_steps_first": 0}
        full = lite_boost.boost(tiny_wan_transformer(spec), BoostConfig(sparse=sparse, quant="int8_dynamic"))
        low = lite_boost.boost(tiny_wan_transformer(spec), BoostConfig(sparse=sparse, quant="int8_dynamic",
                                                                      attention={"precision": "int8"}))
        a, b = full(*args, return_dict=False)[0], low(*args, return_dict=False)[0]
        events = low._lite_boost.extras["sparse"].events
        assert events and all(e.path == "sparse" and e.backend == "cpp" for e in events)
        assert _cos(a, b) > 0.999 and not torch.equal(a, b)


def test_boosted_wan_int8_compiles_without_graph_breaks(int8_cpu, fresh_dynamo):
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer

    model = lite_boost.boost(tiny_wan_transformer(TinyWanSpec(heads=2, head_dim=32)), {"attention": {"precision": "int8"}})
    args = _wan_inputs()
    with torch.no_grad():
        eager = model(*args, return_dict=False)[0]
        report = torch._dynamo.explain(model)(*args)
        assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
        compiled = torch.compile(model, backend="eager", fullgraph=True)(*args, return_dict=False)[0]
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_step_cache_composes_with_int8_attention(int8_cpu):
    """First-block caching on a tiny Wan pipeline with int8 attention: the cache hooks decide per step as they do
    at full precision, and the output stays near the full-precision cached output."""
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

    from conftest import pipeline_kwargs

    outs, logs = {}, {}
    for precision in ("auto", "int8"):
        pipe = lite_boost.boost(tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=2, head_dim=32)),
                                {"cache": "first_block_cache:threshold=0.14", "attention": {"precision": precision}})
        outs[precision] = pipe(**pipeline_kwargs("t2v", height=32, width=48, num_frames=5, steps=3)).frames
        logs[precision] = pipe.transformer._lite_boost.extras["cache"].decisions
    assert len(logs["int8"]) == len(logs["auto"]) == 6
    assert any(not d.compute for d in logs["int8"])  # some steps served from the cache
    assert _cos(outs["int8"], outs["auto"]) > 0.99


@torch.no_grad()
def test_generic_path_int8_self_attention(int8_cpu, monkeypatch):
    """A model boosted on the generic path (diffusers' dispatch_attention_fn, no family code) takes the option too:
    its self-attention runs the int8 kernel (dense and block-sparse), near the full-precision boost."""
    import copy

    from _diffusers_tiny import build, inputs

    from lite_boost.adapter.generic import generic_context

    from conftest import without_family

    without_family(monkeypatch, "skyreels-v2")  # a Wan-like model on the generic path
    name = "SkyReelsV2Transformer3DModel"
    stock = build(name)
    for extra in ({}, {"sparse": {"sparsity": 0.5, "block_size": 16, "backend": "cpp"}}):
        full = lite_boost.boost(copy.deepcopy(stock), dict(extra))
        low = lite_boost.boost(copy.deepcopy(stock), dict(extra, attention={"precision": "int8"}))
        assert generic_context(low).self_attn_fn.precision == "int8"
        a, b = full(**inputs(name)), low(**inputs(name))
        a, b = (x.sample if hasattr(x, "sample") else x[0] for x in (a, b))
        assert _cos(a, b) > 0.999 and not torch.equal(a, b)
        if extra:
            assert {e.backend for e in low._lite_boost.extras["sparse"].events} == {"cpp"}
