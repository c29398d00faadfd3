"""Request-trace loaders: Mooncake JSONL, Azure LLM inference CSV, vLLM ShareGPT lengths CSV, generic CSV/JSONL.

Every loader returns one ``TraceRecord`` per data line, in file order. A malformed line raises
``ValueError("PATH:LINE: <what is wrong, naming the field>")``; nothing is skipped except blank lines.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_FORMATS = ("auto", "mooncake", "azure", "sharegpt", "csv", "jsonl")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace. ``arrival_s`` is None where the trace has no times (ShareGPT lengths)."""

    arrival_s: float | None
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


class _Line:
    """Error context for one line of one file."""

    __slots__ = ("path", "lineno")

    def __init__(self, path: Path, lineno: int) -> None:
        self.path = path
        self.lineno = lineno

    def error(self, what: str) -> ValueError:
        return ValueError(f"{self.path}:{self.lineno}: {what}")

    def int_field(self, name: str, raw: Any, minimum: int) -> int:
        value: int | None = None
        if isinstance(raw, bool):
            value = None
        elif isinstance(raw, int):
            value = raw
        elif isinstance(raw, float) and raw.is_integer():
            value = int(raw)
        elif isinstance(raw, str):
            try:
                value = int(raw)
            except ValueError:
                value = None
        if value is None:
            raise self.error(f"{name}: expected an integer, got {raw!r}")
        if value < minimum:
            raise self.error(f"{name}: must be >= {minimum}, got {value}")
        return value

    def seconds_field(self, name: str, raw: Any, scale: float = 1.0) -> float:
        try:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw.strip() if isinstance(raw, str) else raw) * scale
        except (TypeError, ValueError):
            raise self.error(f"{name}: expected a number, got {raw!r}") from None
        if not math.isfinite(value) or value < 0:
            raise self.error(f"{name}: must be a finite time >= 0, got {raw!r}")
        return value

    def hash_ids_field(self, name: str, raw: Any) -> tuple[int, ...]:
        if isinstance(raw, str):
            raw = raw.replace(";", " ").split()
        if not isinstance(raw, list):
            raise self.error(f"{name}: expected a list of integers, got {raw!r}")
        if all(type(h) is int for h in raw) and (not raw or min(raw) >= 0):
            return tuple(raw)  # the common case, checked in one pass
        return tuple(self.int_field(f"{name}[{i}]", h, 0) for i, h in enumerate(raw))


def _jsonl_objects(path: Path):
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            line = _Line(path, lineno)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise line.error(f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise line.error(f"expected a JSON object, got {type(obj).__name__}")
            yield line, obj


def _csv_rows(path: Path, required: tuple[str, ...]):
    """Yields (line, row dict) for each non-blank data row; checks the header has ``required`` columns."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header: list[str] | None = None
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            if header is None:
                header = [c.strip() for c in row]
                missing = [c for c in required if c not in header]
                if missing:
                    raise _Line(path, reader.line_num).error(
                        f"{missing[0]}: missing column in header {header}"
                    )
                continue
            line = _Line(path, reader.line_num)
            if len(row) != len(header):
                raise line.error(f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
            yield line, dict(zip(header, row))
        if header is None:
            raise _Line(path, 1).error(f"empty file: expected a header with columns {', '.join(required)}")


def _get(line: _Line, obj: dict, name: str) -> Any:
    if name not in obj:
        raise line.error(f"{name}: missing field")
    return obj[name]


def load_mooncake(path: str | Path) -> list[TraceRecord]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, optional ``hash_ids``
    (512-token block identities; a line without them shares no prefix)."""
    path = Path(path)
    out = []
    for line, obj in _jsonl_objects(path):
        arrival = line.seconds_field("timestamp", _get(line, obj, "timestamp"), 1e-3)
        inp = line.int_field("input_length", _get(line, obj, "input_length"), 1)
        outp = line.int_field("output_length", _get(line, obj, "output_length"), 0)
        raw_hashes = obj.get("hash_ids")
        hashes = None if raw_hashes is None else line.hash_ids_field("hash_ids", raw_hashes)
        out.append(TraceRecord(arrival, inp, outp, hashes))
    return out


_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(?:Z|\+00:?00)?")


def _parse_azure_time(line: _Line, raw: str) -> tuple[int, float]:
    """'2023-11-16 18:15:46.6805900' -> (whole seconds since 0001-01-01, fraction of a second)."""
    m = _AZURE_TIME.fullmatch(raw.strip())
    if m is None:
        raise line.error(f"TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS[.fffffff]', got {raw!r}")
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        days = _dt.date(y, mo, d).toordinal()
    except ValueError as e:
        raise line.error(f"TIMESTAMP: {e} in {raw!r}") from None
    if h > 23 or mi > 59 or s > 60:
        raise line.error(f"TIMESTAMP: time of day out of range in {raw!r}")
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    return days * 86400 + h * 3600 + mi * 60 + s, frac


def load_azure(path: str | Path) -> list[TraceRecord]:
    """Azure LLM inference trace CSV: ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``.

    Arrival is seconds since the earliest row (the first row, in the published files, which are sorted).
    """
    path = Path(path)
    rows = []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        whole, frac = _parse_azure_time(line, row["TIMESTAMP"])
        inp = line.int_field("ContextTokens", row["ContextTokens"], 1)
        outp = line.int_field("GeneratedTokens", row["GeneratedTokens"], 0)
        rows.append((whole, frac, inp, outp))
    if not rows:
        return []
    w0, f0 = min((w, f) for w, f, _, _ in rows)
    return [TraceRecord((w - w0) + (f - f0), i, o) for w, f, i, o in rows]


def load_sharegpt_lengths(path: str | Path) -> list[TraceRecord]:
    """The vLLM artifact's ShareGPT lengths CSV: ``input_len,output_len`` with no arrival times."""
    path = Path(path)
    return [
        TraceRecord(
            None,
            line.int_field("input_len", row["input_len"], 1),
            line.int_field("output_len", row["output_len"], 0),
        )
        for line, row in _csv_rows(path, ("input_len", "output_len"))
    ]


def _generic_record(line: _Line, obj: dict) -> TraceRecord:
    if "arrival_s" in obj:
        arrival: float | None = line.seconds_field("arrival_s", obj["arrival_s"])
    elif "timestamp" in obj:
        arrival = line.seconds_field("timestamp", obj["timestamp"])
    else:
        arrival = None
    inp = line.int_field("input_len", _get(line, obj, "input_len"), 1)
    outp = line.int_field("output_len", _get(line, obj, "output_len"), 0)
    raw_hashes = obj.get("hash_ids")
    hashes = None if raw_hashes in (None, "") else line.hash_ids_field("hash_ids", raw_hashes)
    return TraceRecord(arrival, inp, outp, hashes)


def load_generic(path: str | Path) -> list[TraceRecord]:
    """CSV (header row) or JSONL with ``arrival_s`` (or ``timestamp``, seconds; optional), ``input_len``,
    ``output_len`` and optional ``hash_ids`` (a JSON list, or space-separated ints in CSV).

    Either every record has an arrival time or none has.
    """
    path = Path(path)
    if _is_jsonl(path):
        records = [_generic_record(line, obj) for line, obj in _jsonl_objects(path)]
    else:
        records = [_generic_record(line, row) for line, row in _csv_rows(path, ("input_len", "output_len"))]
    timed = [r.arrival_s is not None for r in records]
    if any(timed) and not all(timed):
        raise ValueError(f"{path}: arrival_s: some records have an arrival time and some do not")
    return records


def _is_jsonl(path: Path) -> bool:
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return True
    if path.suffix.lower() in (".csv", ".tsv"):
        return False
    with open(path, encoding="utf-8") as f:
        for text in f:
            if text.strip():
                return text.lstrip().startswith("{")
    return False


def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRecord]:
    """Load ``path`` in format ``fmt`` (one of TRACE_FORMATS); ``auto`` looks at the header / first object."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: trace file {path} does not exist")
    if fmt == "auto":
        fmt = _detect(path)
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "azure":
        return load_azure(path)
    if fmt == "sharegpt":
        return load_sharegpt_lengths(path)
    if fmt in ("csv", "jsonl"):
        return load_generic(path)
    raise ValueError(f"fmt: unknown trace format {fmt!r}; expected one of {', '.join(TRACE_FORMATS)}")


def _detect(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        first = next((t for t in f if t.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            return "jsonl"  # load_generic reports the line
        return "mooncake" if isinstance(obj, dict) and "input_length" in obj else "jsonl"
    header = [c.strip() for c in first.split(",")]
    if "ContextTokens" in header:
        return "azure"
    return "csv"
