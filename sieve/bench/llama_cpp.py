"""llama.cpp as a peer: find or build `llama-server`/`llama-bench`, the command that serves a GGUF file, a server
subprocess that stops when its block ends, and the sieve ÷ llama.cpp ratio tables. Shared by `bench peers`,
`bench pd` and `bench ladder`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sieve.demo import cache_root

SERVED_NAME = "bench"


def _cpu_has_amx() -> bool:
    try:
        return "amx_int8" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# llama-server flags per GGUF type. On a Xeon with AMX (torch and llama.cpp both see AMX_INT8),
# llama.cpp's AMX-repacked Q8_0 weights crashed at warm-up (SIGSEGV, exit 139); without repacking Q8_0
# runs on its AVX512 kernels. Elsewhere llama.cpp repacks as it likes. F16 is not repacked either way.
LLAMA_FLAGS = {"q8_0": ["--no-repack"]} if _cpu_has_amx() else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; log: {log_path}\n"
                               + log_path.read_text()[-2000:])
        try:
            r = httpx.get(base_url + "/models", timeout=5)
            if r.status_code == 200:
                probe = httpx.post(base_url + "/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 1}, timeout=120)
                if probe.status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout:.0f}s; log: {log_path}")


class Server:
    """A server subprocess that is stopped (SIGTERM, then SIGKILL) when the block ends."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, timeout: float):
        self.cmd, self.base_url, self.log_path, self.timeout = cmd, f"http://127.0.0.1:{port}/v1", log_path, timeout

    def __enter__(self) -> "Server":
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(self.base_url, self.proc, self.timeout, self.log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


LLAMA_ISA_FLAGS = {  # llama.cpp's CMake switches per instruction set; avx2: what a CPU without AVX-512 runs
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"],
}


def llama_build_dir(isa: str = "native") -> Path:
    from importlib.metadata import version

    return cache_root() / "llama.cpp" / version("llama-cpp-python") / ("build" if isa == "native" else f"build-{isa}")


def build_llama_server(log=print, target: str = "llama-server", isa: str = "native") -> Path:
    """Compile llama.cpp's `target` (llama-server, llama-bench) for `isa` from the llama.cpp tree inside
    the installed llama-cpp-python's sdist."""
    from importlib.metadata import version

    ver = version("llama-cpp-python")
    root = cache_root() / "llama.cpp" / ver
    build = llama_build_dir(isa)
    binary = build / "bin" / target
    if binary.exists():
        return binary
    src = root / "src"
    if not src.exists():
        dl = root / "sdist"
        log(f"downloading llama-cpp-python {ver} sources from the package registry")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dl),
                        f"llama-cpp-python=={ver}"], check=True)
        import tarfile

        with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(dl, filter="data")
        shutil.move(str(next(dl.glob("llama_cpp_python-*/vendor/llama.cpp"))), src)
    log(f"compiling {target} ({isa}) in {build} (several minutes)")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF", *LLAMA_ISA_FLAGS[isa], "-DBUILD_SHARED_LIBS=OFF"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)], check=True)
    return binary


def find_llama_server(args, log=print, target: str = "llama-server") -> Path | None:
    isa = getattr(args, "llama_isa", "native")
    if target == "llama-server" and isa == "native":
        for cand in (args.llama_server, shutil.which("llama-server")):
            if cand and Path(cand).exists():
                return Path(cand)
    from importlib.metadata import PackageNotFoundError

    try:
        built = llama_build_dir(isa) / "bin" / target
    except PackageNotFoundError:
        return None
    if built.exists():
        return built
    return build_llama_server(log, target, isa) if args.build_llama_server else None


def llama_cmd(binary: Path | None, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int,
              extra: list[str] = ()) -> tuple[list[str], str]:
    if binary is not None:
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--alias", SERVED_NAME,
               "--no-webui", *extra]
        return cmd, f"llama.cpp llama-server ({parallel} parallel slots{', ' + ' '.join(extra) if extra else ''})"
    return ([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx_per_slot),
             "--model_alias", SERVED_NAME], "llama-cpp-python server (one request at a time: no llama-server binary)")


def ratio_table(ours: dict, theirs: dict, key: str) -> list[dict]:
    """sieve ÷ llama.cpp per load point. For latencies a ratio below 1 means sieve is faster."""
    by_load = {r[key]: r for r in theirs["runs"]}
    rows = []
    for r in ours["runs"]:
        t = by_load.get(r[key])
        if t is None:
            continue
        div = lambda a, b: a / b if b else float("nan")  # noqa: E731
        rows.append({key: r[key],
                     "output_throughput": div(r["output_token_throughput"], t["output_token_throughput"]),
                     "ttft_p50": div(r["ttft_s"]["p50"], t["ttft_s"]["p50"]), "ttft_p99": div(r["ttft_s"]["p99"], t["ttft_s"]["p99"]),
                     "tpot_p50": div(r["tpot_s"]["p50"], t["tpot_s"]["p50"]), "tpot_p99": div(r["tpot_s"]["p99"], t["tpot_s"]["p99"]),
                     "goodput": div(r["goodput"], t["goodput"])})
    return rows


def format_table(rows: list[dict], key: str, ours: dict, theirs: dict, name: str, us: str = "sieve") -> str:
    lines = [f"{us} ÷ {name} (throughput, goodput: higher is better for {us}; TTFT, TPOT: lower is better)",
             f"| {key} | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput |", "|---|---|---|---|---|---|---|"]
    def ratio(v: float) -> str:  # nan: the other engine's figure was 0 (e.g. no request within the SLO)
        return "— (other 0)" if v != v else f"{v:.2f}×"

    for r in rows:
        lines.append(f"| {r[key]} | " + " | ".join(ratio(r[c]) for c in ("output_throughput", "ttft_p50", "ttft_p99", "tpot_p50",
                                                                        "tpot_p99", "goodput")) + " |")
    m = f"max_{key}_within_slo"
    within = lambda v: "none of the loads" if v is None else v  # noqa: E731
    lines.append(f"max {key} within the SLO: {us} {within(ours[m])}, {name} {within(theirs[m])}")
    return "\n".join(lines)
