"""Seconds per step from a compiled GPU program (t5scale/whatif/gpu_step.py), checked by
hand arithmetic on HLO text in the form XLA:GPU prints."""

import dataclasses

import pytest

from t5scale.analysis.hlo_module import parse_module
from t5scale.analysis.kernels import Kernel, read_program
from t5scale.errors import ConfigError
from t5scale.whatif.gpu_cluster import ClusterConfig
from t5scale.whatif.gpu_step import KERNEL_LAUNCH_S, kernel_seconds, predict_program

# Round figures: GEMMs at 50 TFLOP/s in bf16 and 25 in f32, fused attention at 10 in bf16,
# memory at 0.5 TB/s.
CLUSTER = ClusterConfig(
    name="round", gpu="NVIDIA H100", gpus_per_node=8, peak_flops=100e12, peak_flops_float32=50e12,
    gemm_efficiency=0.5, attention_efficiency=0.1, memory_efficiency=0.5, roofline_fraction=1.0,
    memory_bandwidth=1e12,
    device_memory_gb=80, nvlink_bus_bandwidth=100e9, network_bus_bandwidth=50e9,
    nvlink_latency_s=1e-6, network_latency_s=10e-6, collective_launch_s=5e-6,
)  # fmt: skip

GEMM = (
    '{"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,'
    '"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
    '"epilogue":"DEFAULT"}}'
)
COLLECTIVE = '{"operation_queue_id":"0","collective_backend_config":{"is_sync":IS_SYNC}}'

# 8 devices: gather a bf16[1024,1024] from 128-row shards; an f32 512³ GEMM runs while it
# flies; then an add fusion of the gathered matrix and a bf16 1024³ GEMM.
STEP = f"""HloModule jit_step, is_scheduled=true, num_partitions=8

%fused_add (param_0: bf16[1024,1024], param_1: bf16[1024,1024]) -> bf16[1024,1024] {{
  %param_0 = bf16[1024,1024]{{1,0}} parameter(0)
  %param_1 = bf16[1024,1024]{{1,0}} parameter(1)
  ROOT %add.1 = bf16[1024,1024]{{1,0}} add(%param_0, %param_1)
}}

ENTRY %main.2 (p0: bf16[1024,1024], p1: bf16[1024,1024], p2: f32[512,512], p3: bf16[128,1024]) -> (bf16[1024,1024], f32[512,512]) {{
  %p3 = bf16[128,1024]{{1,0}} parameter(3)
  %p2 = f32[512,512]{{1,0}} parameter(2)
  %p1 = bf16[1024,1024]{{1,0}} parameter(1)
  %p0 = bf16[1024,1024]{{1,0}} parameter(0)
  %all-gather-start = (bf16[128,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p3), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, dimensions={{0}}, use_global_device_ids=true, backend_config={COLLECTIVE}
  %custom-call.2 = (f32[512,512]{{1,0}}, s8[4194304]{{0}}) custom-call(%p2, %p2), custom_call_target="__cublas$lt$matmul", backend_config={GEMM}
  %all-gather-done = bf16[1024,1024]{{1,0}} all-gather-done(%all-gather-start)
  %loop_add_fusion = bf16[1024,1024]{{1,0}} fusion(%all-gather-done, %p1), kind=kLoop, calls=%fused_add
  %custom-call.1 = (bf16[1024,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(%loop_add_fusion, %p0), custom_call_target="__cublas$lt$matmul", backend_config={GEMM}
  %get-tuple-element.1 = bf16[1024,1024]{{1,0}} get-tuple-element(%custom-call.1), index=0
  %get-tuple-element.2 = f32[512,512]{{1,0}} get-tuple-element(%custom-call.2), index=0
  ROOT %tuple.1 = (bf16[1024,1024]{{1,0}}, f32[512,512]{{1,0}}) tuple(%get-tuple-element.1, %get-tuple-element.2)
}}
"""
MiB = 2**20
LAUNCH = KERNEL_LAUNCH_S


def by_hand(fit: float = 1.0, hidden: bool = True) -> dict[str, float]:
    # bf16 GEMM: 2·1024³ FLOPs at 50e12 (compute-bound: its 6 MiB take 12.6 µs)
    bf16_gemm = max(2 * 1024**3 / 50e12, 6 * MiB / 0.5e12) / fit + LAUNCH
    # f32 GEMM: 2·512³ FLOPs at the f32 25e12 = 10.7 µs, over its 3 MiB's 6.3 µs
    f32_gemm = max(2 * 512**3 / 25e12, 3 * MiB / 0.5e12) / fit + LAUNCH
    fusion = 6 * MiB / 0.5e12 / fit + LAUNCH  # reads two 2 MiB matrices, writes one
    # ring all-gather of 2 MiB over 8 GPUs of one node: launch + 7/8 of it over NVLink + 7 hops
    gather = 5e-6 + 7 / 8 * 2 * MiB / 100e9 + 7 * 1e-6
    behind = min(gather, f32_gemm) if hidden else 0.0  # only the f32 GEMM lies between
    compute = bf16_gemm + f32_gemm + fusion
    return {"compute": compute, "gather": gather, "hidden": behind,
            "step": compute + gather - behind}  # fmt: skip


def test_step_by_hand():
    program = read_program(parse_module(STEP.replace("IS_SYNC", "false")))
    time = predict_program(program, CLUSTER)
    expected = by_hand()
    assert time.compute_s == pytest.approx(expected["compute"])
    assert time.communication_s == pytest.approx(expected["gather"])
    assert time.hidden_s == pytest.approx(expected["hidden"])
    assert time.step_s == pytest.approx(expected["step"])
    # 2·1024³/50e12 = 42.9 µs, 10.7 µs, 12.6 µs, three launches of 2 µs; the gather's 30.4 µs
    # hides behind the f32 GEMM's 12.7, 17.6 µs left exposed
    assert time.step_s == pytest.approx(
        42.95e-6 + 10.74e-6 + 12.58e-6 + 3 * 2e-6 + 30.35e-6 - 12.74e-6, rel=1e-3
    )
    assert time.launch_s == pytest.approx(3 * LAUNCH) and time.kernels == 3
    assert time.compute_by_class_s["gemm"] == pytest.approx(
        expected["compute"] - 6 * MiB / 0.5e12 - LAUNCH
    )
    assert time.communication_by_kind_s == pytest.approx({"all-gather": expected["gather"]})
    assert time.exposed_by_kind_s == pytest.approx(
        {"all-gather": expected["gather"] - expected["hidden"]}
    )


def test_synchronous_collective_is_exposed():
    program = read_program(parse_module(STEP.replace("IS_SYNC", "true")))
    time = predict_program(program, CLUSTER)
    assert time.hidden_s == 0
    assert time.step_s == pytest.approx(by_hand(hidden=False)["step"])


def test_fused_attention_runs_at_its_own_rate():
    # The same FLOPs and bytes: a GEMM at 50 TFLOP/s, an attention kernel at the 10 measured
    # for attention kernels (ClusterConfig.attention_efficiency).
    gemm, attention = (
        Kernel(kind, 1, 1e12, 2**20, 2**20, "bf16") for kind in ("gemm", "attention")
    )
    assert kernel_seconds(gemm, CLUSTER) == pytest.approx(0.02 + KERNEL_LAUNCH_S)
    assert kernel_seconds(attention, CLUSTER) == pytest.approx(0.1 + KERNEL_LAUNCH_S)


def test_fp8_gemms_run_at_the_fp8_peak_and_need_a_gpu_that_has_one():
    # 1 TFLOP: in bf16 at 50 TFLOP/s; as an FP8 GEMM at the H100's datasheet FP8 peak (twice its
    # 16-bit one, 1,978.9 TFLOP/s) and the bf16 efficiency unless the cluster gives one of its own
    flops, mib = 1e12, 2**20
    bf16, fp8 = (Kernel("gemm", 1, flops, mib, mib, dtype) for dtype in ("bf16", "f8e4m3fn"))
    assert CLUSTER.peak_flops_float8 == 1978.9e12 and CLUSTER.gemm_efficiency_float8 == 0.5
    assert kernel_seconds(fp8, CLUSTER) == pytest.approx(flops / (1978.9e12 * 0.5) + LAUNCH)
    assert kernel_seconds(bf16, CLUSTER) == pytest.approx(0.02 + LAUNCH)
    measured = dataclasses.replace(CLUSTER, gemm_efficiency_float8=0.25)
    assert kernel_seconds(fp8, measured) == pytest.approx(flops / (1978.9e12 * 0.25) + LAUNCH)
    a100 = dataclasses.replace(CLUSTER, gpu="NVIDIA A100", peak_flops_float8=None)
    assert a100.peak_flops_float8 is None  # no FP8 tensor cores
    with pytest.raises(ConfigError, match="FP8 GEMMs and the cluster's GPU no FP8 peak"):
        kernel_seconds(fp8, a100)
    with pytest.raises(ConfigError, match="gemm_efficiency_float8 must be in"):
        dataclasses.replace(CLUSTER, gemm_efficiency_float8=1.5)


def test_fit_factor_scales_the_roofline_not_the_launches():
    program = read_program(parse_module(STEP.replace("IS_SYNC", "false")))
    time = predict_program(program, CLUSTER, fit_factor=0.5)
    assert time.step_s == pytest.approx(by_hand(fit=0.5)["step"])
    with pytest.raises(ValueError, match="fit_factor"):
        predict_program(program, CLUSTER, fit_factor=0)


def test_group_across_nodes_is_slower():
    # the same 8-device gather laid over two nodes of 4 crosses the network
    program = read_program(parse_module(STEP.replace("IS_SYNC", "false")))
    four_per_node = dataclasses.replace(CLUSTER, gpus_per_node=4)
    across = predict_program(program, four_per_node)
    assert across.communication_s > predict_program(program, CLUSTER).communication_s
