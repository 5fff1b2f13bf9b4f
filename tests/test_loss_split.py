"""A user's compiled loss split over micro-batches (1F1B, ZB-H1): exact where it is a mean
over examples, refused, before any update, where its call reduces the batch another way."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close

import tf_gpipe


class _MeanOfSquares(keras.losses.Loss):
    """One value for the whole batch, but a mean over examples: splits exactly."""

    def call(self, y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred))


class _WorstExample(keras.losses.Loss):
    """One value for the whole batch that is no mean: its micro-batches' maxima, weighted
    by their shares, are not the batch's maximum."""

    def call(self, y_true, y_pred):
        return tf.reduce_max(tf.square(y_true - y_pred))


def _per_example(y_true, y_pred):
    return tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)


def _worst(y_true, y_pred):
    return tf.reduce_max(tf.abs(y_true - y_pred))


def _models(loss, schedule, loops):
    def layers():
        keras.utils.set_random_seed(2)
        return [keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(2)]

    seq = keras.Sequential(layers())
    pm = tf_gpipe.PipelineModel(
        layers(), num_stages=2, num_micro_batches=3, schedule=schedule, micro_batch_loops=loops
    )
    for m in (seq, pm):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    return seq, pm


def _data():
    rng = np.random.RandomState(1)
    return rng.randn(10, 4).astype("float32"), rng.randn(10, 2).astype("float32")  # 4, 3, 3


@pytest.mark.parametrize(
    "loss,schedule,loops",
    [(_MeanOfSquares, "1f1b", True), (lambda: _per_example, "zb-h1", False), (_WorstExample, "gpipe", True)],
)
def test_a_users_loss_trains_as_keras_sequential(loss, schedule, loops):
    seq, pm = _models(loss, schedule, loops)
    x, y = _data()
    a, b = (m.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"] for m in (seq, pm))
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "loss,name,schedule,loops",
    [(_WorstExample, "_WorstExample", "1f1b", True), (lambda: _worst, "_worst", "zb-h1", False)],
)
def test_a_users_loss_that_is_no_mean_is_refused_per_micro_batch(loss, name, schedule, loops):
    _, pm = _models(loss, schedule, loops)
    x, y = _data()
    pm.build((None, 4))
    before = pm.get_weights()
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
    message = str(err.value).replace("\\'", "'")  # the assertion escapes quotes
    assert f"The loss '{name}' is not" in message
    assert "one value per example" in message and "schedule='gpipe'" in message
    assert_all_close(pm.get_weights(), before, rtol=0, atol=0)  # nothing trained
