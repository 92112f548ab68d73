"""What one compiled train step costs, as records: `StepAnalysis` and its parts.

`t5scale/analysis/step.py` computes it; step_analysis.json, the study's results.jsonl and
`t5scale simulate`'s cache hold its JSON form (`StepAnalysis.to_json`, `from_json`), whose keys
are the fields' names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from t5scale.analysis.collective_ops import CollectiveOp, Collectives
from t5scale.analysis.kernels import KernelInventory, Program
from t5scale.jsonform import JsonRecord
from t5scale.model.sizes import RENAMED_REMATS


@dataclasses.dataclass(frozen=True)
class StatePrecision(JsonRecord):
    """In what dtypes the model state is kept (t5scale/train/precision.py)."""

    mode: str  # 'mixed', 'fp8' (mixed, with FP8 GEMMs for the layers) or 'float32'
    parameters: str
    gradients: str
    fp32_master: bool


@dataclasses.dataclass(frozen=True)
class MemoryPerDevice(JsonRecord):
    """XLA's per-device memory analysis of the compiled step."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_estimate_bytes: int  # arguments + outputs - aliased + temporaries


@dataclasses.dataclass(frozen=True)
class ZeroFormulaBytes(JsonRecord):
    """The ZeRO formula per device: each tree divided by the zero size where the stage shards
    it."""

    parameters: float
    gradients: float
    optimizer_state: float
    total: float


@dataclasses.dataclass(frozen=True)
class ModelStatePerDevice(JsonRecord):
    """Model-state bytes per device: from XLA, under the shardings, and by the ZeRO formula."""

    # From XLA: the step's arguments less the batch are parameters + optimizer state.
    xla_parameters_and_optimizer_bytes: int
    sharded_parameters_and_optimizer_bytes: int
    gradient_bytes: int
    zero_formula_bytes: ZeroFormulaBytes
    zero_formula: str  # e.g. '2Ψ + 14Ψ/N'


@dataclasses.dataclass(frozen=True)
class FlopsPerStep(JsonRecord):
    model: float  # t5scale/analysis/flops.py, all devices together
    model_per_device: float
    xla_cost_analysis_per_device: float


@dataclasses.dataclass(frozen=True)
class Layers(JsonRecord):
    encoder: int
    decoder: int

    @property
    def depth(self) -> int:
        """The shallower stack: how many layers a layer loop's collectives overlap with."""
        return min(self.encoder, self.decoder)


@dataclasses.dataclass(frozen=True)
class SyncBytes(JsonRecord):
    """Collective bytes per device: all of them, and those over `replica`."""

    bytes: float
    bytes_over_replica: float

    def plus(self, other: SyncBytes, every: int) -> SyncBytes:
        """These bytes and `other`'s spread over `every` steps (an outer step's over H)."""
        return SyncBytes(
            self.bytes + other.bytes / every,
            self.bytes_over_replica + other.bytes_over_replica / every,
        )


@dataclasses.dataclass(frozen=True)
class OuterStep(JsonRecord):
    """What local SGD's or DiLoCo's outer step moves per device, once per H steps."""

    bytes: int
    bytes_over_replica: int
    collectives: Collectives


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaSync(JsonRecord):
    """How replicas synchronise (ReplicaSyncConfig.describe) and what it moves per device: the
    step's collective bytes and those over `replica`, with local SGD or DiLoCo the outer
    step's, and both per step (the outer step's over H)."""

    mode: str
    every: int | None = None  # local SGD, DiLoCo: the outer step's settings
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None
    inner_step: SyncBytes
    outer_dtype: str | None = None  # with a compiled outer step
    outer_step: OuterStep | None = None
    outer_collective_ops: tuple[CollectiveOp, ...] | None = None
    per_step: SyncBytes
    # the anchor and outer momentum, sharded over `zero` as the optimizer state is
    outer_state_bytes_per_device: int | None = None


def _remats_named_now(data: Mapping[str, Any], *fields: str) -> dict[str, Any]:
    """`data` with the remat policies in `fields` named as they are now (a file written before
    'none' became 'dots')."""
    named = {
        f: RENAMED_REMATS.get(data[f], data[f]) for f in fields if isinstance(data.get(f), str)
    }
    return dict(data) | named


@dataclasses.dataclass(frozen=True)
class RematTry(JsonRecord):
    policy: str
    peak_estimate_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return super().from_json(_remats_named_now(data, "policy"))


@dataclasses.dataclass(frozen=True)
class RematChoice(JsonRecord):
    """The remat policy the step was compiled with; for 'auto', the budget and each policy
    tried (Setup.choose_remat)."""

    requested: str
    policy: str
    budget_bytes: int | None = None
    fits: bool | None = None
    tried: tuple[RematTry, ...] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return super().from_json(_remats_named_now(data, "requested", "policy"))


@dataclasses.dataclass(frozen=True)
class StepAnalysis(JsonRecord):
    """What one compiled train step costs: memory per device (XLA's analysis and the ZeRO
    formula), FLOPs and collectives, with the run's shape and the remat policy it was
    compiled with (step_analysis.json)."""

    model: str
    zero_stage: int
    mesh: dict[str, int]  # axis: size
    devices: int
    batch_size: int
    micro_batches: int
    tokens_per_step: int
    lengths: tuple[int, int]  # input, target
    backend: str
    compile_time_s: float | None
    parameters: int
    precision: StatePrecision
    padded: bool
    memory_per_device: MemoryPerDevice
    model_state_per_device: ModelStatePerDevice
    flops_per_step: FlopsPerStep
    collectives: Collectives
    # Each collective with its replica group (positions in the mesh's device list, which puts
    # processes slowest) and enclosing loop trip counts: what the cluster model times.
    collective_ops: tuple[CollectiveOp, ...]
    layers: Layers
    replica_sync: ReplicaSync
    remat: RematChoice
    # The compiler that made the program, e.g. 'xla:cpu' or 'xla:gpu NVIDIA H100 80GB HBM3,
    # 2 nodes x 8' (compile-only, t5scale/xla_gpu.py); None in files written before it was said.
    compiler: str | None = None
    # ModelConfig.attention as compiled ('dot', 'fused' or 'fused_reference'; 'auto' resolved); None in files
    # written before it was said.
    attention: str | None = None
    # ModelConfig.scan_layers as compiled (the layers as a loop, or unrolled); None in files
    # written before it was said.
    scan_layers: bool | None = None
    # XLA:GPU's or XLA:TPU's program (compile-only devices): its kernels and schedule, what the
    # cluster model's GPU and TPU paths time (t5scale/whatif/gpu_step.py, tpu_step.py). None
    # from the CPU compiler.
    program: Program | None = None

    @property
    def kernels(self) -> KernelInventory | None:
        """The GPU or TPU program's kernels per step, by class (None from the CPU compiler)."""
        return self.program.inventory if self.program else None

    @property
    def data_parallel(self) -> int:
        """Devices the batch is split over (`replica` × `zero`)."""
        return self.mesh.get("replica", 1) * self.mesh.get("zero", 1)

    @property
    def zero(self) -> int:
        return self.mesh.get("zero", 1)

    @property
    def pipeline(self) -> int:
        """Pipeline stages (1 in files written before t5scale had them)."""
        return self.mesh.get("pipeline", 1)

    @property
    def tensor(self) -> int:
        return self.mesh.get("tensor", 1)
