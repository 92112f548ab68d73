"""How JAX starts in a t5scale process where an accelerator's compiler is installed but no
accelerator is.

The `gpu-compile` extra installs jax's CUDA plugin and the `tpu` extra libtpu, so that a laptop
or a login node can compile for a GPU cluster or a TPU pod it does not have (t5scale/xla_gpu.py,
t5scale/xla_tpu.py). Left alone, either spoils every command on such a machine: JAX tries it
first and prints a traceback ("Unable to load CUDA") or libtpu's complaints that it finds no TPU
VM, and importing jax prints an absl line per GPU library ("Could not find cuda drivers on
your machine"). So, before jax is imported, and only where the plugin or libtpu is installed:

- without the accelerator (no NVIDIA driver, no TPU chip on the PCI bus) and without
  JAX_PLATFORMS set by the user, JAX_PLATFORMS defaults to `cpu`: every command runs on the
  CPU as it does without them, and compile-only devices still come from
  jax.experimental.topologies;
- the absl lines the CUDA plugin's registration prints are dropped; anything else passes
  through.

On a GPU machine or a TPU VM, or with JAX_PLATFORMS set, nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import os
import sys
import tempfile

# The lines jaxlib's CUDA stubs print when no driver is loaded (absl, before its log is set up).
_STUB_LINES = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")


# jax's CUDA plugins, as jax itself looks for them (CUDA 13 first)
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def cuda_plugin_installed() -> bool:
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ValueError:  # imported as None: kept out on purpose
            continue
    return False


def libtpu_installed() -> bool:
    try:
        return importlib.util.find_spec("libtpu") is not None
    except ValueError:
        return False


def tpu_chips_present() -> bool:
    """Whether a TPU chip is on this machine's PCI bus (Google's vendor id, as jax looks)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with contextlib.suppress(OSError), open(vendor) as file:
            if file.read().strip() == "0x1ae0":
                return True
    return False


def nvidia_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def captured_stderr():
    """Run the body with file descriptor 2 captured (C++ writes there, not to sys.stderr);
    the list it yields holds the captured lines afterwards."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines += captured.read().decode(errors="replace").splitlines(keepends=True)


@contextlib.contextmanager
def _without_stub_lines():
    """Run the body; then print what it wrote to stderr, less the stubs' lines."""
    with captured_stderr() as lines:
        yield
    sys.stderr.writelines(line for line in lines if not any(s in line for s in _STUB_LINES))
    sys.stderr.flush()


def start_jax() -> None:
    """Import jax as the module docstring says (a no-op once jax is imported)."""
    if "jax" in sys.modules:
        return
    cuda, tpu = cuda_plugin_installed(), libtpu_installed()
    if not cuda and not tpu:
        return
    driver = cuda and nvidia_driver_present()
    chips = tpu and tpu_chips_present()
    if not chips and not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cuda,cpu" if driver else "cpu"
    if driver or not cuda:
        return
    with _without_stub_lines():
        import jax  # noqa: F401
        from jax._src import xla_bridge

        # The stubs speak when the plugin is registered (once, before any backend starts, so
        # CPU devices can still be configured after it). A private function: without it, the
        # lines come later, and that is all.
        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()


@contextlib.contextmanager
def absl_quiet():
    """Run the body with absl's Python log (TensorFlow's, orbax's) at FATAL: for warnings
    that say nothing to the user (t5scale reports what matters in its own line)."""
    from absl import logging as absl_logging  # comes with orbax and TensorFlow

    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.FATAL)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)
