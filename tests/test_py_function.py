"""A differentiable ``tf.py_function`` layer in a stage that keeps its activations trains as in
keras.Sequential (TensorFlow's own py_function gradient holds for one call of the stage only)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, fit_both

import tf_gpipe


class _PySin(keras.layers.Layer):
    """x * sin(x), computed in Python: its gradient depends on each micro-batch's input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # A host call inside: no XLA (what Keras asks a layer to declare).
        self.supports_jit = False

    def call(self, x):
        y = tf.py_function(lambda t: t * tf.sin(t), [x], tf.float32)
        y.set_shape(x.shape)
        return y

    def compute_output_shape(self, input_shape):
        return input_shape


def _layers():
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(8, activation="tanh") for _ in range(2)]
    # K=2 cuts [Dense, PySin, Dense] [PySin, Dense]: a py_function in each stage.
    return [dense[0], _PySin(), dense[1], _PySin(), keras.layers.Dense(3)]


def _pair(**kwargs):
    seq = keras.Sequential(_layers())
    seq.build((None, 5))
    pm = tf_gpipe.PipelineModel(_layers(), num_stages=2, num_micro_batches=3, **kwargs)
    pm.build((None, 5))
    pm.set_weights(seq.get_weights())
    return seq, pm


def _data(n=20):
    rng = np.random.RandomState(0)
    return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n)


@pytest.mark.parametrize("schedule,remat", [("gpipe", "never"), ("gpipe", "except_last"), ("zb-h1", "never")])
def test_fit_with_py_function_matches_keras_sequential(schedule, remat):
    seq, pm = _pair(schedule=schedule, remat=remat)
    x, y = _data()
    fit_both(seq, pm, x, y)


def test_tape_through_py_function_matches_keras_sequential():
    seq, pm = _pair(remat="never")
    x, y = _data(10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(model):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return [loss] + tape.gradient(loss, model.trainable_variables)

    assert_all_close(step(pm), step(seq), rtol=1e-5, atol=1e-6)
