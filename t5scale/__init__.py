"""t5scale: how to spread mT5 training over many accelerators (ZeRO stages as JAX shardings)."""

import os

# XLA's CPU scheduler may reorder independent collectives differently on each emulated device,
# which deadlocks (or corrupts) programs that use collectives over two mesh axes at once. Keeping
# program order costs nothing on real accelerators (the flag is CPU-only) and must be set before
# the backend starts, hence at import.
_CPU_ORDERED_COLLECTIVES = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} {_CPU_ORDERED_COLLECTIVES}".strip()
    )

__version__ = "0.1.0"
