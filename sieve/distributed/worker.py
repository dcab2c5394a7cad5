"""Tensor-parallel ranks: starting them, and the loop a worker rank runs.

Two ways to launch, one code path:
- `--tensor-parallel-size N` alone: the driver (the process that serves) spawns N - 1 worker processes on this host
  and forms the group with them on a free port of 127.0.0.1;
- torchrun (or anything that sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, on one host or several):
  every rank runs the same `sieve serve|generate ... --tensor-parallel-size N` command; rank 0 becomes the driver
  and the others call `run_worker` (the CLI does this) instead of serving.

A worker loads its shard of the model, builds a K/V pool of the driver's size for its own KV heads, then runs what
the driver announces (sieve.distributed.parallel) until told to stop or until the driver goes away.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import time

import torch

from sieve.config import ConfigError, EngineConfig
from sieve.distributed.parallel import TensorParallelGroup

log = logging.getLogger("sieve")


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class TensorParallelWorkers:
    """The driver's handle on the other ranks: the group, and the processes it spawned (none under torchrun)."""

    def __init__(self, group: TensorParallelGroup | None, processes: list, errors, ray_refs: list | None = None):
        self.group, self.processes, self._errors, self.ray_refs = group, processes, errors, ray_refs or []
        self._ready = 0  # spawned workers that reported their pool built
        self.reported: str | None = None  # the last error a spawned worker reported before it exited

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> "TensorParallelWorkers":
        n = config.tensor_parallel_size
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != n:
                raise ConfigError(f"tensor_parallel_size {n} but torchrun started WORLD_SIZE={world} ranks")
            log.info("tensor parallelism: rank 0 of %d (torchrun, %s:%s)", n, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
            group = TensorParallelGroup.init(0, n, device, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            return cls(group, [], None)
        if config.distributed_executor_backend == "ray":
            return cls._start_ray(config, device)
        ctx = mp.get_context("spawn")
        errors, port = ctx.Queue(), _free_port()
        processes = [ctx.Process(target=_spawned_worker, args=(config, rank, n, "127.0.0.1", port, errors), daemon=True,
                                 name=f"sieve-tp{rank}") for rank in range(1, n)]
        for p in processes:
            p.start()
        handle = cls(None, processes, errors)
        log.info("tensor parallelism: %d ranks on this host (gloo/NCCL on 127.0.0.1:%d)", n, port)
        handle.group = TensorParallelGroup.init(0, n, device, "127.0.0.1", port, before_join=handle._joined)
        handle.group.gone = handle.gone
        return handle

    @classmethod
    def _start_ray(cls, config: EngineConfig, device: torch.device) -> "TensorParallelWorkers":
        """Ranks 1..N-1 as Ray tasks, placed by Ray (on this node or any node of the cluster RAY_ADDRESS names); they
        reach the driver at this node's address."""
        try:
            import ray
        except ImportError:
            raise ConfigError("distributed_executor_backend 'ray' needs Ray: pip install ray") from None
        n = config.tensor_parallel_size
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("SIEVE_")}})
        addr, port = ray.util.get_node_ip_address(), _free_port()
        task = ray.remote(num_cpus=0, num_gpus=1 if device.type == "cuda" else 0)(_ray_worker)
        handle = cls(None, [], None, [task.remote(config, rank, n, addr, port) for rank in range(1, n)])
        log.info("tensor parallelism: %d ranks, %d as Ray tasks (driver at %s:%d)", n, n - 1, addr, port)
        handle.group = TensorParallelGroup.init(0, n, device, addr, port, before_join=handle._joined)
        handle.group.gone = handle.gone
        return handle

    def gone(self, wait_s: float = 0.0) -> str | None:
        """A rank this driver started that is no longer running, named, with the error it reported; None while they
        all run (after waiting up to `wait_s` for one to be seen gone: a step that failed on a collective may have
        failed before the rank that broke it has exited). The group asks it while a command is out."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                detail = self._reported_error()
                return f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode})" + (f": {detail}" if detail else "")
            if self.ray_refs:
                import ray

                done, _ = ray.wait(self.ray_refs, timeout=0)
                if done:
                    return "a tensor-parallel Ray task ended"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _reported_error(self) -> str | None:
        """The last error a spawned worker put in the queue (kept: the queue is read once)."""
        while self._errors is not None:
            try:
                kind, rank, detail = self._errors.get_nowait()
            except (queue.Empty, OSError, ValueError):
                break
            if kind == "error":
                self.reported = f"rank {rank}: {detail}"
        return self.reported

    def _joined(self, store, timeout_s: float = 600.0) -> None:
        """Before the driver waits for the ranks it started: each has signed in on the store, or it fails here, naming
        why (a rank that died before joining must not leave the driver waiting forever)."""
        deadline = time.monotonic() + timeout_s
        for rank in range(1, len(self.processes) + len(self.ray_refs) + 1):
            while not store.check([f"sieve-tp/joining/{rank}"]):
                self._check_alive("joining")
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise RuntimeError(f"tensor-parallel workers not joining after {timeout_s:.0f} s (are there resources for them?)")
                time.sleep(0.1)

    def _check_alive(self, what: str) -> None:
        """Raise (after stopping the rest) if a started rank reported an error or is gone."""
        if self.ray_refs:
            import ray

            done, _ = ray.wait(self.ray_refs, timeout=0)
            if done:
                try:
                    ray.get(done[0])
                    error = RuntimeError(f"a tensor-parallel Ray task returned before it was {what}")
                except ray.exceptions.RayTaskError as e:
                    error = ConfigError(f"tensor-parallel Ray task: {getattr(e, 'cause', e)}")
                self.shutdown()
                raise error
            return
        try:
            kind, rank, detail = self._errors.get_nowait()
        except queue.Empty:
            kind = None
        if kind == "error":
            self.shutdown()
            raise ConfigError(f"tensor-parallel rank {rank}: {detail}")
        if kind == "ready":
            self._ready += 1
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            self.shutdown()
            detail = self._reported_error()  # (read here, or by `gone` while a command was out)
            if detail:
                raise ConfigError(f"tensor-parallel {detail}")
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}) before it was {what}")

    def ready(self, num_blocks: tuple[int, int], timeout_s: float = 600.0) -> None:
        """After the driver built its K/V pool: the workers build theirs of the same size and start following. Spawned
        workers report when they have (or why they cannot)."""
        self.group.announce(("init", num_blocks))
        deadline = time.monotonic() + timeout_s
        while self.processes and self._ready < len(self.processes):
            self._check_alive("ready")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"tensor-parallel workers not ready after {timeout_s:.0f} s")
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:  # a worker already gone: nothing left to tell
                pass
            self.group = None
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        refs, self.ray_refs = self.ray_refs, []
        if refs:
            import ray

            _, pending = ray.wait(refs, num_returns=len(refs), timeout=10)
            for ref in pending:
                ray.cancel(ref, force=True)


def _ray_worker(config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
    run_worker(config, rank, world, addr, port)


def _spawned_worker(config: EngineConfig, rank: int, world: int, addr: str, port: int, errors) -> None:
    try:
        run_worker(config, rank, world, addr, port, report=lambda kind, detail=None: errors.put((kind, rank, detail)))
    except Exception as e:  # the driver reports it and stops
        errors.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1)


def run_worker(config: EngineConfig, rank: int | None = None, world: int | None = None, addr: str | None = None,
               port: int | None = None, report=None) -> None:
    """Run tensor-parallel rank `rank` (> 0) until the driver stops. Without arguments, from torchrun's environment."""
    from sieve.device import pick_device
    from sieve.model_runner import ModelRunner
    from sieve.models.arch import ModelArch
    from sieve.models.default import resolve_default
    from sieve.models.loader import default_num_threads, load_model, open_checkpoint, resolve_dtype
    from sieve.distributed.lora_ranks import WorkerAdapters
    from sieve.distributed.shard import shard_arch

    rank = env_rank() if rank is None else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1") if addr is None else addr
    port = int(os.environ["MASTER_PORT"]) if port is None else port
    report = report or (lambda kind, detail=None: None)
    config.model, _ = resolve_default(config.model)
    device = pick_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(config.num_threads or max(1, default_num_threads() // world))
    group = TensorParallelGroup.init(rank, world, device, addr, port)
    ckpt = open_checkpoint(config.model, config.revision, dequantize=config.dequantize)
    arch = ModelArch.from_hf_config({**ckpt.config, **config.parsed_hf_overrides()})
    dtype = resolve_dtype(config.dtype, arch, device)
    max_len = config.max_model_len or arch.max_position_embeddings
    model = load_model(ckpt, arch, dtype, device, max_positions=max_len, quantization=config.quantization,
                       group_size=config.quantization_group_size, quantize_lm_head=config.quantize_lm_head, tp=group)
    command = group.next_command()
    if command[0] == "stop":  # the driver failed to start
        return
    if command[0] != "init":
        raise RuntimeError(f"tensor-parallel rank {rank} expected the driver's pool size, got {command[0]!r}")
    runner = ModelRunner(config, shard_arch(arch, world), model, dtype, device, (), num_blocks=command[1])
    adapters = WorkerAdapters(arch, group, device, config.max_loras, config.max_lora_rank) if config.enable_lora else None
    report("ready")
    with torch.inference_mode():
        while True:
            command = group.next_command()
            kind = command[0]
            if kind == "forward":
                _, input_ids, positions, meta = command
                model(input_ids, positions, runner.caches, adapters.incoming(meta) if adapters else meta)
            elif kind == "lora_add":
                adapters.add(*command[1:])
            elif kind == "lora_drop":
                adapters.drop(command[1])
            elif kind == "logits":
                model.compute_logits(command[1], adapters.batch(command[2]) if adapters else None)
            elif kind == "copy_blocks":
                runner.copy_blocks(command[1])
            elif kind == "stop":
                break
            else:
                raise RuntimeError(f"tensor-parallel rank {rank}: unknown command {kind!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(config: EngineConfig, arch, device: torch.device) -> tuple[TensorParallelWorkers, object]:
    """The engine's other ranks (this process is rank 0) and the architecture of the shard this rank holds, once the
    model is known to split `config.tensor_parallel_size` ways (checked before any process starts)."""
    from sieve.distributed.shard import check_shardable, shard_arch

    check_shardable(arch, config.tensor_parallel_size)
    return TensorParallelWorkers.start(config, device), shard_arch(arch, config.tensor_parallel_size)
