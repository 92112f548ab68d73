"""The ZeRO stages as data: which trees of model state each one shards over the mesh's `zero` axis.

| stage | parameters | gradients / accumulator | optimizer state | gradient collective | parameter collective             |
|-------|------------|-------------------------|-----------------|---------------------|----------------------------------|
| 0     | replicated | replicated              | replicated      | all-reduce          | none                             |
| 1     | replicated | replicated              | sharded         | all-reduce          | all-gather after the update      |
| 2     | replicated | sharded                 | sharded         | reduce-scatter      | all-gather after the update      |
| 3     | sharded    | sharded                 | sharded         | reduce-scatter      | all-gather before each use       |

Every sharding in t5scale is derived from this one table (t5scale/parallel/layout.py). The
collectives are named as XLA's HLO names them, so that the tests can find them in the compiled
step (tests/test_zero.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class ZeroStage:
    number: int
    shard_optimizer_state: bool
    shard_gradients: bool
    shard_parameters: bool
    gradient_collective: str  # sums the gradients over `zero`
    parameter_collective: str | None  # rebuilds whole parameters from `zero` shards


STAGES: tuple[ZeroStage, ...] = (
    ZeroStage(0, False, False, False, "all-reduce", None),
    ZeroStage(1, True, False, False, "all-reduce", "all-gather"),  # after the update
    ZeroStage(2, True, True, False, "reduce-scatter", "all-gather"),  # after the update
    ZeroStage(3, True, True, True, "reduce-scatter", "all-gather"),  # before each use
)


# The stages a pipeline takes (t5scale/train/pipeline.py), as DeepSpeed's pipeline engine: its
# schedule accumulates each stage's gradients over every micro-batch inside its loop, so stage
# 2 could not keep them scattered and stage 3 would gather every layer again per micro-batch.
PIPELINED_STAGES = (0, 1)


def with_pipeline(stages: Iterable[int], pipeline: int) -> tuple[int, ...]:
    """The `stages` that a pipeline of `pipeline` stages allows (all of them without one)."""
    return tuple(s for s in stages if pipeline == 1 or s in PIPELINED_STAGES)


def check_stages(stages: Iterable[int], where: str) -> None:
    """A ValueError naming `where` unless every stage is 0, 1, 2 or 3."""
    if bad := [stage for stage in stages if stage not in range(len(STAGES))]:
        raise ValueError(f"{where}: ZeRO stage must be 0, 1, 2 or 3, got {bad}")


def get_stage(stage: int) -> ZeroStage:
    check_stages([stage], "zero_stage")
    return STAGES[stage]
