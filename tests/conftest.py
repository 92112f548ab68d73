"""Tests run on the CPU with 8 emulated devices (set before JAX starts its backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

import t5scale  # noqa: E402,F401  (sets the CPU collective-ordering flag first)

jax.config.update("jax_num_cpu_devices", 8)
