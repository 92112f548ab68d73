"""A fresh train state (t5scale/train/state.py): a small one is made in its canonical form on one
device and then laid out, a large one straight in its shardings; both give the same state."""

import jax
import numpy as np
from conftest import TINY_MODEL, tiny_setup

from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train import state as state_module
from t5scale.train.precision import PrecisionConfig

MIXED = {
    "model": ModelConfig(vocab_size=TINY_MODEL.vocab_size, dtype="bfloat16"),
    "precision": PrecisionConfig(mode="mixed"),
}


def _leaves(state) -> list:
    return jax.tree.leaves(jax.device_get(state))


def test_a_small_state_made_on_one_device_is_the_state_made_in_its_shardings(monkeypatch):
    """Mixed precision, ZeRO-3 on 6 devices (the tables padded): leaf by leaf the same values
    (to fp32 rounding: two compiles of the random initialisers) in the same shardings."""
    setup = tiny_setup(ParallelConfig(zero_stage=3), 6, batch_size=6, **MIXED)
    assert setup.form.one_device_init and setup.layout.padded
    made_once = setup.create_state(seed=0)
    monkeypatch.setattr(state_module, "ONE_DEVICE_INIT_BYTES", 0)
    in_place = tiny_setup(ParallelConfig(zero_stage=3), 6, batch_size=6, **MIXED)
    assert not in_place.form.one_device_init
    made_in_place = in_place.create_state(seed=0)
    expected = jax.tree.leaves(setup.form.shardings)
    assert [x.sharding for x in jax.tree.leaves(made_once)] == expected
    assert [x.sharding for x in jax.tree.leaves(made_in_place)] == expected
    for once, in_place_leaf in zip(_leaves(made_once), _leaves(made_in_place), strict=True):
        assert once.dtype == in_place_leaf.dtype and once.shape == in_place_leaf.shape
        np.testing.assert_allclose(
            np.float32(once), np.float32(in_place_leaf), rtol=1e-6, atol=1e-7
        )


def test_one_initialiser_serves_every_stage_mesh_and_precision():
    """The one-device program with the random initialisers is the same text for ZeRO-0 fp32 on
    8 devices and ZeRO-3 mixed on 6, so one compile (and the compilation cache) serves both; and
    their canonical states are equal to the bit."""
    plain = tiny_setup(ParallelConfig(zero_stage=0), 8)
    mixed = tiny_setup(ParallelConfig(zero_stage=3), 6, batch_size=6, **MIXED)
    key = jax.random.key(0)
    texts = [
        s.form._canonical_initializer_on_one_device.lower(key).as_text() for s in (plain, mixed)
    ]
    assert texts[0] == texts[1]
    canonical = [s.form.to_canonical(s.create_state(seed=0)) for s in (plain, mixed)]
    for a, b in zip(_leaves(canonical[0]), _leaves(canonical[1]), strict=True):
        np.testing.assert_array_equal(a, b)
