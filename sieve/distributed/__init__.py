"""Beyond one process: tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

    TensorParallelGroup   this rank's collectives and the driver's commands (parallel.py)
    check_shardable, shard_arch, shard_tensor   which part of the model a rank holds (shard.py)
    TensorParallelWorkers, run_worker, start_tensor_parallel   starting the ranks, and a worker's loop (worker.py)
"""

from sieve.distributed.parallel import TensorParallelGroup
from sieve.distributed.shard import check_shardable, shard_arch, shard_tensor
from sieve.distributed.worker import TensorParallelWorkers, launched_by_torchrun, run_worker, start_tensor_parallel

__all__ = ["TensorParallelGroup", "TensorParallelWorkers", "check_shardable", "launched_by_torchrun", "run_worker", "shard_arch",
           "shard_tensor", "start_tensor_parallel"]
