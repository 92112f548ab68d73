"""T5's attention on one TPU v5p chip, compile-only: the einsum route ('dot') against jax's TPU
flash attention (jax.experimental.pallas.ops.tpu.flash_attention) and t5scale's own TPU kernels
(t5scale/model/attention_tpu.py), forward and backward with the position bias's gradient, at
mt5_large's shapes (batch 32, 16 heads of 64, 1024/229).

    python bench/tpu_attention.py [--batch 32]
    python bench/tpu_attention.py --step     # mt5_large's whole train step, 'dot' and 'fused'

For each attention of the model (encoder self-attention 1024×1024 with the bias, the causal
decoder's 229×229 with the bias, cross-attention 229×1024 without) and each route: XLA:TPU's
memory (temporaries and the peak estimate) and whether the program holds a [batch, heads, q, k]
array, the tensor a flash kernel exists to avoid. jax's kernel takes its additive bias `ab` as
[batch, heads, q, k], so T5's bias [heads, q, k], shared by the batch, goes in broadcast, and
its gradient comes out batch-sized. (docs/attention.md, "On TPUs".)
"""

from __future__ import annotations

import argparse
import re

from t5scale.startup import start_jax  # first: JAX on the CPU, quietly, with libtpu here

start_jax()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # noqa: E402

from t5scale.analysis.memory import compiled_memory  # noqa: E402
from t5scale.model.attention_reference import bias_matrix, reference_attention  # noqa: E402
from t5scale.model.attention_tpu import tpu_flash_attention  # noqa: E402
from t5scale.target import Target  # noqa: E402
from t5scale.xla_tpu import COMPILER_OPTIONS, TpuSlice, TpuTopology  # noqa: E402

HEADS, DIM = 16, 64
CASES = {  # name: (q length, k length, bias, causal)
    "encoder self-attention": (1024, 1024, True, False),
    "decoder self-attention (causal)": (229, 229, True, True),
    "cross-attention": (229, 1024, False, False),
}


def dot_loss(q, k, v, bias, q_segments, k_segments, causal):
    """The einsum route's arithmetic (t5scale's reference of the fused kernels): [b, q, h, d]."""
    out = reference_attention(q, k, v, bias, q_segments, k_segments, causal)
    return jnp.sum(out.astype(jnp.float32))


def flash_loss(q, k, v, bias, q_segments, k_segments, causal):
    """jax's TPU flash attention: [b, h, t, d] operands, the bias broadcast to the batch."""
    batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    # its key blocks are whole multiples of 128: lengths padded (padding is segment 0)
    q_pad, k_pad = -q_len % 128, -k_len % 128
    q = jnp.pad(q, ((0, 0), (0, q_pad), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, k_pad), (0, 0), (0, 0))) for x in (k, v))
    q_segments = jnp.pad(q_segments, ((0, 0), (0, q_pad)))
    k_segments = jnp.pad(k_segments, ((0, 0), (0, k_pad)))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    if bias is not None:  # jax's kernel takes the bias [heads, q, k], made from its diagonals
        bias = jnp.pad(bias_matrix(bias, q_len, k_len), ((0, 0), (0, q_pad), (0, k_pad)))
    ab = None if bias is None else jnp.broadcast_to(bias[None], (batch, *bias.shape))
    blocks = tpu_flash.BlockSizes(
        block_q=min(q.shape[2], 512), block_k_major=min(k.shape[2], 512),
        block_k=min(k.shape[2], 512), block_b=1,
        block_q_major_dkv=min(q.shape[2], 512), block_k_major_dkv=min(k.shape[2], 512),
        block_k_dkv=min(k.shape[2], 512), block_q_dkv=min(q.shape[2], 512),
        block_k_major_dq=min(k.shape[2], 512), block_k_dq=min(k.shape[2], 512),
        block_q_dq=min(q.shape[2], 512),
    )  # fmt: skip
    segments = tpu_flash.SegmentIds(q=q_segments, kv=k_segments)
    out = tpu_flash.flash_attention(q, k, v, ab, segments, causal=causal, sm_scale=1.0,
                                    block_sizes=blocks)  # fmt: skip
    return jnp.sum(out[:, :, :q_len].astype(jnp.float32))


def t5scale_loss(q, k, v, bias, q_segments, k_segments, causal):
    """t5scale's own kernels for TPUs (t5scale/model/attention_tpu.py): the bias by head."""
    out = tpu_flash_attention(q, k, v, bias, q_segments, k_segments, causal)
    return jnp.sum(out.astype(jnp.float32))


def batch_sized(hlo: str, batch: int, q: int, k: int) -> list[str]:
    """The distinct [batch, heads, q, k] array types in the program (either length order,
    either length padded to 128 as the flash route pads it)."""
    lengths = {(a, b) for a in (q, q + -q % 128) for b in (k, k + -k % 128)}
    found = set()
    for dtype, dims in re.findall(r"\b(bf16|f32|s32|pred)\[([\d,]+)\]", hlo):
        shape = tuple(int(d) for d in dims.split(","))
        if len(shape) != 4 or shape[0] != batch or HEADS not in shape[1:]:
            continue
        rest = list(shape[1:])
        rest.remove(HEADS)
        if tuple(rest) in lengths or tuple(reversed(rest)) in lengths:
            found.add(f"{dtype}[{dims}]")
    return sorted(found)


def whole_step(chip, batch: int) -> None:
    """mt5_large's train step on the one chip (ZeRO 0, mixed precision, remat 'dots', which
    keeps every matmul's output) with attention 'dot' and 'fused' (the TPU kernels)."""
    from t5scale.config import build_run_config, parse_gin
    from t5scale.train.setup import build_setup

    print(f"mt5_large's train step on one {chip.device_kind} chip, batch {batch} of 1024/229, "
          "mixed precision, remat dots\n")  # fmt: skip
    print("| attention | arguments GB | temporaries GB | peak GB | [batch, heads, q, k] arrays |")
    print("|---|---|---|---|---|")
    for attention in ("dot", "fused"):
        parse_gin(["gin/models/mt5_large.gin", "gin/precision/mixed.gin"],
                  ["ModelConfig.dtype='bfloat16'", "ModelConfig.remat='dots'", "DATA_SOURCE='synthetic'",
                   f"TrainConfig.batch_size={batch}", f"ModelConfig.attention='{attention}'"])  # fmt: skip
        step = build_setup(build_run_config(), [chip]).compile()
        memory = compiled_memory(step.compiled)
        text = step.compiled.as_text()
        arrays = sorted({*batch_sized(text, batch, 1024, 1024), *batch_sized(text, batch, 229, 229),
                         *batch_sized(text, batch, 229, 1024)})  # fmt: skip
        print(f"| {step.setup.run.model.attention} | {memory.argument_bytes / 1e9:.2f} | "
              f"{memory.temp_bytes / 1e9:.2f} | {memory.peak_estimate_bytes / 1e9:.2f} | "
              f"{len(arrays)} types: {', '.join(arrays[:4]) or 'none'} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step", action="store_true", help="mt5_large's whole train step")
    args = parser.parse_args()
    chip = Target.compile_only_tpus(TpuTopology(TpuSlice.named("v5p-8"))).devices[0]
    if args.step:
        whole_step(chip, args.batch)
        return
    sharding = jax.sharding.SingleDeviceSharding(chip)
    print(f"one {chip.device_kind} chip (of a v5p-8), batch {args.batch}, {HEADS} heads of {DIM}, "
          "bf16, forward and backward (q, k, v and the bias)\n")  # fmt: skip
    print("| attention | route | temporaries GB | peak GB | [batch, heads, q, k] arrays |")
    print("|---|---|---|---|---|")
    for name, (q_len, k_len, has_bias, causal) in CASES.items():
        b = args.batch
        shapes = [
            jax.ShapeDtypeStruct((b, n, HEADS, DIM), jnp.bfloat16) for n in (q_len, k_len, k_len)
        ]
        diagonals = (HEADS, q_len + k_len - 1)  # the position bias as the fused route has it
        bias = jax.ShapeDtypeStruct(diagonals, jnp.float32) if has_bias else None
        segments = [jax.ShapeDtypeStruct((b, n), jnp.int32) for n in (q_len, k_len)]
        routes = (("dot", dot_loss), ("jax TPU flash", flash_loss), ("t5scale TPU", t5scale_loss))
        for route, loss in routes:
            differentiated = (0, 1, 2, 3) if has_bias else (0, 1, 2)
            step = jax.jit(jax.grad(loss, argnums=differentiated), static_argnums=6,
                           in_shardings=sharding, out_shardings=sharding)  # fmt: skip
            compiled = step.lower(*shapes, bias, *segments, causal).compile(
                compiler_options=dict(COMPILER_OPTIONS)
            )
            memory = compiled_memory(compiled)
            arrays = batch_sized(compiled.as_text(), b, q_len, k_len)
            print(f"| {name} | {route} | {memory.temp_bytes / 1e9:.2f} | "
                  f"{memory.peak_estimate_bytes / 1e9:.2f} | {', '.join(arrays) or 'none'} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
