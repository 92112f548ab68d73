"""Accounting checked against independent counts: HLO collectives, and FLOPs against XLA."""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before anything starts the backend

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from t5scale.analysis.collective_ops import collective_summary, format_bytes  # noqa: E402
from t5scale.analysis.flops import (  # noqa: E402
    forward_flops_breakdown,
    forward_flops_per_sequence,
    mfu,
    training_flops_per_step,
)
from t5scale.analysis.hlo import (  # noqa: E402
    collective_stats,
    first_group,
    group_size,
)
from t5scale.analysis.hlo_module import parse_module, shape_bytes  # noqa: E402
from t5scale.model.sizes import ModelConfig  # noqa: E402

F32 = 4


def _compiled_text(fn, *shapes, mesh_shape=(4, 2), names=("zero", "tensor")) -> str:
    """HLO of `fn` run under shard_map on 8 devices, every input split over `zero`."""
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    with jax.set_mesh(mesh):
        mapped = jax.shard_map(
            fn, in_specs=(P("zero"),) * len(args), out_specs=P(), check_vma=False
        )
        return jax.jit(mapped).lower(*args).compile().as_text()


# --- collectives of real compiled programs ---------------------------------------------------


def test_collective_in_a_scan_counts_once_per_iteration():
    def looped(x):  # x: [5, 8, 8] per device
        def body(carry, row):
            return carry + lax.psum(row, "zero"), None

        return lax.scan(body, jnp.zeros((8, 8)), x)[0]

    def once(x):
        return lax.psum(x[0], "zero")

    text = _compiled_text(looped, (20, 8, 8))
    assert text.count(" all-reduce(") == 1  # written once, inside the while body
    assert '"known_trip_count":{"n":"5"}' in text
    in_loop, single = (
        collective_stats(parse_module(text)),
        collective_stats(parse_module(_compiled_text(once, (20, 8, 8)))),
    )
    assert single["all-reduce"] == {"count": 1, "bytes": 8 * 8 * F32, "operand_bytes": 8 * 8 * F32}
    assert in_loop["all-reduce"] == {k: 5 * v for k, v in single["all-reduce"].items()}
    assert set(in_loop) == {"all-reduce"}


def test_reduce_scatter_and_all_gather_sizes():
    def fn(x):  # [8, 16] per device; zero has 4 devices
        scattered = lax.psum_scatter(x, "zero", scatter_dimension=0, tiled=True)  # [2, 16]
        return lax.all_gather(scattered * 2, "zero", axis=0, tiled=True)  # [8, 16]

    stats = collective_stats(parse_module(_compiled_text(fn, (32, 16))))
    scatter, gather = stats["reduce-scatter"], stats["all-gather"]
    assert scatter["count"] == gather["count"] == 1
    assert scatter["operand_bytes"] == 8 * 16 * F32
    assert scatter["bytes"] == scatter["operand_bytes"] // 4
    assert gather["operand_bytes"] == scatter["bytes"]
    assert gather["bytes"] == gather["operand_bytes"] * 4


def test_all_to_all_and_collective_permute():
    def fn(x):  # [8, 16] per device
        swapped = lax.all_to_all(x, "zero", 0, 0, tiled=True)
        return swapped + lax.ppermute(x, "zero", [(i, (i + 1) % 4) for i in range(4)])

    stats = collective_stats(parse_module(_compiled_text(fn, (32, 16))))
    for kind in ("all-to-all", "collective-permute"):
        assert stats[kind] == {"count": 1, "bytes": 8 * 16 * F32, "operand_bytes": 8 * 16 * F32}


def test_a_psum_over_an_axis_of_one_device_is_not_counted():
    def fn(x):
        return lax.psum(x, "one") + lax.psum(x, "tensor")

    names = ("zero", "tensor", "one")
    text = _compiled_text(fn, (32, 16), mesh_shape=(4, 2, 1), names=names)
    assert text.count(" all-reduce(") == 2  # XLA keeps both; only the tensor one moves data
    assert collective_stats(parse_module(text))["all-reduce"]["count"] == 1


# --- handwritten HLO: the forms CPU programs do not show --------------------------------------

REDUCERS = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}
"""


def test_tuple_results_and_replica_group_forms():
    text = (
        REDUCERS
        + """
ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %q = bf16[2,2]{1,0} parameter(1)
  %lone = f32[4]{0} all-reduce(%p), replica_groups={{0},{1},{2}}, to_apply=%add
  %lone_iota = f32[4]{0} all-reduce(%p), replica_groups=[8,1]<=[8], to_apply=%add
  %t = (f32[4]{0}, bf16[2,2]{1,0}) all-reduce(%p, %q), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  %g = f32[8]{0} all-gather(%p), replica_groups={{0,1},{2,3}}, dimensions={0}
  %self = f32[4]{0} collective-permute(%p), source_target_pairs={{0,0},{1,1}}
  ROOT %r = f32[4]{0} get-tuple-element(%t), index=0
}
"""
    )
    stats = collective_stats(parse_module(text))
    tuple_bytes = 4 * 4 + 2 * 2 * 2
    assert stats == {
        "all-reduce": {"count": 1, "bytes": tuple_bytes, "operand_bytes": tuple_bytes},
        "all-gather": {"count": 1, "bytes": 8 * 4, "operand_bytes": 4 * 4},
    }
    assert group_size("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}") == 2
    assert group_size("replica_groups=[1,8]<=[8]") == 8
    assert group_size("replica_groups={{0,2,4},{1,3,5}}") == 3
    assert group_size("replica_groups={}") is None
    # Newer XLA's mesh form: the devices as a mesh (maybe a transposed iota), grouped along the
    # axes in braces.
    mesh = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}"
    assert first_group(mesh) == (0, 1, 2, 3) and group_size(mesh) == 4
    assert first_group("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == (0, 4)
    permuted = "replica_groups=mesh['a'=2,'b'=1,'c'=2,'d'=2], device_ids=([2,2,2]T(0,2,1)) {'c'}"
    assert first_group(permuted) == (0, 1)  # ids [[0,2],[1,3]], [[4,6],[5,7]]: c runs 0 → 1


def test_async_pairs_count_once_with_the_result_of_their_done():
    text = (
        REDUCERS
        + """
%wrapped_rs (w: f32[8,16]) -> f32[2,16] {
  %w = f32[8,16]{1,0} parameter(0)
  ROOT %rs = f32[2,16]{1,0} reduce-scatter(%w), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %s = f32[2,16]{1,0} slice(f32[8,16]{1,0} %p), slice={[0:2], [0:16]}
  %ags = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(f32[2,16]{1,0} %s), replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[8,16]{1,0} all-gather-done((f32[2,16]{1,0}, f32[8,16]{1,0}) %ags)
  %ars = (f32[8,16]{1,0}, f32[2,16]{1,0}) all-reduce-start(%p, %s), replica_groups={{0,1}}, to_apply=%add
  %ard = (f32[8,16]{1,0}, f32[2,16]{1,0}) all-reduce-done(%ars)
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,16]{1,0} collective-permute-done(%cps)
  %rss = ((f32[8,16]{1,0}), f32[2,16]{1,0}, s32[]) async-start(%p), calls=%wrapped_rs
  %rsd = f32[2,16]{1,0} async-done(%rss), calls=%wrapped_rs
  ROOT %out = f32[8,16]{1,0} add(%agd, %cpd)
}
"""
    )
    full, quarter = 8 * 16 * F32, 2 * 16 * F32
    assert collective_stats(parse_module(text)) == {
        "all-reduce": {"count": 1, "bytes": full + quarter, "operand_bytes": full + quarter},
        "all-gather": {"count": 1, "bytes": full, "operand_bytes": quarter},
        "reduce-scatter": {"count": 1, "bytes": quarter, "operand_bytes": full},
        "collective-permute": {"count": 1, "bytes": full, "operand_bytes": full},
    }


def test_nested_loops_multiply_and_reducers_are_not_walked():
    text = (
        REDUCERS
        + """
%reducer_with_collective (a: f32[], b: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %never = f32[] all-reduce(%a.1), replica_groups={{0,1}}, to_apply=%add
}

%inner_body (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
}

%cond (c: f32[4]) -> pred[] {
  %c = f32[4]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}

%outer_body (y: f32[4]) -> f32[4] {
  %y = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%y), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
}

%unknown_body (z: f32[4]) -> f32[4] {
  %z = f32[4]{0} parameter(0)
  ROOT %ag = f32[8]{0} all-gather(%z), replica_groups={{0,1}}, dimensions={0}
}

%called (v: f32[4]) -> f32[4] {
  %v = f32[4]{0} parameter(0)
  ROOT %cp = f32[4]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %outer = f32[4]{0} while(%p), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %loop = f32[4]{0} while(%p), condition=%cond, body=%unknown_body
  %r = f32[] reduce(%p, %p), dimensions={0}, to_apply=%reducer_with_collective
  ROOT %c = f32[4]{0} call(%outer), to_apply=%called
}
"""
    )
    stats = collective_stats(parse_module(text))
    assert stats["all-reduce"] == {"count": 3 * 2, "bytes": 6 * 16, "operand_bytes": 6 * 16}
    assert stats["all-gather"]["count"] == 1  # loop of unknown length: once, and flagged
    assert stats["collective-permute"]["count"] == 1  # reached through `call ... to_apply=`
    assert stats["unknown_trip_count_loops"] == 1
    summary = collective_summary(stats)
    assert summary.startswith("all-reduce 6× 96 B, all-gather 1× 32 B, collective-permute 1×")
    assert "1 loop of unknown trip count" in summary


def test_summary_and_sizes():
    assert collective_summary({}) == "no collectives"
    stats = {"reduce-scatter": {"count": 12, "bytes": 3 * 2**19, "operand_bytes": 0}}
    assert collective_summary(stats) == "reduce-scatter 12× 1.5 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**29) == "1.5 GiB"
    assert shape_bytes("f32[8,64]{1,0}") == 8 * 64 * 4
    assert (
        shape_bytes("(bf16[3]{0}, s8[2,2]{1,0}, pred[], f8e4m3fn[4], c128[1])")
        == 6 + 4 + 1 + 4 + 16
    )


# --- FLOPs -------------------------------------------------------------------------------------

MODEL = ModelConfig(
    vocab_size=256,
    d_model=64,
    d_ff=128,
    num_heads=4,
    d_kv=16,
    num_encoder_layers=2,
    num_decoder_layers=2,
)
LIN, LTGT = 64, 32


def _einsum_flops(spec: str, sizes: dict[str, int]) -> int:
    """2 × the product of every index size of an einsum: each index tuple is one multiply-add."""
    letters = set(spec.replace(",", "").replace("->", ""))
    product = 1
    for letter in letters:
        product *= sizes[letter]
    return 2 * product


def _forward_by_einsums(m: ModelConfig, lin: int, ltgt: int) -> int:
    """Forward FLOPs of one sequence, summed over the einsums of the model written out."""
    # s: input positions, t: target positions, d, h, k, f, v: model dimensions
    sizes = dict(s=lin, t=ltgt, d=m.d_model, h=m.num_heads, k=m.d_kv, f=m.d_ff, v=m.vocab_size)
    encoder = [
        *["sd,dhk->shk"] * 3,  # q, k, v
        "shk,hkd->sd",  # o
        "shk,Shk->hsS",  # scores (S: key positions, also inputs)
        "hsS,Shk->shk",  # weighted values
        *["sd,df->sf"] * 2,  # wi_0, wi_1
        "sf,fd->sd",  # wo
    ]
    decoder = [
        *["td,dhk->thk"] * 3,
        "thk,hkd->td",
        "thk,Thk->htT",  # causal self-attention, full matrix (T: key positions)
        "htT,Thk->thk",
        "td,dhk->thk",  # cross q
        *["sd,dhk->shk"] * 2,  # cross k, v of the encoder output
        "thk,shk->hts",
        "hts,shk->thk",
        "thk,hkd->td",  # cross o
        *["td,df->tf"] * 2,
        "tf,fd->td",
    ]
    sizes.update(S=lin, T=ltgt)
    per_layer = [(m.num_encoder_layers, encoder), (m.num_decoder_layers, decoder)]
    total = sum(n * sum(_einsum_flops(e, sizes) for e in specs) for n, specs in per_layer)
    return total + _einsum_flops("td,dv->tv", sizes)


def test_flops_formula_against_an_independent_count():
    full = forward_flops_per_sequence(MODEL, LIN, LTGT, causal_attention_halved=False)
    assert full == _forward_by_einsums(MODEL, LIN, LTGT)
    halved = forward_flops_per_sequence(MODEL, LIN, LTGT)
    causal_self_attention = MODEL.num_decoder_layers * _einsum_flops(
        "thk,Thk->htT", dict(t=LTGT, T=LTGT, h=MODEL.num_heads, k=MODEL.d_kv)
    )  # scores and weighted values cost the same; half of both is masked
    assert full - halved == causal_self_attention
    parts = forward_flops_breakdown(MODEL, LIN, LTGT)
    assert sum(parts.values()) == halved
    assert parts["lm_head"] == 2 * LTGT * MODEL.d_model * MODEL.vocab_size
    assert training_flops_per_step(MODEL, 8, LIN, LTGT) == 3 * 8 * halved


def test_flops_formula_agrees_with_xla_cost_analysis():
    """The forward pass in plain jnp on one device, counted by XLA.

    XLA computes the whole causal matrix, so the un-halved formula is compared. There is no
    scan here because XLA's cost analysis counts a while-loop body once, not trip-count times
    (a lax.scan of 5 matmuls reports the FLOPs of one). XLA also counts elementwise work
    (softmax, GELU, residual adds, the position bias) that the model FLOPs leave out: hence 10%.
    """
    m, batch = MODEL, 2
    d, h, k, f = m.d_model, m.num_heads, m.d_kv, m.d_ff

    def attention_params():
        return {"q": (d, h, k), "k": (d, h, k), "v": (d, h, k), "o": (h, k, d)}

    def layer_params(cross: bool):
        layer = {"self": attention_params(), "wi_0": (d, f), "wi_1": (d, f), "wo": (f, d)}
        return layer | ({"cross": attention_params()} if cross else {})

    shapes = {
        "encoder": [layer_params(False) for _ in range(m.num_encoder_layers)],
        "decoder": [layer_params(True) for _ in range(m.num_decoder_layers)],
        "lm_head": (d, m.vocab_size),
        "bias": (h, LIN, LIN),
    }
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )

    def attention(p, xq, xkv, mask=None, bias=0.0):
        q = jnp.einsum("bqd,dhk->bqhk", xq, p["q"])
        kk = jnp.einsum("bsd,dhk->bshk", xkv, p["k"])
        v = jnp.einsum("bsd,dhk->bshk", xkv, p["v"])
        scores = jnp.einsum("bqhk,bshk->bhqs", q, kk) + bias
        if mask is not None:
            scores = jnp.where(mask, scores, -1e9)
        values = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores), v)
        return jnp.einsum("bqhk,hkd->bqd", values, p["o"])

    def ffn(p, x):
        return (jax.nn.gelu(x @ p["wi_0"]) * (x @ p["wi_1"])) @ p["wo"]

    def forward(params, x, y):
        for p in params["encoder"]:
            x = x + attention(p["self"], x, x, bias=params["bias"])
            x = x + ffn(p, x)
        causal = jnp.tril(jnp.ones((LTGT, LTGT), bool))
        for p in params["decoder"]:
            y = y + attention(p["self"], y, y, mask=causal)
            y = y + attention(p["cross"], y, x)
            y = y + ffn(p, y)
        return y @ params["lm_head"]

    x = jax.ShapeDtypeStruct((batch, LIN, d), jnp.float32)
    y = jax.ShapeDtypeStruct((batch, LTGT, d), jnp.float32)
    compiled = jax.jit(forward).lower(params, x, y).compile()
    xla = compiled.cost_analysis()["flops"]
    ours = batch * forward_flops_per_sequence(m, LIN, LTGT, causal_attention_halved=False)
    assert xla == pytest.approx(ours, rel=0.10)


def test_mfu():
    # 3 devices of 10 FLOP/s for 2 s could do 60 FLOPs; 15 done is a quarter.
    assert mfu(15.0, 2.0, 10.0, 3) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mfu(15.0, 0.0, 10.0, 3)


def test_operands_past_the_fifth_count_in_a_collective_s_bytes():
    """XLA prints `/*index=5*/` before the sixth operand of a long list (XLA:GPU's combined
    collectives have many): its bytes count like the others'."""
    from t5scale.analysis.hlo import collective_ops

    params = "\n".join(f"  %p{i} = f32[4]{{0}} parameter({i})" for i in range(6))
    text = (
        "HloModule m, num_partitions=2\n"
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
        "  %y = f32[] parameter(1)\n  ROOT %s = f32[] add(%x, %y)\n}\n"
        "ENTRY %main () -> f32[4] {\n" + params + "\n"
        "  ROOT %all-reduce.1 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, "
        "/*index=5*/f32[4]{0}) all-reduce(%p0, %p1, %p2, %p3, %p4, /*index=5*/%p5), "
        "channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add\n}\n"
    )
    (op,), _ = collective_ops(parse_module(text))
    assert (op.bytes, op.operand_bytes) == (6 * 16, 6 * 16)
