"""The memory planner (lite_boost.memory, `lite-boost plan`, ParallelConfig(layout="auto")).

Independent references: the Wan block's parameter count written out from its layers, the real module's
parameter bytes, a pipeline folder whose weight files were deleted (only configs can be read), and a peak
measured in a fresh process from the kernel's resident-set high-water mark.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lite_boost.config import ConfigError, ParallelConfig, parse_bytes
from lite_boost.memory import (FSDP_GATHER_BLOCKS, HOST_LIBRARIES_BYTES, HOST_LINK_FACTOR, HOST_RUNTIME_BYTES, GiB, Layout,
                               ModelDims, candidate_layouts, dims_for_family, dims_for_model_dir, estimate,
                               fsdp_gather_blocks, fsdp_offload_gather_blocks, meta_model, plan_layouts, token_count)

HERE = Path(__file__).resolve().parent


def _wan_family():
    from lite_boost.registry import families

    return next(f for f in families() if f.name == "wan")


def test_parse_bytes_and_layout_fields():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(1000) == 1000
    assert ParallelConfig(layout="auto", device_memory="1.5GiB").device_memory == int(1.5 * 2**30)
    with pytest.raises(ConfigError, match=r"device_memory must be a positive size .* got 'lots'"):
        ParallelConfig(layout="auto", device_memory="lots")
    with pytest.raises(ConfigError, match=r"device_memory applies to layout='auto' only"):
        ParallelConfig(device_memory="24GiB")
    with pytest.raises(ConfigError, match=r"layout='auto' chooses .*'ulysses_degree'.* but \{'ulysses_degree': 2\}"):
        ParallelConfig(layout="auto", ulysses_degree=2)
    with pytest.raises(ConfigError, match=r"layout must be one of \['manual', 'auto'\]"):
        ParallelConfig(layout="best")
    with pytest.raises(ConfigError, match=r"layout_shape must be None or three positive ints"):
        ParallelConfig(layout="auto", layout_shape=(81, 480))


def test_wan_reference_dims_come_from_configs_on_the_meta_device():
    model = meta_model("diffusers", "WanTransformer3DModel")
    assert all(p.is_meta for p in model.parameters())
    dims, shape = dims_for_family(_wan_family())
    D, F = 5120, 13824  # Wan2.1-14B (DESIGN.md section 3), the block written out layer by layer:
    attn = 4 * (D * D + D) + 2 * D  # q, k, v, o (+ biases) and the q / k RMS norms
    block = 2 * attn + (D * F + F + F * D + D) + 2 * D + 6 * D  # self, cross, FFN, norm2 (affine), modulation
    assert (dims.layers, dims.heads, dims.head_dim, dims.hidden, dims.ffn) == (40, 40, 128, D, F)
    assert dims.block_params == block and dims.blocks_params == 40 * block
    assert 14.2e9 < dims.params < 14.4e9 and 5.6e9 < dims.text_encoder_params < 5.8e9  # 14B, UMT5-XXL
    assert shape == (81, 480, 832) and token_count(dims, *shape) == 21 * 30 * 52  # 32,760 tokens


def test_estimates_follow_the_real_module():
    from lite_boost.demo import TinyWanSpec, tiny_wan_transformer

    model = tiny_wan_transformer(TinyWanSpec(heads=4, layers=3))
    dims = ModelDims.from_module(model, dtype_bytes=4)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    outside = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    linear = sum(m.weight.numel() * 4 + m.bias.numel() * 4 for m in model.blocks.modules()
                 if isinstance(m, torch.nn.Linear))
    tokens = 100
    assert estimate(dims, Layout(), tokens).weights == total
    assert estimate(dims, Layout(offload=True), tokens).weights == outside + 2 * block
    assert estimate(dims, Layout(tp=2, ulysses=1), tokens).weights == total - linear // 2
    fsdp4 = estimate(dims, Layout(ulysses=4, fsdp=4), tokens)  # at rest: a quarter; during a call: gathered blocks
    assert fsdp4.weights == total // 4 and fsdp4.gather == 2 * block * 3 // 4  # NCCL / HCCL: assumed
    gloo = estimate(dims, Layout(ulysses=4, fsdp=4), tokens, backend="gloo")
    assert gloo.gather == 4 * block and gloo.weights == fsdp4.weights  # gloo: 4 whole blocks, measured
    # tp 2 x fsdp 2: FSDP shards the tp shards (the split Linears / 4, the rest / 2); a gather brings back one tp
    # shard of a block (its Linears / 2)
    block_linear = sum(m.weight.numel() * 4 + m.bias.numel() * 4 for m in model.blocks[0].modules()
                       if isinstance(m, torch.nn.Linear))
    both = estimate(dims, Layout(tp=2, ulysses=2, fsdp=2), tokens, backend="gloo")
    assert abs(both.weights - (total - linear // 2) / 2) <= 4, (both.weights, total, linear)
    assert abs(both.gather - 4 * (block - block_linear // 2)) <= 4, (both.gather, block, block_linear)
    # what FSDP adds to tp 2 x ulysses 2: gathering the other half of this rank's tp shard of every unit
    fsdp_moved = both.traffic - estimate(dims, Layout(tp=2, ulysses=2), tokens, backend="gloo").traffic
    assert abs(fsdp_moved - (total - linear // 2) / 2) <= 8, (fsdp_moved, total, linear)
    assert gloo.total == gloo.weights + gloo.text_encoder + gloo.gather + gloo.activations
    assert gloo.host == HOST_RUNTIME_BYTES  # the runtime's host memory: reported beside the device total, not in it
    blocks = sum(p.numel() * 4 for p in model.blocks.parameters())
    off = estimate(dims, Layout(offload=True), tokens)
    assert off.host_weights == blocks and off.host == HOST_RUNTIME_BYTES + blocks  # the blocks wait on the host
    # offload x fsdp 4 (FSDP2's CPUOffloadPolicy): nothing at rest on the device, the shards on the host; during a
    # call the running and the prefetched block whole plus one shard upload (NCCL / HCCL, assumed); gloo: 4 blocks
    fo = estimate(dims, Layout(ulysses=4, fsdp=4, offload=True), tokens)
    assert fo.weights == 0 and fo.host_weights == total // 4 and fo.host == HOST_RUNTIME_BYTES + total // 4
    assert fo.gather == int((2 + 1 / 4) * block) and fo.total == fo.text_encoder + fo.gather + fo.activations
    assert fo.activations == fsdp4.activations and fo.total < fsdp4.total and fsdp4.host_weights == 0
    # it moves fsdp's all-gather plus the rank's shards up from the host
    assert abs(fo.traffic - fsdp4.traffic - HOST_LINK_FACTOR * total / 4) <= 2, (fo.traffic, fsdp4.traffic)
    assert estimate(dims, Layout(ulysses=4, fsdp=4, offload=True), tokens, backend="gloo").gather == 4 * block
    # sequence ranks divide the activations; cfg on separate-call pipelines does not
    a1 = estimate(dims, Layout(), 4000).activations
    a4 = estimate(dims, Layout(ulysses=4), 4000).activations
    assert a4 < a1 / 2 and estimate(dims, Layout(cfg=2), 4000).activations == a1


def test_fsdp_gather_multiple_per_backend():
    assert fsdp_gather_blocks(1, "gloo") == 0 and fsdp_gather_blocks(1) == 0  # no FSDP, nothing gathered
    assert fsdp_gather_blocks(2, "gloo") == fsdp_gather_blocks(4, "gloo") == FSDP_GATHER_BLOCKS["gloo"] == 4
    assert fsdp_gather_blocks(2) == 1 and fsdp_gather_blocks(4, "nccl") == fsdp_gather_blocks(4, "hccl") == 1.5
    assert fsdp_offload_gather_blocks(1) == 0 and fsdp_offload_gather_blocks(2) == 2.5
    assert fsdp_offload_gather_blocks(4, "hccl") == 2.25 and fsdp_offload_gather_blocks(4, "gloo") == 4
    with pytest.raises(ConfigError, match=r"backend must be one of \[None, 'gloo', 'nccl', 'hccl'\], got 'mpi'"):
        plan_layouts(ModelDims("x", 2, 2, 8, 16, 16, 32, 10, 20, 15, 5), 2, 10, None, backend="mpi")


def test_planner_against_the_recorded_gloo_measurements():
    """benchmarks/results/memory.json: per-rank peaks measured on gloo processes (Wan2.1-14B block dims); the
    planner's device total + the libraries loaded after the benchmark's baseline must be within 15% of each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_memory", HERE.parent / "benchmarks" / "bench_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rec = json.loads((HERE.parent / "benchmarks" / "results" / "memory.json").read_text())
    with torch.device("meta"):
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel(num_layers=rec["blocks"], **rec["dims"])
    measured = {k: v for k, v in rec["results"].items() if not isinstance(v, str)}
    assert {"replicated", "fsdp2", "fsdp4", "tp2", "ulysses4_fsdp2"} <= set(measured)
    for name, rows in measured.items():
        pred = bench.predict(name, model, tuple(rec["shape"]))
        assert pred["host_libraries"] == HOST_LIBRARIES_BYTES
        for r in rows:
            peak = pred["total_predicted"] + HOST_LIBRARIES_BYTES
            assert abs(peak - r["peak_over_baseline"]) <= 0.15 * r["peak_over_baseline"], (name, peak, r)


def test_candidate_layouts_cover_the_world_and_respect_the_heads():
    dims, _ = dims_for_family(_wan_family())
    layouts = candidate_layouts(dims, 8)
    assert all(lay.world == 8 for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}  # 40 heads, FFN 13824: all divide
    # fsdp x tp: FSDP over the ranks with the same tp rank, so fsdp divides world / tp
    assert {(lay.tp, lay.fsdp) for lay in layouts if lay.tp > 1 and lay.fsdp > 1} == {(2, 2), (2, 4), (4, 2)}
    assert all((8 // lay.tp) % lay.fsdp == 0 for lay in layouts)
    assert not any(lay.offload and lay.tp > 1 for lay in layouts)
    # every layout without tp has its offload twin, FSDP ones included (FSDP2's CPUOffloadPolicy)
    plain = {lay for lay in layouts if lay.tp == 1 and not lay.offload}
    assert {dataclasses.replace(lay, offload=False) for lay in layouts if lay.offload} == plain
    assert any(lay.offload and lay.fsdp == 8 for lay in layouts)
    three = ModelDims("x", 2, 3, 8, 24, 24, 64, 100, 200, 150, 50)
    assert {lay.tp for lay in candidate_layouts(three, 4)} == {1}  # 3 heads: no tp
    # Ulysses up to the heads (uneven heads are padded), the rest of the sequence ranks on Ring
    assert {(lay.ulysses, lay.ring) for lay in candidate_layouts(three, 4) if lay.cfg == 1} == {(2, 2)}


def test_plan_recommends_the_fitting_layout_that_moves_least():
    dims, shape = dims_for_family(_wan_family())
    tokens = token_count(dims, *shape)
    one = plan_layouts(dims, 1, tokens, "24GiB")
    assert [e.layout.label() for e in one.rows] == ["replicated", "offload"]
    assert one.recommended.layout.offload and not one.rows[0].fits  # 14B + UMT5-XXL do not fit one 24 GiB card
    four = plan_layouts(dims, 4, tokens, "24GiB")
    rec = four.recommended
    assert rec.fits and rec.total <= 24 * GiB * 0.9
    assert all(not e.fits for e in four.rows if e.traffic < rec.traffic)  # everything that moves less does not fit
    without = plan_layouts(dims, 4, tokens, "24GiB", available={"fsdp": False, "tp": False})
    assert without.recommended.layout.fsdp == 1 and without.recommended.layout.tp == 1
    assert plan_layouts(dims, 4, tokens, "1GiB").recommended is None


def test_cli_plan_reads_only_the_configs(tmp_path, capsys):
    from lite_boost.cli import main
    from lite_boost.demo import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v")
    pipe.save_pretrained(tmp_path)
    for f in tmp_path.rglob("*.safetensors"):  # no weights left to read
        f.unlink()
    assert main(["plan", "--model", str(tmp_path), "--nproc", "2", "--device-memory", "1GiB", "--num-frames", "9",
                 "--height", "64", "--width", "96", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    real = ModelDims.from_module(pipe.transformer, text_encoder=pipe.text_encoder, dtype_bytes=4)
    got = dims_for_model_dir(tmp_path, 4)
    assert (got.params, got.text_encoder_params, got.layers) == (real.params, real.text_encoder_params, real.layers)
    assert "2 rank(s), 9 frames x 64 x 96, 72 tokens" in out and "<- recommended" in out
    assert " gather " in out.splitlines()[3] and "host memory of each process's runtime" in out
    assert main(["plan", "--family", "wan", "--nproc", "1", "--device-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "Wan2.1-T2V-14B: 40 blocks" in out and "recommended: offload" in out
    for argv, msg in ((["plan", "--nproc", "2"], "give exactly one of --model PATH"),
                      (["plan", "--family", "wan", "--device-memory", "lots"], "--device-memory must be a positive"),
                      (["plan", "--family", "nope"], "--family must be one of")):
        with pytest.raises(SystemExit, match=msg):
            main(argv)


def test_parallel_manager_applies_the_auto_layout(single_process_env, tiny_kwargs):
    import lite_boost
    from lite_boost.api import memory_plan
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.offload import offload_record

    def pipe():
        return tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3, layers=3))

    kw = dict(height=32, width=48, num_frames=5, steps=2)
    with torch.no_grad():
        ref = pipe_out = lite_boost.boost(pipe())(**tiny_kwargs("t2v", **kw)).frames
    auto = {"layout": "auto", "layout_shape": (5, 32, 48)}
    plan = memory_plan(pipe(), {"parallel": {**auto, "device_memory": 10 * GiB}}, 1)
    replicated, offloaded = plan.rows[0], plan.rows[1]
    assert replicated.layout == Layout() and offloaded.layout == Layout(offload=True)
    assert offloaded.total < replicated.total
    between = int(offloaded.total / 0.9) + 2  # only the offload layout fits (10% kept free)
    p = lite_boost.ParallelManager(pipe(), {"parallel": {**auto, "device_memory": between}})
    assert offload_record(p.transformer) is not None and p.transformer._lite_boost.config.parallel.layout == "manual"
    with torch.no_grad():
        pipe_out = p(**tiny_kwargs("t2v", **kw)).frames
    assert torch.equal(pipe_out, ref)
    p = lite_boost.ParallelManager(pipe(), {"parallel": {**auto, "device_memory": "10GiB"}})
    assert offload_record(p.transformer) is None  # everything fits: nothing moves
    with pytest.raises(ConfigError, match=r"no layout of 1 rank\(s\) fits .* the smallest, offload, needs"):
        lite_boost.ParallelManager(pipe(), {"parallel": {**auto, "device_memory": 1000}})
    with pytest.raises(ConfigError, match=r"needs parallel.device_memory"):
        lite_boost.ParallelManager(pipe(), {"parallel": {"layout": "auto"}})


def test_auto_layout_offers_offload_with_fsdp():
    """On 2 ranks with room only for an FSDP x offload layout, layout='auto' writes fsdp_degree and offload (the
    2-rank run of that config: tests/test_weight_sharding.py). Planned for NCCL's gather multiple: with gloo's 4
    blocks the tiny model's plain offload layout would be the smaller one."""
    from lite_boost.api import auto_layout, memory_plan
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=4, layers=3))
    auto = {"layout": "auto", "layout_shape": (5, 32, 48), "backend": "nccl"}
    rows = memory_plan(pipe, {"parallel": {**auto, "device_memory": 10 * GiB}}, 2).rows
    labels = [e.layout.label() for e in rows]
    assert "ulysses2 x fsdp2 x offload" in labels and "cfg2 x fsdp2 x offload" in labels
    both = [e for e in rows if e.layout.offload and e.layout.fsdp > 1]
    assert all(e.weights == 0 and e.host_weights > 0 for e in both)
    between = int(max(e.total for e in both) / 0.9) + 2  # fits them, nothing else
    assert all(e.total > between * 0.9 for e in rows if not (e.layout.offload and e.layout.fsdp > 1))
    config = auto_layout(pipe, {"parallel": {**auto, "device_memory": between}}, 2)
    assert config.parallel.fsdp_degree == 2 and config.offload is not None and config.parallel.layout == "manual"


@pytest.mark.slow
def test_predicted_call_peak_is_within_15_percent_of_the_measured_one():
    """A fresh process measures one call's resident-set peak (the kernel's high-water mark, glibc mapping every
    block of 64 KiB or more on its own so that freed tensors leave the resident set); the planner predicts it."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", THREADS="2")
    res = subprocess.run([sys.executable, str(HERE / "_memory_peak_worker.py"), "4", "2048", "2", "17x320x512",
                          "float32"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["tokens"] == 3200
    assert abs(r["activations_predicted"] - r["call_peak_measured"]) <= 0.15 * r["call_peak_measured"], r
    # the weights: the prediction is the parameter bytes; the worker pays boost's one-off imports and library
    # load on a tiny model first, so what is left beside the weights is small (about 1 MiB)
    assert 0 <= r["weights_measured"] - r["weights_predicted"] <= 8 * 2**20, r


def test_planner_lists_only_the_layouts_a_family_can_take(capsys):
    """Tensor-parallel layouts need a tp plan: the family record's (Wan) or diffusers' class plan (Flux); LTX-2 has
    neither and its tp_degree > 1 is refused, so the planner neither lists nor recommends them there, for the
    CLI and for layout='auto' alike."""
    from lite_boost.cli import main
    from lite_boost.plan import planner_features
    from lite_boost.registry import families

    fams = {f.name: f for f in families()}
    for name, has_tp in (("wan", True), ("flux", True), ("ltx2", False)):
        assert planner_features(fams[name])[1] == {"ring": True, "tp": has_tp}, name
    assert planner_features(None)[1] == {"ring": True, "tp": True}  # a family-less target without a model
    for name, has_tp in (("ltx2", False), ("wan", True)):
        assert main(["plan", "--family", name, "--nproc", "4", "--device-memory", "24GiB"]) == 0
        rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:] if line[:1].isalpha()]
        assert rows and any("ulysses" in r for r in rows), rows
        assert any("tp" in r for r in rows) == has_tp, (name, rows)
