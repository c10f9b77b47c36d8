"""The errors a new user meets first: each names what was wrong and what to do instead, before anything runs."""

import re

import pytest
import torch

import lite_boost
from lite_boost.cli import check_output, main, output_path
from lite_boost.config import BoostConfig, ConfigError


@pytest.fixture
def no_launch(monkeypatch):
    import subprocess

    def refuse(*a, **k):
        raise AssertionError("torchrun was launched")

    monkeypatch.setattr(subprocess, "call", refuse)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------------------------ YAML
@pytest.mark.parametrize("text, line", [
    ("sparse:\n  sparsity: [0.5\nparallel: {}\n", 3),  # unclosed flow sequence: found on line 3
    ("cache: first_block_cache\nquant: a: b\n", 2),  # a mapping value where none may start
])
def test_malformed_yaml_names_the_file_and_line(tmp_path, no_launch, text, line):
    path = tmp_path / "boost.yaml"
    path.write_text(text)
    want = rf"{re.escape(str(path))}: line {line}, column \d+: not valid YAML"
    with pytest.raises(ConfigError, match=want):
        BoostConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=want):
        lite_boost.BoostManager(config=str(path))
    with pytest.raises(SystemExit, match="lite-boost generate: " + want):
        main(["generate", "--config", str(path)])


def test_a_wrong_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "boost.yaml"
    path.write_text("sparse:\n  sparsity: 0.5\n  block: 64\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: unknown SparseConfig key\(s\) \['block'\]"):
        BoostConfig.from_yaml(path)


# ------------------------------------------------------------------------------------------------ device
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_unusable_device_names_the_usable_ones(no_launch):
    from lite_boost.cli import usable_devices

    assert usable_devices()[0] == "cpu"
    why = "this torch build .* has no CUDA support" if torch.version.cuda is None else "no cuda device is visible"
    with pytest.raises(SystemExit, match=rf"--device cuda is not usable here \({why}\); usable devices: \['cpu'"):
        main(["generate", "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"--device cuda:1 is not usable here .*usable devices: \['cpu'"):
        main(["generate", "--device", "cuda:1", "--nproc", "2"])  # refused in the launcher, before torchrun
    with pytest.raises(SystemExit, match=r"--device must be a device name such as cpu, cuda or cuda:0, got 'gpu'; "
                                         r"usable here: \['cpu'"):
        main(["generate", "--device", "gpu"])


# ------------------------------------------------------------------------------------------------ processes
@pytest.mark.parametrize("flags, need", [(["--cfg-degree", "2"], 2), (["--ulysses-degree", "2", "--ring-degree", "2"], 4),
                                         (["--sequence-degree", "3"], 3)])
def test_parallel_degrees_without_processes_are_refused_with_the_launch_hint(no_launch, flags, need):
    with pytest.raises(SystemExit, match=rf"{' '.join(flags)} need {need} processes, but this run has one; add "
                                         rf"--nproc {need} .*torchrun --nproc_per_node {need}"):
        main(["generate", *flags])


def test_parallel_degrees_from_a_config_file_without_processes(no_launch, tmp_path):
    path = tmp_path / "boost.yaml"
    path.write_text("Parallel:\n  world_size: 2\n  dit:\n    alg: CP\n")
    with pytest.raises(SystemExit, match=r"parallel world_size=2 \(from --config .*boost\.yaml\) need 2 processes, "
                                         r"but this run has one; add --nproc 2"):
        main(["generate", "--config", str(path)])


def _stock_processors(pipe):
    return {n: type(p) for n, p in pipe.transformer.attn_processors.items()}


@pytest.mark.parametrize("parallel, asked, need", [
    ({"cfg_degree": 2}, "cfg_degree=2", 2),
    ({"ulysses_degree": 2, "ring_degree": 2}, "ulysses_degree=2, ring_degree=2", 4),
])
def test_boost_refuses_parallel_degrees_before_touching_the_pipeline(parallel, asked, need):
    from lite_boost.api import is_boosted
    from lite_boost.demo import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    before = _stock_processors(pipe)
    with pytest.raises(ConfigError, match=rf"parallel {asked} needs {need} processes, but boost\(\) runs in this one "
                                          rf"process\. Launch {need} processes \(torchrun --nproc_per_node {need} "
                                          r".*lite_boost\.ParallelManager\(pipe, config\)"):
        lite_boost.boost(pipe, {"parallel": parallel})
    assert not is_boosted(pipe) and _stock_processors(pipe) == before
    lite_boost.boost(pipe, {"parallel": {"cfg_degree": 1, "timeout_s": 30}})  # one process' worth: fine
    assert is_boosted(pipe)
    lite_boost.unboost(pipe)


def test_yaml_path_given_to_boost_points_to_boost_manager(tmp_path):
    from lite_boost.demo import tiny_wan_transformer

    model = tiny_wan_transformer()
    for config in ("boost.yaml", tmp_path / "boost.yaml"):
        with pytest.raises(ConfigError, match=r"is a path: boost\(\) and ParallelManager\(\) take a BoostConfig.*"
                                              r"lite_boost\.BoostManager\(pipe, config='.*boost\.yaml'\).*"
                                              r"BoostConfig\.from_yaml\('.*boost\.yaml'\)"):
            lite_boost.boost(model, config)
    assert getattr(model, "_lite_boost", None) is None


# ------------------------------------------------------------------------------------------------ usage
def test_a_mistyped_generate_option_prints_generates_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--stepz", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lite-boost generate ")  # the subcommand's usage, not the top level's
    assert "error: unrecognized arguments: --stepz 2; --stepz: did you mean --steps" in err


# ------------------------------------------------------------------------------------------------ outputs
def test_outputs_are_never_overwritten_silently(tmp_path, no_launch):
    default = tmp_path / "lite_boost_t2v.mp4"
    assert output_path(None, default) == default
    default.write_bytes(b"x")
    assert output_path(None, default) == tmp_path / "lite_boost_t2v-1.mp4"
    (tmp_path / "lite_boost_t2v-1.gif").write_bytes(b"x")  # the GIF fallback of an earlier run counts too
    assert output_path(None, default) == tmp_path / "lite_boost_t2v-2.mp4"
    with pytest.raises(SystemExit, match=rf"--output {re.escape(str(default))}: .* exists; pass --overwrite"):
        main(["generate", "--output", str(default)])
    with pytest.raises(SystemExit, match=r"lite_boost_t2v-1\.gif exists; pass --overwrite"):
        check_output(str(tmp_path / "lite_boost_t2v-1.mp4"), overwrite=False)
    check_output(str(default), overwrite=True)  # asked for: fine
    assert output_path(str(default), "unused.mp4") == default
