"""LoRA adapters over one base model (sieve/lora): PEFT's format read and checked (adapter.py), the adapters an engine
serves and keeps in memory (manager.py), and one step's rows grouped by adapter with their low-rank products
(batch.py)."""

from sieve.lora.adapter import LoRAAdapter, LoRAError
from sieve.lora.batch import LoRABatch
from sieve.lora.manager import LoRAManager, LoRARequest

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAError", "LoRAManager", "LoRARequest"]
