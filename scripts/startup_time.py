"""Start-up time, two trees side by side (docs/benchmarks.md, "Start-up"): `sieve serve` on the default model
(SmolLM2-135M-Instruct Q4_1) from launch until /health answers 200, and `LLM(...)` on Gemma-3-270M (its 262k-token
vocabulary; no tokenizer), each in a fresh process, `repeats` times; medians.

    python scripts/startup_time.py TREE [TREE ...] [--repeats 3]

A TREE is a checkout of sieve (run from it, PYTHONPATH pointing at it; this .venv's packages serve all of them). A tree whose
native kernels are not built yet builds them in its first start: run it once before timing."""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

GEMMA = ("import time; t = time.perf_counter(); from sieve import LLM; from sieve.models.default import gemma3_270m_path; "
         "LLM(str(gemma3_270m_path()), skip_tokenizer_init=True); print(time.perf_counter() - t)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_seconds(tree: str, env: dict) -> float:
    port, t = free_port(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sieve.cli", "serve", "--port", str(port)], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"sieve serve exited with {proc.returncode}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    return time.perf_counter() - t
            except OSError:
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for tree in args.trees:
        tree = os.path.abspath(tree)  # the working directory too: `python -m` and `-c` put it first on sys.path
        env = dict(os.environ, PYTHONPATH=tree)
        serve = [serve_seconds(tree, env) for _ in range(args.repeats)]
        gemma = [float(subprocess.run([sys.executable, "-c", GEMMA], env=env, cwd=tree, capture_output=True, text=True,
                                      check=True).stdout.split()[-1]) for _ in range(args.repeats)]
        print(json.dumps({"tree": tree, "serve_default_model_s": serve, "llm_gemma3_s": gemma,
                          "median_serve_s": statistics.median(serve), "median_gemma3_s": statistics.median(gemma)}))


if __name__ == "__main__":
    main()
