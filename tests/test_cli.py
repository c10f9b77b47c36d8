import json
import re
import sys
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ families
def _index(tmp_path, class_name, name="m"):
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.1"}))
    return folder


def test_generate_qwen_image_tiny_writes_png_and_compares(tmp_path, capsys):
    from PIL import Image

    assert main(["generate", "--family", "qwen-image", "--steps", "2", "--height", "64", "--width", "48",
                 "--warmup", "0", "--output", str(tmp_path / "img.png")]) == 0
    out = capsys.readouterr().out
    written = re.search(r"wrote (\S+) \[PNG", out).group(1)
    with Image.open(written) as im:
        assert im.size == (48, 64) and im.format == "PNG"
    assert "t2i, tiny built-in QwenImagePipeline (the qwen-image family), 64x48, 2 steps" in out
    assert "8 x 6 = 48 image tokens + 12 / 7 text tokens (cond / uncond" in out
    for row in ("denoise per step", "VAE decode", "| total |"):
        assert row in out
    diff = float(re.search(r"max \|boosted - stock\| over the image \(values in \[0, 1\]\): (\S+)", out).group(1))
    assert diff <= 1e-5
    assert float(re.search(r"image PSNR boosted vs stock: (\S+) dB", out).group(1)) > 100
    assert "- self-attention: dense" in out and "- RoPE tables: cached" in out


def test_tiny_qwen_image_defaults():
    from lite_boost.cli import _boost_config, _call_kwargs, build_parser
    from lite_boost.demo import DEMO_QWEN_SHAPE, DEMO_QWEN_STEPS, tiny_qwen_image_pipeline

    args = build_parser().parse_args(["generate", "--family", "qwen-image"])
    assert _boost_config(args).sparse is None  # image family: dense by default
    kw = _call_kwargs(args, "t2i", tiny=True, family=_family("qwen-image"), pipe=tiny_qwen_image_pipeline())
    assert (kw["height"], kw["width"], kw["num_inference_steps"]) == (*DEMO_QWEN_SHAPE, DEMO_QWEN_STEPS)
    assert kw["true_cfg_scale"] == 5.0 and "guidance_scale" not in kw and "num_frames" not in kw
    assert kw["prompt_embeds"].shape[1] != kw["negative_prompt_embeds"].shape[1]  # cond / uncond lengths differ
    no_cfg = _call_kwargs(build_parser().parse_args(["generate", "--guidance-scale", "1"]), "t2i", tiny=True,
                          family=_family("qwen-image"), pipe=tiny_qwen_image_pipeline())
    assert "negative_prompt_embeds" not in no_cfg


def test_model_runs_take_the_pipelines_own_defaults():
    from lite_boost.cli import _call_kwargs, build_parser
    from lite_boost.demo import tiny_wan_pipeline

    pipe = tiny_wan_pipeline("t2v")
    wan = _family("wan")
    kw = _call_kwargs(build_parser().parse_args(["generate", "--model", "/m"]), "t2v", tiny=False, family=wan, pipe=pipe)
    assert not {"height", "width", "num_frames", "num_inference_steps", "guidance_scale"} & set(kw)
    kw = _call_kwargs(build_parser().parse_args(["generate", "--model", "/m", "--height", "32", "--num-frames", "9",
                                                 "--guidance-scale", "3"]), "t2v", tiny=False, family=wan, pipe=pipe)
    assert (kw["height"], kw["num_frames"], kw["guidance_scale"]) == (32, 9, 3.0) and "width" not in kw
    tiny = _call_kwargs(build_parser().parse_args(["generate"]), "t2v", tiny=True, family=wan, pipe=pipe)
    assert (tiny["height"], tiny["width"], tiny["num_frames"], tiny["guidance_scale"]) == (192, 256, 25, 5.0)
    # Flux's guidance_scale is a distilled embedding: --guidance-scale is its record's true CFG argument
    flux = _call_kwargs(build_parser().parse_args(["generate", "--model", "/m", "--guidance-scale", "3"]), "t2i",
                        tiny=False, family=_family("flux"))
    assert flux["true_cfg_scale"] == 3.0 and "guidance_scale" not in flux and "num_frames" not in flux


def _family(name):
    from lite_boost.registry import families

    return {f.name: f for f in families()}[name]


def test_cli_names_no_family_and_reads_the_records():
    """cli.py holds no family knowledge: every family name (and its display spelling) is absent from it; the
    tiny runs, the CFG argument and the output kind come from the records."""
    from lite_boost.cli import _tiny_kind, build_parser, default_tiny_family, resolve_family
    from lite_boost.registry import families

    text = Path(__file__).resolve().parents[1].joinpath("lite_boost", "cli.py").read_text(encoding="utf-8")
    names = {f.name for f in families()} | {"wan", "qwen", "flux", "ltx", "hunyuan", "cogvideo", "cogvideox"}
    found = {n for n in names if re.search(rf"(?<![A-Za-z]){re.escape(n)}(?![A-Za-z])", text, re.IGNORECASE)}
    assert not found, f"cli.py names families {sorted(found)}: put the hint on the family record"
    assert default_tiny_family().name == "wan"  # the record that marks its tiny pipeline default=True
    parser = build_parser()
    fam, cls = resolve_family(parser.parse_args(["generate", "--family", "qwen-image"]))
    assert (fam.name, cls, _tiny_kind(fam, parser.parse_args(["generate"]))) == ("qwen-image", "QwenImagePipeline", "t2i")
    assert resolve_family(parser.parse_args(["generate", "--image", "x.png"]))[1] == "WanImageToVideoPipeline"


def test_family_records_declare_the_cli_hints_and_refuse_bad_ones():
    from lite_boost.adapter.family import ModelFamily, TinyPipeline

    wan, qwen = _family("wan"), _family("qwen-image")
    assert (wan.output, wan.cfg_argument, qwen.output, qwen.cfg_argument) == (
        "video", "guidance_scale", "image", "true_cfg_scale")
    assert _family("hunyuan-video-1.5").cfg_argument is None and _family("flux").cfg_argument == "true_cfg_scale"
    base = dict(name="x", transformers=("X",), attention=wan.attention)
    plain = ModelFamily(**base)  # a record that sets none of them: defaults
    assert (plain.output, plain.cfg_argument, plain.tiny) == (None, "guidance_scale", {})
    tiny = TinyPipeline("XPipeline", builder="m.n:build", shape=(32, 32, None))
    with pytest.raises(ValueError, match=r"output must be one of \['image', 'video'\] or None, got 'gif'"):
        ModelFamily(**base, output="gif")
    with pytest.raises(ValueError, match=r"tiny must map kinds of run of its output \('video'"):
        ModelFamily(**base, output="video", tiny={"t2i": tiny})
    with pytest.raises(ValueError, match="num_frames for a video family"):
        ModelFamily(**base, output="video", tiny={"t2v": tiny})
    with pytest.raises(ValueError, match="cfg_argument must be a pipeline argument name"):
        ModelFamily(**base, cfg_argument="true cfg")
    with pytest.raises(ValueError, match="builder must be a 'package.module:function' reference"):
        TinyPipeline("XPipeline", builder="m.build", shape=(32, 32, None))
    with pytest.raises(ValueError, match=r"shape must be \(height, width, num_frames or None\)"):
        TinyPipeline("XPipeline", builder="m:b", shape=(32, 32))
    with pytest.raises(ValueError, match=r"stand_ins\['processor'\] must be a 'package.module:function' reference"):
        TinyPipeline("XPipeline", builder="m:b", shape=(32, 32, None), prompt="m:p", stand_ins={"processor": "p"})
    with pytest.raises(ValueError, match="stand_ins need prompt"):
        TinyPipeline("XPipeline", builder="m:b", shape=(32, 32, None), stand_ins={"processor": "m:p"})


def test_guidance_scale_a_pipeline_cannot_take_is_refused_before_loading(tmp_path):
    idx = tmp_path / "model_index.json"
    for cls, why in (("FluxControlPipeline", "takes no true_cfg_scale"),
                     ("HunyuanVideo15Pipeline", "takes no guidance scale argument")):
        idx.write_text(json.dumps({"_class_name": cls}))
        with pytest.raises(SystemExit, match=f"--guidance-scale is not supported by {cls}, which .*{why}"):
            main(["generate", "--model", str(tmp_path), "--guidance-scale", "3", "--output",
                  str(tmp_path / "o.mp4")])


def test_family_flag_takes_registered_families_and_runs_only_tiny_ones():
    from lite_boost.registry import families

    names = [f.name for f in families()]
    assert {"wan", "qwen-image", "flux"} <= set(names)
    with pytest.raises(SystemExit, match=r"--family must be one of \['wan', 'qwen-image', 'qwen-image-2.1', 'flux'.*got 'sdxl'"):
        main(["generate", "--family", "sdxl"])
    with pytest.raises(SystemExit, match=r"--family flux has no built-in tiny model: pass --model PATH .* "
                                         r"a family with one: \['wan', 'qwen-image', 'qwen-image-2.1', 'flux2', 'ltx2', "
                                         r"'minimax-h3'\]"):
        main(["generate", "--family", "flux"])


def test_detect_family_from_model_index_for_every_registered_pipeline(tmp_path):
    from lite_boost.cli import detect_family
    from lite_boost.registry import families

    for fam in families():
        for i, name in enumerate(fam.pipelines):
            found, cls = detect_family(_index(tmp_path, name, f"{fam.name}{i}"))
            assert (found.name, cls) == (fam.name, name)
    expected = {"WanPipeline": "wan", "QwenImagePipeline": "qwen-image", "FluxPipeline": "flux"}
    for name, fam in expected.items():
        assert detect_family(_index(tmp_path, name, "x" + name))[0].name == fam


def test_detect_family_finds_a_subclass_through_diffusers(tmp_path, monkeypatch):
    import diffusers

    from lite_boost.cli import detect_family

    monkeypatch.setattr(diffusers, "MyWanPipeline", type("MyWanPipeline", (diffusers.WanPipeline,), {}), raising=False)
    assert detect_family(_index(tmp_path, "MyWanPipeline"))[0].name == "wan"


@pytest.mark.parametrize("content, fragment", [
    ('{"_class_name": "StableDiffusionPipeline"}',
     r"holds a StableDiffusionPipeline, which lite_boost does not support; supported pipeline classes: "
     r"\[.*'WanPipeline'.*'QwenImagePipeline'.*'FluxPipeline'"),
    ('{"_diffusers_version": "0.42.1"}', r"names no pipeline class \(_class_name\)"),
    ("{not json", "cannot read"),
])
def test_model_of_an_unknown_or_broken_index_is_refused(tmp_path, content, fragment):
    (tmp_path / "model_index.json").write_text(content)
    with pytest.raises(SystemExit, match=fragment):
        main(["generate", "--model", str(tmp_path)])


def test_family_flag_must_match_the_model(tmp_path):
    folder = _index(tmp_path, "WanPipeline")
    with pytest.raises(SystemExit, match=r"--family qwen-image does not match --model .*, a WanPipeline \(the wan "
                                         r"family\); drop --family or pass --family wan"):
        main(["generate", "--model", str(folder), "--family", "qwen-image"])


@pytest.fixture(scope="module")
def saved_tiny_pipelines(tmp_path_factory):
    from lite_boost.demo import TinyWanSpec, tiny_qwen_image_pipeline, tiny_wan_pipeline

    root = tmp_path_factory.mktemp("models")
    tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3)).save_pretrained(root / "wan")
    tiny_qwen_image_pipeline().save_pretrained(root / "qwen")  # no text encoder / tokenizer: saved as None
    return root


@pytest.mark.parametrize("which, flags, kind, what", [
    ("wan", ["--num-frames", "5"], "t2v", "video"),
    ("qwen", [], "t2i", "image"),
])
def test_generate_model_detects_the_family_and_matches_stock(saved_tiny_pipelines, tmp_path, capsys, which, flags,
                                                             kind, what):
    folder = saved_tiny_pipelines / which
    assert main(["generate", "--model", str(folder), "--height", "32", "--width", "48", "--steps", "2",
                 "--warmup", "0", "--sparsity", "0", *flags, "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    cls, fam = {"wan": ("WanPipeline", "wan"), "qwen": ("QwenImagePipeline", "qwen-image")}[which]
    assert f"lite-boost generate: {kind}, {folder} ({cls}, the {fam} family), 32x48" in out
    assert re.search(r"wrote \S+\.(mp4|gif|npy|png) \[", out)
    diff = float(re.search(rf"max \|boosted - stock\| over the {what} \(values in \[0, 1\]\): (\S+)", out).group(1))
    assert diff <= 1e-5


@pytest.fixture
def no_launch(monkeypatch):
    import subprocess

    def refuse(*a, **k):
        raise AssertionError("torchrun was launched")

    monkeypatch.setattr(subprocess, "call", refuse)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("flags, fragment", [
    (["--family", "qwen-image", "--cache", "pyramid_attention_broadcast"],
     r"--cache pyramid_attention_broadcast is not available for the qwen-image family; its step caches: "
     r"\['first_block_cache', 'mag_cache', 'taylorseer_cache'\]"),
    (["--family", "qwen-image", "--nproc", "2", "--num-frames", "5"],
     r"--num-frames is for video pipelines; QwenImagePipeline \(the qwen-image family\) makes images"),
    (["--family", "qwen-image", "--nproc", "3", "--cfg-degree", "2"], r"cfg_degree=2 does not divide world_size=3"),
])
def test_unsupported_combinations_stop_before_torchrun(no_launch, flags, fragment):
    with pytest.raises(SystemExit, match=fragment):
        main(["generate", *flags])


def test_image_on_a_tiny_model_without_image_input(no_launch, tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), dtype="uint8")).save(tmp_path / "in.png")
    with pytest.raises(SystemExit, match=r"--image is not supported by the built-in tiny qwen-image model; built-in "
                                         r"image-conditioned models: \['wan'\]"):
        main(["generate", "--family", "qwen-image", "--image", str(tmp_path / "in.png")])


def test_features_a_family_lacks_are_named_by_option(tmp_path):
    import dataclasses

    from lite_boost.cli import _boost_config, build_parser, check_family_options
    from lite_boost.registry import families

    qwen = next(f for f in families() if f.name == "qwen-image")
    bare = dataclasses.replace(qwen, name="bare", unsupported={
        "sparse": "no latent token grid declared", "cfg_parallel": "its pipelines run no CFG to split",
        "sequence_parallel": "no sharding plan", "quant": "no default quantization patterns",
        "step_cache": "no cache adapter"})

    def check(*flags, world=1):
        args = build_parser().parse_args(["generate", "--family", "qwen-image", *flags])
        check_family_options(bare, "QwenImagePipeline", args, _boost_config(args), world)

    check("--sparsity", "0")  # dense: fine
    cases = [
        ((["--sparsity", "0.5"], 1), r"--sparsity 0.5 is not supported for the bare family \(no latent token grid "
                                     r"declared\); families with sparse: \['wan', 'qwen-image'"),
        ((["--nproc", "2", "--cfg-degree", "2"], 2), r"--cfg-degree 2 is not supported for the bare family \(its "
                                                     r"pipelines run no CFG to split\); families with cfg_parallel"),
        ((["--nproc", "2"], 2), r"--nproc 2 \(sequence degree 2\) is not supported for the bare family \(no "
                                r"sharding plan\)"),
        ((["--quant", "int8_dynamic"], 1), r"--quant int8_dynamic is not supported for the bare family"),
        ((["--cache", "first_block_cache"], 1), r"--cache first_block_cache is not supported for the bare family"),
    ]
    for (flags, world), fragment in cases:
        with pytest.raises(SystemExit, match=fragment):
            check(*flags, world=world)
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("sparse:\n  sparsity: 0.3\n")
    with pytest.raises(SystemExit, match=r"sparse \(from --config .*c\.yaml\) is not supported for the bare family"):
        check("--config", str(yaml_path))
    # the real qwen-image family has all of these
    for (flags, world), _ in cases:
        args = build_parser().parse_args(["generate", "--family", "qwen-image", *flags])
        check_family_options(qwen, "QwenImagePipeline", args, _boost_config(args), world)


def test_boost_manager_yaml_as_config_is_checked_before_torchrun(no_launch, tmp_path):
    path = tmp_path / "boost.yaml"
    path.write_text("Parallel:\n  dit:\n    alg: CP\n    world_size: 4\n  vae:\n    alg: DP\n")
    with pytest.raises(SystemExit, match=r"world_size=4 .* does not match the launched world size 2"):
        main(["generate", "--config", str(path), "--nproc", "2"])
    path.write_text("Parallel:\n  dit:\n    alg: TP\n")
    with pytest.raises(SystemExit, match=r"Parallel\.dit\.alg must be one of \['CP'\], got 'TP'"):
        main(["generate", "--config", str(path)])


@pytest.fixture(scope="module")
def saved_newer_family_pipelines(tmp_path_factory):
    """Tiny random pipelines of the newer families, saved as diffusers folders, plus image / frame inputs."""
    import numpy as np
    from PIL import Image

    import _tiny_wan_derived as wan_derived
    from lite_boost.demo import (demo_flux2_pipeline, demo_ltx2_pipeline, demo_minimax_h3_pipeline,
                                 demo_qwen_image21_pipeline)

    root = tmp_path_factory.mktemp("newer")
    demo_flux2_pipeline("t2i").save_pretrained(root / "flux2")  # no text encoder: random prompt embeddings
    demo_ltx2_pipeline("t2v").save_pretrained(root / "ltx2")
    for family in ("skyreels-v2", "wan-vace", "chronoedit", "wan-animate"):
        wan_derived.pipeline(family).save_pretrained(root / family)
    # saved without text encoder and processor (model_index.json: [null, null]): loaded with the family's stand-in
    # processor, called with random prompt embeddings
    demo_qwen_image21_pipeline("t2i").save_pretrained(root / "qwen-image-2.1")
    # a modular pipeline (modular_model_index.json), saved without its text encoder: random prompt embeddings
    demo_minimax_h3_pipeline().save_pretrained(str(root / "minimax-h3"), overwrite_modular_index=True)
    rng = np.random.RandomState(0)

    def frames(name, count, size, mode="RGB"):
        (root / name).mkdir()
        for i in range(count):
            pixels = (rng.rand(size[1], size[0], 3) * 255).astype("uint8")
            img = Image.fromarray(pixels) if mode == "RGB" else Image.new("L", size, 0 if i == 0 else 255)
            img.save(root / name / f"{i:03d}.png")

    Image.fromarray((rng.rand(48, 80, 3) * 255).astype("uint8")).save(root / "image.png")
    frames("control", 5, (80, 48))
    frames("mask", 5, (80, 48), mode="L")
    frames("pose", 5, (80, 48))
    frames("face", 5, (16, 16))
    return root


NEWER_MODEL_RUNS = {  # folder -> (pipeline class, kind, output, flags; paths relative to the saved root)
    "flux2": ("Flux2KleinPipeline", "t2i", "image", ["--height", "64", "--width", "96"]),
    "ltx2": ("LTX2Pipeline", "t2v", "video", ["--height", "64", "--width", "96", "--num-frames", "9"]),
    "skyreels-v2": ("SkyReelsV2Pipeline", "t2v", "video", ["--num-frames", "5"]),
    "wan-vace": ("WanVACEPipeline", "t2v", "video", ["--num-frames", "5", "--input", "video=control",
                                                      "--input", "mask=mask"]),
    "chronoedit": ("ChronoEditPipeline", "i2v", "video", ["--num-frames", "5", "--image", "image.png"]),
    "wan-animate": ("WanAnimatePipeline", "i2v", "video", ["--image", "image.png", "--input", "pose_video=pose",
                                                           "--input", "face_video=face"]),
    "qwen-image-2.1": ("QwenImage21Pipeline", "t2i", "image", ["--height", "64", "--width", "96",
                                                               "--guidance-scale", "4"]),
    # 124 frames (5 s at 24 fps, the shortest it makes: its own default), 8 x 8 latent, video + audio
    "minimax-h3": ("MiniMaxH3ModularPipeline", "t2v", "video", ["--height", "32", "--width", "32"]),
}


def _rooted(root, flags):
    """The flags with the saved root put in front of relative input paths."""
    out = []
    for f in flags:
        if f.endswith(".png"):
            f = str(root / f)
        elif "=" in f and not f.startswith("-"):
            name, _, path = f.partition("=")
            f = f"{name}={root / path}"
        out.append(f)
    return out


@pytest.mark.parametrize("folder", list(NEWER_MODEL_RUNS))
def test_generate_model_of_the_newer_families_matches_stock(saved_newer_family_pipelines, tmp_path, capsys, folder):
    """`lite-boost generate --model PATH` on a saved pipeline of each newer family: the family is read from the
    folder, image / frame inputs reach the pipeline (--image, --input NAME=PATH), and the boosted output equals
    stock's within 1e-5."""
    root = saved_newer_family_pipelines
    cls, kind, what, flags = NEWER_MODEL_RUNS[folder]
    size = [] if "--height" in flags else ["--height", "48", "--width", "80"]
    assert main(["generate", "--model", str(root / folder), *size, "--steps", "2", "--warmup", "0",
                 "--sparsity", "0", *_rooted(root, flags), "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"lite-boost generate: {kind}, {root / folder} ({cls}, the {folder} family)" in out, out[:400]
    diff = float(re.search(rf"max \|boosted - stock\| over the {what} \(values in \[0, 1\]\): (\S+)", out).group(1))
    assert diff <= 1e-5


def test_pipeline_inputs_are_checked_before_anything_runs(saved_newer_family_pipelines, no_launch):
    root = saved_newer_family_pipelines
    animate = ["generate", "--model", str(root / "wan-animate"), "--image", str(root / "image.png")]
    with pytest.raises(SystemExit, match=r"WanAnimatePipeline \(the wan-animate family\) needs pose_video, face_video; "
                                         r"pass --input pose_video=PATH --input face_video=PATH"):
        main(animate)
    with pytest.raises(SystemExit, match=r"--input bogus=\.\.\.: WanAnimatePipeline takes no argument 'bogus'; its "
                                         r"arguments: \[.*'face_video'.*'pose_video'"):
        main([*animate, "--input", f"bogus={root / 'pose'}"])
    with pytest.raises(SystemExit, match=r"--num-frames is for video pipelines; WanAnimatePipeline \(the wan-animate "
                                         r"family\) takes no num_frames"):
        main([*animate, "--num-frames", "5"])
    for value, fragment in ((f"prompt={root / 'pose'}", r"a pipeline argument that has no option of its own \(prompt "
                                                        r"has: --prompt\)"),
                            ("pose_video", r"--input must be NAME=PATH"),
                            (f"pose_video={root / 'nowhere'}", r"NAME=PATH with an existing image file")):
        with pytest.raises(SystemExit, match=fragment):
            main([*animate, "--input", value])


def test_generate_modular_minimax_h3_writes_its_soundtrack_equal_to_stock(saved_newer_family_pipelines, tmp_path,
                                                                          capsys):
    """A saved modular pipeline (modular_model_index.json, no model_index.json): the boosted video and audio equal
    the CLI's stock run <= 1e-5, and the soundtrack in the .wav next to the video is that of the in-memory pipeline
    the folder was saved from, run stock with diffusers (the same random prompt embeddings and seed)."""
    import wave

    import torch

    from lite_boost.demo import demo_minimax_h3_pipeline, minimax_h3_demo_prompt

    folder = saved_newer_family_pipelines / "minimax-h3"
    assert (folder / "modular_model_index.json").is_file() and not (folder / "model_index.json").exists()
    assert main(["generate", "--model", str(folder), "--height", "32", "--width", "32", "--steps", "2", "--warmup",
                 "0", "--seed", "3", "--output", str(tmp_path / "v.mp4")]) == 0
    out = capsys.readouterr().out
    assert "the minimax-h3 family), 32x32, 2 steps, cpu, float32" in out
    wav = Path(re.search(r"wrote (\S+\.wav) \[WAV, 32000 Hz", out).group(1))
    assert float(re.search(r"max \|boosted - stock\| over the audio \(samples in \[-1, 1\]\): (\S+)",
                           out).group(1)) <= 1e-5
    pipe = demo_minimax_h3_pipeline()  # what was saved, stock
    with torch.inference_mode():
        ref = pipe(**minimax_h3_demo_prompt(pipe, cfg=False, seed=3), height=32, width=32, num_inference_steps=2,
                   output_type="np", generator=torch.Generator().manual_seed(3), output="audio")[0]
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (2, 2, 32000)
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2).T / 32767
    assert pcm.shape == tuple(ref.shape) and ref.abs().max() > 0.01
    assert np.abs(pcm - ref.numpy().clip(-1, 1)).max() <= 1 / 32767  # 16-bit rounding


def test_modular_pipeline_arguments_are_checked_before_anything_runs(saved_newer_family_pipelines, no_launch,
                                                                     monkeypatch):
    """Its blocks' required inputs (read from the folder, no weights loaded) are named with their options; the
    outputs of the text-encoder step the folder lacks come from the family's prompt embeddings."""
    import lite_boost.cli as cli

    monkeypatch.setattr(cli, "load_modular", lambda *a, **k: pytest.fail("weights were loaded"))
    folder = saved_newer_family_pipelines / "minimax-h3"
    with pytest.raises(SystemExit, match=r"MiniMaxH3ModularPipeline \(the minimax-h3 family\) needs "
                                         r"num_inference_steps; pass --steps N"):
        main(["generate", "--model", str(folder)])
    with pytest.raises(SystemExit, match=r"--input bogus=\.\.\.: MiniMaxH3ModularPipeline takes no argument 'bogus'; "
                                         r"its arguments: \[.*'prompt_embeds'.*'text_token_tags'"):
        main(["generate", "--model", str(folder), "--steps", "2", "--input",
              f"bogus={saved_newer_family_pipelines / 'image.png'}"])
    with pytest.raises(SystemExit, match=r"--guidance-scale is not supported by MiniMaxH3ModularPipeline"):
        main(["generate", "--model", str(folder), "--steps", "2", "--guidance-scale", "3"])
    blocks, dropped = cli.modular_blocks(folder)
    assert list(dropped) == ["text_encoder"] and dropped["text_encoder"] == {"prompt_embeds", "text_token_tags"}
    names, required = cli.modular_parameters(blocks)
    assert sorted(required) == ["num_inference_steps", "prompt_embeds", "text_token_tags"]
    assert {"height", "width", "num_frames", "output_type"} <= names and "prompt" not in names


def test_write_audio_is_16_bit_pcm_interleaved(tmp_path):
    import wave

    from lite_boost.cli import write_audio

    sound = np.stack([np.linspace(-1.5, 1.5, 7), np.linspace(0.5, -0.5, 7)])[None]  # (1, 2, 7), clipped to [-1, 1]
    path = write_audio(sound, 16000, tmp_path / "a" / "s.wav")
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (2, 2, 16000, 7)
        pcm = np.frombuffer(w.readframes(7), dtype="<i2").reshape(7, 2)
    assert pcm[0].tolist() == [-32767, 16384] and pcm[-1].tolist() == [32767, -16384]
