"""Mutation testing of the KV cache, scheduler, cost model, queueing theory and the server's abort path: the kill
ratio per path and per file.

Runs mutmut 3 (dev extra; configured in pyproject.toml ``[tool.mutmut]``: what is mutated and the focused
test selection) over the chosen paths, then reads mutmut's per-file results under ``mutants/`` and prints
killed / survived / timeout / suspicious / no-tests counts and the kill ratio per path and overall.
Equivalent mutants (no behaviour change) are listed, one per line with a reason, in
``benchmarks/results/mutation_equivalent.md`` and left out of the ratio's denominator:

    kill ratio = (killed + timeout) / (all checked - equivalent), "no tests" counted as not killed

mutmut resets its verdicts whenever its test selection changes; this script keeps the merged verdicts of
every run in ``mutants/merged-results.json`` (a killed mutant stays killed while its source file is
unchanged), so ``rerun-survivors`` after adding tests only retests what survived. Files listed in ``EXCLUDED``
are mutated but not tested (their tests are too slow to run per mutant); the summary reports the ratio both
over what ran and with their mutants counted as survivors.

Usage (from the repository root; ``scripts/mutation.sh`` wraps it):

    .venv/bin/python benchmarks/mutation.py run [kvcache scheduler perf theory server-abort]  # mutate, test
    .venv/bin/python benchmarks/mutation.py summary                             # summarise the last run
    .venv/bin/python benchmarks/mutation.py survivors [PATH]                    # diffs of surviving mutants
    .venv/bin/python benchmarks/mutation.py rerun-survivors [PATH]              # retest survivors only
"""

from __future__ import annotations

import argparse
import ast
import difflib
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

# path name -> mutant-name prefixes (mutmut names a mutant by its dotted module and function)
_ABORT = "kvbalance.server."
PATHS = {
    "kvcache": ("kvbalance.kvcache.",),
    "scheduler": ("kvbalance.scheduler.",),
    "perf": ("kvbalance.perf.",),
    "theory": ("kvbalance.theory.",),
    # the server's abort path: a client disconnect (or a dropped generator, or shutdown) to the engine's abort
    "server-abort": (
        _ABORT + "streaming.xǁChoicesǁnext__",
        _ABORT + "streaming.xǁChoicesǁ_client_gone__",
        _ABORT + "streaming.xǁChoicesǁabort__",
        _ABORT + "streaming.xǁChoicesǁcollect__",
        _ABORT + "streaming.x_sse_response__",
        _ABORT + "streams.xǁRequestStreamǁabort__",
        _ABORT + "async_engine.xǁAsyncEngineǁabort__",
        _ABORT + "async_engine.xǁAsyncEngineǁgenerate__",
        _ABORT + "engine_thread.xǁEngineThreadǁ_apply__",
        _ABORT + "engine_thread.xǁEngineThreadǁ_abort_now__",
        "kvbalance.llm.engine.xǁLLMEngineǁabort__",
    ),
}

# files whose mutants are generated but not tested, with the reason; counted as survivors in the
# "with excluded" ratio so that no denominator is hidden
EXCLUDED = {
    "kvbalance.perf.fit_gpu.": "the GPU fitter: its tests (tests/test_calibrate.py) take ~50 s per run",
    "kvbalance.perf.fit_report.": "report and plot writer of the fitter, tested only through tests/test_calibrate.py",
    "kvbalance.perf.fit_cv.": "the fitter's cross-validation (refits per held-out point/model): tests/test_calibrate.py, ~50 s",
    "kvbalance.perf.fit_host.": "the fitter's host-time and link fits, run inside the GPU fit: tests/test_calibrate.py",
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
COLUMNS = ("killed", "survived", "timeout", "suspicious", "no_tests", "equivalent", "excluded", "not_checked")


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
    for path, prefixes in PATHS.items():
        if name.startswith(prefixes):
            return path
    return None


def excluded(name: str) -> bool:
    return name.startswith(tuple(EXCLUDED))


def _status(name: str, code: int | None, equivalent: dict[str, str]) -> str:
    status = "not_checked" if code is None else STATUS.get(code, "suspicious")
    if name in equivalent and status in ("survived", "no_tests"):
        return "equivalent"
    if excluded(name) and status not in ("killed", "timeout"):
        return "excluded"
    return status


def _row(c: Counter) -> dict:
    """Counts and both ratios: of what ran, and with the excluded mutants counted as survivors."""
    denom = sum(c[k] for k in ("killed", "survived", "timeout", "suspicious", "segfault", "no_tests"))
    killed = c["killed"] + c["timeout"]
    full = denom + c["excluded"]
    return {
        **{k: c[k] for k in COLUMNS},
        "ratio": killed / denom if denom else None,
        "ratio_with_excluded": killed / full if full else None,
    }


def summarise(paths: list[str]) -> dict:
    """``{"paths": {path: row}, "files": {module: row}}``, rows as ``_row``; "overall" sums the paths."""
    results, equivalent = load_results(), load_equivalent()
    table: dict[str, Counter] = {p: Counter() for p in paths}
    files: dict[str, Counter] = {}
    for name, code in results.items():
        path = path_of(name)
        if path not in table:
            continue
        status = _status(name, code, equivalent)
        table[path][status] += 1
        files.setdefault(name.rpartition(".")[0], Counter())[status] += 1
    table["overall"] = sum(table.values(), Counter())
    return {
        "paths": {path: _row(c) for path, c in table.items()},
        "files": {module: _row(c) for module, c in sorted(files.items())},
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_report(report: dict) -> None:
    for title, rows in (("path", report["paths"]), ("file", report["files"])):
        head = f"{title:<34}" + "".join(f"{k:>12}" for k in COLUMNS) + f"{'ratio':>9}{'w/ excl':>9}"
        print(head)
        print("-" * len(head))
        for key, row in rows.items():
            counts = "".join(f"{row[k]:>12}" for k in COLUMNS)
            print(f"{key:<34}{counts}{_pct(row['ratio']):>9}{_pct(row['ratio_with_excluded']):>9}")
        print()
    print(
        "ratio = (killed + timeout) / (killed + survived + timeout + suspicious + no tests); equivalent left out;"
        " w/ excl also counts the excluded files' mutants as survivors"
    )


def survivors(paths: list[str]) -> list[str]:
    equivalent = load_equivalent()
    return [
        n
        for n, code in load_results().items()
        if STATUS.get(code) in ("survived", "no_tests")
        and path_of(n) in paths
        and n not in equivalent
        and not excluded(n)
    ]


def _functions(path: Path) -> dict[str, str]:
    """Source of every function in one generated mutants/ file, by name (methods included)."""
    text = path.read_text()
    lines = text.splitlines()
    return {
        node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


_SOURCES: dict[Path, dict[str, str]] = {}


def mutant_diff(name: str) -> list[str]:
    """The changed lines of one mutant against its original function, read from mutants/ directly (what
    ``mutmut show`` prints, without starting mutmut once per mutant)."""
    module, _, func = name.rpartition(".")  # kvbalance.theory.area . x_prefill_area__mutmut_3
    path = MUTANTS / (module.replace(".", "/") + ".py")
    if path not in _SOURCES:
        _SOURCES[path] = _functions(path)
    funcs = _SOURCES[path]
    orig = funcs.get(func.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "")
    mutant = funcs.get(func, "")
    lines = difflib.unified_diff(orig.splitlines()[1:], mutant.splitlines()[1:], lineterm="", n=0)
    return [ln for ln in lines if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]


def forget_plain_copies() -> None:
    """Delete mutants/ copies of ``only_mutate`` files that hold no mutants (copied before the file was
    added to ``only_mutate``): mutmut keeps a copy newer than its source, so it would never mutate it."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    for pattern in config.get("only_mutate", []):
        for source in ROOT.glob(pattern):
            copy = MUTANTS / source.relative_to(ROOT)
            if copy.is_file() and not copy.with_name(copy.name + ".meta").exists() and source.suffix == ".py":
                copy.unlink()


def sync_package_data() -> None:
    """Copy the package's data files (e.g. the fitted presets, ``perf/fits/*.json``) into mutants/: mutmut
    copies them once and never refreshes them, so tests would read stale presets after a refit."""
    import shutil

    for source in (ROOT / "kvbalance").rglob("*"):
        if source.is_file() and source.suffix not in (".py", ".pyc"):
            copy = MUTANTS / source.relative_to(ROOT)
            if copy.parent.is_dir() and (not copy.exists() or copy.read_bytes() != source.read_bytes()):
                shutil.copy2(source, copy)


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
        forget_plain_copies()
        sync_package_data()
        subprocess.run(
            [*MUTMUT, "run", "kvbalance.generate-only.*"], cwd=ROOT, capture_output=True, check=False
        )
        merged, fresh = merge_results(), _last_run()
        todo = [
            n
            for n in fresh
            if path_of(n) in paths
            and not excluded(n)
            and STATUS.get(merged.get(n)) not in ("killed", "timeout")
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
            print(f"{name}\n    " + "\n    ".join(mutant_diff(name)))
        return 0
    report = summarise(paths)
    print_report(report)
    RESULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULT_JSON.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULT_JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
