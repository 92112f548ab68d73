"""A ZeRO stage on N devices with the batch weak-scaled: the run that the study's trials, the
planner and the simulator compile."""

from __future__ import annotations

import dataclasses

from t5scale.train.config import RunConfig


def weak_scale(
    run: RunConfig,
    stage: int,
    devices: int,
    micro_batch_size: int,
    *,
    micro_batches: int | None = None,
    tensor: int = 1,
    replicas: int = 1,
    dcn_groups: int = 1,
    pipeline: int | None = None,
) -> RunConfig:
    """`run` at ZeRO stage `stage` on `devices` devices: `tensor` of them in each
    tensor-parallel group, zero over every data-parallel device of each of `replicas` replicas
    (more than one: local SGD or DiLoCo, ZeRO inside each). The batch grows with the devices,
    as DeepSpeed's `train_micro_batch_size_per_gpu`: micro_batch_size × data-parallel devices ×
    micro_batches (default: the run's own). `pipeline` stages (default: the run's own) take
    devices as `tensor` does; their micro-batches are the accumulated ones. `zero` is left to the mesh (-1: every device that
    replica and tensor leave), so a shape the devices do not divide is refused where the mesh
    is made. Over several `dcn_groups` (GPU nodes or TPU slices), ZeRO spans them all where one
    replica does (zero_across_hosts, as DeepSpeed's stages), and not with a replica per node."""
    micro_batches = run.train.micro_batches if micro_batches is None else micro_batches
    pipeline = run.parallel.pipeline if pipeline is None else pipeline
    parallel = dataclasses.replace(
        run.parallel, zero_stage=stage, replica=replicas, zero=-1, tensor=tensor,
        pipeline=pipeline,
    )  # fmt: skip
    if dcn_groups > 1:
        parallel = dataclasses.replace(parallel, zero_across_hosts=replicas == 1)
    batch_size = micro_batch_size * (devices // (tensor * pipeline)) * micro_batches
    train = dataclasses.replace(run.train, batch_size=batch_size, micro_batches=micro_batches)
    return dataclasses.replace(run, parallel=parallel, train=train)
