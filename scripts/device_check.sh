#!/usr/bin/env bash
# One prepared accelerator check, under 10 minutes on one CUDA GPU:
#   1. lite-boost env (versions, devices, attention backends, operator library);
#   2. the CUDA-relevant tests (dispatch, RoPE, block-sparse kernels, quantization, Wan boost parity);
#   3. the dense dispatch choice (FA3 / FA2 if importable, else SDPA) and its output vs SDPA;
#   4. block-sparse FlexAttention vs SDPA at S = 32,760 (12 heads x 128, bf16);
#   5. the RoPE benchmark on the GPU (Wan2.1 480p grid);
#   6. Wan transformer parity on CUDA (boosted dense / sparse vs stock, fp32 and bf16);
#   7. FP8 vs bf16 on a stack of Wan-sized Linear layers (BoostConfig(quant="fp8")'s code path).
# Results go to $OUT (or outputs/device_check/): device_check.md plus each step's log.
#
#   bash scripts/device_check.sh            # on the GPU machine
#   bash scripts/device_check.sh --dry-run  # CPU, tiny sizes, tests only collected (the test suite runs this)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "${LITE_BOOST_VENV:-.venv}/bin/python" ]; then PY="${LITE_BOOST_VENV:-.venv}/bin/python"; else PY=python3; fi
fi
OUTDIR=${OUT:-outputs/device_check}
mkdir -p "$OUTDIR"
export OUT="$OUTDIR" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="${PYTHONPATH:-$PWD}"
: > "$OUTDIR/device_check.md"
status=0
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUTDIR/$name.log"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  echo "- step \`$name\`: rc=$rc, $((SECONDS - t0)) s" >> "$OUTDIR/steps.md"
  [ $rc -ne 0 ] && status=1
  return 0
}
: > "$OUTDIR/steps.md"
TESTS=(tests/test_attention.py tests/test_rope.py tests/test_rain_fusion.py tests/test_quant.py tests/test_wan_boost.py)
if [ $DRY -eq 1 ]; then
  LITE_BOOST_EXT=0 LITE_BOOST_REQUIRE_EXT=0 step env 120 "$PY" -m lite_boost.cli env  # no operator-library build in the dry run
  step tests 180 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}"
  for s in dispatch flex wan fp8; do step "$s" 300 "$PY" scripts/device_check.py "$s" --dry-run; done
  step rope 120 "$PY" benchmarks/bench_rope.py --grid 2,8,8 --repeats 1 --out "$OUTDIR/rope.md"
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible (try --dry-run)')" || exit 2
  step env 120 "$PY" -m lite_boost.cli env
  step tests 200 "$PY" -m pytest -q -p no:cacheprovider -x -n 0 -m "not slow" "${TESTS[@]}"
  step dispatch 60 "$PY" scripts/device_check.py dispatch
  step flex 150 "$PY" scripts/device_check.py flex
  step rope 60 "$PY" benchmarks/bench_rope.py --device cuda --repeats 5 --out "$OUTDIR/rope.md"
  step wan 90 "$PY" scripts/device_check.py wan
  step fp8 60 "$PY" scripts/device_check.py fp8
fi
cat "$OUTDIR/steps.md"
exit $status
