"""Accounting checked against independent counts: HLO collectives, FLOPs against XLA."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from t5scale.analysis.flops import forward_flops_per_sequence, training_flops_per_step
from t5scale.analysis.hlo import collective_stats, shape_bytes
from t5scale.model.sizes import ModelConfig


def _compiled_text(fn, *args) -> str:
    mesh = jax.make_mesh((4, 2), ("zero", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        mapped = jax.shard_map(
            fn, in_specs=P("zero"), out_specs=P(), axis_names={"zero"}, check_vma=False
        )
        return jax.jit(mapped).lower(*args).compile().as_text()


def test_collectives_in_a_loop_count_once_per_iteration():
    def fn(x):  # x: [5, 8, 8] per device after the split over zero
        def body(carry, row):
            return carry + lax.psum(row, "zero"), None

        total, _ = lax.scan(body, jnp.zeros((8, 8)), x)
        return total

    stats = collective_stats(_compiled_text(fn, jnp.ones((20, 8, 8))))
    assert stats["all-reduce"] == {
        "count": 5,
        "bytes": 5 * 8 * 8 * 4,
        "operand_bytes": 5 * 8 * 8 * 4,
    }


def test_reduce_scatter_and_all_gather_sizes():
    def fn(x):  # [8, 16] per device
        scattered = lax.psum_scatter(x, "zero", scatter_dimension=0, tiled=True)  # [2, 16]
        return lax.all_gather(scattered * 2, "zero", axis=0, tiled=True)

    stats = collective_stats(_compiled_text(fn, jnp.ones((32, 16))))
    assert stats["reduce-scatter"]["operand_bytes"] == 8 * 16 * 4
    assert stats["reduce-scatter"]["bytes"] == 8 * 16 * 4 // 4
    assert stats["all-gather"]["bytes"] == 8 * 16 * 4
    assert stats["all-gather"]["operand_bytes"] == 2 * 16 * 4


def test_groups_of_one_device_move_nothing():
    text = """
ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} all-reduce(%p), replica_groups={{0},{1},{2}}, to_apply=%add
  %b = f32[4]{0} all-reduce(%a), replica_groups=[8,1]<=[8], to_apply=%add
  %c = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(%b, %b), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %d = f32[4]{0} get-tuple-element(%c), index=0
}
"""
    stats = collective_stats(text)
    assert stats == {"all-reduce": {"count": 1, "bytes": 16 + 8, "operand_bytes": 32}}


def test_shape_bytes():
    assert shape_bytes("f32[8,64]{1,0}") == 8 * 64 * 4
    assert shape_bytes("(bf16[3]{0}, s8[2,2]{1,0}, pred[])") == 6 + 4 + 1


MODEL = ModelConfig(vocab_size=256, d_model=64, d_ff=128, num_heads=4, d_kv=16)


def _forward_by_matmul_shapes(m: ModelConfig, lin: int, ltgt: int) -> int:
    """FLOPs summed over the matmuls of a forward pass, written out one by one."""
    hk = m.num_heads * m.d_kv
    matmuls = []  # (rows, contraction, columns)
    for _ in range(m.num_encoder_layers):
        matmuls += [(lin, m.d_model, hk)] * 4  # q, k, v, o (o contracts hk → d: same size)
        matmuls += [(lin, m.d_model, m.d_ff)] * 3
        matmuls += [(lin, hk, lin), (lin, lin, hk)]  # scores, weighted values
    for _ in range(m.num_decoder_layers):
        matmuls += [(ltgt, m.d_model, hk)] * 4 + [(ltgt, hk, ltgt), (ltgt, ltgt, hk)]
        matmuls += [(ltgt, m.d_model, hk)] * 2 + [(lin, m.d_model, hk)] * 2  # cross q, o | k, v
        matmuls += [(ltgt, hk, lin), (ltgt, lin, hk)]
        matmuls += [(ltgt, m.d_model, m.d_ff)] * 3
    matmuls.append((ltgt, m.d_model, m.vocab_size))
    return sum(2 * a * b * c for a, b, c in matmuls)


def test_flops_formula_against_an_independent_count():
    full = forward_flops_per_sequence(MODEL, 64, 32, causal_attention_halved=False)
    assert full == _forward_by_matmul_shapes(MODEL, 64, 32)
    halved = forward_flops_per_sequence(MODEL, 64, 32)
    causal_saving = MODEL.num_decoder_layers * 32 * 2 * 32 * MODEL.num_heads * MODEL.d_kv
    assert full - halved == causal_saving
    assert training_flops_per_step(MODEL, 8, 64, 32) == 3 * 8 * halved


def test_flops_formula_agrees_with_xla_cost_analysis():
    """XLA counts the full causal matrix, so compare with the un-halved formula (no scan: XLA's
    cost analysis does not multiply loop bodies by their trip count)."""
    m, lin, ltgt, batch = MODEL, 64, 32, 2
    d, h, k, f = m.d_model, m.num_heads, m.d_kv, m.d_ff
    fills = iter(range(1, 1000))

    def w(*shape):  # distinct constants, so that XLA cannot merge two projections into one
        return jnp.full(shape, 0.001 * next(fills))

    def attention(xq, xkv):
        q, kk, v = (jnp.einsum("bsd,dhk->bshk", x, w(d, h, k)) for x in (xq, xkv, xkv))
        probs = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, kk))
        return jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", probs, v), w(h, k, d))

    def mlp(x):
        return (jax.nn.gelu(x @ w(d, f)) * (x @ w(d, f))) @ w(f, d)

    def forward(x, y):
        for _ in range(m.num_encoder_layers):
            x = x + mlp(x + attention(x, x))
        for _ in range(m.num_decoder_layers):
            y = y + mlp(y + attention(y + attention(y, y), x))
        return y @ w(d, m.vocab_size)

    x, y = jnp.ones((batch, lin, d)), jnp.ones((batch, ltgt, d))
    xla = jax.jit(forward).lower(x, y).compile().cost_analysis()["flops"]
    ours = batch * forward_flops_per_sequence(m, lin, ltgt, causal_attention_halved=False)
    assert xla == pytest.approx(ours, rel=0.10)
