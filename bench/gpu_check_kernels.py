"""The GPU check's kernels item (bench/gpu_check.py): the fused attention kernels
(t5scale/model/attention_kernels.py), their tiles chosen on the card (gpu_check_tiles.py), against
the einsum path and cuDNN's attention, errors and times."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any

from gpu_check_items import h100_target, start_jax, timed
from gpu_check_list import Results, Shapes
from gpu_check_tiles import sweep, write_choice


# (attention, causal, bias, query length, key length)
def attention_cases(shapes: Shapes) -> list[tuple[str, bool, bool, int, int]]:
    encoder, decoder = shapes.input_length, shapes.target_length
    return [
        ("encoder", False, True, encoder, encoder),
        ("decoder", True, True, decoder, decoder),
        ("cross", False, False, decoder, encoder),
    ]


# tests/test_attention.py's tolerances: the kernel against the einsum path in the same dtype
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def kernels_item(results: Results, shapes: Shapes, dry_run: bool, dtype: str) -> None:
    jax = start_jax(dry_run)
    import numpy as np

    from t5scale.model.attention_kernels import Blocks, shape_key

    rng = np.random.default_rng(0)
    repeats = 2 if dry_run else 10
    for case in attention_cases(shapes):
        what, causal, with_bias, q_len, k_len = case
        arrays = _attention_arrays(jax.numpy, rng, shapes, dtype, q_len, k_len, with_bias)
        blocks = Blocks()
        if dtype == "bfloat16":  # the tiles the steps take are bf16's
            blocks, rows = sweep(jax, arrays[:6], causal, dry_run, repeats)
            results.write(attention=what, tile_sweep=rows)
            write_choice(results.path.parent, shape_key(q_len, k_len, causal), blocks)
        results.write(**attention_case(jax, arrays, shapes, dtype, *case, blocks, repeats))


def attention_case(
    jax, arrays: tuple, shapes: Shapes, dtype: str, what: str, causal: bool, with_bias: bool,
    q_len: int, k_len: int, blocks, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """One attention at its lengths: the fused kernels' errors against the einsum path and
    against exact fp32 einsums, output and gradients, and the forward + backward time of each
    path: the kernels at `blocks` and at the default tiles, the einsum path, cuDNN's."""
    import jax.numpy as jnp

    from t5scale.analysis.peaks import datasheet_peak
    from t5scale.model.attention_kernels import Blocks, flash_attention
    from t5scale.model.attention_reference import reference_attention

    wrt = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    interpret = jax.devices()[0].platform != "gpu"

    def gradients(attend, precision=None):
        return _with_gradients(jax, attend, causal, wrt, precision)

    fused = gradients(partial(flash_attention, blocks=blocks, interpret=interpret))
    paths = {"fused": fused, "dot": gradients(reference_attention),
             "fused_default": gradients(partial(flash_attention, blocks=Blocks(),
                                                interpret=interpret))}  # fmt: skip
    got = {name: paths[name](*arrays) for name in ("fused", "dot")}
    as32 = [None if x is None else x.astype(jnp.float32) for x in arrays[:4]]
    exact = gradients(reference_attention, "highest")(*as32, *arrays[4:])
    names = ["out", "dq", "dk", "dv", "d_bias"][: len(exact)]
    errors = {
        "fused_vs_dot": _errors(names, got["fused"], got["dot"]),
        "fused_vs_exact": _errors(names, got["fused"], exact),
        "dot_vs_exact": _errors(names, got["dot"], exact),
    }
    milliseconds = {name: 1e3 * timed(path, *arrays, repeats=repeats)
                    for name, path in paths.items()}  # fmt: skip
    cudnn = _cudnn_milliseconds(jax, gradients, arrays, repeats, interpret)
    compiled_fused = gradients(partial(flash_attention, blocks=blocks, interpret=False))
    batch, heads = shapes.batch, shapes.heads
    # FlashAttention's convention: 4·B·N·T·S·H forward, 2.5 times that backward, half causal
    useful = 3.5 * 4 * batch * heads * q_len * k_len * 64 * (0.5 if causal else 1.0)
    return dict(
        attention=what, dtype=dtype, causal=causal, bias=with_bias, q=q_len, k=k_len,
        batch=batch, heads=heads, errors=errors, tolerance=TOLERANCE[dtype],
        verdict=_verdict(errors, names, dtype), ms_fused=milliseconds["fused"],
        ms_fused_default_tiles=milliseconds["fused_default"], ms_dot=milliseconds["dot"],
        **cudnn, useful_flops=useful,
        # counted for bf16 only: the rate a cluster file takes is bf16's, and a compile costs
        fused_flops=(fused_attention_flops(jax, compiled_fused, arrays)
                     if dtype == "bfloat16" else None),  # fmt: skip
        datasheet_flops=datasheet_peak(dtype),
    )  # fmt: skip


def _cudnn_milliseconds(jax, gradients, arrays, repeats: int, interpret: bool) -> dict:
    """cuDNN's attention (jax.nn.dot_product_attention), forward + backward, as the baseline:
    with T5's bias made [1, heads, q, k], and without a bias; neither masks the packed segments
    (cuDNN takes no segment ids), so each does less than the kernels. None where it refuses."""
    from t5scale.model.attention_reference import bias_matrix

    def attend(q, k, v, bias, q_segments, k_segments, causal, with_bias):
        matrix = None
        if with_bias and bias is not None:
            matrix = bias_matrix(bias, q.shape[1], k.shape[1])[None].astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=matrix, scale=1.0, is_causal=causal,
                                            implementation="cudnn")  # fmt: skip

    timings = {}
    for name, with_bias in (("ms_cudnn_bias", True), ("ms_cudnn_no_bias", False)):
        if interpret:
            timings[name], timings[name + "_why"] = None, "no GPU"
            continue
        try:
            path = gradients(partial(attend, with_bias=with_bias))
            timings[name] = 1e3 * timed(path, *arrays, repeats=repeats)
        except Exception as error:  # cuDNN refuses some lengths and biases in training
            timings[name], timings[name + "_why"] = None, str(error).splitlines()[0][:200]
    return timings


def _attention_arrays(jnp, rng, shapes: Shapes, dtype: str, q_len: int, k_len: int,
                      with_bias: bool) -> tuple:  # fmt: skip
    """q, k, v, the bias, both segment ids (packed, with padding), the loss's weights and
    which queries are valid. Everything the program reads is an argument: arrays it closes
    over would be constants, which XLA folds at compile time (minutes for these sizes)."""
    from t5scale.model.attention_reference import packed_segment_ids

    batch, heads = shapes.batch, shapes.heads
    q, k, v = (jnp.asarray(rng.normal(size=(batch, n, heads, 64)), dtype)
               for n in (q_len, k_len, k_len))  # fmt: skip
    diagonals = (heads, q_len + k_len - 1)  # the position bias, as the kernels take it
    bias = jnp.asarray(rng.normal(size=diagonals), jnp.float32) if with_bias else None
    q_segments = jnp.asarray(packed_segment_ids(rng, batch, q_len))
    k_segments = (
        q_segments if q_len == k_len else jnp.asarray(packed_segment_ids(rng, batch, k_len))
    )
    valid = (q_segments > 0)[:, :, None, None]  # padding queries' outputs are unused
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * valid
    return q, k, v, bias, q_segments, k_segments, weights, valid


def _with_gradients(jax, attend, causal: bool, wrt: tuple[int, ...], precision=None):
    """The attention's output and its loss's gradients with respect to `wrt`, jitted."""
    import jax.numpy as jnp

    def loss(q, k, v, bias, q_segments, k_segments, weights, valid):
        out = attend(q, k, v, bias, q_segments, k_segments, causal)
        return jnp.sum(out.astype(jnp.float32) * weights), out * valid

    def run(*arrays):
        with jax.default_matmul_precision(precision) if precision else nullcontext():
            (_, out), grads = jax.value_and_grad(loss, wrt, has_aux=True)(*arrays)
        return (out, *grads)

    return jax.jit(run)


def _verdict(errors: dict[str, dict[str, float]], names: list[str], dtype: str) -> str:
    """'ok': within the interpreter tests' tolerance of the einsum path. Else 'nearer exact' or
    'as dot': no further from exact fp32 than the einsum path is (its bf16 probabilities or
    TF32 matmuls on the card), output and every gradient; 'WRONG' otherwise."""
    within = max(errors["fused_vs_dot"].values()) <= TOLERANCE[dtype]
    fused_exact, dot_exact = errors["fused_vs_exact"], errors["dot_vs_exact"]
    nearer = all(fused_exact[n] <= dot_exact[n] for n in names)
    as_dot = all(fused_exact[n] <= 2 * dot_exact[n] + 1e-6 for n in names)
    return "ok" if within else "nearer exact" if nearer else "as dot" if as_dot else "WRONG"


def fused_attention_flops(jax, function, arrays) -> float | None:
    """The fused kernels' FLOPs in `function`'s program as the kernel inventory counts them
    (what ClusterConfig.attention_efficiency is a rate of): the card's own program, or in a dry
    run the same function compiled for one H100 without one (None without jax's CUDA plugin)."""
    from jax.sharding import SingleDeviceSharding

    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program
    from t5scale.target import Target

    if Target.local().is_gpu:
        text = function.lower(*arrays).compile().as_text()
        return read_program(parse_module(text)).inventory.attention.flops
    target = h100_target()
    if target is None:
        return None
    on_h100 = SingleDeviceSharding(target.devices[0])
    shapes = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_h100)
              for a in arrays]  # fmt: skip
    with target.compiling():
        compiled = function.lower(*shapes).compile(target.compiler_options)
    return read_program(parse_module(compiled.as_text())).inventory.attention.flops


def _errors(names: list[str], got, want) -> dict[str, float]:
    """Max |got − want| over max |want|, per output (tests/test_attention.py's measure)."""
    import numpy as np

    errors = {}
    for name, a, b in zip(names, got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errors[name] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return errors
