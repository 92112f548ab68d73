"""The seed studies' layout question on paper: ZeRO 3 against ZeRO 1 + tensor 8 against tensor 8
× pipeline, for mt5_xl and mt5_xxl on 1 to 64 DGX H100 nodes, and the pipeline's micro-batch
size (Hagemann et al.: is micro-batch 1 the most efficient?).

    python bench/pipeline_layouts.py [--nodes 1 2 4 8 16 32 64] [--plot docs/pipeline_layouts.png]
    python bench/pipeline_layouts.py --tpu [--slices 1 2 4]   # mt5_xl on v5p-128 slices
    python bench/pipeline_layouts.py --models mt5_tiny --nodes 1 --sweep --out /tmp/p.json \
        --plot /tmp/p.png                                   # the script's check: one point

Every point is `t5scale simulate` in-process: the step compiled by XLA:GPU for the cluster's
GPUs (compile-only, t5scale/xla_gpu.py) and timed kernel by kernel, with its collectives (the
pipeline's permutes over NVLink or the network) and the pipeline's bubble as the compiled
schedule has them. Every layout at a node count trains on the same global batch: 4 sequences
per GPU (lengths 1024/229, as the seed study), bf16 compute, mixed precision, full remat, so
the layouts compare on tokens/s per GPU at equal work. Nothing here ran on a GPU.

Layouts (a data-parallel rank is a tensor group, or a pipeline of them):
- ZeRO 3: every GPU a data-parallel rank, 4 sequences each.
- ZeRO 1 + TP 8: a node per data-parallel rank, 32 sequences each (from 2 nodes: on one node
  no device would split the batch, which t5scale's step does not compile without a pipeline).
- TP 8 × PP p: p nodes per pipeline, 32·p sequences per pipeline in micro-batches of
  `--rows` sequences (default 1), ZeRO 1 over the pipelines.
The micro-batch sweep: TP 8 × PP 4 on 8 nodes with micro-batches of 1 to 16 sequences.

With --tpu: mt5_xl on 1, 2 and 4 slices of v5p-128 (64 chips each, 4 a host) by the TPU path
(XLA:TPU's programs, compile-only; unvalidated): ZeRO 3, ZeRO 1 + TP 4, TP 4 × PP 2 and 4
(micro-batches of 4 sequences), the same 4 sequences per chip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax

from t5scale import xla_cpu  # noqa: E402

jax.config.update("jax_platforms", "cpu")
xla_cpu.emulate_cpu_devices(8)

from t5scale.config import build_run_config, build_study_config, parse_gin  # noqa: E402
from t5scale.whatif.simulate import SimulateConfig, simulate  # noqa: E402

MODELS = ("mt5_xl", "mt5_xxl")
PER_GPU = 4  # sequences per GPU per step, every layout
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    stage: int
    tensor: int = 1
    pipeline: int = 1
    rows: int = PER_GPU  # sequences per micro-batch per data-parallel rank

    def config(self, nodes: int) -> SimulateConfig | None:
        """The simulate grid point, or None where the layout does not exist on `nodes`."""
        gpus = nodes * GPUS_PER_NODE
        ranks = gpus // (self.tensor * self.pipeline)
        if ranks < 1 or gpus % (self.tensor * self.pipeline):
            return None
        if self.tensor > 1 and self.pipeline == 1 and ranks == 1:
            return None  # no data-parallel axis: refused by the mesh (docs/concepts.md)
        per_rank = PER_GPU * gpus // ranks
        if per_rank % self.rows:
            return None
        return SimulateConfig(
            nodes=(nodes,), stages=(self.stage,), micro_batch_size=self.rows,
            tensor=self.tensor, pipelines=(self.pipeline,), micro_batches=per_rank // self.rows,
            compiler="gpu",
        )  # fmt: skip


def predict_tpu(model: str, layout: Layout, slices: int) -> dict | None:
    from t5scale.config import build_hardware

    config = layout.config(slices * 8)  # 64 chips a slice: as 8 "nodes" of 8 for the grid
    if config is None:
        return None
    parse_gin([f"gin/models/{model}.gin", "gin/clusters/tpu_v5p.gin", "gin/precision/mixed.gin"],
              ["ModelConfig.dtype='bfloat16'", "ModelConfig.remat='full'",
               "DATA_SOURCE='synthetic'", "TpuPodConfig.slice='v5p-128'"])  # fmt: skip
    run, pod = build_run_config(), build_hardware(required=True)
    config = dataclasses.replace(config, nodes=(slices,), compiler="auto")
    started = time.perf_counter()
    (row,) = simulate(run, pod, config, show=lambda _: None).rows
    return {"slices": slices, "chips": row.devices} | _record(model, layout, config, row, started)


def tpu_main(model: str, slice_counts: list[int], out: str) -> None:
    tpu_layouts = [
        Layout("ZeRO 3", 3), Layout("ZeRO 1 + TP 4", 1, tensor=4, rows=PER_GPU * 4),
        Layout("TP 4 × PP 2", 1, 4, 2, PER_GPU), Layout("TP 4 × PP 4", 1, 4, 4, PER_GPU),
    ]  # fmt: skip
    rows = []
    for slices in slice_counts:
        for layout in tpu_layouts:
            if (row := predict_tpu(model, layout, slices)) is not None:
                rows.append(row)
                print(f"{model} {layout.name} {slices} × v5p-128: {row['step_s']:.3f} s/step, "
                      f"{row['tokens_per_s_per_device']:,.0f} tokens/s/chip "
                      f"({row['wall_s']:.0f} s)", flush=True)  # fmt: skip
                Path(out).write_text(json.dumps(rows, indent=1))
    lines = ["| layout | " + " | ".join(f"{n} × v5p-128" for n in slice_counts) + " |",
             "|---" * (len(slice_counts) + 1) + "|"]  # fmt: skip
    for layout in tpu_layouts:
        cells = []
        for n in slice_counts:
            found = [r for r in rows if r["layout"] == layout.name and r["slices"] == n]
            cells.append(f"{found[0]['tokens_per_s_per_device']:,.0f} ({100 * found[0]['mfu']:.0f}%)"
                         if found else "–")  # fmt: skip
        lines.append(f"| {layout.name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


def layouts(nodes: int, rows: int) -> list[Layout]:
    found = [Layout("ZeRO 3", 3), Layout("ZeRO 1 + TP 8", 1, tensor=8, rows=PER_GPU * 8)]
    for pipeline in (2, 4, 8):
        if pipeline <= nodes:
            found.append(Layout(f"TP 8 × PP {pipeline}", 1, 8, pipeline, rows))
    return found


def predict(model: str, layout: Layout, nodes: int) -> dict | None:
    config = layout.config(nodes)
    if config is None:
        return None
    parse_gin([f"gin/models/{model}.gin", "gin/clusters/h100.gin", "gin/precision/mixed.gin"],
              ["ModelConfig.dtype='bfloat16'", "ModelConfig.remat='full'"])  # fmt: skip
    run, cluster = build_run_config(), build_study_config("cluster")
    started = time.perf_counter()
    (row,) = simulate(run, cluster, config, show=lambda _: None).rows
    return {"nodes": nodes, "gpus": row.devices} | _record(model, layout, config, row, started)


def _record(model: str, layout: Layout, config: SimulateConfig, row, started: float) -> dict:
    """What a predicted point records, wherever it ran."""
    predicted = row.prediction
    return {
        "model": model, "layout": layout.name, "stage": layout.stage, "tensor": layout.tensor,
        "pipeline": layout.pipeline, "micro_batch_rows": layout.rows,
        "micro_batches": config.micro_batches, "batch_size": row.analysis.batch_size,
        "step_s": predicted.step_s, "compute_s": predicted.compute_s,
        "exposed_communication_s": predicted.exposed_communication_s,
        "permute_s": predicted.communication_by_kind_s.get("collective-permute", 0.0),
        "tokens_per_s_per_device": predicted.tokens_per_s_per_device, "mfu": predicted.mfu,
        "fits": predicted.fits, "xla_peak_gb": predicted.xla_peak_bytes / 1e9,
        "wall_s": time.perf_counter() - started,
    }  # fmt: skip


def table(rows: list[dict], model: str) -> str:
    mine = [r for r in rows if r["model"] == model and not r.get("sweep")]
    names = list(dict.fromkeys(r["layout"] for r in mine))
    nodes = sorted({r["nodes"] for r in mine})
    lines = [
        f"**{model}**: tokens/s per GPU (MFU; fits in 80 GB?) by layout and DGX H100 nodes, "
        f"{PER_GPU} sequences per GPU",
        "",
        "| layout | " + " | ".join(f"{n} node{'s' * (n > 1)}" for n in nodes) + " |",
        "|---" * (len(nodes) + 1) + "|",
    ]
    for name in names:
        cells = []
        for n in nodes:
            found = [r for r in mine if r["layout"] == name and r["nodes"] == n]
            if not found:
                cells.append("–")
                continue
            r = found[0]
            fits = "" if r["fits"] else ", does not fit"
            cells.append(f"{r['tokens_per_s_per_device']:,.0f} ({100 * r['mfu']:.0f}%{fits})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    lines = [
        "| model | micro-batch (sequences) | micro-batches | bubble | step s | compute s | "
        "tokens/s per GPU | MFU | XLA peak GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("sweep"):
            continue
        bubble = (r["pipeline"] - 1) / (r["micro_batches"] + r["pipeline"] - 1)
        lines.append(
            f"| {r['model']} | {r['micro_batch_rows']} | {r['micro_batches']} | {bubble:.1%} | "
            f"{r['step_s']:.3f} | {r['compute_s']:.3f} | {r['tokens_per_s_per_device']:,.0f} | "
            f"{100 * r['mfu']:.0f}% | {r['xla_peak_gb']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], models: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(models) + 1, figsize=(16, 4.5))
    for axis, model in zip(axes, models, strict=False):
        mine = [r for r in rows if r["model"] == model and not r.get("sweep")]
        for name in dict.fromkeys(r["layout"] for r in mine):
            points = sorted((r["nodes"], r["tokens_per_s_per_device"], r["fits"])
                            for r in mine if r["layout"] == name)  # fmt: skip
            line = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                             label=name)[0]  # fmt: skip
            misses = [p for p in points if not p[2]]
            axis.scatter([p[0] for p in misses], [p[1] for p in misses], marker="x", s=80,
                         color=line.get_color())  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.set_xlabel("DGX H100 nodes (8 GPUs each)")
        axis.set_ylabel("predicted tokens/s per GPU")
        axis.set_title(f"{model}, {PER_GPU} sequences per GPU (×: does not fit)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    sweep = axes[-1]
    for model in models:
        points = sorted((r["micro_batch_rows"], r["tokens_per_s_per_device"]) for r in rows
                        if r["model"] == model and r.get("sweep"))  # fmt: skip
        if points:
            sweep.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
    sweep.set_xscale("log", base=2)
    sweep.set_xlabel("pipeline micro-batch (sequences), TP 8 × PP 4 on 8 nodes")
    sweep.set_ylabel("predicted tokens/s per GPU")
    sweep.set_title("micro-batch size at equal global batch")
    sweep.grid(alpha=0.3)
    sweep.legend(fontsize=8)
    figure.suptitle("t5scale simulate (XLA:GPU programs, compile-only; no GPU ran)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rows", type=int, default=1, help="pipeline micro-batch sequences")
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--models", nargs="+", help=f"default: {', '.join(MODELS)} (mt5_xl with --tpu)"
    )
    parser.add_argument("--out", help="default: docs/pipeline_layouts.json (_tpu.json with --tpu)")
    parser.add_argument("--plot", default="docs/pipeline_layouts.png")
    parser.add_argument("--tpu", action="store_true", help="mt5_xl on v5p-128 slices instead")
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if args.tpu:
        if args.models and len(args.models) > 1:
            parser.error("--tpu takes one model")
        model = args.models[0] if args.models else "mt5_xl"
        tpu_main(model, args.slices, args.out or "docs/pipeline_layouts_tpu.json")
        return
    models, out = args.models or list(MODELS), args.out or "docs/pipeline_layouts.json"
    rows = []
    started = time.perf_counter()
    for model in models:
        for nodes in args.nodes:
            for layout in layouts(nodes, args.rows):
                if (row := predict(model, layout, nodes)) is not None:
                    rows.append(row)
                    print(f"{model} {layout.name} {nodes} nodes: {row['step_s']:.3f} s/step, "
                          f"{row['tokens_per_s_per_device']:,.0f} tokens/s/GPU "
                          f"[{time.perf_counter() - started:.0f} s]", flush=True)  # fmt: skip
        for rows_per_micro_batch in args.sweep:
            layout = Layout("TP 8 × PP 4", 1, 8, 4, rows_per_micro_batch)
            if (row := predict(model, layout, 8)) is not None:
                rows.append(row | {"sweep": True})
                print(f"{model} sweep micro-batch {rows_per_micro_batch}: "
                      f"{row['tokens_per_s_per_device']:,.0f} tokens/s/GPU", flush=True)  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=1))
    for model in models:
        print(table(rows, model), end="\n\n")
    print(sweep_table(rows))
    plot(rows, models, args.plot)
    print(f"\n{len(rows)} points in {time.perf_counter() - started:.0f} s; plot: {args.plot}")


if __name__ == "__main__":
    main()
