"""Native kernels behind the same interfaces as the PyTorch path.

`cpu_ops()` JIT-builds the CPU C++ kernels once per machine (cached under the sieve cache folder,
keyed by the source, the CPU and the instruction set) and returns None where that is impossible (no
compiler, no ninja, SIEVE_NO_NATIVE=1); callers then use the PyTorch path, which the tests also use as
the reference.

The instruction set is chosen from the CPU's features, or forced with SIEVE_CPU_ISA:
  avx512   AVX512-BF16 kernels (gemv.cpp, gemm_bf16.cpp, qmatmul.cpp), built with -march=native
  avx2     AVX2 + FMA + F16C kernels (gemv_avx2.cpp, qmatmul_avx2.cpp), built for Haswell, so that an
           AVX-512 machine can build, test and benchmark what an AVX2-only CPU runs
  generic  no vector linear kernels: quantized weights fall back to PyTorch (dequantized per call)
`ops.isa` says which one a module was built for. Forcing avx2 or generic also asks PyTorch's own
kernels (ATen's CPU dispatch, oneDNN) to stay below AVX-512, where the environment does not already
set them, before they first run.

In the avx512 build the int4 and int8 kernels run several rows' bf16 dot products either as vdpbf16ps or as the
two float32 FMAs that instruction is defined as (the same bits; chosen where this CPU agrees bit for bit and the
FMAs are faster, `ops.bf16_dot_kernel()`); SIEVE_BF16_DOT=fma|dpbf16 forces one. Where it reads "fma", bf16 weights
above the GEMV's rows also run float32 FMAs on widened panels (gemm_bf16.cpp) instead of oneDNN's bf16 GEMM.
Where the CPU has AMX-BF16 and Linux grants the tile registers, int4 weights multiply on AMX tiles from
`ops.int4_amx_rows()` rows (several rows for about the price of one), and below that as FMAs in the order the tiles sum
(the same bits, so a row's result does not depend on its neighbours): `ops.int4_amx()`. SIEVE_INT4_AMX=0 keeps the
other forms; SIEVE_INT4_AMX=1 asks for the tiles and fails closed where there are none.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

from sieve.config import ConfigError  # a bad SIEVE_* setting: the command line reports it in one line

log = logging.getLogger("sieve")
KERNEL_SOURCES = Path(__file__).parent
_LOADED: dict = {}  # name -> module: cpu_ops.cache_clear() must not load a module twice
_SOURCES = ("attention.cpp", "layer_ops.cpp", "gemv.cpp", "gemv_avx2.cpp", "gemm_bf16.cpp", "qmatmul.cpp", "qmatmul_avx2.cpp",
            "qmatmul_q8act.cpp", "w8a8.cpp", "linear.cpp", "greedy_head.cpp", "decoder.cpp", "lora.cpp", "module.cpp")  # and kernels.h, which they include


_MARCH = {"avx512": "-march=native", "avx2": "-march=haswell", "generic": "-march=x86-64"}
_NEEDS = {"avx512": ("avx512_bf16", "avx512bw"), "avx2": ("avx2", "fma", "f16c"), "generic": ()}


def _cpu_flags() -> set[str]:
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set(platform.processor().split())


def _cpu_signature() -> str:
    return hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:8]


def cpu_isa() -> str:
    """The instruction set the native kernels are built for: SIEVE_CPU_ISA, else the best this CPU has."""
    forced = os.environ.get("SIEVE_CPU_ISA", "").strip().lower()
    flags = _cpu_flags()
    if forced:
        if forced not in _MARCH:
            raise ConfigError(f"SIEVE_CPU_ISA={forced!r}: use one of {', '.join(_MARCH)}")
        missing = [f for f in _NEEDS[forced] if f not in flags]
        if missing:
            raise ConfigError(f"SIEVE_CPU_ISA={forced} but this CPU lacks {', '.join(missing)}")
        return forced
    return next((isa for isa in ("avx512", "avx2") if all(f in flags for f in _NEEDS[isa])), "generic")


def limit_torch_isa() -> None:
    """Under a forced avx2 / generic build, keep ATen's CPU dispatch and oneDNN there too (they read
    these variables when they first run)."""
    forced = os.environ.get("SIEVE_CPU_ISA", "").strip().lower()
    if forced == "avx2":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    elif forced == "generic":
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "SSE41")


def _apply_settings(ops, dot: str | None):
    """Apply SIEVE_BF16_DOT (already checked to be fma or dpbf16) to a loaded module, and check SIEVE_INT4_AMX."""
    if dot:
        if not hasattr(ops, "set_bf16_dot_kernel"):
            raise ConfigError(f"SIEVE_BF16_DOT={dot}: the {ops.isa} build has no bf16 dot products to choose a form for")
        ops.set_bf16_dot_kernel(dot)
    amx = os.environ.get("SIEVE_INT4_AMX")
    if amx == "1" and not (hasattr(ops, "int4_amx") and ops.int4_amx()):
        raise ConfigError(f"SIEVE_INT4_AMX=1: the {ops.isa} build on this CPU has no AMX-BF16 tiles it may use")
    return ops


def build_key(isa: str, sources: Path | None = None) -> str:
    """The kernel folder's name: the sources, where they live (two installs would otherwise share a folder, and torch
    rebuilds a module whose source paths changed: they rebuilt each other's kernels in turn), this CPU and the ISA."""
    sources = sources or KERNEL_SOURCES
    text = b"".join((sources / name).read_bytes() for name in (*_SOURCES, "kernels.h"))
    return (hashlib.sha256(text).hexdigest()[:10] + "-" + hashlib.sha256(str(sources.resolve()).encode()).hexdigest()[:6] + "-"
            + _cpu_signature() + ("" if isa == "avx512" else "-" + isa))


@contextlib.contextmanager
def build_lock(build: Path, log_every_s: float = 10.0):
    """One builder per kernel folder at a time, and never a wait on a dead one. The lock is an flock on
    `sieve-build.lock` (the kernel drops it when its process ends, killed or not), which names the holder's pid; whoever
    holds it may remove torch's own `lock` file, which only a builder killed mid-build leaves behind (torch's loader
    then waits on it forever, printing nothing). A waiter logs whom it waits for."""
    import fcntl
    import time

    with open(build / "sieve-build.lock", "a+") as f:
        waited = None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if waited is None or now - waited >= log_every_s:
                    f.seek(0)
                    log.warning("waiting for process %s, which is building sieve's native kernels in %s", f.read().strip() or "?", build)
                    waited = now
                time.sleep(0.2)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


@lru_cache(maxsize=1)
def cpu_ops():
    if os.environ.get("SIEVE_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from sieve.demo import cache_root

        isa = cpu_isa()
        key = build_key(isa)
        name = f"sieve_cpu_ops_{key.replace('-', '_')}"
        dot = os.environ.get("SIEVE_BF16_DOT")
        if dot and dot not in ("fma", "dpbf16"):
            raise ConfigError(f"SIEVE_BF16_DOT={dot}: expected fma or dpbf16")
        if os.environ.get("SIEVE_INT4_AMX", "0") not in ("0", "1"):
            raise ConfigError(f"SIEVE_INT4_AMX={os.environ['SIEVE_INT4_AMX']}: expected 0 or 1")
        if name in _LOADED:  # loaded before in this process (a module registers its classes once)
            return _apply_settings(_LOADED[name], dot)
        build = Path(os.environ.get("SIEVE_KERNEL_CACHE") or cache_root() / "kernels") / key
        build.mkdir(parents=True, exist_ok=True)
        with build_lock(build):
            if not (build / f"{name}.so").exists():
                log.info("building sieve's native CPU kernels (%s) in %s (once per install and machine: about a minute; "
                         "make install does it ahead)", isa, build)
            _LOADED[name] = load(
                name=name, sources=[str(KERNEL_SOURCES / name) for name in _SOURCES], build_directory=str(build),
                extra_cflags=["-O3", _MARCH[isa], "-fopenmp", "-ffast-math", "-std=c++20"], extra_ldflags=["-fopenmp"], verbose=False,
            )
        return _apply_settings(_LOADED[name], dot)
    except ValueError:  # a bad SIEVE_* setting (ConfigError): not something to fall back from silently
        raise
    except Exception as e:  # no compiler, no ninja, unsupported platform
        lines = str(e).splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()][1:4]  # the compiler's own words, after the summary
        log.warning("native CPU kernels unavailable (%s); using the PyTorch path", "; ".join([lines[0][:200] if lines else type(e).__name__] + errors))
        return None
