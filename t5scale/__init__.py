"""t5scale: how to spread mT5 training over many accelerators (ZeRO stages as JAX shardings).

Importing it changes nothing in JAX: a process that emulates devices on the CPU says so with
t5scale.xla_cpu.emulate_cpu_devices (the CLI and the tests do).
"""

__version__ = "0.1.0"
