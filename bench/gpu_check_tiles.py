"""The GPU check's tile sweep (bench/gpu_check_kernels.py): each pass of the fused attention
kernels (t5scale/model/attention_kernels.py) timed alone on the card at each candidate tile,
warps and stages, and the fastest kept per pass and attention. The choice goes to
OUT/attention_tiles.json, which the steps of the same run read (attention_kernels.TILES_FILE)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from gpu_check_items import timed

# (q, k, warps, stages, groups, transposed). Forward and dq hold a query block and stream keys;
# dk, dv hold a key block and stream queries; the bias's gradient holds a tile and streams
# examples. The first of each is the kernels' default. Chosen from the H200's sweep of
# 2026-11-28 (larger tiles, 8 warps and 128 × 128 were slower in every pass), with smaller tiles
# added, which skip more of a packed row's dead tiles (attention_tiles.py), and dk, dv from the
# scores transposed (faster at every shape on the H200 of 2026-11-30: `Blocks`' default since).
CANDIDATES = {
    "forward": [(64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)],
    "dkv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
            (64, 64, 4, 3, 1, True), (64, 64, 4, 2, 1, True), (32, 64, 4, 3, 1, True)],
    "dq": [(64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (32, 32, 4, 2)],
    "bias": [(64, 64, 4, 2), (64, 64, 4, 2, 4), (32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2)],
}  # fmt: skip


# attention_kernels.TILES_FILE, named here so that the runner needs no JAX
TILES_VARIABLE = "T5SCALE_ATTENTION_TILES"


def tiles_file(out: Path) -> Path:
    return out / "attention_tiles.json"


def sweep(jax, arrays: tuple, causal: bool, dry_run: bool, repeats: int):
    """(each pass's fastest tiles as Blocks, the sweep's rows) for q, k, v, the bias's
    diagonals (or None) and the segment ids in the kernels' form."""
    import jax.numpy as jnp

    from t5scale.model import attention_kernels as kernels

    q, k, v, bias, q_segments, k_segments = arrays
    interpret = dry_run
    out, lse = kernels.forward_pass(*arrays, causal, kernels.Blocks(), interpret)
    d_out = (out * 0.5).astype(out.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    backward = (*arrays, d_out, lse, delta)

    statics = {"causal": causal, "interpret": interpret}
    passes = {  # (the pass at given tiles, its arguments)
        "forward": (lambda t: partial(_forward, blocks=kernels.Blocks(forward=t), **statics),
                    arrays),
        "dkv": (lambda t: partial(kernels.dkv_pass, tiles=t, **statics), backward),
        "dq": (lambda t: partial(kernels.dq_pass, tiles=t, **statics), backward),
        "bias": (lambda t: partial(kernels.bias_pass, tiles=t, **statics), backward),
    }  # fmt: skip
    chosen, rows = {}, []
    for name, (make, arguments) in passes.items():
        if name == "bias" and bias is None:
            continue
        fitted = _candidates(kernels, name, q.shape, k.shape[1], dry_run)
        timings = _time_each(jax, [make(tiles) for tiles in fitted], arguments, repeats)
        ran = [(ms, i) for i, ms in enumerate(timings) if ms is not None]
        best = min(ran)[1] if ran else 0  # none ran: the default, which the steps would use
        chosen[name] = fitted[best]
        rows.append({"pass": name, "chosen": dataclasses.asdict(fitted[best]),
                     "candidates": [dict(dataclasses.asdict(t), ms=ms)
                                    for t, ms in zip(fitted, timings, strict=True)]})  # fmt: skip
    return kernels.Blocks(**chosen), rows


def _candidates(kernels, name: str, q_shape, k_len: int, dry_run: bool) -> list:
    """The pass's candidates fitted to these lengths, each once (the default first)."""
    batch, q_len = q_shape[0], q_shape[1]
    listed = CANDIDATES[name][: 2 if dry_run else None]
    fitted = [kernels.fit_tiles(kernels.Tiles(*c), q_len, k_len, batch) for c in listed]
    return list(dict.fromkeys(fitted))


def _forward(*arrays, blocks, causal: bool, interpret: bool):
    from t5scale.model.attention_kernels import forward_pass

    return forward_pass(*arrays, causal, blocks, interpret)


def _time_each(jax, functions: list, arguments: tuple, repeats: int) -> list[float | None]:
    """Milliseconds of each function on `arguments` (None where it does not compile or run);
    compiled side by side in threads (XLA and Triton release the GIL while they compile). The
    arrays are arguments, not constants that XLA would fold at compile time."""

    def compile_one(function):
        try:
            return jax.jit(function).lower(*arguments).compile()
        except Exception as error:  # a tile Triton refuses (shared memory, registers)
            return error

    with ThreadPoolExecutor(max_workers=8) as pool:
        compiled = list(pool.map(compile_one, functions))
    # one at a time again where a thread's compile failed: a tile Triton refuses fails alike
    compiled = [compile_one(f) if isinstance(c, Exception) else c
                for f, c in zip(functions, compiled, strict=True)]  # fmt: skip
    timings = []
    for program in compiled:
        try:
            ok = not isinstance(program, Exception)
            timings.append(1e3 * timed(program, *arguments, repeats=repeats) if ok else None)
        except Exception:  # a launch the card refuses
            timings.append(None)
    return timings


def write_choice(out: Path, key: str, blocks) -> None:
    """Adds this attention's tiles to OUT/attention_tiles.json."""
    path = tiles_file(out)
    chosen: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    chosen[key] = dataclasses.asdict(blocks)
    path.write_text(json.dumps(chosen, indent=1))
