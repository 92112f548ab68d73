"""The kernels of a compiled XLA:GPU program (t5scale/analysis/kernels.py), read from HLO text
written in the form `compiled.as_text()` prints for an H100 (lines trimmed of metadata)."""

import json

import pytest

from t5scale.analysis.hlo_module import parse_module
from t5scale.analysis.kernels import ClassTotal, Program, read_program

GEMM_CONFIG = (
    '{"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0","alpha_real":1,'
    '"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
    '"epilogue":"DEFAULT"}}'
)
FMHA_CONFIG = (
    '{"operation_queue_id": "0", "cudnn_fmha_backend_config": {"algorithm": {"algo_id": "0", '
    '"math_type": "TENSOR_OP_MATH", "is_cudnn_frontend": true, "workspace_size": "0"}, '
    '"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": '
    '["4", "8", "512", "512"], "tuple_shapes": [], "layout": {"minor_to_major": ["3", "2", "1", '
    '"0"]}}, "is_flash_attention": true, "mask_type": "NO_MASK"}}'
)
ASYNC = '{"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}'
SYNC = '{"operation_queue_id":"0","collective_backend_config":{"is_sync":true}}'
STATE = "(s32[], f32[64,32]{1,0}, bf16[3,64,32]{2,1,0}, bf16[32,32]{1,0})"

# A GEMM, fused attention, a sync (is_sync) reduce-scatter, a copy, a loop of 3 trips whose body
# runs an async all-gather around a fusion, an in-place update and a scalar add, a transpose
# fusion, a synchronous all-reduce.
PROGRAM = f"""HloModule jit_step, is_scheduled=true, num_partitions=2

%fused_transpose (param_0.1: bf16[64,32]) -> bf16[32,64] {{
  %param_0.1 = bf16[64,32]{{1,0}} parameter(0)
  ROOT %transpose.1 = bf16[32,64]{{1,0}} transpose(%param_0.1), dimensions={{1,0}}
}}

%fused_dynamic_update_slice (param_0.2: bf16[3,64,32], param_1.2: s32[], param_2.2: bf16[64,32]) -> bf16[3,64,32] {{
  %param_0.2 = bf16[3,64,32]{{2,1,0}} parameter(0)
  %param_2.2 = bf16[64,32]{{1,0}} parameter(2)
  %bitcast.1 = bf16[1,64,32]{{2,1,0}} bitcast(%param_2.2)
  %param_1.2 = s32[] parameter(1)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = bf16[3,64,32]{{2,1,0}} dynamic-update-slice(%param_0.2, %bitcast.1, %param_1.2, %constant.1, %constant.1)
}}

%fused_tanh (param_0.3: f32[64,32]) -> bf16[64,32] {{
  %param_0.3 = f32[64,32]{{1,0}} parameter(0)
  %tanh.1 = f32[64,32]{{1,0}} tanh(%param_0.3)
  ROOT %convert.1 = bf16[64,32]{{1,0}} convert(%tanh.1)
}}

%fused_compare (param_0.4: s32[]) -> pred[] {{
  %param_0.4 = s32[] parameter(0)
  %constant.2 = s32[] constant(3)
  ROOT %compare.1 = pred[] compare(%param_0.4, %constant.2), direction=LT
}}

%region_add (a.1: bf16[], b.1: bf16[]) -> bf16[] {{
  %a.1 = bf16[] parameter(0)
  %b.1 = bf16[] parameter(1)
  ROOT %add.9 = bf16[] add(%a.1, %b.1)
}}

%region_cond (arg.1: {STATE}) -> pred[] {{
  %arg.1 = {STATE} parameter(0)
  %get-tuple-element.1 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_compare
}}

%region_body (arg.2: {STATE}) -> {STATE} {{
  %arg.2 = {STATE} parameter(0)
  %get-tuple-element.2 = s32[] get-tuple-element(%arg.2), index=0
  %get-tuple-element.3 = f32[64,32]{{1,0}} get-tuple-element(%arg.2), index=1
  %get-tuple-element.4 = bf16[3,64,32]{{2,1,0}} get-tuple-element(%arg.2), index=2
  %get-tuple-element.5 = bf16[32,32]{{1,0}} get-tuple-element(%arg.2), index=3
  %all-gather-start.1 = (bf16[32,32]{{1,0}}, bf16[64,32]{{1,0}}) all-gather-start(%get-tuple-element.5), channel_id=1, replica_groups={{{{0,1}}}}, dimensions={{0}}, use_global_device_ids=true, backend_config={ASYNC}
  %loop_convert_fusion = bf16[64,32]{{1,0}} fusion(%get-tuple-element.3), kind=kLoop, calls=%fused_tanh
  %all-gather-done.1 = bf16[64,32]{{1,0}} all-gather-done(%all-gather-start.1)
  %loop_dynamic_update_slice_fusion = bf16[3,64,32]{{2,1,0}} fusion(%get-tuple-element.4, %get-tuple-element.2, %all-gather-done.1), kind=kCustom, calls=%fused_dynamic_update_slice, backend_config={{"fusion_backend_config":{{"kind":"__custom_fusion","custom_fusion_config":{{"name":"dynamic_slice_fusion","kernel_index":0}}}}}}
  %constant.3 = s32[] constant(1)
  %add.2 = s32[] add(%get-tuple-element.2, %constant.3)
  ROOT %tuple.1 = {STATE} tuple(%add.2, %get-tuple-element.3, %loop_dynamic_update_slice_fusion, %get-tuple-element.5)
}}

ENTRY %main.1 (p.0: bf16[256,512], p.1: bf16[512,1024], p.2: f32[64,32], p.3: bf16[64,32], p.5: bf16[3,64,32], q.0: bf16[4,512,8,64], b.0: bf16[1,8,512,512]) -> f32[64,32] {{
  %b.0 = bf16[1,8,512,512]{{3,2,1,0}} parameter(6)
  %q.0 = bf16[4,512,8,64]{{3,2,1,0}} parameter(5)
  %p.5 = bf16[3,64,32]{{2,1,0}} parameter(4)
  %p.3 = bf16[64,32]{{1,0}} parameter(3)
  %p.2 = f32[64,32]{{1,0}} parameter(2)
  %p.1 = bf16[512,1024]{{1,0}} parameter(1)
  %p.0 = bf16[256,512]{{1,0}} parameter(0)
  %custom-call.1 = (bf16[256,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(%p.0, %p.1), custom_call_target="__cublas$lt$matmul", backend_config={GEMM_CONFIG}
  %fmha.1 = (bf16[4,8,512,64]{{3,1,2,0}}, f32[4,8,512]{{2,1,0}}, u8[0]{{0}}) custom-call(%q.0, %q.0, %q.0, %b.0), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", api_version=API_VERSION_STATUS_RETURNING, backend_config={FMHA_CONFIG}
  %reduce-scatter-start.1 = ((bf16[64,32]{{1,0}}), bf16[32,32]{{1,0}}) reduce-scatter-start(%p.3), channel_id=2, replica_groups={{{{0,1}}}}, use_global_device_ids=true, dimensions={{0}}, to_apply=%region_add, backend_config={SYNC}
  %reduce-scatter-done.1 = bf16[32,32]{{1,0}} reduce-scatter-done(%reduce-scatter-start.1)
  %copy.1 = bf16[64,32]{{0,1}} copy(%p.3)
  %constant.4 = s32[] constant(0)
  %tuple.0 = {STATE} tuple(%constant.4, %p.2, %p.5, %reduce-scatter-done.1)
  %while.1 = {STATE} while(%tuple.0), condition=%region_cond, body=%region_body, metadata={{op_name="jit(step)/encoder/while"}}, backend_config={{"known_trip_count":{{"n":"3"}},"known_init_step":{{"init":"0","step":"1"}},"known_induction_variable":{{"tuple_index":"0"}},"dynamic_variables":[]}}
  %transpose_fusion = bf16[32,64]{{1,0}} fusion(%copy.1), kind=kInput, calls=%fused_transpose
  ROOT %all-reduce.1 = f32[64,32]{{1,0}} all-reduce(%p.2), channel_id=3, replica_groups={{{{0,1}}}}, use_global_device_ids=true, to_apply=%region_add
}}
"""


def test_inventory_by_class_with_loops_multiplied_out():
    inventory = read_program(parse_module(PROGRAM)).inventory
    # 256×512 · 512×1024: 2·256·1024·512 FLOPs; the s8 workspace is no output
    assert inventory.gemm == ClassTotal(
        1, (256 * 512 + 512 * 1024) * 2, 256 * 1024 * 2, 2.0 * 256 * 1024 * 512
    )
    # forward fused attention: two products of 2·B·N·T·S·H; q, k, v and bias read; output and
    # f32 softmax statistics written
    q_bytes, bias_bytes = 4 * 512 * 8 * 64 * 2, 8 * 512 * 512 * 2
    assert inventory.attention == ClassTotal(
        1, 3 * q_bytes + bias_bytes, q_bytes + 4 * 8 * 512 * 4, 2 * 2.0 * 4 * 8 * 512 * 512 * 64
    )
    # the loop body's tanh fusion, 3 trips; the condition's compare never runs
    assert inventory.fusion == ClassTotal(3, 3 * 64 * 32 * 4, 3 * 64 * 32 * 2)
    # in-place update (3×: the update and the index read, the update written), the transpose
    # fusion and the copy (each 4 KiB each way)
    update = 64 * 32 * 2
    assert inventory.copy == ClassTotal(5, 3 * (update + 4) + 2 * 4096, 3 * update + 2 * 4096)
    assert inventory.other == ClassTotal(3, 3 * 8, 3 * 4)  # the loop counter's add
    # reduce-scatter 4 KiB → 2 KiB, all-gather 3 × 2 KiB → 4 KiB, all-reduce 8 KiB
    assert inventory.collective == ClassTotal(5, 4096 + 3 * 2048 + 8192, 2048 + 3 * 4096 + 8192)
    assert inventory.kernels == 1 + 1 + 3 + 5 + 3 + 5
    assert inventory.unknown_trip_count_loops == 0


def test_collectives_with_their_schedule():
    program = read_program(parse_module(PROGRAM))
    assert program.devices == 2
    by_kind = {collective.op.kind: collective for collective in program.collectives}
    gather = by_kind["all-gather"]
    assert (gather.op.count, gather.op.bytes, gather.op.operand_bytes) == (3, 4096, 2048)
    assert gather.op.group == (0, 1)
    assert gather.op.loops == (3,) and gather.op.loop_names == ("jit(step)/encoder/while",)
    assert not gather.synchronous
    ((index, runs),) = gather.overlapped  # the tanh fusion between start and done, once
    assert program.kernels[index].kind == "fusion" and runs == 1
    scatter = by_kind["reduce-scatter"]  # XLA made it synchronous: nothing to hide behind
    assert scatter.synchronous and scatter.overlapped == ()
    assert (scatter.op.count, scatter.op.bytes, scatter.op.operand_bytes) == (1, 2048, 4096)
    assert by_kind["all-reduce"].synchronous


def test_program_json_round_trip():
    program = read_program(parse_module(PROGRAM))
    text = json.dumps(program.to_json())
    assert Program.from_json(json.loads(text)) == program
    assert program.inventory.to_json()["gemm"]["count"] == 1


def test_alike_kernels_are_one_record():
    # the three runs of the loop's fusion are one record with 3 runs
    fusions = [k for k in read_program(parse_module(PROGRAM)).kernels if k.kind == "fusion"]
    assert [(k.runs, k.bytes_read, k.bytes_written) for k in fusions] == [(3, 8192, 4096)]


def test_backward_attention_counts_five_products():
    backward = PROGRAM.replace("fmhaScaleBiasSoftmax", "fmhaScaleBiasSoftmaxBackward")
    assert read_program(parse_module(backward)).inventory.attention.flops == pytest.approx(
        5 * 2.0 * 4 * 8 * 512 * 512 * 64
    )


def test_loop_of_unknown_trip_count_counted_once():
    unknown = PROGRAM.replace('"known_trip_count":{"n":"3"},', "")
    inventory = read_program(parse_module(unknown)).inventory
    assert inventory.unknown_trip_count_loops == 1
    # body once, and the condition's compare fusion once
    assert inventory.fusion.count == 2 and inventory.other.count == 1


def test_dots_and_operands_after_index_comments():
    text = """HloModule m, is_scheduled=true

%fused_dot (param_0: bf16[8,16], param_1: bf16[16,4]) -> bf16[8,4] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.2 = bf16[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,16], b: f32[16,4], c: f32[8,4], x: bf16[8,16], y: bf16[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %c = f32[8,4]{1,0} parameter(2)
  %x = bf16[8,16]{1,0} parameter(3)
  %y = bf16[16,4]{1,0} parameter(4)
  %dot.1 = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm_fusion = bf16[8,4]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_dot
  ROOT %custom-call.3 = f32[8,4]{1,0} custom-call(%dot.1, %c, %c, %c, %c, /*index=5*/%c), custom_call_target="my_kernel"
}
"""
    program = read_program(parse_module(text))
    flops = 2.0 * 8 * 4 * 16
    gemms = {
        (k.dtype, k.flops, k.bytes_read, k.bytes_written)
        for k in program.kernels
        if k.kind == "gemm"
    }
    assert gemms == {
        ("f32", flops, (8 * 16 + 16 * 4) * 4, 8 * 4 * 4),
        ("bf16", flops, (8 * 16 + 16 * 4) * 2, 8 * 4 * 2),
    }
    assert program.devices == 1
    assert program.inventory.other.bytes_read == 6 * 8 * 4 * 4  # the sixth operand counted too


def test_an_asynchronous_fusion_moves_the_slice_it_takes_not_the_stack():
    """On the card XLA:GPU runs some fusions as fusion-start / fusion-done, the start's result
    repeating its operands: a layer's slice of a scan's stacked activations is a copy of the
    slice (the H200's mt5_large program of 2026-11-27 had 65; read as 'other' kernels over the
    whole stack they put 0.55 s a step that the card did not spend)."""
    text = """HloModule m, is_scheduled=true

%fused_slice (param_0: bf16[24,1024,64], param_1: s32[]) -> bf16[1,1024,64] {
  %param_0 = bf16[24,1024,64]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %dynamic-slice = bf16[1,1024,64]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,1024,64}
}

ENTRY %main (stack: bf16[24,1024,64], i: s32[]) -> bf16[1,1024,64] {
  %stack = bf16[24,1024,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %fusion-start = ((bf16[24,1024,64]{2,1,0}, s32[]), bf16[1,1024,64]{2,1,0}, u32[]) fusion-start(%stack, %i), kind=kLoop, calls=%fused_slice
  ROOT %fusion-done = bf16[1,1024,64]{2,1,0} fusion-done(%fusion-start)
}
"""
    inventory = read_program(parse_module(text)).inventory
    layer = 1024 * 64 * 2
    assert inventory.copy.count == 1 and inventory.other.count == 0
    assert (inventory.copy.bytes_read, inventory.copy.bytes_written) == (layer + 4, layer)


def test_a_tpu_matmul_reads_the_layer_its_nested_fusion_slices_from_the_stack():
    """XLA:TPU writes a layer's matmul as a convolution in a fusion whose nested fusion
    dynamic-slices the layer's weight out of the scan's stacked weights: the weight read is
    that layer's, not the stack's (read whole, mT5-XXL's 24 layers put its matmuls 24x over
    the HBM they touch); the contraction, a window over a padded dimension, counts as a
    matmul's FLOPs."""
    text = """HloModule m, is_scheduled=true

%slice_layer (param_0: bf16[24,512,64], param_1: s32[]) -> bf16[512,64] {
  %param_0 = bf16[24,512,64]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %dynamic-slice = bf16[1,512,64]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,512,64}
  ROOT %bitcast = bf16[512,64]{1,0} bitcast(%dynamic-slice)
}

%layer_matmul (param_0: bf16[8,512], param_1: bf16[24,512,64], param_2: s32[]) -> bf16[8,64] {
  %param_0 = bf16[8,512]{1,0} parameter(0)
  %param_1 = bf16[24,512,64]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %weight = bf16[512,64]{1,0} fusion(%param_1, %param_2), kind=kLoop, calls=%slice_layer
  ROOT %convolution = bf16[8,64]{1,0} convolution(%param_0, %weight), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[8,512], stack: bf16[24,512,64], i: s32[]) -> bf16[8,64] {
  %x = bf16[8,512]{1,0} parameter(0)
  %stack = bf16[24,512,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %fusion = bf16[8,64]{1,0} fusion(%x, %stack, %i), kind=kOutput, calls=%layer_matmul
}
"""
    (gemm,) = read_program(parse_module(text)).kernels
    assert gemm.kind == "gemm" and gemm.flops == 2.0 * 8 * 64 * 512
    assert gemm.bytes_read == 8 * 512 * 2 + 512 * 64 * 2 + 4
