"""ZB-H1's two backward halves (``tf_gpipe.stash``, split): the B makes the activation
gradients once, the W makes the weight gradients from what the B handed it, without a
second pass of the chain; a re-materialized stage's B replays it once for both."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TRAINED_TOL, assert_all_close, data, mlp_layers, partition_graphs

import tf_gpipe

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Twice(keras.layers.Layer):
    """One kernel read by two matmuls in a chain (the second's input is the first's output),
    a term made of the weights alone added to the activations, and a layer loss of the
    weights alone: what the W's sum over the ops that read a weight must get right."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        w = tf.convert_to_tensor(self.w)  # one read for every use
        h = tf.tanh(tf.matmul(x, w))
        self.add_loss(1e-2 * tf.reduce_sum(tf.square(w)))
        return tf.matmul(h, w, transpose_b=True) * self.b + tf.reduce_mean(w)


def _layers():
    keras.utils.set_random_seed(3)
    return [
        keras.layers.Dense(8, activation="tanh"),
        Twice(6),
        keras.layers.Dense(8, activation="relu"),
        Twice(5),
        keras.layers.Dense(3),
    ]


@pytest.mark.parametrize("loops", [True, False])
def test_split_halves_train_as_the_unsplit_model(cpu_devices, loops):
    """A weight read twice along the chain, a weights-only term and a layer loss: zb-h1 with
    ``remat="never"`` trains as ``keras.Sequential`` (Adam, 10 examples in 4 uneven
    micro-batches, two steps), in the loops and built out."""
    x, y = data(10)
    seq = keras.Sequential([keras.Input((8,))] + _layers())
    pm = tf_gpipe.PipelineModel(
        _layers(), num_stages=3, balance=[2, 2, 1], num_micro_batches=4, devices=cpu_devices[:3],
        schedule="zb-h1", remat="never", micro_batch_loops=loops,
    )  # fmt: skip
    pm.build((None, 8))
    pm.set_weights(seq.get_weights())
    for m in (seq, pm):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    for _ in range(2):
        np.testing.assert_allclose(pm.train_on_batch(x, y), seq.train_on_batch(x, y), rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=TRAINED_TOL, atol=TRAINED_TOL)


def _matmuls(cpu_devices, schedule, loops, remat):
    x, y = data(16)
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=5), num_stages=3, num_micro_batches=4, devices=cpu_devices[:3],
        schedule=schedule, remat=remat, micro_batch_loops=loops,
    )  # fmt: skip
    pm.compile(optimizer="sgd", loss=LOSS)
    found = collections.Counter()
    for g in partition_graphs(lambda: pm.train_on_batch(x, y)):
        for node in g.node:
            if "MatMul" in node.op:
                found[node.device.rsplit(":", 1)[-1]] += 1
    return found


# Built out, a re-materialized stage's backward is a call the partition graphs do not open:
# test_guarantees' timeline counts its replays instead.
@pytest.mark.parametrize("loops,remat", [(True, "never"), (False, "never"), (True, "always")])
def test_the_weight_half_does_not_compute_the_input_half_again(cpu_devices, loops, remat):
    """Per device, the step's matmuls (forward, replay, input and weight gradients) under
    zb-h1 are 1F1B's: each stage's W multiplies the gradients its B made, once per weight;
    re-materialized, only the B replays the forward."""
    assert _matmuls(cpu_devices, "zb-h1", loops, remat) == _matmuls(cpu_devices, "1f1b", loops, remat)


def _recurrent():
    keras.utils.set_random_seed(1)
    return [keras.layers.Embedding(50, 8, mask_zero=True), keras.layers.LSTM(6), keras.layers.Dense(3)]


def test_weights_read_inside_a_loop_keep_one_backward(cpu_devices):
    """A recurrent layer reads its weights inside its loop, whose gradient TensorFlow makes
    whole: its stage is not split (built out it trains as ``keras.Sequential``), and the loops,
    which cannot hold the loop's per-step values for a later W, say so and what to use."""
    rng = np.random.RandomState(0)
    # Right-padded, the only masks cuDNN's LSTM takes on a GPU.
    x = rng.randint(1, 50, (10, 7)) * (np.arange(7) < rng.randint(2, 8, (10, 1)))
    y = rng.randint(0, 3, 10)
    seq = keras.Sequential([keras.Input((7,))] + _recurrent())
    seq.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    for loops in (False, True):
        pm = tf_gpipe.PipelineModel(
            _recurrent(), num_stages=3, num_micro_batches=4, devices=cpu_devices[:3],
            schedule="zb-h1", remat="never", micro_batch_loops=loops,
        )  # fmt: skip
        pm.build((None, 7))
        pm.set_weights(seq.get_weights())
        pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
        if loops:
            with pytest.raises(
                RuntimeError, match=r"stage 1's gradient reads a variant tensor.*micro_batch_loops=False"
            ):
                pm.train_on_batch(x, y)
            continue
        for _ in range(2):
            np.testing.assert_allclose(pm.train_on_batch(x, y), seq.train_on_batch(x, y), rtol=1e-6)
        assert_all_close(pm.get_weights(), seq.get_weights(), rtol=TRAINED_TOL, atol=TRAINED_TOL)


def _tokens():
    keras.utils.set_random_seed(5)
    return [
        keras.layers.Embedding(40, 12, mask_zero=True),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(16, activation="gelu"),
        keras.layers.Dense(12),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(12, activation="relu", kernel_regularizer="l2"),
        keras.layers.Dense(3, dtype="float32"),
    ]


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_split_halves_fit_as_the_unsplit_model_with_masks_and_sample_weights(cpu_devices, policy):
    """A masked token model (embedding rows, a layer norm, masked pooling, a regularized
    layer) under zb-h1/never, fit for an epoch with sample weights in uneven
    micro-batches, as ``keras.Sequential``; under ``mixed_float16`` too (float16 weight
    casts between the weights and the ops that read them, loss scaling)."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        rng = np.random.RandomState(2)
        x = rng.randint(1, 40, (22, 6)) * (rng.rand(22, 6) > 0.25)
        y, w = rng.randint(0, 3, 22), rng.rand(22).astype("float32")
        seq = keras.Sequential([keras.Input((6,))] + _tokens())
        pm = tf_gpipe.PipelineModel(
            _tokens(), num_stages=3, balance=[2, 3, 2], num_micro_batches=3, devices=cpu_devices[:3],
            schedule="zb-h1", remat="never",
        )  # fmt: skip
        pm.build((None, 6))
        pm.set_weights(seq.get_weights())
        history = []
        for m in (seq, pm):
            m.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
            fit = m.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0)
            history.append(fit.history["loss"])
        tol = 2e-3 if policy == "mixed_float16" else TRAINED_TOL
        np.testing.assert_allclose(history[1], history[0], rtol=tol)
        assert_all_close(pm.get_weights(), seq.get_weights(), rtol=tol, atol=tol)
    finally:
        keras.mixed_precision.set_global_policy("float32")
