"""The tensor-parallel group: which rank this process is, its collectives, and the driver's control messages.

Rank 0 is the driver: it runs the whole engine (scheduler, sampler, server) and its shard of the model. Ranks 1..N-1
are workers that hold only their shard and K/V heads, and follow the driver: before every model call the driver
broadcasts what it is about to run (`announce`), the workers run the same call on their shard (`next_command`), and
the collectives inside the model (one all-reduce per attention block and per MLP block, one all-gather of the
vocab-parallel logits) meet in the same order on every rank.

Collectives are torch.distributed's: gloo on CPU, NCCL on CUDA. The group is set up from the usual environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so a torchrun launch works as is.
"""

from __future__ import annotations

import datetime
import io
import os
import threading
import time

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """One engine's ranks. The group is its own (a store and process groups of its own, not torch.distributed's global
    default group), so one process can drive several tensor-parallel engines one after another, or side by side."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store, control, data):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.is_driver = rank == 0
        self._store, self._control, self._data = store, control, data  # control: gloo (commands); data: gloo or NCCL
        # Driver: names a rank it started that is no longer running, or None (set by TensorParallelWorkers; None
        # under torchrun, whose launcher watches its ranks)
        self.gone = None
        # Driver with LoRA: what the other ranks hold of the adapters (sieve/distributed/lora_ranks.py DriverAdapters)
        self.adapters = None

    @classmethod
    def init(cls, rank: int, world_size: int, device: torch.device, master_addr: str, master_port: int,
             before_join=None) -> "TensorParallelGroup":
        """Join (or form) the group. Idle workers wait on the driver's next command for as long as the server is idle,
        so operations get a long timeout; a rank that dies closes its sockets, which fails the others at once.
        `before_join(store)` runs once the rendezvous store is up and before the ranks wait for each other (the driver
        checks there that the ranks it started are alive and joining)."""
        timeout = datetime.timedelta(hours=float(os.environ.get("SIEVE_TP_TIMEOUT_HOURS", "168")))
        # Under torchrun the launcher may already host the store on MASTER_PORT (as torch's env:// rendezvous reads it)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0 and not agent_store,
                              timeout=datetime.timedelta(minutes=10), wait_for_workers=False)
        store.set(f"sieve-tp/joining/{rank}", "1")
        if before_join is not None:
            before_join(store)
        control = dist.ProcessGroupGloo(dist.PrefixStore("sieve-tp/control", store), rank, world_size, timeout)
        if device.type == "cuda":
            data = dist.ProcessGroupNCCL(dist.PrefixStore("sieve-tp/data", store), rank, world_size)
        else:
            data = dist.ProcessGroupGloo(dist.PrefixStore("sieve-tp/data", store), rank, world_size, timeout)
        return cls(rank, world_size, device, store, control, data)

    # ---- shapes ----------------------------------------------------------------------------
    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` (heads, channels); `total` must divide evenly."""
        if total % self.world_size:
            raise ValueError(f"tensor parallelism over {self.world_size} ranks needs {what} divisible by {self.world_size}, got {total}")
        n = total // self.world_size
        return self.rank * n, n

    def vocab_shard(self, vocab: int) -> int:
        """Rows of the LM head each rank holds: the vocabulary rounded up to the ranks (the last shard is padded)."""
        return -(-vocab // self.world_size)

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial `x` (a row-parallel layer's output), on every rank."""
        x = x.contiguous()
        self._data.allreduce([x]).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """[B, vocab shard] on each rank -> [B, vocab] on every rank (padding dropped)."""
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        self._data.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, :vocab]

    # ---- the driver's commands -------------------------------------------------------------
    def announce(self, command: tuple) -> None:
        """Driver: tell the workers what runs next (tensors in it travel by value). A no-op on a worker."""
        if not self.is_driver:
            return
        buf = io.BytesIO()
        torch.save(command, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)

    def announce_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Driver: a model step, its adapters (if any) sent to the ranks first and named in it by fingerprint."""
        if self.adapters is not None:
            meta = self.adapters.outgoing(self, meta)
        self.announce(("forward", input_ids, positions, meta))

    def announce_logits(self, hidden: torch.Tensor, lora=None) -> None:
        """Driver: score `hidden` with the head (`lora`: the adapters that change it, over these rows)."""
        rows = self.adapters.rows(self, lora) if self.adapters is not None and lora is not None else None
        self.announce(("logits", hidden, rows))

    def next_command(self) -> tuple:
        """Worker: wait for the driver's next command."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location=self.device, weights_only=False)

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self._control.broadcast([t], opts)
        if self.is_driver and self.gone is not None:
            # gloo does not always fail a send to a rank that was killed (1 run in about 8 of
            # test_a_dead_rank_fails_the_step_instead_of_hanging waited here for good), so the driver checks its ranks
            # while a command is out; a receive, as every all-reduce has, fails on the closed socket
            while not work.is_completed():
                gone = self.gone()
                if gone:
                    raise RuntimeError(f"{gone}: the tensor-parallel step cannot run")
                time.sleep(1e-4)
        work.wait()

    def shutdown(self) -> None:
        """Driver: tell the workers to stop; then this group is done on every rank. Where a rank is gone (or the stop
        could not be sent), the groups are aborted first: gloo work to a dead rank may never complete, and a group's
        destructor would wait for it."""
        told = False
        try:
            if self.gone is None or not self.gone():
                self.announce(("stop",))
                told = True
        finally:
            groups = [self._control, self._data]
            self._control = self._data = self._store = None
            if not told:
                for i in range(len(groups)):  # (by index: a loop variable would keep the last group alive here)
                    try:
                        groups[i].abort()
                    except Exception:  # nothing more to do for a group that cannot abort
                        pass
                # Even aborted, a group's destructor joins its gloo threads, and one blocked on a send to the dead rank
                # never returns (test_a_dead_rank_fails_the_step_instead_of_hanging hung there in full make test runs):
                # the last references go on a daemon thread, which the process does not wait for.
                threading.Thread(target=groups.clear, name="sieve-tp-dead-groups", daemon=True).start()
