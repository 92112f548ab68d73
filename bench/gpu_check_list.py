"""What the GPU check (bench/gpu_check.py) runs: the sizes, the work list, and its results file."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes one check runs at: the card's, or the dry run's."""

    batch: int
    input_length: int
    target_length: int
    heads: int  # the kernels' check: heads of d_kv 64
    models: tuple[str, str, str]  # (large, small, extra large)
    timed_steps: int = 10
    warmup_steps: int = 2
    matmul: tuple[int, int] = (8192, 20)  # size, products per sample
    remats: tuple[str, ...] = ("dots", "full")  # the large model's
    unrolled: bool = True  # the unrolled layers' step too
    fp8: bool = True  # the fp8 step too
    extras: bool = False  # the extra items too (Item.extra)
    # the extra large model's batch: on the card, the largest multiple of 8 whose step (remat
    # full) fits one 80 GB H100 by XLA's estimate, compiled for one here (70.1 GiB at 88)
    xl_batch: int = 88
    flagged: bool = True  # the items under extra XLA flags (Item.xla_flags) too


GPU = Shapes(32, 1024, 229, 16, ("mt5_large", "mt5_small", "mt5_xl"))
# The dry run checks the script: remat 'full', the unrolled layers and fp8 are the same code as
# the loop with 'dots' in mixed precision under other settings, and its two models are one (a
# run listed runs once); its extras (--all) are the fp8 step and the same items with the einsum
# attention and in fp32. It leaves out the items under XLA:GPU flags: the CPU ignores them, and
# the H100 program it predicts from may not compile under them here (dynamic-slice fusion).
DRY_RUN = Shapes(2, 96, 23, 2, ("mt5_tiny", "mt5_tiny", "mt5_tiny"), 3, 1, (256, 2), ("dots",),
                 False, False, False, 1, flagged=False)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Item:
    """One entry of the work list: `estimate_s`, its wall time on one H100 (docs/gpu_check.md)."""

    name: str
    estimate_s: float
    kind: str  # device | kernels | head | gemms | step | training loop
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Run when named (--only) or with --all, not in the default run, which fits 9 minutes on
    # a card.
    extra: bool = False
    # XLA flags the item's process adds to XLA_FLAGS (an XLA:GPU option to time against the
    # same step without it)
    xla_flags: tuple[str, ...] = ()


def step_entry(model: str, remat: str, attention: str, estimate: float, unrolled=False,
         batch: int | None = None, chunk: int | None = None, extra: bool = False,
         precision: str = "mixed", flags: tuple[str, str] | None = None,
         logits: str | None = None, head_kernel: bool = False) -> Item:  # fmt: skip
    """A step item, named by what it runs."""
    layers = "unrolled" if unrolled else "loop"
    options = dict(model=model, remat=remat, attention=attention, scan_layers=not unrolled)
    name = f"step {model} {remat} {attention} {layers}"
    if precision != "mixed":  # gin/precision/<precision>.gin's run
        options["precision"], name = precision, f"{name} {precision}"
    if batch:
        options["batch"], name = batch, f"{name} batch {batch}"
    if chunk:  # ModelConfig.loss_chunk_tokens (default: chosen, 264 at these shapes)
        options["loss_chunk_tokens"], name = chunk, f"{name} loss chunk {chunk}"
    if logits:  # ModelConfig.logits_dtype (default: float32)
        options["logits_dtype"], name = logits, f"{name} {logits} logits"
    if head_kernel:  # ModelConfig.head_kernel (t5scale/model/head_kernel.py)
        options["head_kernel"], name = True, f"{name} head kernel"
    xla_flags = ()
    if flags:  # (what they do, the flag)
        name, xla_flags = f"{name} {flags[0]}", (flags[1],)
    return Item(name, estimate, "step", options, extra, xla_flags)


def training_loop_entry(model: str, remat: str, attention: str, estimate: float,
                        unrolled: bool = False, extra: bool = False) -> Item:  # fmt: skip
    """The step item's run through t5scale's own training loop (metrics.jsonl's step times)."""
    step = step_entry(model, remat, attention, estimate, unrolled, extra=extra)
    name = "training loop" + step.name.removeprefix("step")
    return dataclasses.replace(step, name=name, kind="training loop")


DYNAMIC_SLICE_FUSION = ("dynamic-slice fusion", "--xla_gpu_enable_dynamic_slice_fusion=true")
# XLA:GPU's CUDA graphs (command buffers) off: each kernel launched on its own, as while profiling
NO_COMMAND_BUFFERS = ("without command buffers", "--xla_gpu_enable_command_buffer=")


def work_list(shapes: Shapes, extras: bool = False) -> list[Item]:
    """The items in the order they run: the answers worth most first; the extra items too
    where `extras` (or on the dry run)."""
    large, small, _ = shapes.models
    items = [
        # estimates: the walls on the H200 of 2026-11-28, fourteenth (the unrolled steps:
        # fifteenth; the fp32 kernels: the H100's of the 28th); the head's: guesses
        Item("device", 67, "device"),  # the H200, twenty-fifth: the FP8 chain compiles in it
        # the output layer's kernel (issue 59, point 3: the loss's passes over fp32 logits were
        # the largest part of the rest), its tiles, then each unrolled step with and without it
        Item("head", 75, "head"),
        step_entry(small, "dots", "fused", 58, unrolled=True, head_kernel=True),
        # unrolled, the layers' kept activations are no stacks (issue 59's profile: their
        # zero-fills and copies were a third of the time neither GEMM nor attention)
        step_entry(small, "dots", "fused", 58, unrolled=True),
        step_entry(large, "dots", "fused", 97, unrolled=True, head_kernel=True),
        step_entry(large, "dots", "fused", 97, unrolled=True),
        # the layer loop's step with it (the dry run's one step: it runs no unrolled layers)
        step_entry(small, "dots", "fused", 40, head_kernel=True),
        *_extra_items(shapes),
    ]
    extras = extras or shapes.extras
    items = [
        item for item in items
        if item.options.get("remat", "dots") in shapes.remats
        and (shapes.unrolled or item.options.get("scan_layers", True))
        and (shapes.fp8 or extras or item.options.get("precision") != "fp8")
        and (extras or not item.extra)
        and (shapes.flagged or not item.xla_flags)
    ]  # fmt: skip
    return list({item.name: item for item in items}.values())


def _extra_items(shapes: Shapes) -> list[Item]:
    """The items run when named or with --all: answered already, or too long for the list."""
    large, small, extra_large = shapes.models
    extra = functools.partial(step_entry, extra=True)
    return [
        # measured on the H200 of the twenty-sixth session (docs/benchmarks.md): the attention
        # kernels and their tiles (bench/tiles/h200_2026-11-30.json, Blocks' defaults now), the
        # layer loop's steps, and t5scale's loop on the unrolled step (its steps 5.6% under
        # their waited median: the host's work hidden)
        Item("kernels bfloat16", 115, "kernels", {"dtype": "bfloat16"}, extra=True),
        extra(large, "dots", "fused", 40),
        extra(small, "dots", "fused", 40),
        training_loop_entry(small, "dots", "fused", 59, unrolled=True, extra=True),
        # measured on the H200 of the twenty-fifth session (docs/benchmarks.md): the unrolled
        # steps without XLA:GPU's CUDA graphs, +0.7% and +0.8%; t5scale's loop on the layer
        # loop's step
        extra(large, "dots", "fused", 97, True, flags=NO_COMMAND_BUFFERS),
        extra(small, "dots", "fused", 58, True, flags=NO_COMMAND_BUFFERS),
        training_loop_entry(small, "dots", "fused", 37, extra=True),
        # measured on the H200 of the twenty-third session (docs/benchmarks.md): issue 62's FP8
        # GEMMs for the layers (gin/precision/fp8.gin), 0.97× item 3 (its wall 102 s: the
        # quantization's compile)
        extra(large, "dots", "fused", 102, precision="fp8"),
        # XLA's dynamic-slice fusion (jaxlib 0.10.2 refuses it here): the loop's copies into and
        # out of its stacks (−0.5% on item 3), and unrolled the weights sliced out of theirs, a
        # copy kernel a weight a layer, as the GEMMs' own reads and writes (0.0%, twenty-fifth)
        extra(large, "dots", "fused", 40, flags=DYNAMIC_SLICE_FUSION),
        extra(large, "dots", "fused", 97, True, flags=DYNAMIC_SLICE_FUSION),
        # item 4 with bf16 logits (t5x's, MaxText's): −3.5%
        extra(small, "dots", "fused", 40, logits="bfloat16"),
        # the layers' GEMM shapes alone, against the cluster model's one efficiency (issue 59,
        # point 5); bench/gpu_check_gemms.py (42 s)
        Item("gemms", 45, "gemms", extra=True),
        extra(large, "full", "fused", 35),  # 0.430 s on the H200 (fourteenth)
        # the largest batch of mT5-XL whose step fits one 80 GB H100 with remat full (XLA's
        # estimate, compiled for one here; 2.97 s a step on the H200, fourteenth)
        extra(extra_large, "full", "fused", 75, batch=shapes.xl_batch),
        # the einsum steps, measured before (docs/benchmarks.md), for the cluster model's
        # comparison; the kernels in fp32, which 'auto' no longer runs
        extra(large, "dots", "dot", 51),  # too large for an 80 GB H100
        extra(large, "full", "dot", 55),
        extra(small, "dots", "dot", 49),
        # the loss in 7 chunks, not 28: the head's weight gradient is written 7 times either way
        # (products of 4 chunks, twenty-first); this times 1 GB blocks of logits against 264 MB
        extra(small, "dots", "fused", 58, unrolled=True, chunk=1048),
        Item("kernels float32", 109, "kernels", {"dtype": "float32"}, extra=True),
    ]


_STARTED = time.perf_counter()  # this process's start, near enough: each line says when


class Results:
    """OUT/results.jsonl, one line per result, written at once (a run cut short keeps them),
    each with `at_s`, the seconds since its process started (where an item's wall went)."""

    def __init__(self, path: Path, item: str):
        self.path, self.item = path, item

    def write(self, **fields: Any) -> None:
        with self.path.open("a") as file:
            at_s = round(time.perf_counter() - _STARTED, 1)
            line = {"item": self.item, **fields, "at_s": at_s}
            file.write(json.dumps(line, default=float) + "\n")


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def lines_of(path: Path, item: str) -> list[dict[str, Any]]:
    return [line for line in read_lines(path) if line["item"] == item]
