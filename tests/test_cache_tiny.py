"""The documented caching examples do something on the built-in tiny model, and say so when they do not."""

import re

import torch

import lite_boost
from lite_boost.cli import main

SMALL = ["--height", "32", "--width", "48", "--num-frames", "5", "--warmup", "0"]


def test_documented_first_block_cache_example_reuses_steps_at_acceptable_psnr(tmp_path, capsys):
    # docs/guides/caching.md: `lite-boost generate --cache first_block_cache:threshold=0.2` on the tiny Wan
    assert main(["generate", *SMALL, "--steps", "10", "--cache", "first_block_cache:threshold=0.2",
                 "--output", str(tmp_path / "v.mp4")]) == 0
    out = capsys.readouterr().out
    reused, calls = map(int, re.search(r"- step cache: first_block_cache\(threshold=0\.2\): (\d+) of (\d+) transformer "
                                       r"calls reused", out).groups())
    assert calls == 20 and reused >= 6  # 10 steps x (cond, uncond); measured 12 on this model
    psnr = float(re.search(r"video PSNR boosted vs stock: (\S+) dB", out).group(1))
    assert 30.0 <= psnr < float("inf")  # an approximation (steps really reused), close to the stock video
    assert "speed-up: denoising loop" in out and "the loop figure is the one that counts" in out
    assert "the step cache reused nothing" not in out


def test_a_threshold_that_reuses_nothing_says_so_and_what_to_try(tmp_path, capsys):
    assert main(["generate", *SMALL, "--steps", "4", "--no-compare", "--cache", "first_block_cache:threshold=0.05",
                 "--output", str(tmp_path / "v.mp4")]) == 0
    out = capsys.readouterr().out
    assert "0 of 8 transformer calls reused" in out
    m = re.search(r"the step cache reused nothing .* ranged (\S+) - (\S+), median (\S+): a threshold near (\S+) "
                  r"reuses about half", out)
    lo, hi, mid, suggested = map(float, m.groups())
    assert 0.05 < lo <= mid <= hi and suggested >= mid  # every change was above 0.05; the hint is above the median


def test_mag_cache_calibration_prints_one_line_to_paste(capsys):
    from lite_boost.cache import count_block_work
    from lite_boost.config import CacheConfig
    from lite_boost.demo import DEMO_NEGATIVE_PROMPT, DEMO_PROMPT, DEMO_SPEC, tiny_wan_pipeline

    kw = dict(prompt=DEMO_PROMPT, negative_prompt=DEMO_NEGATIVE_PROMPT, height=32, width=48, num_frames=5,
              num_inference_steps=6, guidance_scale=5.0, output_type="latent")
    pipe = lite_boost.boost(tiny_wan_pipeline(spec=DEMO_SPEC), {"cache": "mag_cache:calibrate=true,num_inference_steps=6"})
    capsys.readouterr()
    with torch.inference_mode():
        pipe(**kw, generator=torch.Generator().manual_seed(0))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines  # diffusers' own print (a list per CFG branch) is replaced by one line
    assert lines[0].startswith("MagCache calibrated over 6 steps (mean of the cond / uncond branches); paste: ")
    spec = lines[0].split("paste: ")[1]
    cache = CacheConfig.parse(spec)  # what is printed parses as it stands
    assert cache.method == "mag_cache" and len(cache.params["mag_ratios"]) == 6
    assert spec == pipe.transformer._lite_boost.extras["cache"].mag_calibration.spec
    lite_boost.unboost(pipe)
    lite_boost.boost(pipe, {"cache": spec + ",threshold=0.5"})  # and, pasted, it skips steps
    with torch.inference_mode(), count_block_work([pipe.transformer]) as work:
        pipe(**kw, generator=torch.Generator().manual_seed(0))
    assert work.calls == 12 and work.ffn_runs < work.calls
