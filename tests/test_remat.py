"""Re-materialization replays the exact forward pass and applies side effects once."""

import functools
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, loss_and_grads, pair

import tf_gpipe
from tf_gpipe import replay


def dropout_bn_layers(seed=11):
    keras.utils.set_random_seed(seed)
    return [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5, seed=1),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3, seed=2),
        keras.layers.Dense(3),
    ]


def _grads_for(remat, x, y, in_function, K=3, M=4):
    keras.backend.clear_session()
    pm = tf_gpipe.PipelineModel(dropout_bn_layers(), num_stages=K, num_micro_batches=M, remat=remat)
    pm.build((None, 8))

    def fn(a, b):
        return loss_and_grads(pm, a, b)

    if in_function:
        fn = tf.function(fn)
    out, loss, grads = fn(x, y)
    return out, loss, grads, [v.numpy() for v in pm.non_trainable_weights]


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "tf_function"])
def test_dropout_masks_replayed_exactly(in_function):
    x, y = data(12)
    o_never, l_never, g_never, s_never = _grads_for("never", x, y, in_function)
    o_alw, l_alw, g_alw, s_alw = _grads_for("always", x, y, in_function)
    assert_all_close([o_never, l_never], [o_alw, l_alw], rtol=1e-6, atol=1e-6)
    assert_all_close(g_never, g_alw, rtol=1e-5, atol=1e-6)
    # BatchNorm moving statistics: identical with and without remat (updated once).
    assert_all_close(s_never, s_alw, rtol=1e-6, atol=1e-7)


def test_naive_recompute_would_be_wrong(monkeypatch):
    """Negative control: replaying without the recorded state (what tf.recompute_grad
    does) draws new dropout masks, so the gradients differ. The test above can fail."""
    x, y = data(12)
    _, _, g_ok, _ = _grads_for("always", x, y, False)
    real_replay = replay.run

    def naive(cell, record, training):
        record.replay_state = []
        return real_replay(cell, record, training)

    monkeypatch.setattr(replay, "run", naive)
    _, _, g_naive, _ = _grads_for("always", x, y, False)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(g_ok, g_naive)]
    assert max(diffs) > 1e-3


def _fit_weights(remat):
    """The weights (moving statistics too) after 2 epochs of fit, K=3, M=3."""
    x, y = data(24)
    keras.backend.clear_session()
    pm = tf_gpipe.PipelineModel(dropout_bn_layers(), num_stages=3, num_micro_batches=3, remat=remat)
    pm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pm.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    return pm.get_weights()


_taped_fit_weights = functools.cache(_fit_weights)  # the reference every mode is held to


@pytest.mark.parametrize("remat", ["always", "except_last", "never"])
def test_fit_with_dropout_and_batchnorm_same_for_every_remat(remat):
    """Training with remat gives the weights and moving statistics of training without
    (and training without, run again, the same: the runs are deterministic)."""
    assert_all_close(_taped_fit_weights("never"), _fit_weights(remat), rtol=1e-5, atol=1e-6)


def test_batchnorm_updated_once_matches_unsplit_with_one_micro_batch():
    """With M=1 the pipelined model is exactly the unsplit model, BatchNorm statistics
    included: a second (replayed) update would move them twice."""

    def make():
        keras.utils.set_random_seed(2)
        return [
            keras.layers.Dense(10),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(10, activation="relu"),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(3),
        ]

    seq, pm = pair(make, (None, 8), num_stages=3, num_micro_batches=1, remat="always")
    x, y = data(16)
    for model in (seq, pm):
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)
    moving = [w for w in pm.non_trainable_weights if "moving_mean" in w.path]
    assert moving and not np.allclose(moving[0].numpy(), 0.0)


class _CountCalls(keras.layers.Layer):
    """Counts forward passes in a variable, and records is_recomputing() while tracing."""

    seen: ClassVar[list] = []

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")

    def call(self, x):
        _CountCalls.seen.append(tf_gpipe.is_recomputing())
        self.count.assign_add(1.0)
        return x * 2.0


def test_variable_updates_applied_once_and_is_recomputing():
    _CountCalls.seen = []
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(4), _CountCalls(), keras.layers.Dense(3)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=3, num_micro_batches=4, remat="always")
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(8)
    pm.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # 4 micro-batches, one forward each; the 4 replays change nothing.
    assert float(layers[1].count.numpy()) == 4.0
    assert True in _CountCalls.seen and False in _CountCalls.seen
    assert not tf_gpipe.is_recomputing()


def test_empty_micro_batches_leave_statistics_finite():
    """A last batch smaller than M at run time gives empty micro-batches; their NaN batch
    statistics and gradients must not reach the variables."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(6), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=8)
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(10)
    pm.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)  # last batch: 3 < 8
    assert all(np.all(np.isfinite(w)) for w in pm.get_weights())


def test_read_is_the_stored_value_as_the_enclosing_scope_maps_it():
    """What a replay restores: the mapped value inside a StatelessScope, and never the
    autocast one (inside a mixed-precision layer's call ``variable.value`` is float16)."""
    v = keras.Variable(np.zeros(3, "float32"))
    with keras.StatelessScope(state_mapping=[(v, tf.ones(3))]):
        assert np.array_equal(replay.read_stored(v).numpy(), np.ones(3))
    assert np.array_equal(replay.read_stored(v).numpy(), np.zeros(3))

    class Reads(keras.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(2,), initializer="ones")

        def call(self, x):
            self.seen = (self.w.value.dtype, replay.read_stored(self.w).dtype)
            return x

    layer = Reads(dtype="mixed_float16")
    layer(tf.ones((1, 2)))
    assert layer.seen == (tf.float16, tf.float32)
