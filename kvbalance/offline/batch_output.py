"""The Batch output file, written so that a run can crash anywhere and resume without loss or duplicates.

While a job runs, each finished request is appended to a side file ``OUT.jsonl.partial`` as one complete
line ``{"i": index, "crc": crc32, "record": {...}}`` and fsync'd; its first line names the input (sha256)
and the model, so a journal is never trusted for another job. On resume every journal line is checked
(JSON, checksum, index in range, custom_id matching the input line, not seen before): the first bad line
(a write torn by a crash) and everything after it are cut off and redone. When every input line is
answered, ``OUT.jsonl`` is written in input order to a temporary file, fsync'd and renamed over the
output (atomic), then the journal is removed. A complete ``OUT.jsonl`` is checked against the input and
left as it is.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvbalance.offline.batch_io import BatchInput

JOURNAL_SUFFIX = ".partial"
JOURNAL_VERSION = 1


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _crc(record: dict) -> int:
    return zlib.crc32(_dumps(record).encode())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ResumeState:
    """What an earlier run left: records by input index, and what had to be thrown away."""

    done: dict[int, dict]
    complete: bool = False  # OUT.jsonl already holds the whole job
    dropped_lines: int = 0  # torn or invalid journal lines cut off (their requests are redone)


class BatchOutput:
    """The output of one job over ``inp``: journal while running, atomic final file, checked resume."""

    def __init__(self, path: str | Path, inp: BatchInput, fingerprint: dict) -> None:
        self.path = Path(path)
        self.journal_path = self.path.with_name(self.path.name + JOURNAL_SUFFIX)
        self.inp = inp
        self.header = {"kvbalance_batch_journal": JOURNAL_VERSION, "input_sha256": inp.sha256, **fingerprint}
        self._fh = None

    # -- resume -----------------------------------------------------------------------------------
    def open(self) -> ResumeState:
        """Check what is on disk and get ready to append; raises ValueError naming ``output`` if unusable."""
        if Path(self.inp.path).resolve() == self.path.resolve():
            raise ValueError(f"output: {self.path} is the input file")
        if self.path.exists() and not self.journal_path.exists():
            done = self._read_final()
            return ResumeState(done, complete=True)
        if self.journal_path.exists() and b"\n" in self.journal_path.read_bytes()[:65536]:
            state = self._read_journal()
        else:  # no journal, or one whose header line was torn: start it afresh
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.journal_path, "w", encoding="utf-8") as fh:
                fh.write(_dumps(self.header) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(self.journal_path.parent)
            state = ResumeState({})
        self._fh = open(self.journal_path, "a", encoding="utf-8")
        return state

    def _expected_custom_id(self, index: int) -> str | None:
        return self.inp.items[index].custom_id

    def _read_final(self) -> dict[int, dict]:
        n = len(self.inp.items)
        lines = self.path.read_text(encoding="utf-8").splitlines()
        problem = None
        if len(lines) != n:
            problem = f"has {len(lines)} lines for {n} input requests"
        done: dict[int, dict] = {}
        for i, text in enumerate(lines[:n] if problem is None else ()):
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                problem = f"line {i + 1} is not valid JSON"
                break
            if not isinstance(rec, dict) or rec.get("custom_id") != self._expected_custom_id(i):
                problem = f"line {i + 1} does not answer input request {i + 1}"
                break
            done[i] = rec
        if problem is not None:
            raise ValueError(
                f"output: {self.path} exists and is not a complete output of {self.inp.path} ({problem}); "
                "remove it or choose another --output"
            )
        return done

    def _read_journal(self) -> ResumeState:
        with open(self.journal_path, "rb") as fh:
            data = fh.read()
        lines = data.split(b"\n")
        try:
            header = json.loads(lines[0])
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
        if header != self.header:
            raise ValueError(
                f"output: {self.journal_path} was written for another job (input or model differ: "
                f"{header} vs {self.header}); remove it to start over"
            )
        done: dict[int, dict] = {}
        offset = len(lines[0]) + 1
        body = lines[1:]
        for k, raw in enumerate(body):
            last = k == len(body) - 1
            if last and raw == b"":
                break  # the file ends with a complete line
            rec = None if last else self._check_entry(raw, done)  # a last line without "\n" is torn
            if rec is None:
                dropped = sum(1 for r in body[k:] if r)
                with open(self.journal_path, "r+b") as fh:
                    fh.truncate(offset)
                    fh.flush()
                    os.fsync(fh.fileno())
                return ResumeState(done, dropped_lines=dropped)
            index, record = rec
            done[index] = record
            offset += len(raw) + 1
        return ResumeState(done)

    def _check_entry(self, raw: bytes, done: dict[int, dict]) -> tuple[int, dict] | None:
        try:
            entry = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(entry, dict) or set(entry) != {"i", "crc", "record"}:
            return None
        index, record = entry["i"], entry["record"]
        if not isinstance(index, int) or not 0 <= index < len(self.inp.items) or index in done:
            return None
        if not isinstance(record, dict) or entry["crc"] != _crc(record):
            return None
        if record.get("custom_id") != self._expected_custom_id(index):
            return None
        return index, record

    # -- writing ------------------------------------------------------------------------------------
    def append(self, records: Iterable[tuple[int, dict]]) -> None:
        """Journal finished requests: whole lines, flushed and fsync'd before this returns."""
        if self._fh is None:
            raise RuntimeError("BatchOutput.append before open()")
        text = "".join(_dumps({"i": i, "crc": _crc(r), "record": r}) + "\n" for i, r in records)
        if text:
            self._fh.write(text)
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def finalize(self, records: dict[int, dict]) -> None:
        """Write every record in input order to OUT.jsonl atomically and drop the journal."""
        n = len(self.inp.items)
        missing = [i for i in range(n) if i not in records]
        if missing:
            raise RuntimeError(
                f"finalize: {len(missing)} input request(s) have no output (first: {missing[0]})"
            )
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for i in range(n):
                fh.write(_dumps(records[i]) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.journal_path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
