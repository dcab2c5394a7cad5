"""Native kernels behind the same interfaces as the PyTorch path.

`cpu_ops()` JIT-builds the CPU C++ kernels once per machine (cached under the sieve cache folder,
keyed by the source and the CPU's instruction set) and returns None where that is impossible (no
compiler, no ninja, SIEVE_NO_NATIVE=1); callers then use the PyTorch path, which the tests also use as
the reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("sieve")
_DIR = Path(__file__).parent
_LOADED: dict = {}  # name -> module: cpu_ops.cache_clear() must not load a module twice
_SOURCES = ("attention.cpp", "layer_ops.cpp", "gemv.cpp", "qmatmul.cpp", "linear.cpp", "decoder.cpp", "module.cpp")  # and kernels.h, which they include


def _cpu_signature() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@lru_cache(maxsize=1)
def cpu_ops():
    if os.environ.get("SIEVE_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from sieve.demo import cache_root

        text = b"".join((_DIR / name).read_bytes() for name in (*_SOURCES, "kernels.h"))
        key = hashlib.sha256(text).hexdigest()[:10] + "-" + _cpu_signature()
        name = f"sieve_cpu_ops_{key.replace('-', '_')}"
        if name in _LOADED:  # loaded before in this process (a module registers its classes once)
            return _LOADED[name]
        build = cache_root() / "kernels" / key
        build.mkdir(parents=True, exist_ok=True)
        if not (build / f"{name}.so").exists():
            log.info("building sieve's native CPU kernels in %s (first use on this machine: about a minute)", build)
        _LOADED[name] = load(
            name=name, sources=[str(_DIR / name) for name in _SOURCES], build_directory=str(build),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-std=c++20"], extra_ldflags=["-fopenmp"], verbose=False,
        )
        return _LOADED[name]
    except Exception as e:  # no compiler, no ninja, unsupported platform
        lines = str(e).splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()][1:4]  # the compiler's own words, after the summary
        log.warning("native CPU kernels unavailable (%s); using the PyTorch path", "; ".join([lines[0][:200] if lines else type(e).__name__] + errors))
        return None
