"""The GPU check's head item (bench/gpu_check.py): the output layer and loss, forward and
backward, over a step's target tokens at mT5's vocabulary, by XLA's route (t5scale/model/head.py:
cuBLAS's GEMM writing fp32 logits, XLA's reductions) and by the head's kernel
(t5scale/model/head_kernel.py) at a few tiles; the errors between them, the times, and the
tiles chosen for the steps that follow (head_tiles.json, `tiles_file`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_check_items import start_jax, timed
from gpu_check_list import Results, Shapes

# Candidates for the kernel's tiles: (tokens, columns, depth, warps, stages). The first is
# HeadTiles' default; the others are the shapes Triton's Hopper GEMMs commonly take.
CANDIDATES = (
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 32, 4, 4),
)
DRY_CANDIDATES = ((16, 64, 16, 4, 2), (32, 64, 16, 4, 2))
TOLERANCE = 2e-2  # relative, of the loss and each gradient against XLA's route, in bf16
# t5scale.model.head_kernel.TILES_FILE, named here so that the parent does not import JAX
TILES_VARIABLE = "T5SCALE_HEAD_TILES"


def tiles_file(out: Path) -> Path:
    return out / "head_tiles.json"


def head_item(results: Results, shapes: Shapes, dry_run: bool) -> None:
    jax = start_jax(dry_run)
    from t5scale.model.sizes import preset

    large, small, _ = shapes.models
    chosen = {}
    for model in dict.fromkeys((small, large)):
        config = preset(model)
        timings = _compare(jax, shapes, config.d_model, config.vocab_size, dry_run)
        results.write(head=model, **timings)
        chosen[str(config.d_model)] = timings["chosen"]
    tiles_file(results.path.parent).write_text(json.dumps(chosen, indent=1) + "\n")


def _compare(jax, shapes: Shapes, d_model: int, vocab: int, dry_run: bool) -> dict[str, Any]:
    """Forward + backward of the head over batch × target length tokens: XLA's route and the
    kernel at each candidate (median of 10), its errors against XLA's route in bf16."""
    from t5scale.model.head import HeadLoss, chunk_tokens, chunks_per_product, head_loss

    tokens = shapes.batch * shapes.target_length
    x, w, targets, weights = _head_arrays(jax, tokens, d_model, vocab)
    repeats = 2 if dry_run else 10
    # XLA's route as the step runs it (head.model_loss_sums): its chunks, in products of ~1,024
    chunk = chunk_tokens(None, tokens, vocab)
    base = HeadLoss(z_loss=1e-4, chunk=chunk, vocab_size=vocab, compute_dtype="bfloat16",
                    product_chunks=chunks_per_product(chunk, -(-tokens // chunk)))  # fmt: skip

    def gradients(how: HeadLoss):
        def loss(x, w):
            return head_loss(x, w, targets, weights, weights, how)[0]

        return jax.jit(jax.value_and_grad(loss, (0, 1)))

    xla = gradients(base)
    arrays = (x, w, targets, xla(x, w))
    rows = [_candidate(jax, base, candidate, gradients, arrays, repeats)
            for candidate in (DRY_CANDIDATES if dry_run else CANDIDATES)]  # fmt: skip
    # the fastest of those within bf16's tolerance of XLA's route (tests/test_head_kernel.py)
    exact = [row for row in rows if "seconds" in row and max(row["errors_loss_dx_dw"]) < TOLERANCE]
    best = min(exact, key=lambda row: row["seconds"])["tiles"] if exact else None
    fields = ("tokens", "columns", "depth", "warps", "stages")
    return {
        "tokens": tokens, "d_model": d_model, "vocab": vocab, "xla_chunk": base.chunk,
        "xla_seconds": timed(xla, x, w, repeats=repeats), "kernel": rows,
        "chosen": dict(zip(fields, best, strict=True)) if best else {},
    }  # fmt: skip


def _head_arrays(jax, tokens: int, d_model: int, vocab: int) -> tuple:
    """x [tokens, d_model] and w [d_model, vocab] in bf16 (logits of a few units), targets and
    weights (a tenth padding)."""
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, d_model), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (d_model, vocab)) / d_model**0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (tokens,), 0, vocab)
    weights = (jax.random.uniform(keys[3], (tokens,)) > 0.1).astype(jnp.float32)
    return x, w, targets, weights


def _candidate(jax, base, candidate: tuple, gradients, arrays: tuple, repeats: int) -> dict:
    """The kernel's route at one candidate's tiles: its time, its errors against XLA's route
    (`arrays`' last: its loss and gradients), a chunk's kernel alone; or why it failed."""
    import dataclasses

    import numpy as np

    from t5scale.model.head import chunks_per_product, kernel_chunk_tokens
    from t5scale.model.head_kernel import HeadTiles

    x, w, targets, want = arrays
    interpret = jax.devices()[0].platform != "gpu"
    tiles = HeadTiles(*candidate)
    chunk = kernel_chunk_tokens(None, x.shape[0], tiles.tokens)
    how = dataclasses.replace(base, chunk=chunk, tiles=tiles,
                              product_chunks=chunks_per_product(chunk, -(-x.shape[0] // chunk)),
                              kernel="interpreted" if interpret else "triton")  # fmt: skip
    try:
        function = gradients(how)
        got = function(x, w)
        seconds = timed(function, x, w, repeats=repeats)
    except Exception as error:  # a tile Triton cannot compile is a row, not a failed item
        return {"tiles": candidate, "error": str(error).splitlines()[0][:200]}
    errors = [_relative(np, a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                                    strict=True)]  # fmt: skip
    alone = _kernel_alone(jax, x[:chunk], w, targets[:chunk], tiles, interpret, repeats)
    return {"tiles": candidate, "chunk": chunk, "seconds": seconds, "errors_loss_dx_dw": errors,
            **alone}  # fmt: skip


def _kernel_alone(jax, x, w, targets, tiles, interpret: bool, repeats: int) -> dict[str, float]:
    """One chunk's kernel alone against cuBLAS's GEMM of the same product writing fp32 logits
    (XLA's route's first kernel): how near the Triton GEMM comes to the library's."""
    import jax.numpy as jnp

    from t5scale.model.head_kernel import tile_statistics

    kernel = jax.jit(lambda x, w, t: tile_statistics(x, w, t, w.shape[1], tiles, write_exp=True,
                                                     interpret=interpret))  # fmt: skip
    gemm = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32))
    return {
        "kernel_chunk_s": timed(kernel, x, w, targets, repeats=repeats),
        "gemm_chunk_s": timed(gemm, x, w, repeats=repeats),
        "chunk_flops": 2.0 * x.shape[0] * x.shape[1] * w.shape[1],
    }


def _relative(np, got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def head_rows(lines: list[dict[str, Any]]) -> list[str]:
    """The head item's table: XLA's route and the kernel at each tile, per model's d_model."""
    heads = [line for line in lines if "xla_seconds" in line]
    if not heads:
        return []
    text = ["", "## The output layer: XLA's route against the head's kernel", "",
            "| model | tokens × d_model × vocab | route | tiles (tokens, columns, depth, warps, "
            "stages) | chunk | fwd+bwd | against XLA | errors (loss, dx, dw) | a chunk's kernel "
            "against cuBLAS's GEMM (TFLOP/s) |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for head in heads:
        shape = f"{head['tokens']:,} × {head['d_model']} × {head['vocab']:,}"
        xla_ms = head["xla_seconds"] * 1e3
        text.append(f"| {head['head']} | {shape} | XLA | – | {head['xla_chunk']} | "
                    f"{xla_ms:.2f} ms | 1.00× | – | – |")  # fmt: skip
        for row in head["kernel"]:
            if "seconds" not in row:
                text.append(f"| {head['head']} | {shape} | kernel | {row['tiles']} | – | – | – | "
                            f"{row['error']} | – |")  # fmt: skip
                continue
            errors = ", ".join(f"{e:.1e}" for e in row["errors_loss_dx_dw"])
            text.append(f"| {head['head']} | {shape} | kernel | {row['tiles']} | {row['chunk']} "
                        f"| {row['seconds'] * 1e3:.2f} ms | {xla_ms / (row['seconds'] * 1e3):.2f}× "
                        f"| {errors} | {_rates(row)} |")  # fmt: skip
    return text


def _rates(row: dict[str, Any]) -> str:
    flops = row["chunk_flops"]
    return f"{flops / row['kernel_chunk_s'] / 1e12:.0f} against {flops / row['gemm_chunk_s'] / 1e12:.0f}"
