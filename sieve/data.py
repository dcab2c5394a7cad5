"""Where sieve finds the shared data files (wikitext-2, TinyStories samples) that benchmarks, calibration and
distillation read: `$SIEVE_SHARED_DATA`, else `../shared/data` beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def shared_data(name: str = "") -> Path:
    """The shared data folder, or the file `name` in it."""
    root = os.environ.get("SIEVE_SHARED_DATA")
    base = Path(root) if root else CHECKOUT.parent / "shared" / "data"
    return base / name if name else base
