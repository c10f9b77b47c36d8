#!/usr/bin/env bash
# Run the whole test suite (installs into .venv first if it is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LITE_BOOST_VENV:-.venv}
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
