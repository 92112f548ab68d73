"""What the what-if wing asks of hardware that is not here: one interface, two kinds.

    GPU cluster  ClusterConfig  (gpu_cluster.py; NCCL's collectives, nccl.py)
    TPU pod      TpuPodConfig   (tpu_pod.py; ICI tori and DCN, ici_dcn.py)

A cluster file (gin/clusters/) binds one of them (t5scale/config.py's `build_hardware`). `plan`,
`simulate` and the study each loop once over what it answers, and no code outside the two
modules asks which kind it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.records import StepAnalysis
from t5scale.model.sizes import ModelConfig
from t5scale.target import Target


class Hardware(Protocol):
    name: str
    device_memory_gb: float
    device_word: str  # 'GPU' or 'chip'
    group_word: str  # what the slow network joins: 'node' or 'slice'

    @property
    def memory_budget_bytes(self) -> int:
        """A device's memory, the budget every compile for it is held to."""

    def target(self, devices: int, compiler: str = ...) -> Target:
        """`devices` of its devices to compile for (the study's and plan's device counts), by
        its own compiler unless `compiler` says 'cpu' or 'auto' (SimulateConfig.compiler)."""

    def named_target(self) -> Target | None:
        """The devices the cluster file itself names (a pod's slices), or None."""

    def group_target(self, groups: int, compiler: str = ...) -> Target:
        """`groups` of the groups its slow network joins (`simulate`'s nodes or slices)."""

    def group_words(self, groups: int) -> str:
        """'2 nodes', '2 × v5e-8'."""

    def dcn_groups(self, devices: int) -> int:
        """How many groups the slow network joins among `devices` of its devices."""

    def topology(self, devices: int) -> Any:
        """The compile-only topology of `devices` (what a trial's process compiles for)."""

    def emulated_devices(self, groups: int) -> int:
        """CPU devices to emulate for `simulate` over up to `groups` groups."""

    def check_simulation(self, run: Any, config: Any) -> None:
        """A ConfigError where `simulate` cannot time this run here."""

    def timing_path(self, target: Target) -> str:
        """'gpu', 'cpu' or 'tpu': how `simulate` times programs compiled for `target`."""

    def predict(
        self, analysis: StepAnalysis, model: ModelConfig, devices: Sequence[Any], config: Any
    ) -> Any:
        """(StepTimePrediction, ProgramTime or None): one step of `analysis`'s program, its
        collectives placed on `devices` (the mesh's devices in order)."""

    def link_seconds(
        self, ops: Sequence[CollectiveOp], devices: Sequence[Any]
    ) -> dict[str, float] | None:
        """The collectives' seconds per step by link (none hidden), where plan shows them."""

    def describe(self, config: Any) -> str:
        """The hardware in one clause, for `simulate`'s table."""

    def compile_only_words(self) -> str:
        """What the study's compile-only rounds compile with, in words."""
