"""Every stage is real on any device count: on 3, 5, 6, 12 and 24 devices, which divide few or
none of mT5's dimensions, every leaf of every tree the stage shards is split over `zero` (padded
where the count does not divide it), and a device holds within 1% of 1/N of it."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from t5scale.errors import MeshError
from t5scale.parallel.layout import make_layout
from t5scale.parallel.mesh import ParallelConfig

COUNTS = (3, 5, 6, 12, 24)

# Abstract setups only (nothing compiled, nothing allocated), in a process with 24 devices.
SHARES = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 24)
import t5scale
from t5scale.analysis.memory import per_device_bytes
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.config import RunConfig, TrainConfig
from t5scale.train.setup import build_setup

def zero_split(sharding):
    return any(e == "zero" or (isinstance(e, tuple) and "zero" in e) for e in sharding.spec)

rows = []
for model in ("mt5_small", "mt5_xl"):
    for devices in json.loads(sys.argv[1]):
        for stage in range(4):
            run = RunConfig(model=ModelConfig(name=model, dtype="bfloat16"),
                            parallel=ParallelConfig(zero_stage=stage, zero=devices),
                            train=TrainConfig(batch_size=devices))
            setup = build_setup(run, jax.devices()[:devices])
            state, layout = setup.state, setup.layout
            opt = state.opt_state  # mixed precision: the fp32 master and Adam's moments
            model_state = setup.form.model_state_bytes()  # unpadded: the model's own bytes
            trees = {"parameters": (state.params, stage == 3, model_state.parameters),
                     "optimizer state": (opt, stage >= 1, model_state.optimizer_state)}
            row = {"model": model, "devices": devices, "stage": stage,
                   "padded": layout.padded}
            for name, (tree, sharded, unpadded) in trees.items():
                leaves = [leaf for leaf in jax.tree.leaves(tree) if leaf.ndim]
                whole = [str(leaf.shape) for leaf in leaves if not zero_split(leaf.sharding)]
                held = per_device_bytes(leaves, [leaf.sharding for leaf in leaves])
                row[name] = {"sharded": sharded, "left_whole": whole,
                             "share": held / unpadded * devices}
            grads = layout.grad_shardings
            row["gradients"] = {"sharded": stage >= 2, "left_whole": [
                str(leaf.shape) for leaf, sharding in zip(
                    jax.tree.leaves(layout.leaves, is_leaf=lambda x: hasattr(x, "zero_dim")),
                    jax.tree.leaves(grads)) if not zero_split(sharding)]}
            row["parameters_per_device"] = layout.parameters_per_device()
            row["parameter_count"] = setup.form.model_state_bytes().count
            rows.append(row)
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def shares():
    done = subprocess.run(
        [sys.executable, "-c", SHARES, json.dumps(COUNTS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_tree_the_stage_shards_is_split_on_any_device_count(shares):
    assert {row["devices"] for row in shares} == set(COUNTS)
    assert any(row["padded"] for row in shares)  # these counts do need padding
    for row in shares:
        for tree in ("parameters", "optimizer state", "gradients"):
            found = row[tree]
            if found["sharded"]:
                assert not found["left_whole"], (row["model"], row["devices"], row["stage"], tree)
            else:
                assert found["left_whole"], (row["model"], row["devices"], row["stage"], tree)


def test_a_device_holds_its_share_within_one_percent(shares):
    for row in shares:
        where = (row["model"], row["devices"], row["stage"])
        for tree in ("parameters", "optimizer state"):
            if row[tree]["sharded"]:
                # share: bytes held per device × N / the model's bytes (1: exactly 1/N; padding
                # adds)
                assert 1.0 <= row[tree]["share"] <= 1.01, (where, tree, row[tree]["share"])
        if row["stage"] == 3:
            per_device = row["parameters_per_device"] / (row["parameter_count"] / row["devices"])
            assert per_device <= 1.01, (where, per_device)


def test_a_leaf_no_stage_can_split_is_one_clear_error():
    """A parameter whose every dimension is tensor-parallel or the layer axis cannot be split
    over `zero`: the layout refuses it by name rather than keep it whole without a word."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from t5scale.parallel.mesh import make_mesh

    boxed = {"scale_per_head": nn.LogicallyPartitioned(
        jax.ShapeDtypeStruct((6, 4), jnp.float32), ("layers", "heads"))}  # fmt: skip
    parallel = ParallelConfig(zero_stage=3, zero=4)
    with pytest.raises(MeshError, match=r"scale_per_head.*\(6, 4\).*zero=4 may split"):
        make_layout(parallel, make_mesh(parallel, jax.devices()[:4]), boxed)
