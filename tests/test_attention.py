"""The fused attention kernels (t5scale/model/attention_kernels.py): the same kernels, run by
Pallas's interpreter on the CPU, against the einsum path's own arithmetic (packed segments,
padding, causal, odd and unequal lengths, the bias and its gradient); the fused route on CPU
devices ('fused_reference', t5scale/parallel/attention.py); and the train step that uses the
kernels, compiled for H100s (Triton) without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    TINY_MODEL,
    assert_same_parameters,
    count_parses,
    one_device_reference,
    run_steps,
    tiny_setup,
    train_tiny,
)

from t5scale.config import build_run_config, parse_gin
from t5scale.model.attention_kernels import Blocks, Tiles, flash_attention, uniform
from t5scale.model.attention_reference import bias_matrix, diagonal_sums, packed_segment_ids
from t5scale.model.attention_tiles import live_tiles
from t5scale.model.fused_attention import fused_attention
from t5scale.model.mt5 import MT5, NEG_INF
from t5scale.model.sizes import ModelConfig, attention_for
from t5scale.parallel.attention import kernels_for
from t5scale.parallel.mesh import ParallelConfig
from t5scale.startup import cuda_plugin_installed, libtpu_installed
from t5scale.train.precision import PrecisionConfig
from t5scale.train.setup import build_setup
from t5scale.whatif.weak_scaling import weak_scale


def einsum_attention(q, k, v, bias, q_segments, k_segments, causal):
    """What mt5.Attention computes with attention='dot': the masks folded into an additive
    bias, a float32 softmax over the [batch, heads, q, k] scores (the position bias given by its
    diagonals, as the kernels take it)."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias_matrix(bias, q.shape[1], k.shape[1])[None]
    allowed = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] > 0)
    if causal:
        allowed = allowed & np.tril(np.ones((q.shape[1], k.shape[1]), bool))[None]
    logits = logits + jnp.where(allowed, 0.0, NEG_INF)[:, None]
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# (what, causal, bias, query length, key length, each pass's tiles): the encoder's, the
# decoder's and the cross attention, at odd lengths that are not whole blocks, and one over
# several diagonal blocks with other tiles in each pass, oblong ones and the batch in groups.
# dk and dv from the scores transposed (`Tiles.transposed`) in the causal decoder's cases and
# the cross attention's.
SQUARE = uniform(Tiles(16, 16))
CASES = [
    ("encoder", False, True, 37, 37, SQUARE),
    ("decoder", True, True, 37, 37, uniform(Tiles(16, 32, groups=2, transposed=True))),
    ("cross", False, False, 13, 37, uniform(Tiles(16, 16, transposed=True))),
    ("decoder, 7 blocks", True, True, 100, 100,
     Blocks(Tiles(16, 32), Tiles(32, 16, transposed=True), Tiles(16, 16),
            Tiles(32, 16, groups=3))),
]  # fmt: skip


# CI: fp32 on the encoder and over 7 blocks (causal, with grouped and transposed tiles), bf16
# on the cross attention; every case in both dtypes with `-m slow` (the interpreter is slow)
IN_CI = {("encoder", "float32"), ("decoder, 7 blocks", "float32"), ("cross", "bfloat16")}


@pytest.mark.parametrize(
    ("what", "causal", "with_bias", "q_len", "k_len", "blocks", "dtype"),
    [
        (*case, dtype)
        if (case[0], dtype) in IN_CI
        else pytest.param(*case, dtype, marks=pytest.mark.slow)
        for dtype in ("float32", "bfloat16")
        for case in CASES
    ],
)
def test_the_kernel_equals_the_einsum_path(what, causal, with_bias, q_len, k_len, blocks, dtype):
    rng = np.random.default_rng(len(what))
    batch, heads, dim = 3, 3, 16
    q, k, v = (
        jnp.asarray(rng.normal(size=(batch, n, heads, dim)), dtype) for n in (q_len, k_len, k_len)
    )
    diagonals = (heads, q_len + k_len - 1)
    bias = jnp.asarray(rng.normal(size=diagonals), jnp.float32) if with_bias else None
    q_segments = packed_segment_ids(rng, batch, q_len)
    k_segments = q_segments if q_len == k_len else packed_segment_ids(rng, batch, k_len)
    valid = jnp.asarray(q_segments > 0)[:, :, None, None]  # padding queries' outputs are unused
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid

    def fused(q, k, v, bias):  # several blocks per row, and padded ones
        return flash_attention(q, k, v, bias, q_segments, k_segments, causal, blocks, True)

    def einsum(q, k, v, bias):
        return einsum_attention(q, k, v, bias, q_segments, k_segments, causal)

    def loss(attend, *arguments):
        return jnp.sum(attend(*arguments).astype(jnp.float32) * weights)

    wrt = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    got = jax.grad(lambda *a: loss(fused, *a), argnums=wrt)(q, k, v, bias)
    want = jax.grad(lambda *a: loss(einsum, *a), argnums=wrt)(q, k, v, bias)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    out, reference = fused(q, k, v, bias), einsum(q, k, v, bias)
    assert out.dtype == q.dtype and out.shape == q.shape

    def relative(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return np.max(np.abs(a - b)) / np.max(np.abs(b))

    assert relative(out * valid, reference * valid) <= tolerance
    for name, a, b in zip(["dq", "dk", "dv", "d_bias"], got, want, strict=False):
        assert relative(a, b) <= tolerance, name


def test_dead_tiles_are_skipped_and_the_result_stays_exact():
    """The kernels skip tiles whose queries and keys share no segment (attention_tiles.py):
    seqio's packing leaves most of them dead. Ids that are not one run per example (here
    interleaved) and a row of padding alone keep the result exact, and free of NaN."""
    rng = np.random.default_rng(5)
    batch, length, heads, dim = 3, 64, 2, 16
    segments = packed_segment_ids(rng, batch, length)
    segments[1] = 1 + np.arange(length) % 2  # two examples, token by token
    segments[2] = 0  # padding alone
    live = np.asarray(live_tiles(jnp.asarray(segments), jnp.asarray(segments), False, 16, 16))
    assert live[0].sum() < 16 and live[1].all() and not live[2].any()
    q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
               for _ in range(3))  # fmt: skip
    bias = jnp.asarray(rng.normal(size=(heads, 2 * length - 1)), jnp.float32)
    valid = jnp.asarray(segments > 0)[:, :, None, None]
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid

    def loss(attend, *arguments):
        return jnp.sum(attend(*arguments, segments, segments, False) * weights)

    fused = functools.partial(flash_attention, blocks=SQUARE, interpret=True)
    got = jax.value_and_grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.value_and_grad(lambda *a: loss(einsum_attention, *a), argnums=(0, 1, 2, 3))(
        q, k, v, bias
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_bias_by_its_diagonals_and_its_gradient_back():
    """diagonal_sums is bias_matrix's transpose: what the kernels' gradient of the diagonals
    is, checked against JAX's own gradient of the gather."""
    rng = np.random.default_rng(0)
    diagonals = jnp.asarray(rng.normal(size=(2, 5 + 7 - 1)), jnp.float32)
    matrix = bias_matrix(diagonals, 5, 7)
    assert matrix[1, 3, 6] == diagonals[1, 6 - 3 + 4] and matrix[0, 4, 0] == diagonals[0, 0]
    cotangent = jnp.asarray(rng.normal(size=matrix.shape), jnp.float32)
    (want,) = jax.vjp(lambda d: bias_matrix(d, 5, 7), diagonals)[1](cotangent)
    np.testing.assert_allclose(diagonal_sums(cotangent), want, rtol=1e-6)


def test_auto_attention_is_the_einsum_path_on_cpu_devices():
    model = dataclasses.replace(TINY_MODEL, attention="auto")
    assert tiny_setup(ParallelConfig(zero_stage=3), model=model).run.model.attention == "dot"


# 'auto' is fused for bf16 compute only: the kernels' exact fp32 ran 48× slower than the einsum
# path's TF32 on an H200 (docs/benchmarks.md, the GPU check of 2026-11-27).
@pytest.mark.parametrize(
    ("asked", "dtype", "on_gpus", "elsewhere"),
    [("auto", "bfloat16", "fused", "dot"), ("auto", "float32", "dot", "dot"),
     ("fused", "float32", "fused", "fused_reference"), ("dot", "bfloat16", "dot", "dot"),
     ("fused_reference", "bfloat16", "fused_reference", "fused_reference")],
)  # fmt: skip
def test_attention_is_named_for_what_the_target_runs(asked, dtype, on_gpus, elsewhere):
    model = dataclasses.replace(TINY_MODEL, attention=asked, dtype=dtype)
    assert attention_for(model, fused_kernels=True).attention == on_gpus
    assert attention_for(model, fused_kernels=False).attention == elsewhere


def test_the_kernels_are_named_by_the_devices_target():
    """The backend the model is handed (ShardingHooks.kernels): the interpreter for CPU devices,
    Triton for GPUs, Mosaic for TPUs (v4's without strided rolls), as far as this machine can
    compile for them."""
    from jax.sharding import Mesh

    def backend(devices):
        return kernels_for(Mesh(np.array(devices[:1]), ("x",)))

    assert backend(jax.devices()) == "interpreted"
    if cuda_plugin_installed():
        from t5scale.xla_gpu import GpuTopology

        assert backend(GpuTopology("h100_sxm").devices()) == "triton"
    if libtpu_installed():
        from t5scale.xla_tpu import TpuSlice, TpuTopology

        assert backend(TpuTopology(TpuSlice.named("v5e-8")).devices()) == "mosaic"
        assert backend(TpuTopology(TpuSlice.named("v4-8")).devices()) == "mosaic_v4"


def test_the_model_asks_no_device_which_kernels_compile():
    """t5scale/model imports nothing of t5scale above it (the targets, XLA's GPU and TPU
    compilers): the kernels' backend reaches the model as a value."""
    modules = "t5scale.model.mt5, t5scale.model.hf_export, t5scale.model.head"
    code = f"import sys, {modules}; print(*sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m for m in run.stdout.split() if m.startswith("t5scale.")}
    assert {m for m in loaded if not m.startswith("t5scale.model")} == {
        "t5scale.errors",
        "t5scale.startup",
    }


def test_an_unknown_backend_is_rejected():
    q = jnp.zeros((1, 4, 1, 16))
    segments = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        fused_attention(q, q, q, None, segments, segments, False, "cuda")


@pytest.mark.slow  # CI: the kernels against the einsum path (above), and the fused step's training
def test_the_models_own_fused_attention_equals_the_einsum_path():
    """Without a mesh (the model's default `attend`, fused_attention on whole arrays): 'fused'
    runs the kernels (Pallas's interpreter, the default ShardingHooks.kernels), 'fused_reference'
    their arithmetic as einsums; both give the 'dot' model's logits, padding and all."""
    model = dataclasses.replace(TINY_MODEL, attention="dot")
    rng = np.random.default_rng(0)
    encoder_tokens = jnp.asarray(rng.integers(0, model.vocab_size, (2, 12)), jnp.int32)
    decoder_tokens = jnp.asarray(rng.integers(1, model.vocab_size, (2, 7)), jnp.int32)
    params = MT5(model).init(jax.random.key(0), encoder_tokens, decoder_tokens)
    want = MT5(model).apply(params, encoder_tokens, decoder_tokens)
    for attention in ("fused", "fused_reference"):
        fused = MT5(dataclasses.replace(model, attention=attention))
        got = fused.apply(params, encoder_tokens, decoder_tokens)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=attention)


@pytest.mark.slow  # CI: the fused steps below train like the einsum step
def test_fused_on_cpu_devices_is_named_for_the_arithmetic_it_runs():
    """'fused' asked of CPU devices, for which Triton does not compile the kernels, is built as
    'fused_reference' (the fused route, the kernels' arithmetic as einsums); the step's analysis
    (step_analysis.json) says so, and the step trains as the einsum step does."""
    parallel = ParallelConfig(zero_stage=1, tensor=2)  # fp32 here, mixed below
    setup = tiny_setup(parallel, model=dataclasses.replace(TINY_MODEL, attention="fused"))
    assert setup.run.model.attention == "fused_reference"
    step = setup.compile()
    assert step.analysis.attention == "fused_reference"
    state, losses = run_steps(setup, setup.create_state(seed=0), 0, 4, step.compiled)
    want_losses, want_params = one_device_reference()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    params = jax.device_get(setup.form.to_canonical(state).params)
    assert_same_parameters(params, want_params, 1e-5)


# On CPU devices the fused step ('fused_reference') gives `reference_attention` exactly what
# the kernels would get (t5scale/parallel/attention.py): padded to blocks, the segments, the bias
# [heads, q, k], each device's heads. Trained 5 steps it must end where the einsum path ends:
# in fp32 the one-device reference every layout reproduces (conftest.py), in mixed precision the
# einsum path on the same mesh, by the losses within bf16's tolerance, as
# test_precision_training.py compares layouts.
@pytest.mark.parametrize(
    ("stage", "tensor", "precision"),
    # CI: stage 3 in fp32, parameters and all; mixed precision's fused step runs in the GPU
    # check's dry run (tests/test_gpu_check.py) and compiles in the H100 programs below
    [(3, 2, "fp32"), pytest.param(1, 2, "mixed", marks=pytest.mark.slow),
     pytest.param(0, 2, "fp32", marks=pytest.mark.slow),
     pytest.param(2, 2, "fp32", marks=pytest.mark.slow),
     pytest.param(3, 1, "mixed", marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_fused_step_trains_like_the_einsum_step(stage, tensor, precision):
    parallel = ParallelConfig(zero_stage=stage, tensor=tensor)
    if precision == "fp32":
        changes, tolerance = {}, 1e-5
        want_losses, want_params = one_device_reference()
    else:
        changes = {"precision": PrecisionConfig(mode="mixed")}
        changes["model"], tolerance = dataclasses.replace(TINY_MODEL, dtype="bfloat16"), 1e-3
        want_losses, want_params = train_tiny(parallel, **changes)
    model = dataclasses.replace(changes.pop("model", TINY_MODEL), attention="fused")
    losses, params = train_tiny(parallel, model=model, **changes)
    np.testing.assert_allclose(losses, want_losses, rtol=tolerance)
    if precision == "fp32":  # bf16's rounding leaves parameters alike only in their losses
        assert_same_parameters(params, want_params, tolerance)


def test_an_unknown_attention_is_rejected():
    with pytest.raises(ValueError, match="attention must be dot, fused, fused_reference or auto"):
        ModelConfig(name="mt5_tiny", attention="flash")


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (test extra)")
@pytest.mark.parametrize(
    "gpus, tensor, beside_the_einsum_step",
    # CI: one GPU, the fused step alone; beside the einsum step's program (its score tensor, its
    # larger temporaries: a second compile of 14 s), and the heads split over tensor 2 on 4 GPUs
    # (a compile 2.5x as long), slow
    [
        (1, 1, False),
        pytest.param(1, 1, True, marks=pytest.mark.slow),
        pytest.param(4, 2, True, marks=pytest.mark.slow),
        pytest.param(4, 1, True, marks=pytest.mark.slow),
    ],
)
def test_the_h100_step_runs_the_kernels_and_holds_no_score_tensor(
    gpus, tensor, beside_the_einsum_step, monkeypatch
):
    """mt5_tiny at ZeRO 3 on `gpus` H100s of one node, 3 examples per GPU (compiled, not run),
    mixed precision: with 'auto' the step is the fused one, Triton's kernels for every attention,
    forward and backward, and no [batch, heads, q, k] tensor, which the einsum path has; its
    GEMMs are cuBLAS's (no autotuner for Triton's). The step's analysis (its collectives, its
    kernels) reads the program from one parse of its text. With ModelConfig.head_kernel (asked
    for beside 'auto') the output layer is its kernel (t5scale/model/head_kernel.py) where
    tensor parallelism leaves the vocabulary whole, and XLA's GEMM where it splits it."""
    from t5scale.xla_gpu import GpuTopology

    topology = GpuTopology("h100_sxm", nodes=1, gpus_per_node=gpus)
    programs = {}
    for attention in ("auto", "dot") if beside_the_einsum_step else ("auto",):
        parse_gin(
            ["gin/models/mt5_tiny.gin", "gin/precision/mixed.gin"],
            [
                "INPUT_LENGTH=64",
                "TARGET_LENGTH=15",
                f"ModelConfig.attention='{attention}'",
                f"ModelConfig.head_kernel={attention == 'auto'}",
            ],  # fmt: skip
            [],
        )
        run = weak_scale(build_run_config(), 3, topology.size, 3, tensor=tensor,
                         dcn_groups=topology.nodes)  # fmt: skip
        setup = build_setup(run, topology.devices())
        parsed = count_parses(monkeypatch)
        step = setup.compile()
        assert step.analysis.program.kernels and step.analysis.program.collectives is not None
        assert parsed == [step.compiled.as_text()], f"parsed {len(parsed)} times"
        assert step.analysis.attention == setup.run.model.attention  # step_analysis.json's
        assert step.analysis.compiler.startswith("xla:gpu NVIDIA H100")
        assert bool(step.analysis.collective_ops) == (gpus > 1)  # one GPU: nothing to exchange
        programs[setup.run.model.attention] = step.compiled
    fused = programs["fused"].as_text()
    kernels = set(re.findall(r"t5_attention_(?:forward|backward_dkv|backward_dq|backward_bias)",
                             fused))  # fmt: skip
    assert kernels == {
        "t5_attention_forward",
        "t5_attention_backward_dkv",
        "t5_attention_backward_dq",
        "t5_attention_backward_bias",
    }
    heads = 4 // tensor
    scores = re.compile(rf"\[3,{heads},(64|15|16),(64|15|16)\]")  # per device: 3 examples
    assert not scores.search(fused)
    assert "__cublas$" in fused
    assert ('"t5_head_statistics"' in fused) == (tensor == 1)
    if beside_the_einsum_step:  # the pattern finds the einsum step's scores
        dot = programs["dot"].as_text()
        assert scores.search(dot) and "__cublas$" in dot
        assert '"t5_head_statistics"' not in dot
        temporaries = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
        assert temporaries["fused"] < temporaries["dot"]


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (test extra)")
@pytest.mark.parametrize("causal", [False, True])
def test_the_kernels_are_priced_as_attention(causal):
    """The cluster model's inventory (t5scale/analysis/kernels.py) of a compile-only H100
    program: one forward and three backward kernels, by hand 2·B·N·T·S·H = 2·2·4·128·128·64
    per product, 2 + 4 + 3 + 2 products (the bias's gradient recomputes the scores and their
    gradient), causal ones over 3 of the 4 block pairs (two blocks of 64). The bias comes by
    its diagonals, and no [heads, q, k] array is read or made but the gradient's one sum."""
    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program
    from t5scale.xla_gpu import GpuTopology, compiler_options

    device = GpuTopology("h100_sxm").devices()[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16, sharding=placed)
    bias = jax.ShapeDtypeStruct((4, 255), jnp.float32, sharding=placed)
    segments = jax.ShapeDtypeStruct((2, 128), jnp.int32, sharding=placed)

    def loss(q, k, v, bias, segments):
        out = flash_attention(q, k, v, bias, segments, segments, causal)
        return jnp.sum(out.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, q, q, bias, segments)
    compiled = lowered.compile(compiler_options=compiler_options([device]))
    attention = read_program(parse_module(compiled.as_text())).inventory.attention
    per_product = 2 * 2 * 4 * 128 * 128 * 64
    assert attention.count == 4
    assert attention.flops == pytest.approx(per_product * 11 * (3 / 4 if causal else 1))
    # what each kernel reads: the bias's diagonals [4, 255] padded by a tile on each side,
    # never a [4, 128, 128] matrix
    reads = re.findall(r"operand_layout_constraints=\{(.*?)\}, api_version", compiled.as_text())
    assert len(reads) == 4 and all("f32[4,383]" in read for read in reads)
    assert not any("4,128,128]" in read for read in reads)


# ---- the TPU kernels (t5scale/model/attention_tpu.py: Mosaic) ------------------------------------

# (what, causal, bias, query length, key length, strided rolls): lengths padded to one block, to
# two, and to 3 × 2 (the bias's tiles skewed from windows of its diagonals across blocks both
# ways), that with v4's skew (no strided rolls) too
TPU_CASES = [
    ("encoder", False, True, 37, 37, True),
    ("decoder, 2 blocks", True, True, 200, 200, True),
    ("cross, 2 key blocks", False, False, 13, 150, True),
    ("biased, 3 × 2 blocks", False, True, 300, 200, True),
    ("biased, 3 × 2 blocks, v4", False, True, 300, 200, False),
]


@pytest.mark.parametrize(
    ("what", "causal", "with_bias", "q_len", "k_len", "strided"),
    # CI: the biased 3 × 2 blocks (strided rolls, as on v5e); the others, slow
    [
        case if case[0] == "biased, 3 × 2 blocks" else pytest.param(*case, marks=pytest.mark.slow)
        for case in TPU_CASES
    ],
)
def test_the_tpu_kernels_equal_the_einsum_path(what, causal, with_bias, q_len, k_len, strided):
    """Under Pallas's TPU interpreter on the CPU, fp32: outputs and the gradients of q, k, v and
    the bias within 1e-5 of the einsum path's, packed segments with padding."""
    from t5scale.model.attention_tpu import tpu_flash_attention

    rng = np.random.default_rng(len(what))
    batch, heads, dim = 2, 3, 16
    q, k, v = (jnp.asarray(rng.normal(size=(batch, n, heads, dim)), jnp.float32)
               for n in (q_len, k_len, k_len))  # fmt: skip
    diagonals = (heads, q_len + k_len - 1)
    bias = jnp.asarray(rng.normal(size=diagonals), jnp.float32) if with_bias else None
    q_segments = packed_segment_ids(rng, batch, q_len)
    k_segments = q_segments if q_len == k_len else packed_segment_ids(rng, batch, k_len)
    valid = jnp.asarray(q_segments > 0)[:, :, None, None]  # padding queries' outputs are unused
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid

    def fused(*arguments):
        return tpu_flash_attention(*arguments, q_segments, k_segments, causal, True,
                                   strided_rolls=strided)  # fmt: skip

    def einsum(*arguments):
        return einsum_attention(*arguments, q_segments, k_segments, causal)

    def loss(attend, *arguments):
        return jnp.sum(attend(*arguments) * weights)

    wrt = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    got = jax.grad(lambda *a: loss(fused, *a), argnums=wrt)(q, k, v, bias)
    want = jax.grad(lambda *a: loss(einsum, *a), argnums=wrt)(q, k, v, bias)

    def relative(a, b):
        return np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))

    out = fused(q, k, v, bias)
    assert out.shape == q.shape
    assert relative(out * valid, einsum(q, k, v, bias) * valid) <= 1e-5
    for name, a, b in zip(["dq", "dk", "dv", "d_bias"], got, want, strict=False):
        assert relative(a, b) <= 1e-5, name


@pytest.mark.skipif(not libtpu_installed(), reason="needs libtpu (the tpu extra)")
# v4: the kernels without strided rolls, which the interpreter checks in CI
@pytest.mark.parametrize("chips", ["v5e-8", pytest.param("v4-8", marks=pytest.mark.slow)])
def test_a_tpu_step_runs_the_kernels_and_holds_no_score_tensor(chips):
    """mt5_tiny at ZeRO 3 on a TPU slice (compile-only), bf16: 'auto' is the fused step,
    Mosaic's kernels for every attention, forward and backward, counted as attention by the
    inventory, and no [batch, heads, q, k] array (bench/tpu_attention.py: the einsum step's),
    nor the bias's [heads, q, k]: the kernels skew its tiles from the diagonals."""
    from t5scale.target import Target
    from t5scale.xla_tpu import TpuSlice, TpuTopology

    target = Target.compile_only_tpus(TpuTopology(TpuSlice.named(chips)))
    parse_gin(["gin/models/mt5_tiny.gin", "gin/precision/mixed.gin"],
              ["INPUT_LENGTH=64", "TARGET_LENGTH=15", "ModelConfig.dtype='bfloat16'"], [])  # fmt: skip
    run = weak_scale(build_run_config(), 3, target.size, 3, dcn_groups=target.dcn_groups)
    step = build_setup(run, target).compile()
    assert step.analysis.attention == "fused"
    fused = step.compiled.as_text()
    kernels = set(re.findall(r"t5_attention_(?:forward|backward_dkv|backward_dq)", fused))
    assert kernels == {"t5_attention_forward", "t5_attention_backward_dkv",
                       "t5_attention_backward_dq"}  # fmt: skip
    assert step.analysis.kernels.attention.count > 0
    assert not re.search(r"\[3,4,(64|15|128),(64|15|128)\]", fused)  # 3 examples, 4 heads a chip
    # nor [heads, q, ·]: the bias's matrix, its gradient's, diagonal_sums' skewed rows
    assert not re.search(r"\[4,(64|15|128),\d+\]", fused)
