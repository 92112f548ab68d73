"""t5scale: how to spread mT5 training over many accelerators (ZeRO stages as JAX shardings)."""

from t5scale import xla_cpu

# Before JAX starts its backend or lowers anything: see t5scale/xla_cpu.py.
xla_cpu.keep_collectives_in_program_order()
xla_cpu.give_collectives_distinct_channels()

__version__ = "0.1.0"
