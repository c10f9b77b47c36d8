"""BoostManager (MindSpore Lite 2.11's ParallelManager) and its YAML schema mapped onto ours."""

import pytest
import torch

import lite_boost
from lite_boost import BoostManager
from lite_boost.config import BoostConfig, ConfigError, ParallelConfig, parallel_from_boost_manager
from lite_boost.demo import TinyWanSpec, tiny_qwen_image_pipeline, tiny_wan_pipeline

from conftest import pipeline_kwargs


pytestmark = pytest.mark.usefixtures("single_process_env")


# ------------------------------------------------------------------------------------------ mapping
@pytest.mark.parametrize("section, expected", [
    ({}, {}),
    ({"dit": {"alg": "CP"}}, {}),
    ({"dit": {"alg": "cp"}}, {}),  # case-insensitive, as YAML authors write it
    ({"world_size": 4}, {"world_size": 4}),
    ({"dit": {"alg": "CP", "world_size": 2}, "vae": {"alg": "DP", "world_size": 2}},
     {"world_size": 2, "vae_parallel": "exact"}),  # MindSpore Lite's Qwen-Image-Edit example
    ({"dit": {"ulysses_degree": 2, "ring_degree": 2}}, {"ulysses_degree": 2, "ring_degree": 2}),
    ({"dit": {"sequence_degree": 2, "cfg_degree": 2}}, {"sequence_degree": 2, "cfg_degree": 2}),
    ({"dit": {"rotate_method": "allgather"}}, {"rotate_method": "allgather"}),
    ({"vae": {"alg": "DP"}}, {"vae_parallel": "exact"}),
    ({"vae": {"alg": "none"}}, {"vae_parallel": "off"}),
    ({"vae": {"alg": "DP", "mode": "chunked", "overlap": 2, "chunk_size": 3, "gather": "rank0"}},
     {"vae_parallel": "chunked", "vae_overlap": 2, "vae_chunk_size": 3, "vae_gather": "rank0"}),
    ({"vae": {"mode": "exact", "gather": "all"}}, {"vae_parallel": "exact", "vae_gather": "all"}),
    ({"dit": None, "vae": None}, {}),
])
def test_parallel_section_maps_onto_parallel_config(section, expected):
    assert parallel_from_boost_manager(section) == expected
    cfg = BoostConfig.from_dict({"Parallel": section})
    assert cfg.parallel == ParallelConfig(**expected)


@pytest.mark.parametrize("section, fragment", [
    ({"dit": {"alg": "TP"}}, r"Parallel\.dit\.alg must be one of \['CP'\], got 'TP'"),
    ({"dit": {"alg": 1}}, r"Parallel\.dit\.alg must be one of \['CP'\]"),
    ({"vae": {"alg": "TP"}}, r"Parallel\.vae\.alg must be one of \['DP', 'NONE'\], got 'TP'"),
    ({"vae": {"alg": False}}, r"Parallel\.vae\.alg must be one of \['DP', 'NONE'\], got False"),  # YAML `off`
    ({"pipeline": {}}, r"unknown Parallel key\(s\) \['pipeline'\]; accepted keys are \['dit', 'vae', 'world_size'\]"),
    ({"dit": {"alg": "CP", "ulysses": 2}}, r"unknown Parallel\.dit key\(s\) \['ulysses'\]; accepted keys are \["),
    ({"vae": {"overlaps": 2}}, r"unknown Parallel\.vae key\(s\) \['overlaps'\]"),
    ({"dit": "CP"}, r"Parallel\.dit must be a mapping with keys"),
    ("CP", r"Parallel must be a mapping with keys \['dit', 'vae', 'world_size'\]"),
    ({"world_size": 0}, r"Parallel\.world_size must be >= 1, got 0"),
    ({"dit": {"world_size": "2"}}, r"Parallel\.dit\.world_size must be an integer"),
    ({"vae": {"world_size": True}}, r"Parallel\.vae\.world_size must be an integer"),
    ({"dit": {"world_size": 2}, "vae": {"world_size": 4}},
     r"Parallel\.dit\.world_size / Parallel\.vae\.world_size disagree"),
    ({"world_size": 2, "dit": {"world_size": 4}}, r"Parallel\.world_size / Parallel\.dit\.world_size disagree"),
    ({"dit": {"ulysses_degree": 0}}, r"Parallel\.dit\.ulysses_degree must be >= 1, got 0"),
    ({"dit": {"ring_degree": 1.5}}, r"Parallel\.dit\.ring_degree must be an integer"),
    ({"dit": {"sequence_degree": -1}}, r"Parallel\.dit\.sequence_degree must be >= 1"),
    ({"dit": {"cfg_degree": 3}}, r"Parallel\.dit\.cfg_degree must be one of \[1, 2\], got 3"),
    ({"dit": {"rotate_method": "ring"}}, r"Parallel\.dit\.rotate_method must be one of \['p2p', 'allgather'\]"),
    ({"vae": {"mode": "fast"}}, r"Parallel\.vae\.mode must be one of \['exact', 'chunked'\], got 'fast'"),
    ({"vae": {"alg": "NONE", "mode": "exact"}}, r"Parallel\.vae\.mode='exact' needs Parallel\.vae\.alg: DP"),
    ({"vae": {"alg": "DP", "overlap": 2}}, r"Parallel\.vae\.overlap applies to Parallel\.vae\.mode: chunked only"),
    ({"vae": {"alg": "DP", "mode": "chunked", "chunk_size": 0}}, r"Parallel\.vae\.chunk_size must be >= 1"),
    ({"vae": {"alg": "DP", "gather": "rank0"}}, r"Parallel\.vae\.gather='rank0' applies to .* \['all'\]"),
    ({"vae": {"alg": "DP", "mode": "chunked", "gather": "some"}},
     r"Parallel\.vae\.gather must be one of \['all', 'rank0'\]"),
])
def test_bad_parallel_section_names_the_key_and_allowed_values(section, fragment):
    with pytest.raises(ConfigError, match=fragment):
        BoostConfig.from_dict({"Parallel": section})


def test_both_schemas_at_once_is_refused_and_ours_keeps_working():
    with pytest.raises(ConfigError, match=r"either 'Parallel' .* or 'parallel'"):
        BoostConfig.from_dict({"Parallel": {}, "parallel": {}})
    ours = BoostConfig.from_dict({"parallel": {"ulysses_degree": 2, "vae_parallel": "chunked", "world_size": 2}})
    assert ours.parallel == ParallelConfig(ulysses_degree=2, vae_parallel="chunked", world_size=2)
    # the Parallel section beside our other keys
    mixed = BoostConfig.from_dict({"Parallel": {"vae": {"alg": "DP"}}, "sparse": {"sparsity": 0.5},
                                   "attention_backend": "sdpa"})
    assert mixed.parallel.vae_parallel == "exact" and mixed.sparse.sparsity == 0.5
    assert mixed.attention_backend == "sdpa"
    assert BoostConfig.coerce({"Parallel": {"world_size": 3}}).parallel.world_size == 3


def test_yaml_files_of_either_schema(tmp_path):
    ms = tmp_path / "boost.yaml"
    ms.write_text("Parallel:\n  dit:\n    alg: CP  # current support [CP]\n    world_size: 2\n"
                  "  vae:\n    alg: DP  # current support [DP]\n    world_size: 2\n")
    assert BoostConfig.from_yaml(str(ms)).parallel == ParallelConfig(world_size=2, vae_parallel="exact")
    ours = tmp_path / "ours.yaml"
    ours.write_text("parallel:\n  ring_degree: 2\nsparse:\n  sparsity: 0.7\n")
    cfg = BoostConfig.from_yaml(str(ours))
    assert cfg.parallel.ring_degree == 2 and cfg.sparse.sparsity == 0.7


def test_world_size_is_checked_against_the_launch():
    ParallelConfig(world_size=2).resolve_mesh(2)
    with pytest.raises(ConfigError, match=r"world_size=2 .* does not match the launched world size 1"):
        ParallelConfig(world_size=2).resolve_mesh(1)
    with pytest.raises(ConfigError, match="world_size must be >= 1"):
        ParallelConfig(world_size=0)


# ------------------------------------------------------------------------------------------ BoostManager
def test_boost_manager_at_world_size_one_equals_boost(tmp_path):
    spec = TinyWanSpec(heads=3)
    ref = lite_boost.boost(tiny_wan_pipeline("t2v", spec=spec))(**pipeline_kwargs("t2v")).frames

    pipe = tiny_wan_pipeline("t2v", spec=spec)
    assert BoostManager(pipe) is pipe  # with a target: patched in place and returned
    assert lite_boost.api.is_boosted(pipe)
    assert torch.equal(pipe(**pipeline_kwargs("t2v")).frames, ref)

    yaml_path = tmp_path / "boost.yaml"
    yaml_path.write_text("Parallel:\n  world_size: 1\n  dit:\n    alg: CP\n  vae:\n    alg: DP\n")
    manager = BoostManager()  # without a target: a manager, called later with the target
    assert isinstance(manager, BoostManager) and manager.config == BoostConfig()
    pipe = tiny_wan_pipeline("t2v", spec=spec)
    assert manager(pipe, config=str(yaml_path)) is pipe
    assert torch.equal(pipe(**pipeline_kwargs("t2v")).frames, ref)

    pipe = tiny_wan_pipeline("t2v", spec=spec)
    assert BoostManager(config=yaml_path)(pipe) is pipe  # a PathLike; the instance's config
    assert torch.equal(pipe(**pipeline_kwargs("t2v")).frames, ref)
    assert lite_boost.BoostManager is BoostManager and "BoostManager" in lite_boost.__all__


def test_boost_manager_config_forms_reach_the_boost():
    sparse_ref = lite_boost.boost(tiny_wan_pipeline("t2v"), {"sparse": {"sparsity": 0.5}})
    for config in ({"sparse": {"sparsity": 0.5}}, BoostConfig(sparse={"sparsity": 0.5}),
                   lite_boost.SparseConfig(sparsity=0.5)):
        pipe = BoostManager(tiny_wan_pipeline("t2v"), config)
        assert pipe.transformer._lite_boost.config.sparse == sparse_ref.transformer._lite_boost.config.sparse
    manager = BoostManager(config={"sparse": {"sparsity": 0.5}})
    assert manager(tiny_wan_pipeline("t2v")).transformer._lite_boost.config.sparse.sparsity == 0.5  # the instance's
    assert manager(tiny_wan_pipeline("t2v"), config={}).transformer._lite_boost.config.sparse is None  # the call's


def test_boost_manager_refuses_before_touching_the_target(monkeypatch, tmp_path):
    pipe = tiny_wan_pipeline("t2v")
    with pytest.raises(ConfigError, match=r"world_size=2 .* does not match the launched world size 1"):
        BoostManager(pipe, {"Parallel": {"dit": {"alg": "CP", "world_size": 2}}})
    with pytest.raises(ConfigError, match=r"Parallel\.dit\.alg must be one of \['CP'\]"):
        BoostManager(pipe, {"Parallel": {"dit": {"alg": "PP"}}})
    with pytest.raises(ConfigError, match="no file at"):
        BoostManager(pipe, str(tmp_path / "missing.yaml"))
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['ranks'\]"):
        BoostManager(pipe, ranks=2)
    with pytest.raises(TypeError, match="target must be"):
        BoostManager()(None)
    assert not lite_boost.api.is_boosted(pipe)
    # a feature the family lacks, before any collective (no MASTER_ADDR: reaching init would fail otherwise)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    import _tiny_cogvideox

    cog = _tiny_cogvideox.tiny_pipeline()
    with pytest.raises(Exception, match=r"no parallel-VAE adapter for AutoencoderKLCogVideoX;"):
        BoostManager(cog, {"Parallel": {"world_size": 2, "vae": {"alg": "DP"}}})
    assert not lite_boost.api.is_boosted(cog)
    qwen = tiny_qwen_image_pipeline()
    with pytest.raises(ConfigError, match=r"world_size=4 .* does not match the launched world size 2"):
        BoostManager(qwen, {"Parallel": {"world_size": 4}})
    assert not lite_boost.api.is_boosted(qwen)


def test_boost_manager_two_processes_equal_one_process(tmp_path):
    from _dist_utils import run_ranks
    import _dist_boost_manager_cases as cases

    ulysses = tmp_path / "ulysses.yaml"
    ulysses.write_text("Parallel:\n  dit:\n    alg: CP\n    world_size: 2\n  vae:\n    alg: DP\n    world_size: 2\n")
    ring = tmp_path / "ring.yaml"
    ring.write_text("Parallel:\n  world_size: 2\n  dit:\n    alg: CP\n    ring_degree: 2\n  vae:\n    alg: NONE\n")
    results = run_ranks(cases.yaml_vs_one_process, 2, [str(ulysses), str(ring)], timeout=400)
    for rank, res in enumerate(results):
        u, r = res[str(ulysses)], res[str(ring)]
        assert u["same_object"] and r["same_object"]
        assert u["mesh"] == (2, 2, 1, 1) and u["vae_mode"] == "exact", u
        assert r["mesh"] == (2, 1, 2, 1) and r["vae_mode"] is None, r
        for got in (u, r):
            assert got["ref_abs"] > 0.01 and got["maxdiff"] <= 1e-5, (rank, got)
