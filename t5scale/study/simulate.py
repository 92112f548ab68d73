"""The cluster model: seconds per step on a described GPU cluster, from the compiled step.

    t5scale simulate --gin_file=gin/models/mt5_xxl.gin --gin_file=gin/clusters/a100.gin

For each ZeRO stage and node count the train step is compiled on as many emulated CPU devices
(zero over all of them, as DeepSpeed partitions over every data-parallel rank) and the
prediction is built from what the compiled step says it does:

- compute: model FLOPs per device (t5scale.analysis.flops, × 4/3 with full remat, which runs
  the forward twice) at `compute_efficiency` × the datasheet peak;
- the optimizer update, memory-bound: the update reads and writes the per-device optimizer
  state and the parameters and gradients it updates, at the memory bandwidth;
- communication: every collective the compiled HLO runs per step, timed as a ring over all N
  devices: all-gather and reduce-scatter (N-1)/N · full size / bandwidth + (N-1) · latency,
  all-reduce twice that. Inside one node the bandwidth and latency are NVLink's; across nodes
  each ring step may cross the network, so the per-GPU network bandwidth and latency apply;
- overlap: the fraction of communication hidden behind compute (0 = none, an upper bound).

The model is deliberately simple: no contention, no hierarchy-aware algorithms, no kernel
launch overheads. docs/cluster_model.md compares it with published measurements.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax

from t5scale.analysis.flops import mfu
from t5scale.parallel.zero import check_stages
from t5scale.study.plan import PlanConfig, stage_run
from t5scale.train.config import ConfigError, RunConfig
from t5scale.train.setup import build_setup

RING_FACTOR = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1,
               "collective-permute": 1}  # fmt: skip
RECOMPUTE = {"none": 1.0, "minimal": 1.0, "full": 4.0 / 3.0}  # minimal keeps the matmul outputs


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A GPU cluster: bandwidths in bytes/s per GPU, latencies in seconds (gin/clusters/)."""

    name: str = "a100"
    gpus_per_node: int = 8
    peak_flops: float = 312e12  # per GPU, dense, in the compute dtype
    compute_efficiency: float = 0.4  # fraction of peak a single GPU's step reaches
    memory_bandwidth: float = 2.0e12
    device_memory_gb: float = 80.0
    intra_node_bandwidth: float = 300e9  # NVLink, one direction
    intra_node_latency_s: float = 5e-6
    inter_node_bandwidth: float = 25e9  # the GPU's share of the node's network
    inter_node_latency_s: float = 10e-6
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.compute_efficiency <= 1 or not 0 <= self.overlap <= 1:
            raise ConfigError("ClusterConfig: compute_efficiency in (0, 1], overlap in [0, 1]")
        if min(self.gpus_per_node, self.peak_flops, self.memory_bandwidth,
               self.intra_node_bandwidth, self.inter_node_bandwidth) <= 0:  # fmt: skip
            raise ConfigError("ClusterConfig: GPU count, FLOP/s and bandwidths must be > 0")


@dataclasses.dataclass(frozen=True)
class SimulateConfig:
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    stages: tuple[int, ...] = (1, 2, 3)
    micro_batch_size: int = 4  # per GPU; global batch = micro × GPUs (weak scaling)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.nodes or min(self.nodes) < 1 or self.micro_batch_size < 1:
            raise ConfigError("SimulateConfig: nodes >= 1 and micro_batch_size >= 1")
        check_stages(self.stages, "SimulateConfig.stages")


def collective_seconds(
    kind: str, count: int, full_bytes: float, devices: int, bandwidth: float, latency: float
) -> float:
    """`count` ring collectives of `kind` moving `full_bytes` in all (the unsharded size)."""
    if devices < 2 or count == 0:
        return 0.0
    factor = RING_FACTOR[kind]
    return factor * (
        (devices - 1) / devices * full_bytes / bandwidth + count * (devices - 1) * latency
    )


def predict(
    analysis: dict[str, Any], cluster: ClusterConfig, nodes: int, remat: str
) -> dict[str, Any]:
    """Seconds per step and its parts, from a compiled step's analysis (step_analysis.json)."""
    devices = analysis["devices"]
    across_nodes = nodes > 1
    bandwidth = cluster.inter_node_bandwidth if across_nodes else cluster.intra_node_bandwidth
    latency = cluster.inter_node_latency_s if across_nodes else cluster.intra_node_latency_s
    compute = (
        analysis["flops_per_step"]["model_per_device"]
        * RECOMPUTE[remat]
        / (cluster.peak_flops * cluster.compute_efficiency)
    )
    formula = analysis["model_state_per_device"]["zero_formula_bytes"]
    shards = devices if analysis["zero_stage"] >= 1 else 1
    # The update reads and writes the optimizer state and the (fp32) parameters it owns, and
    # reads their gradients: 3 passes over the owned parameters.
    owned_parameter_bytes = 4 * analysis["parameters"] / shards
    update_bytes = 2 * formula["optimizer_state"] + 3 * owned_parameter_bytes
    update = update_bytes / cluster.memory_bandwidth
    communication, by_kind = 0.0, {}
    for kind, stats in analysis["collectives"].items():
        if kind not in RING_FACTOR:
            continue
        # reduce-scatter's result is the shard: its full size is the operand
        full = stats["operand_bytes"] if kind == "reduce-scatter" else stats["bytes"]
        seconds = collective_seconds(kind, stats["count"], full, devices, bandwidth, latency)
        by_kind[kind] = seconds
        communication += seconds
    hidden = cluster.overlap * min(communication, compute)
    step = compute + update + communication - hidden
    model_flops = analysis["flops_per_step"]["model"]
    tokens_per_step = analysis["tokens_per_step"]
    return {
        "step_s": step,
        "compute_s": compute,
        "update_s": update,
        "communication_s": communication,
        "communication_by_kind_s": by_kind,
        "hidden_s": hidden,
        "tokens_per_s": tokens_per_step / step,
        "tokens_per_s_per_device": tokens_per_step / step / devices,
        "mfu": mfu(model_flops, step, cluster.peak_flops, devices),
        "fits": analysis["memory_per_device"]["peak_estimate_bytes"]
        <= cluster.device_memory_gb * 1e9,
        "xla_peak_bytes": analysis["memory_per_device"]["peak_estimate_bytes"],
    }


# Part of the cache key: a newer step_analysis.json layout never reads an older entry.
ANALYSIS_VERSION = 3


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root, "t5scale", "step_analyses.json")


def step_analysis(run: RunConfig, stage: int, devices: int, micro_batch_size: int) -> dict:
    """The compiled step's analysis on `devices` emulated devices; cached across calls on disk
    (keyed by the whole run, stage, device count and the JAX version), since compiling a large
    model on 64 devices takes tens of seconds."""
    plan = PlanConfig(devices=devices, micro_batch_size=micro_batch_size)
    staged = stage_run(run, plan, stage)
    key_text = json.dumps(
        [dataclasses.asdict(staged.model), dataclasses.asdict(staged.parallel),
         dataclasses.asdict(staged.precision),
         dataclasses.asdict(staged.optimizer), staged.train.batch_size, staged.train.micro_batches,
         staged.data.input_length, staged.data.target_length, devices, jax.__version__,
         ANALYSIS_VERSION],
        sort_keys=True, default=str,
    )  # fmt: skip
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    path = _cache_path()
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return cache[key]
    analysis = build_setup(staged, jax.devices()[:devices]).compile().analysis
    cache = json.loads(path.read_text()) if path.exists() else {}
    cache[key] = analysis
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache))
    tmp.replace(path)
    return analysis


def simulate(run: RunConfig, cluster: ClusterConfig, config: SimulateConfig, show=print) -> dict:
    rows = []
    needed = max(config.nodes) * cluster.gpus_per_node
    if jax.device_count() < needed:
        raise ConfigError(f"{needed} devices to emulate, {jax.device_count()} here")
    for stage in config.stages:
        for nodes in config.nodes:
            devices = nodes * cluster.gpus_per_node
            analysis = step_analysis(run, stage, devices, config.micro_batch_size)
            row = {"stage": stage, "nodes": nodes, "devices": devices,
                   "batch_size": analysis["batch_size"], "precision": analysis["precision"]["mode"],
                   "zero_formula": analysis["model_state_per_device"]["zero_formula"]}  # fmt: skip
            rows.append(row | predict(analysis, cluster, nodes, run.model.remat))
            show(f"stage {stage}, {nodes} node{'s' if nodes > 1 else ''}: "
                 f"{rows[-1]['step_s']:.3f} s/step predicted")  # fmt: skip
    return {
        "model": run.model.name,
        "cluster": dataclasses.asdict(cluster),
        "micro_batch_size": config.micro_batch_size,
        "lengths": [run.data.input_length, run.data.target_length],
        "dtype": run.model.dtype,
        "precision": rows[0]["precision"] if rows else None,
        "remat": run.model.remat,
        "rows": rows,
    }


def format_simulation(result: dict[str, Any]) -> str:
    cluster = result["cluster"]
    lines = [
        f"{result['model']} on {cluster['name']} nodes ({cluster['gpus_per_node']} GPUs each; "
        f"{cluster['peak_flops'] / 1e12:g} TFLOP/s at {cluster['compute_efficiency']:.0%}, "
        f"network {cluster['inter_node_bandwidth'] / 1e9:g} GB/s per GPU, NVLink "
        f"{cluster['intra_node_bandwidth'] / 1e9:g} GB/s, overlap {cluster['overlap']:.0%}); "
        "micro-batch "
        f"{result['micro_batch_size']} per GPU, lengths {result['lengths'][0]}/"
        f"{result['lengths'][1]}, {result['dtype']} compute, {result['precision']} precision, "
        f"remat {result['remat']}",
        "",
        "| stage | ZeRO formula | nodes | GPUs | step s | compute s | update s | "
        "communication s | tokens/s | tokens/s/GPU | MFU | fits (XLA GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['stage']} | {row['zero_formula']} | {row['nodes']} | {row['devices']} | "
            f"{row['step_s']:.3f} | "
            f"{row['compute_s']:.3f} | {row['update_s']:.3f} | {row['communication_s']:.3f} | "
            f"{row['tokens_per_s']:,.0f} | {row['tokens_per_s_per_device']:,.0f} | "
            f"{100 * row['mfu']:.0f}% | {'yes' if row['fits'] else 'no'} "
            f"({row['xla_peak_bytes'] / 1e9:.0f}) |"
        )
    return "\n".join(lines)
