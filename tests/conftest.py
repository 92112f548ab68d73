"""Tests run on the CPU with 8 emulated devices (set before JAX starts its backend).

Compiled programs go to a persistent compilation cache shared by this session's workers and the
processes they start: many tests compile the same small programs (a killed run and its restart,
the processes of a cluster), and compiling is most of the suite's time. The cache is fresh for
each session, so each program is still compiled once per run of the suite.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"t5scale-tests-{_session}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

import t5scale  # noqa: E402,F401  (sets the CPU collective-ordering flag first)

jax.config.update("jax_num_cpu_devices", 8)
