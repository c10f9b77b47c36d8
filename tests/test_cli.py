import re
import sys

import numpy as np
import pytest

from lite_boost.cli import main, write_video


def test_env_lists_backends(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "| sdpa | installed |" in out
    assert "| fa2 | unavailable |" in out and "torch:" in out


@pytest.mark.parametrize("image", [False, True])
def test_generate_tiny_default_writes_video_and_timing(tmp_path, capsys, image):
    args = ["generate", "--steps", "2", "--height", "32", "--width", "48", "--num-frames", "5", "--warmup", "0",
            "--sparsity", "0", "--output", str(tmp_path / "video.mp4")]
    if image:
        from PIL import Image

        Image.fromarray((np.random.RandomState(0).rand(40, 40, 3) * 255).astype("uint8")).save(tmp_path / "in.png")
        args += ["--image", str(tmp_path / "in.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    written = re.search(r"wrote (\S+) \[", out).group(1)
    assert (tmp_path / written.split("/")[-1]).stat().st_size > 0
    for row in ("text encode", "denoise per step", "VAE decode", "| total |"):
        assert row in out
    diff = float(re.search(r"max \|boosted - stock\| over the video \(values in \[0, 1\]\): (\S+)", out).group(1))
    assert diff <= 1e-5  # the dense boosted video equals the stock one
    assert float(re.search(r"video PSNR boosted vs stock: (\S+) dB", out).group(1)) > 100
    assert "- self-attention: dense" in out and "VAE only 2 channels wide" in out


def test_generate_default_sparsity_is_the_demo_models_only():
    from lite_boost.cli import _boost_config, build_parser
    from lite_boost.demo import DEMO_SPARSITY

    parser = build_parser()
    assert _boost_config(parser.parse_args(["generate"])).sparse.sparsity == DEMO_SPARSITY == 0.8
    assert _boost_config(parser.parse_args(["generate", "--sparsity", "0"])).sparse is None
    assert _boost_config(parser.parse_args(["generate", "--model", "/m"])).sparse is None  # a real model: dense
    assert _boost_config(parser.parse_args(["generate", "--model", "/m", "--sparsity", "0.5"])).sparse.sparsity == 0.5


def test_video_psnr_uses_the_reference_range_as_peak():
    from lite_boost.cli import video_psnr

    rng = np.random.RandomState(0)
    ref = 0.4 + 0.2 * rng.rand(2, 3, 8, 8, 3)  # range ~0.2, not [0, 1]
    noisy = ref + 1e-3 * rng.randn(*ref.shape)
    peak = ref.max() - ref.min()
    expected = 10 * np.log10(peak**2 / np.mean((noisy - ref) ** 2))
    got, got_peak, diff = video_psnr(noisy, ref)
    assert abs(got - expected) < 1e-9 and abs(got_peak - peak) < 1e-12
    assert diff == np.abs(noisy - ref).max()
    assert video_psnr(ref, ref)[0] == float("inf")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--sparsity", "1.5"], r"--sparsity must be in \[0, 1\)"),
        (["--height", "30"], "--height must be a positive multiple of 16"),
        (["--num-frames", "6"], r"--num-frames must be 4k \+ 1"),
        (["--nproc", "0"], "--nproc must be a positive integer"),
        (["--model", "/nonexistent"], "--model must be a diffusers pipeline folder"),
        (["--image", "/nonexistent.png"], "--image must be an existing image file"),
    ],
)
def test_generate_rejects_bad_flags(flags, fragment):
    with pytest.raises(SystemExit, match=fragment):
        main(["generate", *flags])


def test_write_video_falls_back_to_gif(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    frames = np.random.RandomState(0).rand(1, 3, 16, 16, 3)
    path, fmt = write_video(frames, tmp_path / "v.mp4")
    assert path.suffix == ".gif" and "GIF" in fmt and path.stat().st_size > 0
    from PIL import Image

    with Image.open(path) as im:
        assert im.n_frames == 3


def test_nproc_relaunches_under_torchrun_without_the_flag():
    from lite_boost.cli import _torchrun_command, build_parser

    argv = ["generate", "--nproc", "3", "--steps", "1", "--nproc=3", "--cfg-degree", "1"]
    cmd = _torchrun_command(build_parser().parse_args(argv), argv)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    assert cmd[5:] == ["-m", "lite_boost.cli", "generate", "--steps", "1", "--cfg-degree", "1"]
