"""The cluster model (t5scale/whatif/): collective times against hand-computed cases, the
collectives' placement and overlap read from a real compiled step, the compute roofline, and
bad cluster files."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from conftest import REPO, cli_inline, tiny_run, tiny_setup

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.flops import training_flops_per_step
from t5scale.analysis.hlo import first_group
from t5scale.analysis.peaks import GPU_DATASHEET
from t5scale.config import build_study_config, parse_gin
from t5scale.errors import ConfigError
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.target import Target
from t5scale.whatif.compile import PACKAGE, PROGRAM_CODE, analysis_key, program_code_digest
from t5scale.whatif.compute import ComputeTime, step_compute
from t5scale.whatif.gpu_cluster import ClusterConfig
from t5scale.whatif.nccl import Placement, collective_seconds, placement
from t5scale.whatif.step_time import (
    OverlapSeconds,
    combined,
    hidden_seconds,
    overlap_class,
    predict,
)
from t5scale.xla_gpu import COMBINE_THRESHOLD_BYTES

# Round figures, so that every expected time below can be checked by hand (the peaks too: given,
# they replace the GPU's datasheet figures).
CLUSTER = ClusterConfig(
    name="round", gpu="NVIDIA A100", gpus_per_node=8, peak_flops=100e12, peak_flops_float32=50e12,
    gemm_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0, roofline_fraction=1.0, memory_bandwidth=1e12,
    device_memory_gb=80, nvlink_bus_bandwidth=200e9, network_bus_bandwidth=100e9,
    nvlink_latency_s=1e-6, network_latency_s=10e-6, collective_launch_s=5e-6,
)  # fmt: skip
GB = 1e9


def test_ring_inside_one_node():
    # all-gather of 8 GB over 8 GPUs of one node: 7/8 of it through each NVLink, 7 steps
    seconds = collective_seconds("all-gather", 8 * GB, Placement(8, 1), CLUSTER)
    assert seconds == pytest.approx(5e-6 + 7 / 8 * 8 * GB / 200e9 + 7 * 1e-6)
    scatter = collective_seconds("reduce-scatter", 8 * GB, Placement(8, 1), CLUSTER)
    assert scatter == pytest.approx(seconds)
    # all-reduce: twice the bytes and twice the steps
    reduce = collective_seconds("all-reduce", 8 * GB, Placement(8, 1), CLUSTER)
    assert reduce == pytest.approx(5e-6 + 2 * 7 / 8 * 8 * GB / 200e9 + 14 * 1e-6)
    assert collective_seconds("all-reduce", 8 * GB, Placement(1, 1), CLUSTER) == 0


def test_across_nodes_the_network_and_the_group_share_of_nics_set_the_pace():
    # 4 nodes × 8 GPUs: the network's 100 GB/s (all 8 NICs) is slower than NVLink's 200
    # of the ring's 31 steps, 3 cross between nodes (NCCL's latency model)
    seconds = collective_seconds("all-gather", 32 * GB, Placement(32, 4), CLUSTER)
    assert seconds == pytest.approx(5e-6 + 31 / 32 * 32 * GB / 100e9 + 28 * 1e-6 + 3 * 10e-6)
    # 4 GPUs per node in the group: two such groups share each node's NICs, 50 GB/s each
    half = collective_seconds("all-gather", 16 * GB, Placement(16, 4), CLUSTER)
    assert half == pytest.approx(5e-6 + 15 / 16 * 16 * GB / 50e9 + 12 * 1e-6 + 3 * 10e-6)


def test_large_all_reduce_runs_as_a_ring_small_as_a_tree():
    where = Placement(64, 8)
    big = collective_seconds("all-reduce", 8 * GB, where, CLUSTER)
    assert big == pytest.approx(5e-6 + 2 * 63 / 64 * 8 * GB / 100e9 + 112 * 1e-6 + 14 * 10e-6)
    # 1 KB: the ring's 126 steps (14 between nodes) lose to the tree's 2 × (7 NVLink + 3
    # network) steps
    small = collective_seconds("all-reduce", 1024, where, CLUSTER)
    assert small == pytest.approx(5e-6 + 2 * 1024 / 100e9 + 2 * (7 * 1e-6 + 3 * 10e-6))
    # small messages fall short of the bus bandwidth: latency dominates them
    achieved = 2 * 63 / 64 * 1024 / small
    assert achieved < 0.01 * 100e9


def test_xla_combines_zero_collectives_up_to_the_threshold_of_the_launch_flags():
    flags = (REPO / "launch" / "xla_gpu_flags.sh").read_text()
    assert f"all_gather_combine_threshold_bytes={COMBINE_THRESHOLD_BYTES}" in flags
    mesh = {"replica": 1, "zero": 4, "tensor": 2}
    # 10 gathers of 1 MB over `zero` per layer, 24 layers; 2 all-reduces over `tensor`
    gather = CollectiveOp(kind="all-gather", count=240, bytes=2**20, operand_bytes=2**18,
                          group=(0, 2, 4, 6), computation="body", loops=(24,))  # fmt: skip
    tensor = dataclasses.replace(gather, kind="all-reduce", count=48, group=(0, 1))
    ops = combined([gather, tensor], mesh, threshold=4 * 2**20)
    assert tensor in ops  # each waits for the compute before it: never combined
    (merged,) = [op for op in ops if op.kind == "all-gather"]
    assert merged.count == 24 * 3  # 10 MB per layer in messages of at most 4 MB
    assert merged.count * merged.bytes == pytest.approx(240 * 2**20)  # nothing lost
    (whole,) = [op for op in combined([gather], mesh, 2**30) if op.kind == "all-gather"]
    assert whole.count == 24


def test_placement_of_replica_groups_on_nodes():
    assert placement(None, 32, 8) == Placement(32, 4)
    assert placement([0, 2, 4, 6, 8, 10, 12, 14], 16, 8) == Placement(8, 2)
    assert placement([0, 1], 16, 8) == Placement(2, 1)
    assert Placement(8, 2).local == 4


def test_replica_groups_in_both_hlo_spellings():
    assert first_group("replica_groups={{0,2},{1,3}}, dimensions={0}") == (0, 2)
    assert first_group("replica_groups=[2,4]<=[8], to_apply=%add") == (0, 1, 2, 3)
    # iota over [4,2], transposed: groups are the columns
    assert first_group("replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add") == (0, 2, 4, 6)
    assert first_group("replica_groups=[4,2]<=[2,2,2]T(2,1,0), to_apply=%add") == (0, 4)
    assert first_group("channel_id=1, to_apply=%add") is None


@pytest.fixture(scope="module")
def stage3_tensor2():
    """The compiled step's analysis at stage 3, zero 4 × tensor 2, on 8 devices."""
    return tiny_setup(ParallelConfig(zero_stage=3, zero=4, tensor=2)).compile().analysis


def test_compiled_collectives_know_their_loops_and_mesh_axes(stage3_tensor2):
    analysis = stage3_tensor2
    mesh, ops = analysis.mesh, analysis.collective_ops
    classes = {(op.kind, overlap_class(op, mesh)) for op in ops}
    # stage 3 gathers each layer's parameters inside the layer loops of both passes
    assert {("all-gather", "forward"), ("all-gather", "backward")} <= classes
    assert ("reduce-scatter", "backward") in classes  # each layer's gradient, as it is made
    # tensor parallelism's activation all-reduces: the next operation waits for them
    assert ("all-reduce", "exposed") in classes
    names = {name for op in ops for name in op.loop_names}
    assert any(name.endswith("encoder/while") for name in names)
    assert any("transpose(" in name and name.endswith("decoder/while") for name in names)


@pytest.mark.parametrize(
    "stage, kind, expected",
    # CI: stage 2's reduce-scatter; stage 1's all-reduce, placed by the same reading, slow
    [pytest.param(1, "all-reduce", "gradient_per_step", marks=pytest.mark.slow),
     (2, "reduce-scatter", "gradient")],
)  # fmt: skip
def test_gradient_reductions_are_placed_by_the_micro_batch_loop(stage, kind, expected):
    """With 2 micro-batches (as many as the tiny model's layers, so trip counts cannot tell the
    loops apart): stage 1 reduces once after accumulating, stage 2 once per micro-batch; the
    update's all-gather hides behind nothing."""
    setup = tiny_setup(ParallelConfig(zero_stage=stage, zero=8), batch_size=16, micro_batches=2)
    analysis = setup.compile().analysis
    classes: dict[str, set[str]] = {}
    for op in analysis.collective_ops:
        if op.bytes > 1024:  # not the scalars
            classes.setdefault(op.kind, set()).add(overlap_class(op, analysis.mesh))
    assert classes[kind] == {expected}
    assert classes["all-gather"] == {"exposed"}


def test_hidden_communication_by_hand():
    compute = ComputeTime(forward_layers=1.0, backward_layers=2.0, head=0.5, matmul_flops=0)
    by_class = OverlapSeconds(forward=0.5, backward=1.5, gradient=1.0, gradient_per_step=2.0,
                              exposed=7.0)  # fmt: skip
    # depth 4: a quarter of each class is never hidden. forward: 0.375 behind 1.0; backward:
    # 1.125 behind 2.0, leaving 0.875; gradient: 0.75 of it, leaving 0.125, of which the last
    # of 2 micro-batches' share, 0.0625, hides the once-per-step reduction
    got = hidden_seconds(by_class, compute, depth=4, micro_batches=2)
    assert got == pytest.approx(0.375 + 1.125 + 0.75 + 0.0625)
    # more layer traffic than compute: capped by each pass's own compute
    swamped = dataclasses.replace(by_class, forward=10.0, backward=10.0)
    assert hidden_seconds(swamped, compute, depth=4, micro_batches=1) == pytest.approx(3.0)


def test_overlap_switch(stage3_tensor2):
    model = ModelConfig(vocab_size=1024)
    slow = dataclasses.replace(CLUSTER, gpus_per_node=2, network_bus_bandwidth=1e6)
    on = predict(stage3_tensor2, model, slow, overlap=True)
    off = predict(stage3_tensor2, model, slow, overlap=False)
    assert off.hidden_s == 0 < on.hidden_s and on.step_s < off.step_s


def test_the_roofline_counts_the_model_flops_and_what_remat_recomputes():
    base = ModelConfig(name="mt5_small", dtype="bfloat16")
    flops = training_flops_per_step(base, 8, 512, 128, causal_attention_halved=False)
    time = {remat: step_compute(dataclasses.replace(base, remat=remat), 8, 512, 128, CLUSTER)
            for remat in ("dots", "minimal", "full")}  # fmt: skip
    assert time["dots"].matmul_flops == pytest.approx(flops)
    head = 2 * 8 * 128 * base.d_model * base.vocab_size  # the output projection's forward
    assert time["full"].matmul_flops == pytest.approx(flops + (flops / 3 - head))
    assert step_compute(base, 8, 512, 128, CLUSTER, tensor=2).matmul_flops == pytest.approx(
        flops / 2
    )
    forward = time["dots"].forward_layers
    # dots recomputes the elementwise work, minimal also attention's batched matmuls, full all
    assert 2 * forward < time["dots"].backward_layers < time["minimal"].backward_layers
    assert time["minimal"].backward_layers < time["full"].backward_layers
    assert time["full"].backward_layers == pytest.approx(3 * forward)


def test_compute_roofline_differs_per_model_size():
    parse_gin(["gin/clusters/a100.gin"], [])
    a100 = build_study_config("cluster")

    def efficiency(name: str) -> float:
        model = ModelConfig(name=name, dtype="bfloat16")
        time = step_compute(model, 8, 1024, 229, a100)
        return time.matmul_flops / time.total / (a100.peak_flops * a100.gemm_efficiency)

    small, xl = efficiency("mt5_small"), efficiency("mt5_xl")
    assert small < 0.8 * xl  # narrow layers and the vocabulary's logits are memory-bound work
    # the 250k-entry head is a larger share of mt5_small's step than of mt5_xl's
    share = {
        name: (t := step_compute(ModelConfig(name=name, dtype="bfloat16"), 8, 1024, 229, a100)).head
        / t.total
        for name in ("mt5_small", "mt5_xl")
    }
    assert share["mt5_small"] > 2 * share["mt5_xl"]


@pytest.mark.parametrize(
    "edit, named",
    [
        ("drop:ClusterConfig.network_bus_bandwidth", "network_bus_bandwidth"),
        ("ClusterConfig.nvlink_bus_bandwidth = -230e9", "nvlink_bus_bandwidth"),
        ("ClusterConfig.gpus_per_node = 0", "gpus_per_node"),
    ],
)
def test_a_bad_cluster_file_is_one_line_and_exit_2(tmp_path, edit, named, capsys, monkeypatch):
    lines = (REPO / "gin/clusters/a100.gin").read_text().splitlines()
    if edit.startswith("drop:"):
        lines = [line for line in lines if not line.startswith(edit.removeprefix("drop:"))]
    else:
        lines.append(edit)
    bad = tmp_path / "bad.gin"
    bad.write_text("\n".join(lines) + "\n")
    args = ["simulate", "--gin_file=gin/models/mt5_tiny.gin", f"--gin_file={bad}"]
    code, _, err = cli_inline(args, capsys, monkeypatch)
    assert code == 2, err[-2000:]
    message = err.strip().splitlines()
    assert len(message) == 1 and named in message[0], err


def test_cluster_config_refuses_an_efficiency_above_one():
    with pytest.raises(ConfigError, match="gemm_efficiency"):
        dataclasses.replace(CLUSTER, gemm_efficiency=1.5)


def test_a_cluster_files_gpu_peaks_are_the_datasheet_tables():
    for name, gpu in (("a100", "NVIDIA A100"), ("h100", "NVIDIA H100")):
        parse_gin([f"gin/clusters/{name}.gin"], [])
        cluster = build_study_config("cluster")
        peaks = GPU_DATASHEET[gpu]
        assert (cluster.peak_flops, cluster.peak_flops_float32) == (
            peaks["bfloat16"],
            peaks["float32"],
        )
    with pytest.raises(ConfigError, match="ClusterConfig.gpu must be one of NVIDIA H200"):
        dataclasses.replace(CLUSTER, gpu="NVIDIA Z9")


def test_the_analysis_cache_is_keyed_by_the_program_not_by_the_checkout():
    """Where the data's files are changes no program, so a cache filled in one clone serves
    another (the key held the vocabulary's absolute path: a seed study run in a second checkout
    compiled its 144 programs again); what the program is made of still changes the key."""
    run, target = tiny_run(ParallelConfig(zero_stage=1)), Target.local(2)
    moved = dataclasses.replace(run.data, corpus_dir="/elsewhere/corpus",
                                vocabulary="/elsewhere/vocab.model")  # fmt: skip
    assert analysis_key(dataclasses.replace(run, data=moved), target) == analysis_key(run, target)
    longer = dataclasses.replace(run.data, input_length=2 * run.data.input_length)
    assert analysis_key(dataclasses.replace(run, data=longer), target) != analysis_key(run, target)
    assert analysis_key(run, Target.local(1)) != analysis_key(run, target)
    assert analysis_key(run, target, 10**9) != analysis_key(run, target)


def test_the_analysis_cache_is_keyed_by_the_code_that_makes_the_program(tmp_path):
    """A copy of the package digests alike (a second clone shares the cache); a change to the
    model's code changes the digest, a change to the cluster model's pricing does not."""
    copy = tmp_path / "t5scale"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert all((copy / entry).exists() for entry in PROGRAM_CODE)
    assert program_code_digest(copy) == program_code_digest(PACKAGE)
    with open(copy / "whatif" / "gpu_step.py", "a") as f:
        f.write("# priced again\n")
    assert program_code_digest.__wrapped__(copy) == program_code_digest(PACKAGE)
    with open(copy / "model" / "head.py", "a") as f:
        f.write("# a changed program\n")
    assert program_code_digest.__wrapped__(copy) != program_code_digest(PACKAGE)
