"""A ZeRO stage on N devices with the batch weak-scaled: the run that the study's trials, the
planner and the simulator compile, as a RunConfig or as gin bindings."""

from __future__ import annotations

import dataclasses

from t5scale.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class WeakScaling:
    """ZeRO stage `stage` on `devices` devices: `tensor` of them in each tensor-parallel group,
    zero over every data-parallel device of each of `replicas` replicas (more than one: local
    SGD or DiLoCo, ZeRO inside each). The batch grows with the devices, as DeepSpeed's
    `train_micro_batch_size_per_gpu`: micro_batch_size × data-parallel devices × micro_batches
    (gradient accumulation steps, as TrainConfig.micro_batches)."""

    stage: int
    devices: int
    micro_batch_size: int
    micro_batches: int = 1
    tensor: int = 1
    replicas: int = 1
    # Processes the devices belong to (compile-only GPU nodes): with one replica, ZeRO spans
    # them all (zero_across_hosts, as DeepSpeed's stages); with a replica per node, it does not.
    hosts: int = 1

    @property
    def data_parallel(self) -> int:
        return self.devices // self.tensor

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.data_parallel * self.micro_batches

    def _parallel(self) -> dict[str, int | bool]:
        """ParallelConfig's fields: zero is -1, every device replica and tensor leave, so that
        a shape the devices do not divide is refused where the mesh is made."""
        fields = {"zero_stage": self.stage, "replica": self.replicas, "zero": -1,
                  "tensor": self.tensor}  # fmt: skip
        if self.hosts > 1:
            fields["zero_across_hosts"] = self.replicas == 1
        return fields

    def run(self, run: RunConfig) -> RunConfig:
        """`run` at this stage, mesh and batch."""
        parallel = dataclasses.replace(run.parallel, **self._parallel())
        train = dataclasses.replace(
            run.train, batch_size=self.batch_size, micro_batches=self.micro_batches
        )
        return dataclasses.replace(run, parallel=parallel, train=train)

    def gin_bindings(self) -> list[str]:
        """The same as --gin.NAME=VALUE bindings (a trial's process builds its run from gin)."""
        parallel = [f"ParallelConfig.{name}={value}" for name, value in self._parallel().items()]
        return [*parallel, f"BATCH_SIZE={self.batch_size}", f"MICRO_BATCHES={self.micro_batches}"]
