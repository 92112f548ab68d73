"""t5scale: how to spread mT5 training over many accelerators (ZeRO stages as JAX shardings).

Importing it changes nothing in JAX but for one case: where jax's CUDA plugin (the `gpu-compile`
extra) or libtpu (the `tpu` extra) is installed on a machine without that accelerator, JAX
starts on the CPU, quietly (t5scale/startup.py).
A process that emulates devices on the CPU says so with t5scale.xla_cpu.emulate_cpu_devices
(the CLI and the tests do).
"""

from t5scale.startup import start_jax

start_jax()

__version__ = "0.1.0"
