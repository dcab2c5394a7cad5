"""`python -m sieve.kernels`: build the native CPU kernels for this machine now (make install runs it), so that no
server compiles at first use. Prints the instruction set built for; exits 1 where they cannot be built."""

import logging
import sys

from sieve.kernels import cpu_isa, cpu_ops

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
ops = cpu_ops()
if ops is None:
    print("sieve's native CPU kernels could not be built here; sieve runs on its PyTorch path", file=sys.stderr)
    sys.exit(1)
print(f"sieve's native CPU kernels are built ({ops.isa}; this CPU's best: {cpu_isa()})")
