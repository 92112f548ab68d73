"""A profiled step's device time by kernel class (t5scale/analysis/device_profile.py) and the GPU
check's profile of its step items (bench/gpu_check_profile.py, bench/gpu_profile_table.py).

Without a GPU (issue 59 allows it): mt5_tiny's step profiled as the dry run profiles it, whose
XLA:CPU operations on the host's threads stand in for a GPU's kernels. That proves the reader,
not a GPU. A GPU's trace keeps its kernels on the device's streams, a form one small trace
written here checks."""

import gzip
import json
import sys

import jax
import pytest
from conftest import REPO

from t5scale.analysis.device_profile import (
    CLASSES,
    device_profile,
    instruction_classes,
    instruction_cuts,
    read_trace,
)
from t5scale.analysis.hlo_module import array_shape, parse_module
from t5scale.analysis.kernel_rates import attention_by_pass, bandwidth_by_size
from t5scale.analysis.kernels import read_program
from t5scale.analysis.top_ops import top_ops
from t5scale.data.synthetic import synthetic_batch
from t5scale.target import Target
from t5scale.train.setup import build_setup

sys.path.insert(0, str(REPO / "bench"))  # the scripts' sibling modules, as a script has them
from gpu_check_items import step_run  # noqa: E402
from gpu_check_list import DRY_RUN, Results, read_lines  # noqa: E402
from gpu_check_profile import PROFILED_STEPS, profile_directory, profile_steps  # noqa: E402
from gpu_profile_table import profile_tables  # noqa: E402

ITEM = "step mt5_tiny dots fused loop"


@pytest.fixture(scope="module")
def stepped():
    """mt5_tiny's dry-run step on one CPU device, compiled, and its batches."""
    run = step_run(DRY_RUN, model="mt5_tiny", remat="dots", attention="fused", scan_layers=True)
    setup = build_setup(run, Target.local(1))
    step = setup.compile()
    batches = [
        jax.device_put(
            synthetic_batch(run.data, run.train.batch_size, run.model.vocab_size, 0, i),
            setup.batch_sharding(),
        )
        for i in range(2)
    ]
    return run, setup, step, batches


@pytest.fixture(scope="module")
def profiled(stepped, tmp_path_factory):
    """The step item's profile, as the GPU check saves it: (results file, its lines)."""
    _, setup, step, batches = stepped
    state, _ = step.compiled(setup.create_state(), batches[0])  # as after the timed steps
    results = Results(tmp_path_factory.mktemp("check") / "results.jsonl", ITEM)
    results.write(step_s=0.05)
    profile_steps(results, step, state, batches, step_s=0.05)
    return results.path, read_lines(results.path)


def test_the_profile_is_saved_small_with_every_kernel_named(profiled):
    path, lines = profiled
    saved = lines[-1]
    directory = path.parent / saved["profile"]
    assert directory == profile_directory(path.parent, ITEM)
    assert sorted(p.name for p in directory.iterdir()) == sorted(saved["profile_bytes"])
    assert saved["profiled_steps"] == PROFILED_STEPS and saved["profile_on"] == "cpu"
    # Every XLA:CPU operation it kept names its HLO op; gzipped, all of it is small.
    assert saved["profile_events"] == saved["profile_events_with_hlo_op"] > 0
    assert sum(saved["profile_bytes"].values()) < 2**20


def test_every_kernel_is_classed_and_each_runs_once_a_step(profiled):
    """Each operation joins its instruction by HLO op; the GEMMs run as often as the kernel
    inventory counts them, loops multiplied out (its other classes count inside XLA:CPU's small
    calls, which run as one operation)."""
    path, lines = profiled
    directory = path.parent / lines[-1]["profile"]
    with gzip.open(directory / "program.hlo.txt.gz", "rt") as text:
        module = parse_module(text.read())
    profile = device_profile(read_trace(directory / "trace.json.gz"), module, PROFILED_STEPS)
    assert profile.by_name == 0 and profile.other_programs == 0
    assert profile.uneven_ops == ()  # the profiled steps divide every operation's count
    assert profile.kernels["gemm"] == read_program(module).inventory.gemm.count > 0
    # The layers' loops hold their bodies' operations: left out, once per loop and step.
    assert profile.containers and profile.containers % PROFILED_STEPS == 0
    # Time: the classes hold every operation's; busy is within them and the wall.
    assert profile.seconds["gemm"] > 0 and profile.seconds["elementwise"] > 0
    assert sum(profile.seconds.values()) >= profile.busy_s > 0
    assert profile.wall_s >= profile.busy_s and profile.idle_s >= 0
    assert 0 < profile.cuts["head_and_loss"] < profile.busy_s
    assert 0 < profile.cuts["update"] < profile.busy_s


def test_the_cuts_find_the_head_and_the_update(stepped):
    """The head's projection (a GEMM with the vocabulary's dimension) is in the head and loss;
    the update after the gradient (AdamW) has no GEMM."""
    run, _, step, _ = stepped
    module = parse_module(step.compiled.as_text())
    classes, cuts = instruction_classes(module), instruction_cuts(module)
    head = [name for name, cut in cuts.items() if cut == "head_and_loss"]
    vocab = run.model.vocab_size
    assert any(
        classes.get(name) == "gemm" and vocab in array_shape(module.types[name])[1] for name in head
    )
    assert not [
        name for name, cut in cuts.items() if cut == "update" and classes.get(name) == "gemm"
    ]


def test_the_table_has_each_class_the_idle_time_and_the_cuts(profiled):
    path, _ = profiled
    table = profile_tables(path)
    assert f"### {ITEM}" in table and "XLA:CPU's operations" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(CLASSES) + 6 + 4  # header, classes, totals, cuts; by size
    labels = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert labels[1:4] == ["GEMMs", "attention kernels", "elementwise fusions"]
    assert labels[-8:-4] == ["idle between kernels", "the step on the device",
                             "of which the head and loss",
                             "of which the update after the gradient (AdamW)"]  # fmt: skip
    # then the fusions and copies by size (the interpreted attention has no kernels of its own)
    assert labels[-4:] == ["kernels of", "over 64 MB", "4–64 MB", "under 4 MB"]
    assert "Its attention kernels by pass" not in table


def test_a_failing_profiler_costs_the_profile_alone(stepped, tmp_path):
    _, setup, step, batches = stepped
    results = Results(tmp_path / "results.jsonl", ITEM)
    jax.profiler.start_trace(tmp_path / "other")  # one profile at a time: the next one fails
    try:
        state, _ = step.compiled(setup.create_state(), batches[0])
        profile_steps(results, step, state, batches, step_s=0.05)
    finally:
        jax.profiler.stop_trace()
    profile_steps(results, step, None, batches, step_s=30.0)  # too slow to profile: not tried
    failed, slow = read_lines(results.path)
    assert failed["profile"] is None and "RuntimeError" in failed["why"]
    assert not profile_directory(tmp_path, ITEM).exists()
    assert slow["profile"] is None and "not profiled" in slow["why"]
    assert "not profiled" in profile_tables(results.path)


def _gpu_trace(path, kernels) -> None:
    """A trace in the form XLA's trace viewer JSON gives a GPU: the device a process of its
    own, its streams threads named `Stream #…`, the host's events beside them."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel)"}},
        {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 701, "tid": 3, "ts": 0, "dur": 99, "name": "launch",
         "args": {"hlo_op": kernels[0][1], "hlo_module": "jit_step"}},
    ]  # fmt: skip
    for start, (name, op, duration) in zip((0, 12, 30, 42), kernels * 2, strict=True):
        args = {"hlo_op": op, "hlo_module": "jit_step"} if op else {}
        events.append({"ph": "X", "pid": 1, "tid": 7, "ts": start, "dur": duration,
                       "name": name, "args": args})  # fmt: skip
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)


def test_a_gpu_trace_is_read_from_the_device_streams(stepped, tmp_path):
    """Two steps of two kernels: a GEMM joined by its HLO op, and a cuBLAS kernel without one
    joined by its place to the program's next GEMM; the host's events are not the device's."""
    _, _, step, _ = stepped
    module = parse_module(step.compiled.as_text())
    gemm = next(name for name, kind in instruction_classes(module).items() if kind == "gemm")
    _gpu_trace(tmp_path / "trace.json.gz", [("gemm_kernel", gemm, 10), ("nvjet_tst_64x8", None, 8)])
    trace = read_trace(tmp_path / "trace.json.gz")
    assert trace.source == "gpu" and len(trace.kernels) == 4
    profile = device_profile(trace, module, steps=2)
    assert profile.kernels["gemm"] == 2 and profile.by_name == 0 and profile.by_place == 2
    # Kernels at 0-10, 12-20, 30-40, 42-50 µs: a wall of 25 µs a step, 18 busy, 7 idle.
    assert profile.seconds["gemm"] == pytest.approx(18e-6)
    assert profile.wall_s == pytest.approx(25e-6) and profile.busy_s == pytest.approx(18e-6)
    assert profile.idle_s == pytest.approx(7e-6) and profile.concurrent_s == pytest.approx(0)


# XLA:GPU's (jax 0.11) form inside a command buffer: each kernel's `hlo_op` is the command
# buffer's thunk, which no HLO text has; a fusion's kernel bears its instruction's name, `.` as
# `_`; cuBLAS's (a Memset, then nvjet) and the driver's memcpy bear none. Args as the H200's
# trace has them, trimmed.
_PROGRAM = """HloModule jit_step, is_scheduled=true

%fused_add.1 (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %add.1 = bf16[64,64]{1,0} add(%p0, %p1), metadata={op_name="jit(step)/jvp(MT5)/encoder/add"}
}

ENTRY %main.1 (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %copy.3 = bf16[64,64]{1,0} copy(%a)
  %custom-call.20 = (bf16[64,64]{1,0}, s8[1024]{0}) custom-call(%copy.3, %b), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(MT5)/encoder/dot_general"}
  %get-tuple-element.1 = bf16[64,64]{1,0} get-tuple-element(%custom-call.20), index=0
  ROOT %loop_add_fusion.12 = bf16[64,64]{1,0} fusion(%get-tuple-element.1, %b), kind=kLoop, calls=%fused_add.1
}
"""
_GRAPH_KERNELS = (  # name, duration in µs: one step, in the order the graph runs them
    ("memcpy32_post", 2.0), ("Memset 0", 1.0),
    ("nvjet_sm90_tss_128x136_64x6_2x1_v_bz_NNT", 40.0), ("loop_add_fusion_12", 5.0),
)  # fmt: skip


def _graph_trace(path, steps: int) -> None:
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name",
         "args": {"name": "Stream #14(Memset,Compute)"}},
    ]  # fmt: skip
    start = 0.0
    for step in range(steps):
        for node, (name, duration) in enumerate(_GRAPH_KERNELS):
            args = {"context_id": "$$1", "correlation_id": str(step + 1), "cuda_graph_id": "147",
                    "cuda_graph_node_id": str(631360192530 + node), "hlo_module": "jit_step",
                    "hlo_op": "command_buffer_188", "tf_op": "XlaModule:"}  # fmt: skip
            events.append({"ph": "X", "pid": 1, "tid": 14, "ts": start, "dur": duration,
                           "name": name, "args": args})  # fmt: skip
            start += duration + 1.0
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)


def test_a_command_buffers_kernels_join_their_instructions(tmp_path):
    """The fusion joins by its name, cuBLAS's Memset and GEMM the custom call, the memcpy the
    copy; so no kernel is classed by its own name, and each instruction runs once a step."""
    _graph_trace(tmp_path / "trace.json.gz", steps=2)
    trace = read_trace(tmp_path / "trace.json.gz")
    profile = device_profile(trace, _PROGRAM, steps=2)
    assert profile.by_name == 0 and profile.by_place == 2 * 3 and profile.uneven_ops == ()
    assert profile.seconds["gemm"] == pytest.approx(41e-6)  # the Memset is cuBLAS's
    assert profile.seconds["copy"] == pytest.approx(2e-6)
    assert profile.seconds["elementwise"] == pytest.approx(5e-6)
    ops = top_ops(trace, parse_module(_PROGRAM), 2, leave_out=("gemm",))
    assert [(op.instruction, op.launches) for op in ops] == [
        ("loop_add_fusion.12", 1), ("copy.3", 1)]  # fmt: skip
    assert "add" in ops[0].summary and ops[0].op_name == "jvp(MT5)/encoder/add"


def test_the_rates_are_read_kernel_by_kernel(tmp_path):
    """The copy's and the fusion's bytes (as the kernel inventory counts them) over their own
    kernels' time, not the GEMM's; the attention kernels by pass, by their names."""
    _graph_trace(tmp_path / "trace.json.gz", steps=2)
    trace = read_trace(tmp_path / "trace.json.gz")
    over, middle, under = bandwidth_by_size(trace, parse_module(_PROGRAM), steps=2)
    assert over.kernels == middle.kernels == 0
    # copy.3: 8 kB read and written; loop_add_fusion.12: two 8 kB read, 8 kB written
    assert under.kernels == 2 and under.bytes == 16384 + 24576
    assert under.seconds == pytest.approx(7e-6)  # 2 µs and 5 µs: the memcpy, the add
    _gpu_trace(tmp_path / "attention.json.gz",
               [("t5_attention_backward_dkv__1", None, 10), ("t5_attention_forward_causal", None, 8)])  # fmt: skip
    passes = attention_by_pass(read_trace(tmp_path / "attention.json.gz"), steps=2)
    assert passes == pytest.approx(
        {"t5_attention_backward_dkv": 10e-6, "t5_attention_forward_causal": 8e-6}
    )
