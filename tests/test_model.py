"""The mT5 architecture: published parameter counts, T5 v1.1 features, scan and remat."""

import dataclasses
import math
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5scale.config import build_run_config, parse_gin
from t5scale.model.mt5 import (
    MT5,
    _Module,
    abstract_params,
    gated_gelu,
    init_params,
    project_to_vocab,
    relative_position_bucket,
)
from t5scale.model.sizes import PRESETS, ModelConfig

PUBLISHED = {
    "mt5_small": 300_176_768,
    "mt5_base": 582_401_280,
    "mt5_large": 1_229_581_312,
    "mt5_xl": 3_742_619_648,
    "mt5_xxl": 12_921_057_280,
}


def count(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(abstract_params(cfg))))


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_are_the_published_ones(name):
    assert count(PRESETS[name]) == PUBLISHED[name]


@pytest.mark.parametrize("name", PRESETS)
def test_gin_presets_bind_the_python_presets(name):
    parse_gin([f"gin/models/{name}.gin"], [])
    assert build_run_config().model == PRESETS[name]


def test_t5_v11_parameter_layout():
    cfg = ModelConfig()
    params = nn.meta.unbox(abstract_params(cfg))
    paths = [
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    assert not [p for p in paths if "bias" in p.split("/")[-1]]  # no biases anywhere
    # One relative-position table per stack, shared by its layers (not stacked per layer).
    assert params["encoder"]["relpos_bias"]["rel_embedding"].shape == (cfg.num_heads, 32)
    assert params["decoder"]["relpos_bias"]["rel_embedding"].shape == (cfg.num_heads, 32)
    # Gated-GELU feed-forward and untied output projection beside one shared embedding.
    assert set(params["encoder"]["layers"]["mlp"]) == {"wi_0", "wi_1", "wo"}
    assert params["lm_head"].shape == (cfg.d_model, cfg.vocab_size)
    assert params["embedding"].shape == (cfg.vocab_size, cfg.d_model)
    # Norms carry a scale only; layer weights are stacked on a leading `layers` axis (scan).
    assert set(params["encoder"]["final_norm"]) == {"scale"}
    assert params["encoder"]["layers"]["attention"]["query"].shape[0] == cfg.num_encoder_layers


def test_relative_position_buckets():
    rel = np.arange(-200, 201)
    bidirectional = relative_position_bucket(rel, True, 32, 128)
    causal = relative_position_bucket(rel, False, 32, 128)
    assert bidirectional.min() == 0 and bidirectional.max() == 31
    assert (causal[rel > 0] == 0).all()  # the decoder cannot tell future positions apart
    assert causal.max() == 31  # causal spends all 32 buckets on the past
    # Bidirectional splits them: the lower half for keys before the query, the upper for after.
    assert set(bidirectional[rel < 0]) == set(range(1, 16)) and bidirectional[rel == 0] == 0
    assert set(bidirectional[rel > 0]) == set(range(17, 32))
    # Exact buckets for small distances, the same bucket beyond max_distance.
    assert len(set(causal[(rel <= 0) & (rel > -8)])) == 8
    assert len(set(causal[rel <= -128])) == 1


def _loss_and_grads(cfg: ModelConfig, params, tokens):
    def loss(p):
        logits = MT5(cfg).apply({"params": p}, tokens, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow  # out of CI's budget: run with -m slow
def test_remat_policies_do_not_change_the_numbers():
    cfg = ModelConfig()
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, cfg.vocab_size)
    params = nn.meta.unbox(MT5(cfg).init(jax.random.key(0), tokens, tokens)["params"])
    base_loss, base_grads = _loss_and_grads(cfg, params, tokens)
    for remat in ("minimal", "full"):
        loss, grads = _loss_and_grads(ModelConfig(remat=remat), params, tokens)
        np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_init_declares_the_parameters_without_the_arithmetic_and_draws_the_same(monkeypatch):
    """A state's creation traces the model's init: it skips the layers' matmuls (_Module.declaring),
    and the parameters are those of an init that runs them, to the bit."""
    cfg = ModelConfig(vocab_size=256)
    rng = jax.random.key(3)

    def init() -> tuple[int, list[np.ndarray]]:
        """(the init's matmuls, its parameters)"""
        traced = jax.jit(lambda key: init_params(cfg, key)).trace(rng)
        params = traced.lower().compile()(rng)
        return str(traced.jaxpr).count("dot_general"), jax.tree.leaves(params)

    declared_dots, declared = init()
    monkeypatch.setattr(_Module, "declaring", lambda self: False)
    computed_dots, computed = init()
    assert declared_dots == 0 < computed_dots
    for a, b in zip(declared, computed, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # CI: the layer loop, every model's default; unrolling is the GPU check's option
def test_unrolled_layers_give_the_loop_s_numbers():
    """scan_layers=False unrolls the same scan: the same stacked parameters, loss and gradients
    (that the remat survives unrolling is checked on the H100 program, test_xla_gpu.py)."""
    cfg = ModelConfig(vocab_size=256, remat="full")
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, cfg.vocab_size)
    # jitted: one program each, not an XLA:CPU compile per operation
    params = nn.meta.unbox(jax.jit(MT5(cfg).init)(jax.random.key(0), tokens, tokens)["params"])
    # init_params makes an unrolled model's parameters by the loop: the same draws (the last
    # bit may differ: XLA scales them in another order)
    own = nn.meta.unbox(jax.jit(MT5(unrolled).init)(jax.random.key(0), tokens, tokens)["params"])
    for a, b in zip(jax.tree.leaves(init_params(unrolled, jax.random.key(0))),
                    jax.tree.leaves(own), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    shapes = jax.tree.map(lambda x: x.shape, nn.meta.unbox(abstract_params(unrolled)))
    assert shapes == jax.tree.map(lambda x: x.shape, params)
    loss, grads = _loss_and_grads(cfg, params, tokens)
    unrolled_loss, unrolled_grads = _loss_and_grads(unrolled, params, tokens)
    np.testing.assert_allclose(unrolled_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(unrolled_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vocab_projection_has_the_gradients_of_a_plain_matmul(dtype):
    """The output projection's hand-written backward pass (for the CPU's fast matmul form)
    gives autodiff's gradients, under jit, with batch and length dimensions."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (3, 5, 16)).astype(dtype)
    w = jax.random.normal(kw, (16, 40)).astype(dtype)
    cotangent = jax.random.normal(kg, (3, 5, 40)).astype(dtype)

    def grads(f):
        out, vjp = jax.vjp(f, x, w)
        return (out, *vjp(cotangent))

    mine = jax.jit(lambda: grads(project_to_vocab))()
    plain = jax.jit(lambda: grads(lambda a, b: a @ b))()
    tol = 1e-6 if dtype == "float32" else 2e-2
    for a, b in zip(mine, plain, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_gelu_has_the_gradients_of_autodiff(dtype):
    """The gated GELU's hand-written gradient (in bf16 each (a, b) pair's two gradients as one
    32-bit word) against autodiff of gelu(a) · b in fp32 on the same inputs: to fp32's rounding
    in fp32, to bf16's in bf16, each gradient in its own place of the pair."""
    k_both, k_grad = jax.random.split(jax.random.key(1))
    both = (3 * jax.random.normal(k_both, (3, 5, 24, 2))).astype(dtype)
    grad = jax.random.normal(k_grad, (3, 5, 24)).astype(dtype)

    def plain(pairs):
        return jax.nn.gelu(pairs[..., 0], approximate=True) * pairs[..., 1]

    want_out, want_vjp = jax.vjp(plain, both.astype(jnp.float32))
    (want,) = want_vjp(grad.astype(jnp.float32))
    out, vjp = jax.vjp(gated_gelu, both)
    (got,) = jax.jit(vjp)(grad)
    assert got.shape == both.shape and got.dtype == jnp.dtype(dtype)
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: 8 bits of mantissa, a few roundings
    largest = float(jnp.abs(want).max())
    # the forward pass is jax.nn.gelu's, in the compute dtype
    np.testing.assert_allclose(np.float32(out), want_out, rtol=tol,
                               atol=tol * float(jnp.abs(want_out).max()))  # fmt: skip
    for half in (0, 1):  # each of a pair's gradients in its place
        np.testing.assert_allclose(np.float32(got[..., half]), want[..., half],
                                   rtol=tol, atol=tol * largest)  # fmt: skip


def test_bfloat16_compute_keeps_float32_parameters():
    cfg = ModelConfig(dtype="bfloat16")
    tokens = jnp.ones((1, 8), jnp.int32)
    variables = MT5(cfg).init(jax.random.key(0), tokens, tokens)
    assert {x.dtype for x in jax.tree.leaves(nn.meta.unbox(variables))} == {jnp.dtype("float32")}
    logits = MT5(cfg).apply(variables, tokens, tokens)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_compile_time_does_not_grow_with_depth():
    """The layers run under a scan: the HLO holds one layer body whatever the depth."""

    def hlo_size(layers: int) -> int:
        cfg = ModelConfig(num_encoder_layers=layers, num_decoder_layers=layers)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        params = nn.meta.unbox(abstract_params(cfg))
        lowered = jax.jit(lambda p, t: MT5(cfg).apply({"params": p}, t, t)).lower(params, tokens)
        return len(re.findall(r"stablehlo\.dot_general", lowered.as_text()))

    assert hlo_size(2) == hlo_size(12)


def test_gin_files_exist_for_every_preset():
    assert sorted(p.stem for p in Path("gin/models").glob("*.gin")) == sorted(PRESETS)


def test_an_unknown_size_is_refused_and_a_custom_model_names_every_dimension():
    """A misspelt size used to train mt5_tiny's dimensions under the misspelt name."""
    with pytest.raises(ValueError, match="'mt5_xlarge' is not a known size .*missing: vocab_size"):
        ModelConfig(name="mt5_xlarge")
    dimensions = {"vocab_size": 512, "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16,
                  "num_encoder_layers": 1, "num_decoder_layers": 3}  # fmt: skip
    with pytest.raises(ValueError, match="missing: num_decoder_layers$"):
        ModelConfig(name="mine", **{**dimensions, "num_decoder_layers": None})
    custom = ModelConfig(name="mine", **dimensions)
    assert {field: getattr(custom, field) for field in dimensions} == dimensions
    with pytest.raises(ValueError, match="d_model must be a positive integer, got 0"):
        ModelConfig(d_model=0)
    with pytest.raises(ValueError, match="num_heads must be an integer or None, got 2.5"):
        ModelConfig(num_heads=2.5)
