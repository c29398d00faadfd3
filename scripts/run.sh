#!/usr/bin/env bash
# Set up .venv with the light core (no torch) and run the default simulation
# (ShareGPT-like load on llama-2-7b / a100-80gb). Extra arguments go to `kvbalance simulate`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e .
exec .venv/bin/kvbalance simulate "$@"
