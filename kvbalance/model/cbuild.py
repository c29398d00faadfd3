"""Compile a small C source into a shared library on first use and load it with ctypes.

The native CPU kernels (``fused.py``, ``native.py``) are C sources kept in Python strings. Each is compiled once with the system C compiler and cached by the
hash of (source, flags, compiler, CPU) in ``$KVBALANCE_CACHE`` or ``~/.cache/kvbalance``, so a
``-march=native`` build is never loaded on another kind of CPU sharing the cache; the finished file
is moved into place atomically, so concurrent builders never load a half-written library.
``KVBALANCE_NATIVE=0`` disables every native kernel; without a compiler, or where the build fails,
:func:`load` returns None and callers run their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

DEFAULT_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-funroll-loops",
    "-fopenmp",
    "-fPIC",
    "-shared",
)


def native_enabled() -> bool:
    """False where ``KVBALANCE_NATIVE=0`` asks for the PyTorch paths only."""
    return os.environ.get("KVBALANCE_NATIVE", "1") != "0"


def cache_dir() -> Path:
    base = os.environ.get("KVBALANCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbalance")
    return Path(base) / "native"


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), where Linux tells."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(keep)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(
    name: str, source: str, flags: tuple[str, ...] = DEFAULT_FLAGS, remember_failure: bool = False
) -> Path | None:
    """The shared library of ``source`` compiled with ``flags`` (cached; see the module docstring), or None
    where native kernels are disabled, there is no compiler or the build fails. ``remember_failure``: a
    failed build leaves a ``.failed`` file beside where the library would be, and later calls (in any
    process) return None at once (for optional flags a compiler may not know, e.g. AMX)."""
    cc = compiler()
    if not native_enabled() or cc is None:
        return None
    key = "\0".join((source, " ".join(flags), cc, _cpu_signature()))
    out = cache_dir() / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    failed = out.with_suffix(".failed")
    try:
        if remember_failure and failed.exists():
            return None
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                src, so = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
                src.write_text(source)
                proc = subprocess.run([cc, *flags, str(src), "-o", str(so)], capture_output=True, text=True)
                if proc.returncode != 0:
                    if remember_failure:
                        failed.write_text(proc.stderr[-4000:])
                    return None
                os.replace(so, out)  # atomic: concurrent builders never load a half-written file
        return out
    except OSError:
        return None


def load(name: str, source: str, flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL | None:
    """:func:`build`'s library loaded with ctypes, or None where it cannot be built or loaded."""
    out = build(name, source, flags)
    if out is None:
        return None
    try:
        return ctypes.CDLL(str(out))
    except OSError:
        return None
