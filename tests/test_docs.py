"""The README and docs stay true: every ``kvbalance`` command in their fenced ``bash`` blocks runs.

Commands are extracted from README.md and docs/*.md. Quick ones run in the default suite (outputs redirected
under a temporary folder); the few that need a server, the real model or minutes of CPU are listed in
``NOT_QUICK`` with the reason, and run (where they can) under ``-m slow``. A command in the docs that is
neither quick nor listed fails the test, so the list cannot silently go stale.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# command prefix -> why it is not run in the default suite ("slow": run under -m slow; else: never run here)
NOT_QUICK = {
    "kvbalance serve": "starts a long-running server (tests/test_server.py serves the same app)",
    "kvbalance bench": "needs a running server (tests/test_bench.py runs it against one)",
    "kvbalance offline run examples/batch_input.jsonl --output": "slow",  # the real SmolLM2 engine
    "kvbalance calibrate": "writes the committed preset file (tests/test_calibrate.py fits the same profiles)",
    "kvbalance reproduce": "slow",  # minutes per experiment, even in --quick mode
}
# placeholders that docs use in generic usage lines (not meant to be run as written)
PLACEHOLDER = re.compile(r"\b(CONFIG|JOB|INPUT|OUT|DIR|KEY|NAME|ADDR|FILE)\b|\[|\]|\|")


def _commands(path: Path) -> list[str]:
    """``kvbalance ...`` lines of the fenced bash blocks in ``path`` (comments and continuations joined)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            line = re.sub(r"^\.venv/bin/", "", line)
            if line.startswith("kvbalance ") and not PLACEHOLDER.search(line):
                out.append(line)
    return out


ALL = [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in _commands(p)]


def _reason(cmd: str) -> str | None:
    for prefix, why in NOT_QUICK.items():
        if cmd.startswith(prefix):
            return why
    return None


def _run(cmd: str, tmp_path: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd.replace("runs/", f"{tmp_path}/runs/"))
    if not any(a.startswith("--out") or a == "--output" for a in argv) and argv[1] == "simulate":
        argv += ["--out", str(tmp_path / "out")]
    if argv[1] == "simulate":
        argv.append("--no-progress")
    exe = Path(sys.executable).with_name("kvbalance")
    return subprocess.run([str(exe), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_docs_have_commands_to_check():
    assert len(ALL) >= 8, ALL
    assert any(f == "README.md" for f, _ in ALL)


@pytest.mark.parametrize(("doc", "cmd"), [a for a in ALL if _reason(a[1]) is None], ids=lambda x: str(x)[:60])
def test_quick_command_runs(doc, cmd, tmp_path):
    r = _run(cmd, tmp_path)
    assert r.returncode == 0, f"{doc}: `{cmd}` exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("doc", "cmd"), [a for a in ALL if _reason(a[1]) == "slow"], ids=lambda x: str(x)[:60]
)
def test_slow_command_runs(doc, cmd, tmp_path):
    r = _run(cmd, tmp_path)
    assert r.returncode == 0, f"{doc}: `{cmd}` exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def test_every_listed_exception_still_names_a_command():
    """A NOT_QUICK entry whose command left the docs is stale: remove it."""
    for prefix in NOT_QUICK:
        assert any(c.startswith(prefix) for _, c in ALL), f"no command in the docs starts with {prefix!r}"


def test_readme_is_a_user_guide():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 160, f"README.md has {n} lines: measurements belong in docs/"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which does not exist"
