"""The GPU check's GEMMs item (bench/gpu_check.py): each matmul shape of the layers of mt5_small's
and mt5_large's steps, forward and both gradients, timed alone on the card beside the cluster
model's price of it.

The cluster model prices every GEMM at one `gemm_efficiency` of the peak (with its bytes as a
floor: t5scale/whatif/gpu_step.py). On an H200 mt5_small's GEMMs took 26.9 ms a step where it
priced 22.2 (docs/benchmarks.md, fifteenth): its GEMMs are narrow (d_model 512, 6 heads of 64),
and the one efficiency is the 8192³ chain's. Issue 59 asks that the model's figures be fitted
on kernels, not on steps: these rows are what a GEMM efficiency by shape would be fitted on.
"""

from __future__ import annotations

import dataclasses

from gpu_check_items import cluster_for, start_jax, timed
from gpu_check_list import Results, Shapes


@dataclasses.dataclass(frozen=True)
class Gemm:
    """[m, k] · [k, n] in bf16, fp32 accumulation, a bf16 result."""

    model: str
    stack: str  # encoder or decoder: whose tokens
    what: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def bytes(self) -> tuple[int, int]:
        """(read, written)"""
        return 2 * (self.m * self.k + self.k * self.n), 2 * self.m * self.n


def layer_gemms(model_name: str, shapes: Shapes) -> list[Gemm]:
    """The distinct GEMM shapes of one encoder and one decoder layer at the shapes' batch, each
    once: the projections x·W [tokens, K]·[K, N], the input's gradient g·Wᵀ and the weight's
    xᵀ·g (contracted over the tokens), for the attention's (d_model ↔ heads × d_kv) and the
    gated MLP's (d_model → 2 × d_ff in one product, d_ff → d_model)."""
    from t5scale.model.sizes import preset

    model = preset(model_name)
    d, inner, f = model.d_model, model.num_heads * model.d_kv, model.d_ff
    projections = {"q, k, v": (d, inner), "attention out": (inner, d), "MLP in": (d, 2 * f),
                   "MLP out": (f, d)}  # fmt: skip
    gemms: dict[tuple[int, int, int], Gemm] = {}
    for stack, length in (("encoder", shapes.input_length), ("decoder", shapes.target_length)):
        tokens = shapes.batch * length
        for what, (k, n) in projections.items():
            for kind, (m_, k_, n_) in (("forward", (tokens, k, n)), ("input grad", (tokens, n, k)),
                                       ("weight grad", (k, tokens, n))):  # fmt: skip
                key = (m_, k_, n_)
                if key not in gemms:
                    gemms[key] = Gemm(model_name, stack, f"{what}, {kind}", m_, k_, n_)
    return list(gemms.values())


# Independent products a program runs of each shape: a GEMM of mt5_small's decoder takes a few
# microseconds on the card, less than JAX's dispatch of one call, so one call times several.
# Each has operands of its own: XLA merges dots that share an operand (DotMerger).
PRODUCTS = 8


def independent_products(lefts: list, rights: list) -> list:
    """Each a · b in bf16 (fp32 accumulation): one GEMM each on a GPU, nothing else
    (tests/test_gpu_check.py compiles it for an H100)."""
    import jax.numpy as jnp

    return [jnp.matmul(a, b, preferred_element_type=jnp.bfloat16)
            for a, b in zip(lefts, rights, strict=True)]  # fmt: skip


def gemms_item(results: Results, shapes: Shapes, dry_run: bool) -> None:
    """Each GEMM shape timed as PRODUCTS independent products in one program (its median of 10
    after a warm-up, over PRODUCTS), with the cluster model's price of one on this card's
    cluster file (h100.gin, h200.gin)."""
    jax = start_jax(dry_run)
    import jax.numpy as jnp

    from t5scale.analysis.kernels import Kernel
    from t5scale.whatif.gpu_step import KERNEL_LAUNCH_S, kernel_seconds

    cluster = cluster_for(jax.devices()[0])
    large, small, _ = shapes.models
    models = dict.fromkeys((small, large))  # the dry run's two are one
    products = 2 if dry_run else PRODUCTS
    product = jax.jit(independent_products)
    for model in models:
        for gemm in layer_gemms(model, shapes):
            keys = jax.random.split(jax.random.key(0), 2 * products)
            a = [jax.random.normal(key, (gemm.m, gemm.k), jnp.bfloat16) for key in keys[::2]]
            b = [jax.random.normal(key, (gemm.k, gemm.n), jnp.bfloat16) for key in keys[1::2]]
            seconds = timed(product, a, b, repeats=10) / products
            read, written = gemm.bytes
            kernel = Kernel("gemm", 1, gemm.flops, read, written, "bf16")
            priced = kernel_seconds(kernel, cluster) - KERNEL_LAUNCH_S
            results.write(gemm=dataclasses.asdict(gemm), gemm_s=seconds, priced_s=priced,
                          gemm_flops_per_s=gemm.flops / seconds, cluster=cluster.name,
                          products=products)  # fmt: skip
            del a, b


def gemm_rows(lines: list[dict]) -> list[str]:
    """The table of the GEMMs item's lines (none: no table)."""
    rows = [line for line in lines if "gemm_s" in line]
    if not rows:
        return []
    text = ["", "## GEMMs at the layers' shapes, alone (median of 10)", "",
            f"Each shape as {rows[0]['products']} independent products in one program, its time "
            "over them (a launch's gap included).", "",
            f"The cluster model's price: {rows[0]['cluster']}'s roofline at its one "
            "`gemm_efficiency`; measured / priced above 1: slower than it prices.", "",
            "| model | tokens of | GEMM | m × k × n | measured | TFLOP/s | priced | measured / "
            "priced |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        gemm = row["gemm"]
        text.append(
            f"| {gemm['model']} | {gemm['stack']} | {gemm['what']} | "
            f"{gemm['m']:,} × {gemm['k']:,} × {gemm['n']:,} | {row['gemm_s'] * 1e6:,.1f} µs | "
            f"{row['gemm_flops_per_s'] / 1e12:.3g} | {row['priced_s'] * 1e6:,.1f} µs | "
            f"{row['gemm_s'] / row['priced_s']:.2f} |"
        )
    return text
