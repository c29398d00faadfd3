#!/usr/bin/env bash
# Mutation testing (mutmut 3, dev extra; not part of CI): kill ratio of the tests over kvcache/, scheduler/,
# perf/, theory/ and the server's abort path (server-abort). Configuration: pyproject.toml [tool.mutmut];
# equivalent mutants: benchmarks/results/mutation_equivalent.md. Figures go to benchmarks/results/mutation.json,
# the table with the commands and wall times to benchmarks/results/mutation.md.
#   bash scripts/mutation.sh                      # all five paths (over an hour on 2 busy cores)
#   bash scripts/mutation.sh kvcache scheduler    # some of them
#   bash scripts/mutation.sh --summary            # the table of the last run, no testing
#   bash scripts/mutation.sh --rerun-survivors    # after adding tests: retest only what survived
#   bash scripts/mutation.sh --survivors theory   # the diff of every surviving mutant (to triage)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/mutmut ] || { echo "mutmut missing: bash scripts/test.sh first (dev extra)" >&2; exit 1; }
case "${1:-}" in
  --summary) shift; exec .venv/bin/python benchmarks/mutation.py summary "$@" ;;
  --survivors) shift; exec .venv/bin/python benchmarks/mutation.py survivors "$@" ;;
  --rerun-survivors) shift; exec .venv/bin/python benchmarks/mutation.py rerun-survivors "$@" ;;
  *) exec .venv/bin/python benchmarks/mutation.py run "$@" ;;
esac
