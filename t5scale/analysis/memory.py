"""Per-device memory: XLA's compiled analysis beside the ZeRO formula.

The ZeRO paper gives per-device model-state bytes for Ψ parameters on N_d shards with
mixed-precision Adam (2Ψ fp16 parameters, 2Ψ fp16 gradients, 12Ψ fp32 master copy and moments):
16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d and 16Ψ/N_d for stages 0-3. Here the bytes per parameter come
from the real trees instead — the parameters' and gradients' dtypes (t5scale/train/precision.py)
and whatever the optimizer keeps, with the fp32 master in mixed precision — and the stage table
says which are divided by N_d; in mixed precision with AdamW that is the paper's formula.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from t5scale.analysis.records import MemoryPerDevice, ZeroFormulaBytes
from t5scale.data.config import DataConfig
from t5scale.jsonform import JsonRecord
from t5scale.model.mt5 import layer_stacks, vocabulary_tables
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.zero import ZeroStage

CPU_MEMORY_SHARE = 0.8  # of the host's memory, for all emulated devices together


def cpu_memory_budget(host_memory_bytes: int, devices: int) -> int:
    """Per-device memory budget of `devices` emulated CPU devices: they share the host's memory,
    less a margin for the process itself."""
    return int(CPU_MEMORY_SHARE * host_memory_bytes / devices)


def device_memory_budget(mesh) -> int:
    """Per-device memory of this process's devices of the mesh: the smallest limit the
    backend reports (GPUs, TPUs), or on the CPU the host's memory shared by the devices."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    if limits and all(limits):
        return int(min(limits))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cpu_memory_budget(host, len(local))


def allocator_peak(mesh) -> int | None:
    """The largest allocator peak (bytes in use) over this process's devices of the mesh, where
    the backend reports one (GPUs and TPUs do; the CPU does not): None, not zero, elsewhere."""
    peaks = []
    for device in mesh.devices.flat:
        stats = device.memory_stats() if device.process_index == jax.process_index() else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def tree_bytes(tree: Any) -> int:
    """Total bytes of a tree of arrays or ShapeDtypeStructs (global, not per device)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` under `shardings` (its largest shard, leaf by leaf)."""

    def shard_bytes(leaf, sharding) -> int:
        return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize

    return sum(jax.tree.leaves(jax.tree.map(shard_bytes, tree, shardings)))


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Global bytes of the three trees a ZeRO stage decides about, for `count` parameters."""

    parameters: int
    gradients: int
    optimizer_state: int
    count: int

    def formula(self, stage: ZeroStage) -> str:
        """The stage's per-device bytes in Ψ (parameters) and N (the zero size), e.g.
        '2Ψ + 14Ψ/N'."""
        trees = (
            (self.parameters, stage.shard_parameters),
            (self.gradients, stage.shard_gradients),
            (self.optimizer_state, stage.shard_optimizer_state),
        )
        whole = sum(size for size, sharded in trees if not sharded) / self.count
        split = sum(size for size, sharded in trees if sharded) / self.count
        parts = [f"{whole:.3g}Ψ" if whole else "", f"{split:.3g}Ψ/N" if split else ""]
        return " + ".join(part for part in parts if part)

    def per_device(self, stage: ZeroStage, shards: int) -> ZeroFormulaBytes:
        """The ZeRO formula: each tree divided by N_d where the stage shards it."""
        parameters = self.parameters / (shards if stage.shard_parameters else 1)
        gradients = self.gradients / (shards if stage.shard_gradients else 1)
        optimizer_state = self.optimizer_state / (shards if stage.shard_optimizer_state else 1)
        total = parameters + gradients + optimizer_state
        return ZeroFormulaBytes(parameters, gradients, optimizer_state, total)


def model_state_bytes(
    abstract_params: Any, abstract_opt_state: Any, param_dtype=None, grad_dtype=None,
    master: bool = False,
) -> ModelStateBytes:  # fmt: skip
    """From the parameters in the model's shapes and the optimizer's own state: parameters and
    gradients (the accumulator too) in their dtypes (default: the parameters' own), the
    optimizer state with an fp32 master copy of the parameters when `master`."""
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    own = tree_bytes(abstract_params)
    params = own if param_dtype is None else count * jnp.dtype(param_dtype).itemsize
    grads = params if grad_dtype is None else count * jnp.dtype(grad_dtype).itemsize
    optimizer = tree_bytes(abstract_opt_state) + (4 * count if master else 0)
    return ModelStateBytes(params, grads, optimizer, count)


def compiled_memory(compiled) -> MemoryPerDevice:
    analysis = compiled.memory_analysis()
    argument, output = analysis.argument_size_in_bytes, analysis.output_size_in_bytes
    temp, alias = analysis.temp_size_in_bytes, analysis.alias_size_in_bytes
    return MemoryPerDevice(
        argument_bytes=int(argument), output_bytes=int(output), temp_bytes=int(temp),
        alias_bytes=int(alias), generated_code_bytes=int(analysis.generated_code_size_in_bytes),
        # Donated arguments alias outputs: the live peak is arguments + outputs - aliased + temps.
        peak_estimate_bytes=int(argument + output - alias + temp),
    )  # fmt: skip


def zero3_collective_bytes(
    params: Any,
    model: ModelConfig,
    data: DataConfig,
    batch: int,
    micro_batches: int,
    vocabulary_parallel: bool = True,
) -> tuple[int, int]:
    """ZeRO 3's (all-gather result bytes, reduce-scatter operand bytes) per device per step,
    from the parameters' shapes (in the dtype they are gathered in), as t5scale's step writes
    its collectives; `vocabulary_parallel` False: the tables gathered as the rest outside the
    layers are (t5scale/parallel/vocab.py, pays_off)."""
    layers = model_state_bytes(list(layer_stacks(params)), {}).parameters
    tables = model_state_bytes(list(vocabulary_tables(params)), {}).parameters
    norms_and_positions = model_state_bytes(params, {}).parameters - layers - tables
    # The zero group's activations that travel instead of the vocabulary-split tables, per
    # micro-batch: token ids and targets (as float32), the decoder's output and the embedded rows.
    group = batch // micro_batches
    lengths = data.input_length + data.target_length
    ids = group * (lengths + data.target_length) * 4
    activation = jnp.dtype(model.dtype).itemsize  # the compute dtype's rows travel
    decoded = group * data.target_length * model.d_model * activation
    rows = group * lengths * model.d_model * activation
    # Each layer's parameters are gathered in the forward pass and again in the backward pass
    # (never kept), for every micro-batch; XLA hoists the loop-invariant gather of the norms and
    # position tables out of the micro-batch loop, so those are gathered once per step. The
    # embedding and output projection are never gathered: the activations are (the rows'
    # cotangent in the backward pass).
    gathered = 2 * micro_batches * layers + norms_and_positions
    # The transpose of every parameter gather is a reduce-scatter of that parameter's gradient;
    # the tables' gradients are made where they lie: their reduce-scatters carry activations.
    scattered = micro_batches * layers + norms_and_positions
    if not vocabulary_parallel:  # gathered once, as the norms are
        return gathered + tables, scattered + tables
    gathered += micro_batches * (ids + decoded + rows)
    scattered += micro_batches * (rows + decoded)
    return gathered, scattered


@dataclasses.dataclass(frozen=True)
class DcnBytes(JsonRecord):
    """Bytes one chip hands the slow network per step (DCN between TPU slices), by collective:
    an all-reduce's or a reduce-scatter's operand and an all-gather's own part, as XLA:TPU hands
    each to its megascale runtime (a CollectiveOp's bytes of form 'dcn')."""

    all_reduce: float = 0.0
    reduce_scatter: float = 0.0
    all_gather: float = 0.0

    @property
    def total(self) -> float:
        return self.all_reduce + self.reduce_scatter + self.all_gather

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"total": self.total}

    @classmethod
    def summed(cls, parts: Iterable[tuple[str, float]]) -> DcnBytes:
        """(kind, bytes) pairs summed by kind; kinds other than the three are left out."""
        total = {"all-reduce": 0.0, "reduce-scatter": 0.0, "all-gather": 0.0}
        for kind, size in parts:
            if kind in total:
                total[kind] += size
        return cls(total["all-reduce"], total["reduce-scatter"], total["all-gather"])


def dcn_formula_bytes(
    stage: ZeroStage,
    state: ModelStateBytes,
    chips_per_slice: int,
    slices: int,
    micro_batches: int,
    zero_across_slices: bool,
    zero3_bytes: tuple[int, int] | None = None,
    steps_alone: bool = False,
) -> DcnBytes:
    """What each ZeRO stage must move between slices per chip per step, laid out
    hierarchically as DeepSpeed and MaxText do across nodes: inside the slice over ICI first,
    then between slices each chip's share once (docs/cluster_model.md, "ZeRO across slices").

    G and P are the gradients' and the working copy's bytes (`state`), n the chips of a slice
    over which the stage shards (`chips_per_slice`), S the slices, M the micro-batches:

    | stage | ZeRO across slices (zero = n·S)     | a replica per slice (zero = n) |
    |-------|-------------------------------------|--------------------------------|
    | 0     | all-reduce G/n                      | all-reduce G/n                 |
    | 1     | all-reduce G/n, all-gather P/(nS)   | all-reduce G/n                 |
    | 2     | reduce-scatter M·G/n, gather P/(nS) | all-reduce G/n                 |
    | 3     | reduce-scatter R/n, gather A/(nS)   | all-reduce G/n                 |

    R and A: stage 3's reduce-scatter operands and all-gather results per chip per step
    (`zero3_bytes`, from zero3_collective_bytes): every layer gathered twice per micro-batch.
    With a replica per slice, ZeRO's own collectives stay inside the slice and only the
    gradient shard crosses, once a step; replicas that step on their own (`steps_alone`: local
    SGD, DiLoCo) hand DCN nothing in their steps, and their outer step what
    outer_dcn_formula_bytes says. Nothing crosses with one slice."""
    if slices < 2 or (steps_alone and not zero_across_slices):
        return DcnBytes()
    grads, params, n = state.gradients, state.parameters, chips_per_slice
    if not zero_across_slices:
        return DcnBytes(all_reduce=grads / n)
    gathered = params / (n * slices) if stage.number in (1, 2) else 0.0
    if stage.number < 2:
        return DcnBytes(all_reduce=grads / n, all_gather=gathered)
    if stage.number == 2:
        return DcnBytes(reduce_scatter=micro_batches * grads / n, all_gather=gathered)
    if zero3_bytes is None:
        raise ValueError("stage 3's DCN bytes need its collectives' bytes (zero3_bytes)")
    all_gathered, scattered = zero3_bytes
    return DcnBytes(reduce_scatter=scattered / n, all_gather=all_gathered / (n * slices))


def outer_dcn_formula_bytes(
    stage: ZeroStage, parameters: int, outer_dtype, chips_per_slice: int
) -> DcnBytes:
    """What local SGD's or DiLoCo's outer step hands DCN per chip, a replica per slice: Δ in
    `outer_dtype`, all-reduced between slices, each chip its shard (stages 1-3 shard the
    outer state over `zero` as the optimizer state; stage 0 keeps it whole)."""
    shards = chips_per_slice if stage.shard_optimizer_state else 1
    return DcnBytes(all_reduce=parameters * jnp.dtype(outer_dtype).itemsize / shards)


def dcn_program_bytes(collective_ops) -> DcnBytes:
    """The same read from a compiled TPU program: its collectives between slices (form 'dcn')
    per chip per step."""
    return DcnBytes.summed((op.kind, op.count * op.bytes) for op in collective_ops
                           if op.form == "dcn")  # fmt: skip
