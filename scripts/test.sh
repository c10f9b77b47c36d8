#!/usr/bin/env bash
# Run the test suite (installs into .venv first if it is missing).
# With no test paths among the arguments it runs all of tests/; `bash scripts/test.sh tests/test_x.py -k y`
# runs only what is named.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LITE_BOOST_VENV:-.venv}
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
targets=(tests)
for arg in "$@"; do
    case "$arg" in
        tests|tests/*|./tests/*) targets=(); break ;;
    esac
done
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" "${targets[@]}"
