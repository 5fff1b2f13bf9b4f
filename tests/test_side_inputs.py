"""Side inputs reach every stage, cut into the same micro-batches as the main input."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close

import tf_gpipe


class _Scaled(keras.layers.Layer):
    """Dense whose output is multiplied by a per-example side input `scale`."""

    def __init__(self, units, **kw):
        super().__init__(**kw)
        self.dense = keras.layers.Dense(units, activation="tanh")

    def call(self, x, scale=None):
        y = self.dense(x)
        return y if scale is None else y * scale


class _Masked(keras.layers.Layer):
    """Zeroes features where the side input `keep` is 0."""

    def call(self, x, keep=None):
        return x * tf.cast(keep, x.dtype)


def _layers():
    keras.utils.set_random_seed(3)
    return [_Scaled(6), keras.layers.Dense(6), _Masked(), _Scaled(6), keras.layers.Dense(3)]


def _reference(layers, x, scale, keep):
    h = x
    for layer in layers:
        if isinstance(layer, _Scaled):
            h = layer(h, scale=scale)
        elif isinstance(layer, _Masked):
            h = layer(h, keep=keep)
        else:
            h = layer(h)
    return h


def _inputs(n=10):
    rng = np.random.RandomState(0)
    return {
        "inputs": rng.randn(n, 4).astype("float32"),
        "scale": rng.rand(n, 1).astype("float32") + 0.5,
        "keep": (rng.rand(n, 6) > 0.3).astype("int32"),
    }


@pytest.mark.parametrize("schedule,remat", [("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "always")])
def test_side_inputs_match_manual_wiring(schedule, remat):
    data = _inputs()
    y = np.arange(10) % 3
    ref_layers = _layers()
    pm = tf_gpipe.PipelineModel(
        _layers(),
        num_stages=3,
        num_micro_batches=4,
        side_inputs=("scale", "keep"),
        schedule=schedule,
        remat=remat,
    )
    pm(data)
    _reference(ref_layers, data["inputs"], data["scale"], data["keep"])
    pm.set_weights([w.numpy() for layer in ref_layers for w in layer.weights])
    assert_all_close([pm(data)], [_reference(ref_layers, data["inputs"], data["scale"], data["keep"])])

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss_ref = loss_fn(y, _reference(ref_layers, data["inputs"], data["scale"], data["keep"]))
    g_ref = tape.gradient(loss_ref, [w for layer in ref_layers for w in layer.trainable_weights])
    with tf.GradientTape() as tape:
        loss = loss_fn(y, pm(data, training=True))
    assert_all_close([loss], [loss_ref])
    assert_all_close(tape.gradient(loss, pm.trainable_weights), g_ref)

    pm.compile(optimizer="sgd", loss=loss_fn)
    before = pm.get_weights()
    pm.fit(data, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert any(not np.allclose(a, b) for a, b in zip(before, pm.get_weights()))


def test_side_inputs_are_required_and_named():
    pm = tf_gpipe.PipelineModel(_layers(), num_stages=2, side_inputs=("scale", "keep"))
    with pytest.raises(ValueError, match="side inputs"):
        pm(np.zeros((2, 4), "float32"))
    data = _inputs(4)
    del data["keep"]
    with pytest.raises(ValueError, match="'keep'"):
        pm(data)
