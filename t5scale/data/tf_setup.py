"""TensorFlow and seqio for the input pipeline only: imported on first use, quiet, bounded, off the GPU.

Importing this module imports TensorFlow, so only the corpus pipeline imports it: synthetic-data
runs and the CLI never pay TensorFlow's start-up (a test checks this). TensorFlow's C++ start-up
logging (and the CUDA-stub lines of its GPU build on a machine without CUDA) is written to file
descriptor 2 before any Python setting can reach it, so stderr is closed for the import alone.
"""

from __future__ import annotations

import contextlib
import os

#: Threads TensorFlow may use for the input pipeline; the training step owns the rest.
TF_THREADS = int(os.environ.get("T5SCALE_TF_THREADS", "2"))


@contextlib.contextmanager
def _stderr_silenced():
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _import_tensorflow():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with _stderr_silenced():
        import seqio  # noqa: F401  (imports tensorflow and tensorflow_text, which log)
        import tensorflow

        tensorflow.get_logger().setLevel("ERROR")
        # Before TensorFlow's first op. Listing devices starts its runtime, which logs a cuInit
        # failure on machines without CUDA: hence still inside the silenced block.
        tensorflow.config.set_visible_devices([], "GPU")  # the accelerators belong to JAX
        tensorflow.config.threading.set_inter_op_parallelism_threads(TF_THREADS)
        tensorflow.config.threading.set_intra_op_parallelism_threads(TF_THREADS)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # seqio's per-task info lines
    return tensorflow


tf = _import_tensorflow()
import seqio  # noqa: E402, F401  (after TensorFlow is set up)
