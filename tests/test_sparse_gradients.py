"""Rows gradients (an Embedding's ``tf.IndexedSlices``) reach the optimizer as the unsplit
model's do: a token embedding's one row per looked-up token, a position embedding's
(``arange(length)``, the same in every example) one row per position, not one per
micro-batch. Keras' optimizers square each row before summing rows of one index, so
anything but SGD would notice the difference."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close
from keras import ops

import tf_gpipe
from tf_gpipe import trainer

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"]


class PositionEmbedding(keras.layers.Layer):
    """Adds one learned vector per position, looked up once for the whole batch (as
    keras-io's TokenAndPositionEmbedding and PatchEncoder do)."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.positions = keras.layers.Embedding(length, dim)

    def call(self, x):
        return x + self.positions(ops.arange(ops.shape(x)[1]))


def _layers():
    keras.utils.set_random_seed(0)
    return [
        keras.layers.Embedding(12, 4),  # token rows: one per token, duplicates included
        PositionEmbedding(5, 4),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ]


@pytest.mark.parametrize(
    "schedule, remat",
    [("gpipe", "always"), ("1f1b", "never"), ("interleaved", "always"), ("zb-h1", "always")],
)
def test_rows_update_like_the_unsplit_model(schedule, remat):
    """Three steps of each optimizer on 10 examples in uneven micro-batches (4, 3, 3; or
    3, 3, 2, 2 for interleaved) give keras.Sequential's weights and optimizer state."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randint(0, 12, (10, 5)), tf.int32)
    y = tf.constant(rng.randint(0, 3, 10))
    seq = keras.Sequential([keras.Input((5,), dtype="int32")] + _layers())
    interleaved = schedule == "interleaved"
    pm = tf_gpipe.PipelineModel(
        _layers(),
        num_stages=2,
        num_micro_batches=4 if interleaved else 3,
        schedule=schedule,
        remat=remat,
        virtual_stages=2 if interleaved else 1,
    )
    pm.build((None, 5))
    initial = seq.get_weights()
    pm.compile(optimizer="sgd", loss=LOSS)
    # One trace of the pipelined step for every optimizer: what fit's step applies.
    step = tf.function(lambda x, y: trainer.gradients(pm, (x, y)).grads, autograph=False)
    for name in OPTIMIZERS:
        seq.set_weights(initial)
        pm.set_weights(initial)
        seq_opt, pm_opt = keras.optimizers.get(name), keras.optimizers.get(name)
        for opt in (seq_opt, pm_opt):
            opt.learning_rate = 0.01
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = LOSS(y, seq(x, training=True))
            seq_opt.apply_gradients(zip(tape.gradient(loss, seq.trainable_weights), seq.trainable_weights))
            pm_opt.apply_gradients(zip(step(x, y), pm.trainable_weights))
        assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-5)
        assert_all_close(pm_opt.variables, seq_opt.variables, rtol=1e-5, atol=1e-5)


class _FixedBatch(keras.layers.Layer):
    """A layer that only runs on a known batch size."""

    def call(self, x):
        if x.shape[0] is None:
            raise ValueError("needs a known batch size")
        return x


def test_a_stage_that_needs_a_known_batch_size_still_trains():
    """The trace that tells the rows apart runs with the batch size unknown; a stage that
    cannot be traced so keeps concatenated rows, with a warning saying what that costs."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Embedding(12, 4), PositionEmbedding(5, 4), _FixedBatch(), keras.layers.Flatten()]
    pm = tf_gpipe.PipelineModel(layers + [keras.layers.Dense(3)], balance=[4, 1], num_micro_batches=2)
    pm.build((6, 5))
    pm.compile(optimizer="sgd", loss=LOSS)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randint(0, 12, (6, 5)), tf.int32)
    with pytest.warns(UserWarning, match=r"(?s)batch size unknown.*needs a known batch size"):
        grads = tf.function(lambda x, y: trainer.gradients(pm, (x, y)).grads, autograph=False)(
            x, tf.zeros([6], tf.int32)
        )
    assert isinstance(grads[1], tf.IndexedSlices) and grads[1].values.shape[0] == 2 * 5
