import pytest

from lite_boost.config import BoostConfig, ConfigError, ParallelConfig, SparseConfig


def test_defaults_are_valid_and_round_trip():
    cfg = BoostConfig(sparse=SparseConfig(sparsity=0.5), parallel=ParallelConfig(cfg_degree=2))
    assert BoostConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(attention_backend="flash"), "attention_backend must be one of"),
        (dict(rope_cache_size=0), "rope_cache_size must be >= 1"),
        (dict(rope_cache_size=2.5), "rope_cache_size must be an integer"),
        (dict(sparse=3), "sparse must be a SparseConfig"),
    ],
)
def test_boost_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        BoostConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(sparsity=1.0), r"sparsity must be in \[0, 1\)"),
        (dict(sparsity=-0.1), r"sparsity must be in \[0, 1\)"),
        (dict(sparse_type="rf_v3"), "sparse_type must be one of"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(window=(2, 8, 4), block_size=128), "window volume"),
        (dict(window=(2, 8)), "window must be None or three positive ints"),
        (dict(mask_reuse_steps=0), "mask_reuse_steps must be >= 1"),
        (dict(dense_layers=(-1,)), r"dense_layers\[i\] must be >= 0"),
        (dict(cdf_threshold=0.0), r"cdf_threshold must be in \(0, 1\]"),
    ],
)
def test_sparse_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        SparseConfig(**kwargs)


def test_parallel_config_validation_and_resolve():
    with pytest.raises(ConfigError, match=r"cfg_degree must be one of \[1, 2\]"):
        ParallelConfig(cfg_degree=3)
    with pytest.raises(ConfigError, match="timeout_s must be a positive"):
        ParallelConfig(timeout_s=0)
    assert ParallelConfig().resolve(4) == (1, 4)
    assert ParallelConfig(cfg_degree=2).resolve(4) == (2, 2)
    with pytest.raises(ConfigError, match=r"valid sequence_degree for this cfg_degree: \[2\]"):
        ParallelConfig(cfg_degree=2, sequence_degree=3).resolve(4)
    with pytest.raises(ConfigError, match=r"valid cfg_degree values: \[1\]"):
        ParallelConfig(cfg_degree=2).resolve(3)


def test_unknown_keys_are_rejected_with_the_accepted_list():
    with pytest.raises(ConfigError, match=r"unknown BoostConfig key\(s\) \['atention_backend'\]; accepted keys"):
        BoostConfig.from_dict({"atention_backend": "sdpa"})
    with pytest.raises(ConfigError, match=r"unknown SparseConfig key\(s\) \['sparsty'\]"):
        BoostConfig.from_dict({"sparse": {"sparsty": 0.5}})


def test_from_yaml(tmp_path):
    path = tmp_path / "boost.yaml"
    path.write_text("attention_backend: sdpa\nsparse:\n  sparsity: 0.9\n  dense_steps_first: 3\nparallel:\n  cfg_degree: 2\n")
    cfg = BoostConfig.from_yaml(str(path))
    assert cfg.attention_backend == "sdpa"
    assert cfg.sparse == SparseConfig(sparsity=0.9, dense_steps_first=3)
    assert cfg.parallel.cfg_degree == 2


def test_coerce():
    assert BoostConfig.coerce(None) == BoostConfig()
    assert BoostConfig.coerce(SparseConfig()).sparse == SparseConfig()
    assert BoostConfig.coerce({"rope_cache_size": 3}).rope_cache_size == 3
    with pytest.raises(ConfigError, match="config must be a BoostConfig"):
        BoostConfig.coerce("fast")


def test_backend_name_lists_match_the_registries():
    import importlib

    from lite_boost.config import ATTENTION_BACKEND_NAMES, SPARSE_BACKEND_NAMES
    from lite_boost.ops.rain_fusion import SPARSE_BACKENDS

    assert tuple(importlib.import_module("lite_boost.ops.attention").BACKENDS) == ATTENTION_BACKEND_NAMES
    assert tuple(SPARSE_BACKENDS) == SPARSE_BACKEND_NAMES
    assert SparseConfig(backend="gather").backend == "gather"
    with pytest.raises(ConfigError, match=r"backend must be one of \[None, 'npu', 'cpp', 'sparge', 'flex_int8', 'flex', 'gather', 'reference'\]"):
        SparseConfig(backend="triton")


def test_ops_exports_sparse_names_lazily():
    import lite_boost.ops as ops

    for name in ops.__all__:
        assert getattr(ops, name) is not None
    with pytest.raises(AttributeError):
        ops.not_a_name
