"""Time of one collective as NCCL runs it on GPU nodes: alpha-beta, with hierarchy and rails.

A collective over `ranks` GPUs spread evenly over `nodes` nodes (`local` GPUs each):

- bandwidth: NCCL runs one ring (channel) per NIC, rail-aligned, so inside a node data moves
  over NVLink/NVSwitch and between nodes over all the node's NICs at once. The slowest link
  class sets the pace: the bus bandwidth is nccl-tests' NVLink figure on one node, and across
  nodes the smaller of that and the network figure scaled by the share of the node's NICs the
  group owns (`local / gpus_per_node`: groups that run side by side in one node split them);
- bus factors as nccl-tests defines them: all-gather and reduce-scatter move (n-1)/n of the
  full (unsharded) size through each GPU's link, all-reduce 2(n-1)/n;
- latency, as NCCL's tuning model (src/graph/tuning.cc) counts it: a fixed launch cost plus
  one hop latency per ring step (n-1 steps; 2(n-1) for all-reduce), of which nodes-1 (twice
  that for all-reduce) cross the network and the rest stay on NVLink. Across nodes an
  all-reduce may instead run as NCCL's tree (a chain inside each node, a binary tree between
  nodes): 2(local-1) NVLink and 2·⌊log2(nodes)⌋ network steps, but twice the data per link;
  NCCL picks the faster, and so does this model;
- small messages: the launch and step latencies dominate them, so their achieved bandwidth
  falls below the peak as nccl-tests' size sweeps show (half the peak where the size equals
  latency × bandwidth); NCCL's low-latency protocols for small sizes are not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from t5scale.analysis.collective_ops import CollectiveOp
from t5scale.analysis.memory import DcnBytes
from t5scale.whatif.figures import GpuFigures


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a collective's GPUs sit: `ranks` of them over `nodes` nodes, evenly."""

    ranks: int
    nodes: int

    @property
    def local(self) -> int:
        return self.ranks // self.nodes


def placement(group: Sequence[int] | None, devices: int, gpus_per_node: int) -> Placement:
    """The placement of a replica group of device positions (None: all `devices`); GPU i is on
    node i // gpus_per_node, as when processes are the mesh's slowest dimension."""
    members = range(devices) if group is None else group
    return Placement(len(members), len({m // gpus_per_node for m in members}))


def bus_bandwidth(where: Placement, cluster: GpuFigures) -> float:
    if where.nodes == 1:
        return cluster.nvlink_bus_bandwidth
    network = cluster.network_bus_bandwidth * min(1.0, where.local / cluster.gpus_per_node)
    return min(cluster.nvlink_bus_bandwidth, network)


def ring_latency(steps: int, network_steps: int, cluster: GpuFigures) -> float:
    """Hop latencies of a ring pass of `steps` steps, `network_steps` of them between nodes."""
    return (steps - network_steps) * cluster.nvlink_latency_s + (
        network_steps * cluster.network_latency_s
    )


def collective_seconds(
    kind: str, full_bytes: float, where: Placement, cluster: GpuFigures
) -> float:
    """One collective of `kind` whose unsharded size is `full_bytes` (an all-gather's result, a
    reduce-scatter's or all-reduce's operand)."""
    n = where.ranks
    if n < 2:
        return 0.0
    bandwidth, crossings = bus_bandwidth(where, cluster), where.nodes - 1
    if kind in ("all-gather", "reduce-scatter"):
        seconds = (n - 1) / n * full_bytes / bandwidth + ring_latency(n - 1, crossings, cluster)
    elif kind == "all-reduce":
        seconds = 2 * (n - 1) / n * full_bytes / bandwidth + ring_latency(
            2 * (n - 1), 2 * crossings, cluster
        )
        if where.nodes > 1:
            tree = 2 * full_bytes / bandwidth + 2 * (
                (where.local - 1) * cluster.nvlink_latency_s
                + int(math.log2(where.nodes)) * cluster.network_latency_s  # NCCL's log2i
            )
            seconds = min(seconds, tree)
    elif kind == "all-to-all":  # every pair at once: one step's latency
        seconds = (n - 1) / n * full_bytes / bandwidth + ring_latency(1, min(1, crossings), cluster)
    elif kind == "collective-permute":
        seconds = full_bytes / bandwidth + ring_latency(1, min(1, crossings), cluster)
    else:
        raise ValueError(f"no time model for collective {kind!r}")
    return cluster.collective_launch_s + seconds


def full_bytes(op: CollectiveOp) -> float:
    """The unsharded size a collective moves: an all-gather's result, else the operand."""
    return op.bytes if op.kind == "all-gather" else op.operand_bytes


def network_payload_bytes(
    ops: Sequence[CollectiveOp], devices: int, gpus_per_node: int
) -> DcnBytes:
    """What each GPU's collectives hand the network between nodes per step, laid out
    hierarchically as NCCL's rail-aligned rings and DeepSpeed lay them (inside the node over
    NVLink first, then each GPU's share once): the GPU program's reading of the DCN formula
    (analysis/memory.py, dcn_formula_bytes). A collective whose group spans S nodes of n GPUs
    each hands over an all-reduce's or a reduce-scatter's whole operand / n, an all-gather's
    own part (its operand); one inside a node, nothing."""

    def share(op: CollectiveOp, where: Placement) -> float:
        return op.operand_bytes if op.kind == "all-gather" else full_bytes(op) / where.local

    placed = ((op, placement(op.group, devices, gpus_per_node)) for op in ops)
    return DcnBytes.summed(
        (op.kind, op.count * share(op, where)) for op, where in placed if where.nodes > 1
    )
