"""Block-level offload (BoostConfig.offload) on the CPU: parity, the hooks really run, composition with the
other features, and a pipeline the user offloaded with diffusers / accelerate (before or after boost).

On the CPU the onload and offload devices are the same, so the host-memory path moves nothing; these tests
check that the upload hooks ran once per block group and transformer / encoder call (counted independently
of lite_boost's own counter, with forward pre-hooks on the blocks), that the output equals the boosted and
the stock one, and, with ``disk_path``, that the weights really leave memory between calls and come back
for each block (the weights seen inside a block equal the originals; between calls they do not).
"""

from __future__ import annotations

import os

import pytest
import torch

import lite_boost
import lite_boost.api
import lite_boost.offload
from lite_boost.config import BoostConfig, ConfigError, OffloadConfig
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
from lite_boost.offload import layer_stacks, offload_record

SPEC = TinyWanSpec(heads=3, layers=3)
KW = dict(height=32, width=48, num_frames=5, steps=2)  # CFG on: 4 transformer calls, 2 text-encoder calls


def _pipe():
    return tiny_wan_pipeline("t2v", spec=SPEC)


def _run(pipe, tiny_kwargs, **over):
    with torch.no_grad():
        return pipe(**tiny_kwargs("t2v", **{**KW, **over})).frames


@pytest.fixture(scope="module")
def references():
    """(stock output, boosted output without offload) of the same tiny pipeline."""
    from conftest import pipeline_kwargs

    stock = _run(_pipe(), pipeline_kwargs)
    boosted = _run(lite_boost.boost(_pipe()), pipeline_kwargs)
    return stock, boosted


def _count_calls(module_list):
    calls = []
    for i, block in enumerate(module_list):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    return calls


# ------------------------------------------------------------------------------------------ config
def test_offload_config_forms_and_errors(tmp_path):
    assert BoostConfig(offload=True).offload == OffloadConfig()
    assert BoostConfig(offload=False).offload is None
    assert BoostConfig(offload="cuda:1").offload == OffloadConfig(onload_device="cuda:1")
    assert BoostConfig.coerce(OffloadConfig(num_blocks_per_group=2)).offload.num_blocks_per_group == 2
    b = BoostConfig(offload={"onload_device": "npu:0", "record_stream": True})
    assert BoostConfig.from_dict(b.to_dict()) == b
    (tmp_path / "c.yaml").write_text("offload:\n  onload_device: cuda\n  text_encoder: false\n")
    assert BoostConfig.from_yaml(str(tmp_path / "c.yaml")).offload == OffloadConfig("cuda", text_encoder=False)
    bad = [({"onload_device": "gpu"}, r"offload.onload_device must be a device string of type \['cpu', 'cuda'"),
           ({"offload_device": "cuda"}, r"offload.offload_device must be one of \['cpu'\]"),
           ({"use_stream": True, "onload_device": "cpu"}, r"use_stream=True needs an onload device with streams"),
           ({"use_stream": False, "record_stream": True}, r"record_stream=True needs offload.use_stream"),
           ({"use_stream": True, "num_blocks_per_group": 2}, r"valid num_blocks_per_group with use_stream: \[1\]"),
           ({"num_blocks_per_group": 0}, r"offload.num_blocks_per_group must be >= 1"),
           ({"blocks": 1}, r"unknown OffloadConfig key\(s\) \['blocks'\]")]
    for kwargs, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            BoostConfig(offload=kwargs)
    with pytest.raises(ConfigError, match="offload must be an OffloadConfig"):
        BoostConfig(offload=3)


def test_unusable_onload_device_is_refused_before_anything_changes():
    pipe = _pipe()
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    before = {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()}
    with pytest.raises(ConfigError, match=r"offload.onload_device='cuda:0': no cuda device is available here; "
                                          r"valid onload devices here: \['cpu'\]"):
        lite_boost.boost(pipe, {"offload": "cuda:0"})
    assert not lite_boost.api.is_boosted(pipe) and offload_record(pipe.transformer) is None
    assert before == {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()}


@pytest.mark.parametrize("offload, parallel, match", [
    (True, {"tp_degree": 2}, r"offload \(BoostConfig.offload\) with parallel.tp_degree=2: not built .*DTensor.*Valid: "
                             r"tp_degree=1 with offload, offload with fsdp_degree > 1 \(FSDP2's CPUOffloadPolicy\), "
                             r"or tp_degree without offload"),
    ({"disk_path": "/tmp/x"}, {"fsdp_degree": 2}, r"offload.disk_path with parallel.fsdp_degree=2: FSDP2's "
                                                  r"CPUOffloadPolicy keeps the shards in host memory.*\[None\]"),
    ({"num_blocks_per_group": 2}, {"fsdp_degree": 2}, r"offload.num_blocks_per_group=2 with parallel.fsdp_degree=2: "
                                                      r"FSDP gathers one block per unit; .*: \[1\]"),
])
def test_offload_with_weight_sharding_refused_where_not_built(offload, parallel, match, monkeypatch):
    """offload x fsdp runs on FSDP2's CPUOffloadPolicy (tests/test_weight_sharding.py); what it cannot take, and
    offload x tp, are refused before any collective and before anything changes."""
    import torch.distributed as dist

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=4, layers=2))
    with pytest.raises(ConfigError, match=match):
        lite_boost.ParallelManager(pipe, {"offload": offload, "parallel": parallel})
    assert not dist.is_initialized() and not lite_boost.api.is_boosted(pipe)
    assert offload_record(pipe.transformer) is None


def test_layer_stacks_find_the_block_lists():
    pipe = _pipe()
    assert layer_stacks(pipe.transformer) == [""]  # blocks is a direct child: the transformer itself
    assert layer_stacks(pipe.text_encoder) == ["encoder"]  # UMT5: encoder.block
    assert layer_stacks(torch.nn.Linear(2, 2)) == []


# ------------------------------------------------------------------------------------------ parity, hooks
def test_offload_is_exact_and_uploads_each_block_group_per_call(references, tiny_kwargs):
    stock, boosted = references
    pipe = _pipe()
    calls = _count_calls(pipe.transformer.blocks)
    enc_calls = _count_calls(pipe.text_encoder.encoder.block)
    lite_boost.boost(pipe, {"offload": True})
    rec, enc = offload_record(pipe.transformer), offload_record(pipe.text_encoder)
    assert rec.onload_device == torch.device("cpu") and rec.use_stream is False
    assert rec.stacks == ("",) and rec.blocks == len(pipe.transformer.blocks) == 3
    assert enc.stacks == ("encoder",) and enc.blocks == 2
    # diffusers' group hook sits on every block
    assert all("group_offloading" in b._diffusers_hook.hooks for b in pipe.transformer.blocks)
    out = _run(pipe, tiny_kwargs)
    assert torch.equal(out, boosted)  # the hooks change nothing in the arithmetic
    assert (out - stock).abs().max().item() <= 1e-5
    n_calls = len(calls) // 3  # transformer calls (each ran the 3 blocks once)
    assert calls == [0, 1, 2] * n_calls and n_calls == 4
    # one upload per block group and per call, plus the group of what lies outside the blocks
    assert rec.onloads == n_calls * (3 + 1) == n_calls * len(rec.groups)
    assert enc.onloads == (len(enc_calls) // 2) * len(enc.groups) and len(enc_calls) == 4
    assert "offload: host memory -> cpu" in lite_boost.offload.offload_summary(pipe)
    # unboost removes every hook and the record; the pipeline still runs and equals the boosted output
    lite_boost.unboost(pipe)
    assert offload_record(pipe.transformer) is None and offload_record(pipe.text_encoder) is None
    assert not any(getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks
                   for m in [*pipe.transformer.modules(), *pipe.text_encoder.modules()])
    assert torch.equal(_run(pipe, tiny_kwargs), stock)


def test_disk_offload_really_moves_the_weights(references, tiny_kwargs, tmp_path):
    """With disk_path the weights leave memory after each block (diffusers puts uninitialised tensors in their
    place): inside each block they equal the originals, between calls they do not, and the output is exact."""
    _, boosted = references
    pipe = _pipe()
    blocks = pipe.transformer.blocks
    originals = [b.ffn.net[0].proj.weight.detach().clone() for b in blocks]
    seen = []
    for i, b in enumerate(blocks):  # runs inside the block's hooked forward, after its upload
        b.ffn.register_forward_pre_hook(lambda m, a, i=i: seen.append(torch.equal(m.net[0].proj.weight, originals[i])))
    lite_boost.boost(pipe, {"offload": {"disk_path": str(tmp_path)}})
    assert len(os.listdir(tmp_path)) >= 4  # one safetensors file per group
    out = _run(pipe, tiny_kwargs)
    assert torch.equal(out, boosted)
    assert len(seen) == 12 and all(seen)
    after = [torch.equal(b.ffn.net[0].proj.weight, o) for b, o in zip(blocks, originals)]
    assert not any(after)  # offloaded: not in memory between calls
    lite_boost.unboost(pipe)  # reads them back
    assert all(torch.equal(b.ffn.net[0].proj.weight, o) for b, o in zip(blocks, originals))


def test_offload_composes_with_sparse_quant_and_step_cache(tiny_kwargs):
    features = {"sparse": {"sparsity": 0.5, "block_size": 8, "backend": "gather"},
                "quant": "int8_dynamic", "cache": "first_block_cache:threshold=0.3"}
    ref = _run(lite_boost.boost(_pipe(), features), tiny_kwargs, steps=3)
    pipe = lite_boost.boost(_pipe(), {**features, "offload": True})
    out = _run(pipe, tiny_kwargs, steps=3)
    assert torch.equal(out, ref)
    state = pipe.transformer._lite_boost
    assert {e.path for e in state.extras["sparse"].events} == {"sparse"}
    assert len(state.extras["quant"].layers) > 0
    decisions = state.extras["cache"].decisions
    computed = sum(d.compute for d in decisions)
    assert len(decisions) == 6 and 0 < computed < 6
    # the step cache sits outside the offload hooks: a skipped block is not uploaded either
    rec = offload_record(pipe.transformer)
    assert rec.onloads == 6 * 2 + computed * 2  # (outside + block 0) every call, blocks 1-2 when computed
    # boosting again with another config replaces the offload; without offload the weights are back home
    lite_boost.boost(pipe, features)
    assert offload_record(pipe.transformer) is None and offload_record(pipe.text_encoder) is None
    assert torch.equal(_run(pipe, tiny_kwargs, steps=3), ref)


def test_offload_composes_with_regional_compile(tiny_kwargs, fresh_dynamo):
    pipe = lite_boost.boost(_pipe(), {"offload": True})
    ref = _run(pipe, tiny_kwargs)
    # diffusers' regional compile (AOT-traced; inductor's code generation adds nothing to what is checked): the
    # upload is a graph break at each block's entry, the block body one graph
    pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    before = offload_record(pipe.transformer).onloads
    assert (_run(pipe, tiny_kwargs) - ref).abs().max().item() <= 1e-5
    assert offload_record(pipe.transformer).onloads - before == 4 * 4


# ------------------------------------------------------------------------------------------ the user's offload
@pytest.mark.parametrize("how", ["model_cpu_offload", "group_offload"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_pipeline_offloaded_by_the_user_keeps_working(references, tiny_kwargs, how, order):
    stock, boosted = references
    pipe = _pipe()

    def user_offload():
        if how == "model_cpu_offload":
            pipe.enable_model_cpu_offload(device="cpu")
        else:
            pipe.enable_group_offload(onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)

    if order == "before":
        user_offload()
        lite_boost.boost(pipe)
    else:
        lite_boost.boost(pipe)
        user_offload()
    out = _run(pipe, tiny_kwargs)
    assert torch.equal(out, boosted) and (out - stock).abs().max().item() <= 1e-5
    hooked = (hasattr(pipe.transformer, "_hf_hook") if how == "model_cpu_offload"
              else "group_offloading" in pipe.transformer.blocks[0]._diffusers_hook.hooks)
    assert hooked  # the user's offloading is still in place
    with pytest.raises(ConfigError, match=r"already offloaded by .*boost without offload keeps that offloading"):
        lite_boost.boost(pipe, {"offload": True})
    lite_boost.unboost(pipe)
    assert torch.equal(_run(pipe, tiny_kwargs), stock)


def test_user_group_offload_with_quantization_follows_the_new_weights(tiny_kwargs):
    """boost(quant) after the user's group offloading: diffusers' hooks are re-applied on the quantized weights."""
    ref = _run(lite_boost.boost(_pipe(), {"quant": "int8_weight_only"}), tiny_kwargs)
    pipe = _pipe()
    pipe.transformer.enable_group_offload(onload_device="cpu", offload_type="block_level", num_blocks_per_group=1)
    lite_boost.boost(pipe, {"quant": "int8_weight_only"})
    group = pipe.transformer.blocks[0]._diffusers_hook.get_hook("group_offloading").group
    assert group.modules[0].ffn.net[0].proj.weight is pipe.transformer.blocks[0].ffn.net[0].proj.weight
    assert torch.equal(_run(pipe, tiny_kwargs), ref)
