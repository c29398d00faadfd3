"""Every native kernel compiles for every instruction-set level it is written for, on any x86-64 machine.

A kernel runs only on a CPU with its instructions, so most variants never run on a given machine, and a
syntax error in one of them would otherwise reach users unseen (on their machines the build fails and the
fallback runs). Compiling needs only the compiler's target flags, not the CPU: each variant is built here
with its level's ``-march`` (:data:`kvbalance.model.cbuild.TARGETS`) in place of ``-march=native``, with the
same flags as at run time (``-Wall -Werror`` included). Also: a failed build logs one warning that names
the kernel and what runs instead.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model import (  # noqa: E402
    amx_gemm,
    avx2_gemm,
    avx512_gemm,
    cbuild,
    fused,
    native,
    native_prefill,
)

if cbuild.compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip("no C compiler, or not x86-64: the kernels are x86-64 C", allow_module_level=True)

_DECODE_DTYPES = {"f32": (False, False), "bf16": (True, True), "bf16kv": (True, False)}


def _variants() -> list[tuple[str, tuple[str, ...], tuple[str, ...], str]]:
    """(id, sources, flags, target) of every build the engine can ask for, at each level it is meant for."""
    out = []
    for target in ("portable", "avx2", "avx512f", "amx"):
        for kind, (kv, io) in _DECODE_DTYPES.items():
            if kind == "bf16kv" and target in ("avx2", "amx"):  # the same code as f32 / bf16 at those levels
                continue
            flags = native.build_flags(3, 64, kv, io, amx=target == "amx")
            out.append((f"decode_attention-{kind}-{target}", native.SOURCES, flags, target))
    # the AMX path's other tile layouts (head dims of 1 and 4 tiles), a bf16 cache of odd 16-float vectors
    for hd in (32, 128):
        flags = native.build_flags(4, hd, True, True, amx=True)
        out.append((f"decode_attention-bf16-d{hd}-amx", native.SOURCES, flags, "amx"))
    out.append(
        ("decode_attention-bf16-d80", native.SOURCES, native.build_flags(2, 80, True, True, False), "avx2")
    )
    for target in ("portable", "avx2", "avx512f"):
        for dtype in fused.DTYPES:
            name = str(dtype).removeprefix("torch.")
            out.append((f"fused-{name}-{target}", fused.SOURCES, fused.build_flags(dtype), target))
    # each GEMM and prefill kernel at its own level, and on a plain x86-64 target (its own -m flags only:
    # what a CPU without the instructions would compile)
    for module_id, sources, flags, level in (
        ("avx2_gemm", avx2_gemm.SOURCES, avx2_gemm.FLAGS, "avx2"),
        ("avx512_gemm", avx512_gemm.SOURCES, avx512_gemm.FLAGS, "avx512bf16"),
        ("amx_gemm", amx_gemm.SOURCES, amx_gemm.FLAGS, "amx"),
        (
            "prefill_attention_avx512",
            native_prefill.AVX512_SOURCES,
            native_prefill.AVX512_FLAGS,
            "avx512bf16",
        ),
        ("prefill_attention_amx", native_prefill.AMX_SOURCES, native_prefill.AMX_FLAGS, "amx"),
    ):
        out += [(f"{module_id}-{t}", sources, flags, t) for t in ("portable", level)]
    out += [
        (f"{name}-portable", (f"{name}.c",), cbuild.DEFAULT_FLAGS, "portable")
        for name in ("cpu_bind", "roofline_read")
    ]
    return out


VARIANTS = _variants()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every variant compiled once, as many at a time as there are cores (each compile is one process)."""
    out = tmp_path_factory.mktemp("variants")
    for vid, *_ in VARIANTS:
        (out / vid).mkdir()
    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        jobs = {
            vid: pool.submit(cbuild.compile_for, t, src, flags, out / vid) for vid, src, flags, t in VARIANTS
        }
        return {vid: job.result() for vid, job in jobs.items()}


@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_the_variant_compiles_with_warnings_as_errors(variant, compiled):
    proc = compiled[variant]
    assert proc.returncode == 0, f"{variant} ({' '.join(proc.args)}):\n{proc.stderr[-3000:]}"


def test_every_kernel_file_and_every_level_is_compiled_above():
    """A new .c file or instruction-set level must join the matrix (else it would escape this check)."""
    compiled = {s for _, sources, _, _ in VARIANTS for s in sources}
    assert compiled == {p.name for p in cbuild.NATIVE_DIR.glob("*.c")}
    assert {t for *_, t in VARIANTS} == set(cbuild.TARGETS)


def test_a_syntax_error_in_one_kernel_fails_its_compile(monkeypatch, tmp_path):
    """The check above fails on a broken variant: a copy of the kernels with one error in the AMX path of
    decode attention, which no CPU here needs to run."""
    broken = tmp_path / "native"
    shutil.copytree(cbuild.NATIVE_DIR, broken)
    path = broken / "decode_attention_amx.c"
    path.write_text(
        path.read_text().replace("attend_run_amx(&run, u0, scale, out);", "attend_run_amx(&run, u0);")
    )
    monkeypatch.setattr(cbuild, "NATIVE_DIR", broken)
    flags = native.build_flags(3, 64, True, True, amx=True)
    proc = cbuild.compile_for("amx", native.SOURCES, flags, tmp_path)
    assert proc.returncode != 0 and "decode_attention_amx.c" in proc.stderr
    # the same file compiles where the AMX path is not compiled in (so only the matrix catches it)
    assert (
        cbuild.compile_for(
            "portable", native.SOURCES, native.build_flags(3, 64, True, True, False), tmp_path
        ).returncode
        == 0
    )


def test_a_failed_build_logs_one_warning_naming_the_kernel_and_fallback(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "native"
    shutil.copytree(cbuild.NATIVE_DIR, broken)
    (broken / "fused.c").write_text((broken / "fused.c").read_text() + "\nint broken(void) { return }\n")
    monkeypatch.setattr(cbuild, "NATIVE_DIR", broken)
    monkeypatch.setattr(cbuild, "_warned", set())
    monkeypatch.setenv("KVBALANCE_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING, logger="kvbalance.model.cbuild")
    for _ in range(2):
        assert cbuild.load("fused_check", fused.SOURCES, fused.FLAGS, fused.FALLBACK) is None
    (record,) = caplog.records
    assert "fused_check" in record.getMessage() and fused.FALLBACK in record.getMessage()
    assert "fused.c" in record.getMessage()  # the compiler's first error line


def test_no_compiler_logs_one_warning_and_the_wrapper_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))  # a compiler that cannot run
    monkeypatch.setenv("KVBALANCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_warned", set())
    monkeypatch.setattr(fused, "_libs", {})
    caplog.set_level(logging.WARNING, logger="kvbalance.model.cbuild")
    assert fused.library(torch.float32) is None and not fused.supports(torch.zeros(2, 4))
    (record,) = caplog.records
    assert "fused_f32" in record.getMessage() and fused.FALLBACK in record.getMessage()


def test_native_off_builds_nothing_and_warns_nothing(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVBALANCE_NATIVE", "0")
    monkeypatch.setenv("KVBALANCE_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING, logger="kvbalance.model.cbuild")
    assert cbuild.build("fused_off", fused.SOURCES, fused.FLAGS, fused.FALLBACK) is None
    assert not caplog.records and not (tmp_path / "cache").exists()


def test_an_unknown_source_or_target_is_named():
    with pytest.raises(FileNotFoundError, match="sources: no kernel file .*nope.c"):
        cbuild.source_paths(("nope.c",))
    with pytest.raises(ValueError, match="target: unknown instruction-set level 'avx9'"):
        cbuild.compile_for("avx9", fused.SOURCES, fused.FLAGS, ".")


def test_no_c_source_is_left_in_python_strings():
    """Every kernel is a .c file: none is kept in a Python string (where no compiler check reaches it)."""
    root = cbuild.NATIVE_DIR.parent.parent
    markers = ("#include <", "#pragma omp", "__attribute__((")
    offenders = [
        str(p.relative_to(root))
        for folder in ("kvbalance", "benchmarks", "scripts")
        for p in (root / folder).rglob("*.py")
        if any(m in p.read_text() for m in markers)
    ]
    assert offenders == []
