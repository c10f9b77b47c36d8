#!/usr/bin/env bash
# Create .venv, install lite-boost with its test (incl. torchao, for quantization), video and docs extras and build
# its C++ operator library.
# torch is installed first, pinned, so that no other requirement pulls a different (multi-GB) build.
# On a CUDA or Ascend machine set LITE_BOOST_TORCH to the torch you want (or "skip" to keep one
# already present in the interpreter used to create the venv with --system-site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LITE_BOOST_VENV:-.venv}
TORCH_SPEC=${LITE_BOOST_TORCH:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  if [ "$TORCH_SPEC" = "skip" ]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ "$TORCH_SPEC" != "skip" ]; then
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
"$VENV/bin/python" -m pip install -q -e ".[test,video,docs]"
# Compile the C++ operator library (csrc/) with this torch, ahead of first use. Without a compiler this
# only warns (the Python backends serve); with LITE_BOOST_REQUIRE_EXT=1 (CI) a failed build fails setup.
MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" -m lite_boost.ops._ext
"$VENV/bin/python" -c "import torch, diffusers, lite_boost; print('lite_boost', lite_boost.__version__, '| torch', torch.__version__, '| diffusers', diffusers.__version__)"
