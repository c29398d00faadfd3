"""Mutation testing of the KV cache, scheduler, cost model and queueing theory: the kill ratio per path.

Runs mutmut 3 (dev extra; configured in pyproject.toml ``[tool.mutmut]``: what is mutated and the focused
test selection) over the chosen paths, then reads mutmut's per-file results under ``mutants/`` and prints
killed / survived / timeout / suspicious / no-tests counts and the kill ratio per path and overall.
Equivalent mutants (no behaviour change) are listed, one per line with a reason, in
``benchmarks/results/mutation_equivalent.md`` and left out of the ratio's denominator:

    kill ratio = (killed + timeout) / (all checked - equivalent), "no tests" counted as not killed

mutmut resets its verdicts whenever its test selection changes; this script keeps the merged verdicts of
every run in ``mutants/merged-results.json`` (a killed mutant stays killed while its source file is
unchanged), so ``rerun-survivors`` after adding tests only retests what survived.

Usage (from the repository root; ``scripts/mutation.sh`` wraps it):

    .venv/bin/python benchmarks/mutation.py run [kvcache scheduler perf theory]   # mutate, test, summarise
    .venv/bin/python benchmarks/mutation.py summary                             # summarise the last run
    .venv/bin/python benchmarks/mutation.py survivors [PATH]                    # diffs of surviving mutants
    .venv/bin/python benchmarks/mutation.py rerun-survivors [PATH]              # retest survivors only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
EQUIVALENT = ROOT / "benchmarks" / "results" / "mutation_equivalent.md"
RESULT_JSON = ROOT / "benchmarks" / "results" / "mutation.json"
MERGED = MUTANTS / "merged-results.json"
MUTMUT = [str(ROOT / ".venv" / "bin" / "mutmut")]

# path name -> mutant-name glob (mutmut names a mutant by its dotted module and function)
PATHS = {
    "kvcache": "kvbalance.kvcache.*",
    "scheduler": "kvbalance.scheduler.*",
    "perf": "kvbalance.perf.*",
    "theory": "kvbalance.theory.*",
}

# mutmut's exit codes (mutmut/stats.py), folded into the columns printed here
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no_tests",
    33: "no_tests",
    34: "skipped",
    35: "suspicious",
}
STATUS.update({c: "timeout" for c in (36, -24, 24, 152, 255)})
STATUS.update({c: "segfault" for c in (-11, -9)})
STATUS[37] = "type_check"
COLUMNS = ("killed", "survived", "timeout", "suspicious", "no_tests", "equivalent", "not_checked")


def _last_run() -> dict[str, tuple[int | None, str]]:
    """Every mutant's exit code from mutmut's last run (``mutants/**/*.py.meta``; None = not checked yet),
    with a hash of the source file it mutates."""
    out: dict[str, tuple[int | None, str]] = {}
    for meta in sorted(MUTANTS.glob("kvbalance/**/*.py.meta")):
        source = ROOT / meta.relative_to(MUTANTS).with_suffix("")
        if not source.exists():
            continue  # a file moved or deleted since mutmut generated its mutants
        digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = (code, digest)
    return out


def merge_results() -> dict[str, int | None]:
    """Fold mutmut's last run into ``mutants/merged-results.json`` and return the merged exit codes.

    mutmut resets every verdict when its test selection changes; tests are only ever added between runs,
    so a mutant once killed stays killed (while its source file is unchanged: a changed file drops the
    old verdicts). Any other verdict is replaced by the newest checked one.
    """
    merged: dict[str, list] = json.loads(MERGED.read_text()) if MERGED.exists() else {}
    for name, (code, digest) in _last_run().items():
        old = merged.get(name)
        if old is not None and old[1] != digest:
            old = None
        if old is not None and STATUS.get(old[0]) in ("killed", "timeout"):
            continue
        if code is not None or old is None:
            merged[name] = [code, digest]
    if MUTANTS.exists():
        MERGED.write_text(json.dumps(merged, indent=0, sort_keys=True) + "\n")
    current = _last_run()
    return {name: code for name, (code, _) in merged.items() if name in current}


def load_results() -> dict[str, int | None]:
    return merge_results()


def load_equivalent() -> dict[str, str]:
    """Mutant name -> reason, from lines ``- `name`: reason`` of the equivalent-mutants file."""
    if not EQUIVALENT.exists():
        return {}
    pattern = re.compile(r"^- `([^`]+)`:?\s*(.*)$")
    return {m[1]: m[2] for line in EQUIVALENT.read_text().splitlines() if (m := pattern.match(line))}


def path_of(name: str) -> str | None:
    for path, glob in PATHS.items():
        if name.startswith(glob[:-1]):
            return path
    return None


def summarise(paths: list[str]) -> dict:
    results, equivalent = load_results(), load_equivalent()
    table: dict[str, Counter] = {p: Counter() for p in paths}
    for name, code in results.items():
        path = path_of(name)
        if path not in table:
            continue
        status = "not_checked" if code is None else STATUS.get(code, "suspicious")
        if name in equivalent and status == "survived":
            status = "equivalent"
        table[path][status] += 1
    table["overall"] = sum(table.values(), Counter())
    report = {}
    for path, c in table.items():
        denom = sum(c[k] for k in ("killed", "survived", "timeout", "suspicious", "segfault", "no_tests"))
        killed = c["killed"] + c["timeout"]
        report[path] = {**{k: c[k] for k in COLUMNS}, "ratio": killed / denom if denom else None}
    return report


def print_report(report: dict) -> None:
    head = f"{'path':<10}" + "".join(f"{k:>12}" for k in COLUMNS) + f"{'kill ratio':>12}"
    print(head)
    print("-" * len(head))
    for path, row in report.items():
        ratio = "-" if row["ratio"] is None else f"{100 * row['ratio']:.1f}%"
        print(f"{path:<10}" + "".join(f"{row[k]:>12}" for k in COLUMNS) + f"{ratio:>12}")
    print(
        "\nkill ratio = (killed + timeout) / (killed + survived + timeout + suspicious + no tests); equivalent excluded"
    )


def survivors(paths: list[str]) -> list[str]:
    equivalent = load_equivalent()
    return [
        n
        for n, code in load_results().items()
        if STATUS.get(code) in ("survived", "no_tests") and path_of(n) in paths and n not in equivalent
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "summary", "survivors", "rerun-survivors"])
    ap.add_argument("paths", nargs="*", help=f"paths to mutate, of {', '.join(PATHS)} (default: all)")
    ap.add_argument("--max-children", type=int, default=2, help="parallel mutant workers (default 2)")
    args = ap.parse_args(argv)
    paths = args.paths or list(PATHS)
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    if args.command == "run":
        # generate the mutants and collect test stats (mutmut stops there: the name matches nothing), then
        # test only what is not already killed in the merged results
        subprocess.run(
            [*MUTMUT, "run", "kvbalance.generate-only.*"], cwd=ROOT, capture_output=True, check=False
        )
        merged, fresh = merge_results(), _last_run()
        todo = [
            n for n in fresh if path_of(n) in paths and STATUS.get(merged.get(n)) not in ("killed", "timeout")
        ]
        print(f"{len(todo)} mutants to test ({len(fresh)} generated)", flush=True)
        if todo:
            cmd = [*MUTMUT, "run", "--max-children", str(args.max_children), *todo]
            subprocess.run(cmd, cwd=ROOT, check=False)
    elif args.command == "rerun-survivors":
        names = survivors(paths)
        if names:
            cmd = [*MUTMUT, "run", "--max-children", str(args.max_children), *names]
            subprocess.run(cmd, cwd=ROOT, check=False)
    elif args.command == "survivors":
        for name in survivors(paths):
            diff = subprocess.run([*MUTMUT, "show", name], cwd=ROOT, capture_output=True, text=True).stdout
            changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
            print(f"{name}\n    " + "\n    ".join(changed))
        return 0
    report = summarise(paths)
    print_report(report)
    RESULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULT_JSON.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULT_JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
