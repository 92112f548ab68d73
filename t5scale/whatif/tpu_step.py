"""Seconds per step on a TPU pod from the program XLA:TPU compiled for its slices (kernels.py's
Program): the TPU path of `t5scale simulate`. Unvalidated: no published TPU step time of T5 or
mT5 was found to check it against (docs/cluster_model.md), and the CLI says so.

- compute: each operation at the slower of its FLOPs at the chip's peak (the MXU's bf16 rate;
  XLA:TPU writes its matmuls as convolutions, read by kernels.py) and its bytes read and
  written at the HBM bandwidth: the bare roofline, a lower bound, with no launch cost (a TPU
  runs one compiled program, no kernel launches from the host). Loops run their trip counts;
- communication: each collective over the ICI torus axes its replica group spans
  (ici_dcn.op_seconds: rings both ways where an axis wraps, lines where not, a hop
  latency), and XLA:TPU's transfers between slices at each chip's share of its host's DCN
  (ici_dcn.dcn_op_seconds);
- overlap, from the schedule: an async collective (XLA:TPU's start and done fusions, a
  transfer's send and send-done) hides behind the operations scheduled between its start and
  its done, up to their time; a synchronous one is exposed.

step = compute + exposed communication. Not modelled: collectives in flight at once sharing
the links, compute slowed by collectives, the MXU below its peak on small or awkward shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.kernels import Kernel, Program
from t5scale.whatif.figures import TpuFigures
from t5scale.whatif.ici_dcn import dcn_op_seconds, op_seconds
from t5scale.whatif.program_time import ProgramTime, timed_program
from t5scale.xla_tpu import TpuTopology

UNVALIDATED = (
    "TPU path, unvalidated: no published TPU step time of T5 or mT5 was found to check it "
    "against (docs/cluster_model.md); each operation at the chip's roofline, a lower bound."
)


def operation_seconds(kernel: Kernel, pod: TpuFigures) -> float:
    """One run of an operation: the slower of its FLOPs at the peak and its bytes at HBM's."""
    return max(
        kernel.flops / pod.peak_flops,
        (kernel.bytes_read + kernel.bytes_written) / pod.memory_bandwidth,
    )


def collective_seconds(
    op: CollectiveOp, devices: Sequence, topology: TpuTopology, pod: TpuFigures
) -> float:
    """One run of one of the program's collectives: over the slice's ICI, or between slices
    over DCN; 0 for what neither times (an all-to-all)."""
    once = dataclasses.replace(op, count=1)
    ici = op_seconds(once, devices, topology.slice, pod.ici_link_bandwidth)
    if ici is not None:
        return ici
    per_chip = pod.dcn_bandwidth_per_host / pod.chips_per_host
    return dcn_op_seconds(once, topology.slices, per_chip) or 0.0


def predict_tpu_program(
    program: Program, pod: TpuFigures, topology: TpuTopology, devices: Sequence
) -> ProgramTime:
    """Seconds per step of `program` on the pod's slices (module docstring). `devices`: the
    mesh's devices in order (their torus coordinates place each replica group)."""
    each = [operation_seconds(kernel, pod) for kernel in program.kernels]
    return timed_program(program, each, lambda op: collective_seconds(op, devices, topology, pod))
