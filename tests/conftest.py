"""Tests run on the CPU with 8 emulated devices (set before JAX starts its backend), and the
helpers the test modules share (`from conftest import ...`).

Compiled programs go to a persistent compilation cache shared by this session's workers and the
processes they start: many tests compile the same small programs (a killed run and its restart,
the processes of a multi-host run), and compiling is most of the suite's time. The cache is fresh for
each session, so each program of half a second's compile or more is still compiled once per run
of the suite.
"""

import functools
import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
# This process made the cache (the xdist controller, or a run without workers): it removes it.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"t5scale-tests-{_session}")
)
# Programs that compile in under half a second are not written: most are never read again, and
# the writes cost more than the reads save (tests/test_zero.py, test_numerics.py and
# test_remat.py: 79 s -> 76 s, two runs each). A study's trials write every program
# (t5scale/study/trial.py).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# The what-if wing's cache of step analyses (t5scale/whatif/compile.py) is the session's too, not
# the user's: a test must compile what it reads, on a fresh machine as here.
os.environ.setdefault(
    "XDG_CACHE_HOME", os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "xdg")
)
# t5scale before jax: where jax's CUDA plugin is installed, JAX then starts quietly on the CPU.
importlib.import_module("t5scale")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from t5scale import xla_cpu  # noqa: E402
from t5scale.errors import UnsupportedJaxError  # noqa: E402

# The tests emulate devices on the CPU, so they apply its workarounds, as the CLI does there.
xla_cpu.configure_cpu_devices(8)
# LLVM without its optimisations (for the tests' processes and those they start): the suite
# compiles some 600 small programs and runs each a few steps, and LLVM's optimisation of the
# emitted code was a third of each compile (tests/test_zero.py with test_precision_training.py:
# 185 s -> 125 s). It runs after XLA's passes and buffer assignment, so the programs the tests
# inspect (HLO, shardings, collectives, memory) are the same; only their machine code is slower.
# The numerics tests compare programs compiled alike. User runs keep XLA's default level.
xla_cpu.add_xla_flag("--xla_backend_optimization_level=0")
# XLA:CPU's classic fusion emitters, not its newer MLIR ones (the default): a train step compiles
# in 3.5 s instead of 6 s (mt5_tiny, ZeRO-3, 8 devices). The program t5scale makes is the same:
# its shardings and every collective (kind, shape, groups) come from the SPMD partitioner,
# before fusion; XLA fuses a few reductions differently (temporaries of that step: 799,896
# bytes against 799,704), and its losses were the same to the bit. User runs keep the default.
xla_cpu.add_xla_flag("--xla_cpu_use_fusion_emitters=false")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:  # workers have finished by now; a fresh session compiles afresh anyway
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The longest test files, longest first (their time in the suite on 2 cores, 2026-11-30): each
# runs whole in one worker, so that the two workers end together rather than one waiting on a
# long file that started last. xdist would otherwise start the files with the most tests first
# (--no-loadscope-reorder in pyproject.toml keeps this order). Here every file of 15 s or more;
# the rest, each shorter, follow as collected.
LONGEST_FILES = (
    "test_study.py", "test_attention.py", "test_checkpoint.py", "test_tpu.py",
    "test_multihost_training.py", "test_data.py", "test_multihost.py", "test_zero.py",
    "test_pipeline.py", "test_precision_training.py", "test_xla_gpu.py", "test_cli.py",
    "test_loss.py", "test_fp8.py", "test_hf_import.py", "test_zero_across_slices.py",
    "test_remat.py", "test_replicas.py", "test_device_profile.py", "test_records.py",
    "test_precision.py", "test_numerics.py", "test_bad_input.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_sessionstart(session):
    """Without t5scale's channel-id stand-in (t5scale/xla_cpu.py) a newer JAX would deadlock the
    multi-device tests: stop at once and say why instead."""
    try:
        assert xla_cpu.patch_cpu_collectives(), "the tests run on the CPU backend"
    except UnsupportedJaxError as error:
        pytest.exit(str(error), returncode=3)


from t5scale.cli import IN_CHILD, main  # noqa: E402
from t5scale.data.config import DataConfig  # noqa: E402
from t5scale.data.synthetic import synthetic_batch  # noqa: E402
from t5scale.model.sizes import ModelConfig  # noqa: E402
from t5scale.parallel.mesh import ParallelConfig  # noqa: E402
from t5scale.train.config import CheckpointConfig, RunConfig, TrainConfig  # noqa: E402
from t5scale.train.optim import OptimizerConfig  # noqa: E402
from t5scale.train.precision import PrecisionConfig  # noqa: E402
from t5scale.train.setup import Setup, build_setup  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOCAL_SH = str(REPO / "launch" / "local.sh")

# The small model and run the numerics tests share: every stage and mesh must train it alike.
TINY_MODEL = ModelConfig(vocab_size=1024)
TINY_DATA = DataConfig(input_length=32, target_length=16)
TINY_OPTIMIZER = OptimizerConfig(learning_rate=3e-3, warmup_steps=2)
TINY_BATCH = 8
# The CLI's flags for the same kind of run (mt5_tiny, synthetic batches).
TINY_ARGS = [
    "--gin_file=gin/models/mt5_tiny.gin",
    "--gin.INPUT_LENGTH=32",
    "--gin.TARGET_LENGTH=16",
    "--gin.DATA_SOURCE=synthetic",  # the corpus pipeline has its own tests (test_data.py)
]


# ---- the train step, built the one way the code builds it -----------------------------------


def tiny_run(parallel: ParallelConfig, **changes) -> RunConfig:
    """The shared small run on `parallel`; keyword arguments replace RunConfig's fields
    (model, optimizer, data) or TrainConfig's (batch_size, micro_batches, ...)."""
    train_fields = {
        k: changes.pop(k) for k in list(changes) if k in TrainConfig.__dataclass_fields__
    }
    run = RunConfig(
        model=changes.pop("model", TINY_MODEL),
        parallel=parallel,
        optimizer=changes.pop("optimizer", TINY_OPTIMIZER),
        train=TrainConfig(**({"batch_size": TINY_BATCH} | train_fields)),
        data=changes.pop("data", TINY_DATA),
        checkpoint=changes.pop("checkpoint", CheckpointConfig()),
        precision=changes.pop("precision", PrecisionConfig()),
    )
    assert not changes, f"unknown fields {changes}"
    return run


def tiny_setup(parallel: ParallelConfig, devices: int = 8, **changes) -> Setup:
    return build_setup(tiny_run(parallel, **changes), jax.devices()[:devices])


def synthetic_batches(setup: Setup, first: int, last: int) -> list:
    """The global synthetic batches of steps first..last, in the setup's batch sharding."""
    run = setup.run
    return [
        jax.device_put(
            synthetic_batch(run.data, run.train.batch_size, run.model.vocab_size, 0, index),
            setup.batch_sharding(),
        )
        for index in range(first, last + 1)
    ]


def run_steps(setup: Setup, state, first: int, last: int, step=None):
    """(state, losses) after steps first..last on synthetic batches, one step per execution."""
    step = step or setup.compile().compiled
    losses = []
    for batch in synthetic_batches(setup, first, last):
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    return state, np.array(losses)


def train_tiny(parallel: ParallelConfig, devices: int = 8, steps: int = 5,
               **changes):  # fmt: skip
    """(losses, parameters on the host) after `steps` steps of the shared small run; the
    parameters in their checkpointed form (fp32, the model's shapes: the master when mixed)."""
    setup = tiny_setup(parallel, devices, **changes)
    state, losses = run_steps(setup, setup.create_state(seed=0), 0, steps - 1)
    return losses, jax.device_get(setup.form.to_canonical(state).params)


@functools.cache  # per process: under xdist a module's tests may interleave with others'
def one_device_reference():
    """(losses, parameters) of the shared small run on one device: what every stage and mesh
    must reproduce."""
    return train_tiny(ParallelConfig(), devices=1)


def relative_difference(a, b) -> float:
    """‖a − b‖ / ‖b‖ over one parameter (max-abs would flag Adam's sign-like updates of
    near-zero gradients, which turn rounding noise into a full learning-rate step)."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_same_parameters(params, reference, tolerance: float = 1e-5) -> None:
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True)
    worst = max(relative_difference(got, want) for got, want in leaves)
    assert worst <= tolerance, worst


# ---- the command line, as a user runs it ------------------------------------------------------


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 600):
    """`t5scale ARGS` in a process of its own: a CompletedProcess with text output."""
    return subprocess.run(
        [sys.executable, "-m", "t5scale.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy(),
    )  # fmt: skip


def cli_in_process(args: list[str], capsys) -> tuple[int, str, str]:
    """t5scale.cli.main(args) in this process: (exit code, stdout, stderr)."""
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_inline(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """As cli_in_process, and the commands that compile in a child process of their own (plan,
    simulate) run here as that child would: where the child proves nothing more (a GPU compile,
    a plan within the 8 emulated devices). test_cli.py keeps a real child for XLA's abort."""
    monkeypatch.setenv(IN_CHILD, "1")
    return cli_in_process(args, capsys)


def count_parses(monkeypatch) -> list[str]:
    """The texts t5scale's HLO parser is given from now on (in this test), wherever a module
    imported it by name."""
    from t5scale.analysis import hlo_module

    parse, parsed = hlo_module.parse_module, []

    def counted(text: str) -> hlo_module.Module:
        parsed.append(text)
        return parse(text)

    for module in [m for name, m in sys.modules.items() if name.startswith("t5scale")]:
        if getattr(module, "parse_module", None) is parse:
            monkeypatch.setattr(module, "parse_module", counted)
    return parsed


# ---- several processes on 127.0.0.1 -----------------------------------------------------------


def process_env(**extra: str) -> dict:
    """The environment of a process of a local multi-process run: no scheduler settings leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "T5SCALE_"))}
    return env | {"JAX_PLATFORMS": "cpu", "PYTHON": sys.executable} | extra


def finish(processes: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """(exit code, stdout and stderr) of each process, once it has ended."""
    results = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        results.append((process.returncode, out + (err or "")))
    return results


def free_port() -> int:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        return server.getsockname()[1]


# What srun does for t5scale's purposes: start SLURM_NTASKS copies of the command, each with
# the task variables, here all on 127.0.0.1.
FAKE_SRUN = """#!/usr/bin/env bash
options=()
while [[ $1 == --* ]]; do options+=("$1"); shift; done
echo "srun ${options[*]}"
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=127.0.0.1 SLURM_STEP_NUM_NODES=1 "$@" &
  pids+=($!)
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""


def fake_slurm_env(tmp_path: Path) -> dict[str, str]:
    """This environment without SLURM or t5scale settings, a stand-in srun first on PATH and a
    free coordinator port."""
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "T5SCALE_"))}
    return env | {"PATH": f"{tmp_path}:{env['PATH']}", "T5SCALE_COORDINATOR_PORT": str(free_port())}


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's own reader over the event files in `logdir`: tag → [(step, value)]."""
    # Where TensorFlow is installed the reader imports it (7 s of a worker's time, for files
    # its own stand-in reads as well); a module named tensorboard.compat.notf makes it take
    # the stand-in, as a TensorBoard built without TensorFlow does.
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    events = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    return {
        tag: [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }
