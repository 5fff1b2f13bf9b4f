"""None leaves in nested inputs (Lingvo's ``NestedMap(vec=..., paddings=None)``) pass through the
stages to the layers that receive them, as keras.Sequential passes them."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, fit_both

import tf_gpipe


class _Padded(keras.layers.Layer):
    """Takes and returns ``{"vec", "paddings"}``; ``paddings`` may be None."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="tanh")

    def call(self, inputs):
        vec = self.dense(inputs["vec"])
        if inputs["paddings"] is not None:
            vec = vec * (1.0 - inputs["paddings"][:, None])
        return {"vec": vec, "paddings": inputs["paddings"]}


class _Vec(keras.layers.Layer):
    def call(self, inputs):
        return inputs["vec"]


class _Nest(keras.layers.Layer):
    """A tensor in, a structure holding None out."""

    def call(self, inputs):
        return {"vec": inputs, "paddings": None}


def _layers():
    keras.utils.set_random_seed(0)
    # K=2 cuts after _Nest: the structure with None crosses a stage boundary too.
    return [_Padded(8), _Vec(), _Nest(), _Padded(8), _Vec(), keras.layers.Dense(3)]


def _data(n=20):
    rng = np.random.RandomState(0)
    return {"vec": rng.randn(n, 5).astype("float32"), "paddings": None}, rng.randint(0, 3, n)


def _pair(**kwargs):
    x, _ = _data(2)
    seq = keras.Sequential(_layers())
    seq(x)
    pm = tf_gpipe.PipelineModel(_layers(), num_stages=2, num_micro_batches=3, **kwargs)
    pm(x)
    pm.set_weights(seq.get_weights())
    return seq, pm


@pytest.mark.parametrize("schedule,remat", [("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "except_last")])
def test_fit_with_none_leaves_matches_keras_sequential(schedule, remat):
    seq, pm = _pair(schedule=schedule, remat=remat)
    x, y = _data()
    fit_both(seq, pm, x, y)
    assert_all_close([pm.predict(x, verbose=0)], [seq.predict(x, verbose=0)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", ["always", "never"])
def test_tape_through_none_leaves_matches_keras_sequential(remat):
    seq, pm = _pair(remat=remat)
    x, y = _data(10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    got = []
    for m in (seq, pm):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        got.append([loss] + tape.gradient(loss, m.trainable_variables))
    assert_all_close(got[1], got[0], rtol=1e-5, atol=1e-6)
