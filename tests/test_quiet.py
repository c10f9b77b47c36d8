"""Quiet runs: `import lite_boost`, a user script and the default `lite-boost generate` write no warning to stderr."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a tqdm progress bar segment (the pipelines' own progress bars are output, not warnings)
_BAR = re.compile(r"^\s*\d+%\|[^|]*\| \d+/\d+ \[[^\]]*\]\s*$")


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LITE_BOOST_SHOW_DEPENDENCY_NOTICES", None)
    proc = subprocess.run([sys.executable, "-W", "default", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _not_progress(stderr: str) -> list[str]:
    return [seg for seg in re.split(r"[\r\n]+", stderr) if seg.strip() and not _BAR.match(seg)]


def test_import_and_a_user_script_print_no_warning(tmp_path):
    script = (
        "import sys, lite_boost\n"
        "sys.stderr.write('--after import--\\n'); sys.stderr.flush()\n"
        "from lite_boost.demo import tiny_wan_pipeline, tiny_qwen_image_pipeline\n"
        # lite_boost's own notice on CPUs without int8 dot products (tests/test_quant.py) is not a dependency's
        "import warnings; from lite_boost.errors import PerformanceWarning\n"
        "warnings.simplefilter('ignore', PerformanceWarning)\n"
        "lite_boost.boost(tiny_wan_pipeline('i2v'))\n"  # diffusers, transformers' CLIP classes
        "lite_boost.boost(tiny_qwen_image_pipeline(), {'quant': 'int8_dynamic'})\n"  # torchao
    )
    proc = _run(["-c", script], tmp_path)
    before, after = proc.stderr.split("--after import--\n")
    assert before == ""  # `import lite_boost` alone: not a byte
    assert after == "", after  # building, boosting and quantizing: no dependency notice either


def test_the_filters_drop_only_their_notices():
    import enum
    import logging

    from lite_boost import _quiet

    _quiet.install()

    def passes(logger, msg, *args):
        rec = logging.getLogger(logger).makeRecord(logger, logging.WARNING, __file__, 1, msg, args, None)
        return logging.getLogger(logger).filter(rec)

    class TorchaoEnum(enum.Enum):
        A = 1

    TorchaoEnum.__module__ = "torchao.quantization.quant_primitives"

    class UserEnum(enum.Enum):
        A = 1

    enum_msg = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    assert not passes("torch.utils._pytree", enum_msg, TorchaoEnum)
    assert passes("torch.utils._pytree", enum_msg, UserEnum)  # a user's enum: still reported
    assert not passes("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    assert passes("torchao", "Skipping import of cpp extensions")
    assert not passes("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects. x")
    assert not passes("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision (not installed); "
                                                         "falling back to `CLIPImageProcessorPil` for ...")
    assert passes("transformers.utils.import_utils", "`X` requires torchvision")
    _quiet.uninstall()
    try:
        assert passes("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    finally:
        _quiet.install()


def test_default_generate_prints_no_warning(tmp_path):
    # the default job's features (block-sparse 0.8 on the tiny Wan, the C++ kernels) at a small shape
    proc = _run(["-m", "lite_boost.cli", "generate", "--steps", "2", "--height", "64", "--width", "128",
                 "--num-frames", "5"], tmp_path)
    assert _not_progress(proc.stderr) == []
    assert "self-attention: block-sparse rf_v2 at sparsity 0.8" in proc.stdout
    assert (tmp_path / "outputs").is_dir()
