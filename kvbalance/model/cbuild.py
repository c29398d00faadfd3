"""Compile the native CPU kernels (the C files in ``kvbalance/native/``) on first use and load them with ctypes.

One build path for every kernel: :func:`build` runs the system C compiler over a kernel's ``.c`` files (with
the headers beside them) into a shared library, cached by the hash of (sources, headers, flags, compiler,
CPU) in ``$KVBALANCE_CACHE`` or ``~/.cache/kvbalance``, so a ``-march=native`` build is never loaded on
another kind of CPU sharing the cache; the finished file is moved into place atomically, so concurrent
builders never load a half-written library. Every build is ``-Wall -Werror`` (:data:`WARNING_FLAGS`).

Why at first use and not as setuptools extensions at install: the kernels are compiled per shape (the
decode-attention kernel keeps a GQA group's queries in registers, so GROUP and the head dim are compile-time
constants, and a model's shape is known only when it loads) and for the CPU at hand (``-march=native``: the
same wheel serves an AVX2 laptop and an AMX server); they are loaded with ctypes, so the package stays one
pure-Python wheel with no Python-ABI build. The ``.c`` and ``.h`` files ship as package data.

``KVBALANCE_NATIVE=0`` disables every native kernel (no warning: asked for). Without a compiler, or where a
build fails, :func:`build` returns None, logs one warning naming the kernel and what runs instead, and
callers run their fallback (PyTorch, oneDNN or MKL through torch). :func:`compile_for` builds a kernel for a
named instruction-set level (:data:`TARGETS`) instead of this CPU: the test that compiles every variant on
any x86-64 machine uses it (compiling needs only the compiler's target flags, not the CPU).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"

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
# Every build: warnings are errors. -Wno-psabi: GCC warns that a 64-byte vector argument or return value
# has a different ABI without AVX-512; the kernels pass vectors only to static inline functions, which
# never cross an ABI boundary.
WARNING_FLAGS = ("-Wall", "-Werror", "-Wno-psabi")

# Instruction-set levels of the kernels -> the -march a cross-compile builds for (GCC >= 11, Clang >= 12).
TARGETS = {
    "portable": "x86-64",
    "avx2": "haswell",
    "avx512f": "skylake-avx512",
    "avx512bf16": "cooperlake",
    "amx": "sapphirerapids",
}

_warned: set[str] = set()


def native_enabled() -> bool:
    """False where ``KVBALANCE_NATIVE=0`` asks for the PyTorch paths only."""
    return os.environ.get("KVBALANCE_NATIVE", "1") != "0"


def cache_dir() -> Path:
    base = os.environ.get("KVBALANCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbalance")
    return Path(base) / "native"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), where Linux tells."""
    keep = [ln for ln in _cpuinfo() if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(keep)


def cpu_has(*features: str) -> bool:
    """Whether this CPU lists every one of ``features`` (``/proc/cpuinfo`` names: ``avx2``, ``avx512_bf16``,
    ``amx_bf16``, ...). True where the flags cannot be read (then the build and the kernel's own cpuid
    probe decide)."""
    flags = next((ln.split(":", 1)[1].split() for ln in _cpuinfo() if ln.startswith("flags")), None)
    return flags is None or all(f in flags for f in features)


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def source_paths(sources: tuple[str, ...]) -> list[Path]:
    """The kernel files ``sources`` (names in ``kvbalance/native/``), checked to exist."""
    paths = [NATIVE_DIR / s for s in sources]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"sources: no kernel file {p}")
    return paths


def _key(paths: list[Path], flags: tuple[str, ...], cc: str) -> str:
    h = hashlib.sha256()
    headers = sorted(NATIVE_DIR.glob("*.h"))
    for p in [*paths, *headers]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join((" ".join(flags), cc, _cpu_signature())).encode())
    return h.hexdigest()[:16]


def _command(cc: str, paths: list[Path], flags: tuple[str, ...], out: Path) -> list[str]:
    return [cc, *flags, *WARNING_FLAGS, f"-I{NATIVE_DIR}", *map(str, paths), "-o", str(out)]


def _warn_once(name: str, why: str, fallback: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("native kernel %s is not available (%s); %s runs instead", name, why, fallback)


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln]
    return (errors or lines or ["no output"])[0][:300]


def build(
    name: str,
    sources: tuple[str, ...],
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    fallback: str = "the PyTorch path",
    remember_failure: bool = False,
) -> Path | None:
    """The shared library of the kernel files ``sources`` compiled with ``flags`` (cached; see the module
    docstring), or None where native kernels are disabled, there is no compiler or the build fails; the
    last two log one warning (per ``name`` and process) that names the kernel and ``fallback``, what runs
    instead. ``remember_failure``: a failed build leaves a ``.failed`` file (the compiler's output) beside
    where the library would be, and later calls (in any process) return None without compiling again."""
    if not native_enabled():
        return None
    cc = compiler()
    if cc is None:
        _warn_once(name, "no C compiler: set CC or install gcc", fallback)
        return None
    paths = source_paths(sources)
    try:
        out = cache_dir() / f"{name}_{_key(paths, flags, cc)}.so"
        failed = out.with_suffix(".failed")
        if remember_failure and failed.exists():
            _warn_once(name, f"an earlier build failed, see {failed}", fallback)
            return None
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                so = Path(tmp) / f"{name}.so"
                proc = subprocess.run(_command(cc, paths, flags, so), capture_output=True, text=True)
                if proc.returncode != 0:
                    if remember_failure:
                        failed.write_text(proc.stderr[-8000:])
                    _warn_once(name, f"the C build failed: {_first_error(proc.stderr)}", fallback)
                    return None
                os.replace(so, out)  # atomic: concurrent builders never load a half-written file
        return out
    except OSError as e:
        _warn_once(name, f"the build could not run: {e}", fallback)
        return None


def load(
    name: str,
    sources: tuple[str, ...],
    flags: tuple[str, ...] = DEFAULT_FLAGS,
    fallback: str = "the PyTorch path",
) -> ctypes.CDLL | None:
    """:func:`build`'s library loaded with ctypes, or None where it cannot be built or loaded (warned)."""
    out = build(name, sources, flags, fallback)
    if out is None:
        return None
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        _warn_once(name, f"the library did not load: {e}", fallback)
        return None


def compile_for(
    target: str, sources: tuple[str, ...], flags: tuple[str, ...], out_dir: Path
) -> subprocess.CompletedProcess:
    """Compile ``sources`` with ``flags`` for the instruction-set level ``target`` (a key of
    :data:`TARGETS`: its ``-march`` in place of ``-march=native``) into ``out_dir``, whatever this CPU runs;
    the finished process (``returncode`` 0: it built). Raises where there is no compiler."""
    if target not in TARGETS:
        raise ValueError(f"target: unknown instruction-set level {target!r}; known: {sorted(TARGETS)}")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler: set CC or install gcc")
    march = f"-march={TARGETS[target]}"
    cross = tuple(march if f == "-march=native" else f for f in flags)
    if march not in cross:
        cross = (march, *cross)
    out = Path(out_dir) / f"{Path(sources[0]).stem}_{target}.so"
    return subprocess.run(_command(cc, source_paths(sources), cross, out), capture_output=True, text=True)
