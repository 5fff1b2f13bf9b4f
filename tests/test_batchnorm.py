"""Deferred BatchNormalization statistics under micro-batching."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, pair

import tf_gpipe


class _Block(keras.layers.Layer):
    """A BatchNormalization nested inside a custom layer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.dense = keras.layers.Dense(6)
        self.bn = keras.layers.BatchNormalization(momentum=0.7)

    def call(self, x, training=None):
        return keras.ops.relu(self.bn(self.dense(x), training=training))


def bn_layers(conv=False, second_bn=False):
    """One BatchNormalization (nested in _Block), or a conv net with two."""
    keras.utils.set_random_seed(5)
    if conv:
        return [
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.BatchNormalization(momentum=0.6),
            keras.layers.ReLU(),
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.BatchNormalization(momentum=0.6),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    return [
        keras.layers.Dense(8),
        keras.layers.ReLU(),
        _Block(),
        keras.layers.Dense(3),
    ]


def _data(conv, n=16):
    rng = np.random.RandomState(0)
    x = rng.randn(n, 6, 6, 2) if conv else rng.randn(n, 8) * 3 + 1
    return x.astype("float32"), rng.randint(0, 3, n)


def _moving(model):
    return [w.numpy() for w in model.non_trainable_weights if "moving" in w.path]


def _one_step(model, x, y, batch_size):
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize(
    "schedule,remat",
    [("gpipe", "always"), ("1f1b", "never"), ("gpipe", "except_last"), ("zb-h1", "except_last")],
)
def test_deferred_statistics_equal_the_unsplit_model(schedule, remat):
    """With the same weights and inputs, one step moves the statistics exactly as the
    unsplit model's full-batch step does (here the BatchNormalization is nested)."""
    seq, pm = pair(bn_layers, (None, 8), num_stages=3, num_micro_batches=4, schedule=schedule, remat=remat)
    x, y = _data(False)
    for model in (seq, pm):
        _one_step(model, x, y, batch_size=16)
    assert_all_close(_moving(seq), _moving(pm), rtol=1e-5, atol=1e-6)
    assert not np.allclose(_moving(pm)[0], 0.0)


class _CountedGradient(keras.layers.Layer):
    """The identity whose gradient counts its own runs (a stateful host call)."""

    runs = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # A host call inside: no XLA (what Keras asks a layer to declare).
        self.supports_jit = False

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                def count(g):
                    type(self).runs += 1
                    return g

                out = tf.numpy_function(count, [dy], dy.dtype, stateful=True)
                out.set_shape(dy.shape)
                return out

            return tf.identity(t), grad

        return identity(x)


@pytest.mark.parametrize("remat", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_layer_below_batch_norm_is_differentiated_once_a_micro_batch(schedule, remat):
    """The pooled moments leave a stage beside its outputs; no gradient may flow back through
    them. Through them, a taped stage (its gradient gated, ``tf_gpipe.gated``) ran a second
    backward of every layer below a BatchNormalization: twice the work, zero gradients."""
    keras.utils.set_random_seed(1)
    layers = [
        keras.layers.Dense(6),
        _CountedGradient(),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(3),
    ]
    M = 3  # micro-batches of 3, 3 and 2 examples
    pm = tf_gpipe.PipelineModel(layers, balance=[3, 1], num_micro_batches=M, schedule=schedule, remat=remat)
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(False, n=8)
    pm.train_on_batch(x, y)
    _CountedGradient.runs = 0
    pm.train_on_batch(x, y)
    assert _CountedGradient.runs == M


def test_deferred_statistics_pool_what_each_layer_saw():
    """Deeper BatchNormalizations see inputs normalized per micro-batch; their update pools
    exactly those inputs over the mini-batch (conv net, statistics over N, H, W)."""
    M = 4
    seq, pm = pair(lambda: bn_layers(conv=True), (None, 6, 6, 2), num_stages=3, num_micro_batches=M)
    x, y = _data(True)
    bn2 = seq.layers[4]
    seen = []
    with keras.StatelessScope():  # run the unsplit layers per micro-batch without moving anything
        for chunk in np.array_split(x, M):
            h = chunk
            for layer in seq.layers[:4]:
                h = layer(h, training=True)
            seen.append(np.asarray(h))
    seen = np.concatenate(seen)
    momentum = bn2.momentum
    expected_mean = (1 - momentum) * seen.mean(axis=(0, 1, 2))
    expected_var = momentum * 1.0 + (1 - momentum) * seen.var(axis=(0, 1, 2))
    _one_step(pm, x, y, batch_size=16)
    moving = _moving(pm)
    assert_all_close([moving[2], moving[3]], [expected_mean, expected_var], rtol=1e-4, atol=1e-5)
    _one_step(seq, x, y, batch_size=16)  # the first BatchNormalization sees the same inputs
    assert_all_close(_moving(seq)[:2], moving[:2], rtol=1e-5, atol=1e-6)


def test_without_deferral_statistics_move_once_per_micro_batch():
    """deferred_batch_norm=False behaves like Keras run on each micro-batch in turn."""
    seq, pm = pair(bn_layers, (None, 8), num_stages=2, num_micro_batches=4, deferred_batch_norm=False)
    x, y = _data(False)
    _one_step(pm, x, y, batch_size=16)
    for chunk in np.array_split(x, 4):
        seq(chunk, training=True)
    assert_all_close(_moving(seq), _moving(pm), rtol=1e-5, atol=1e-6)


def test_deferred_differs_from_per_micro_batch_updates():
    """The two behaviours are really different (so the tests above can tell them apart)."""
    results = []
    for deferred in (True, False):
        keras.backend.clear_session()
        pm = tf_gpipe.PipelineModel(
            bn_layers(), num_stages=2, num_micro_batches=4, deferred_batch_norm=deferred
        )
        x, y = _data(False)
        _one_step(pm, x, y, batch_size=16)
        results.append(_moving(pm))
    assert any(not np.allclose(a, b, atol=1e-4) for a, b in zip(*results))


def test_deferred_in_custom_training_loop_and_empty_micro_batches():
    seq, pm = pair(bn_layers, (None, 8), num_stages=3, num_micro_batches=8)
    x, _ = _data(False, n=5)  # M=8 > 5 examples; with a None batch dim: 3 empty micro-batches

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def forward(a):
        return pm(a, training=True)

    forward(x)
    seq(x, training=True)
    assert_all_close(_moving(seq), _moving(pm), rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(np.concatenate([m.ravel() for m in _moving(pm)])))


def _large_mean_layers(masked):
    """A BatchNormalization on values of mean 1000 and spread 0.1 (momentum 0: the moving
    statistics are the mini-batch's): E[x^2] - mean^2 loses that spread in float32.
    Masked: an Embedding(mask_zero=True) gives them, and the padding must not count."""
    keras.utils.set_random_seed(3)
    bn = keras.layers.BatchNormalization(momentum=0.0)
    if not masked:
        return [bn, keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    big = keras.initializers.RandomNormal(mean=1000.0, stddev=0.1, seed=1)
    return [
        keras.layers.Embedding(20, 4, mask_zero=True, embeddings_initializer=big),
        bn,
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ]


@pytest.mark.parametrize(
    "masked, schedule, num_stages, M",
    [
        (False, "gpipe", 1, 1),
        (False, "1f1b", 2, 3),
        (True, "gpipe", 2, 3),
        (True, "1f1b", 2, 3),
        (True, "interleaved", 2, 4),
        (True, "zb-h1", 2, 3),
    ],
)
def test_deferred_statistics_of_large_mean_inputs(masked, schedule, num_stages, M):
    """Moments pooled stably (Chan's formula): Keras' moving variance of inputs of mean
    1000 and spread 0.1, to 1e-3, over 10 examples in uneven micro-batches (Keras': 0.01;
    pooled as E[x^2] - mean^2: 0, even unsplit, K = M = 1)."""
    rng = np.random.RandomState(0)
    if masked:
        x = rng.randint(1, 20, (10, 6)).astype("int32")
        x[:, 4:] *= rng.rand(10, 2) > 0.5  # padding (token 0) at the end of some
        shape = (None, 6)
    else:
        x = (1000.0 + 0.1 * rng.randn(10, 8)).astype("float32")
        shape = (None, 8)
    y = rng.randint(0, 3, 10)
    interleaved = dict(virtual_stages=2) if schedule == "interleaved" else {}
    seq, pm = pair(
        lambda: _large_mean_layers(masked),
        shape,
        input_dtype="int32" if masked else None,
        num_stages=num_stages,
        num_micro_batches=M,
        schedule=schedule,
        **interleaved,
    )
    for model in (seq, pm):
        _one_step(model, x, y, batch_size=10)
    expected = _moving(seq)
    assert expected[1].min() > 1e-3  # the spread is there to be lost
    assert_all_close(_moving(pm), expected, rtol=1e-3, atol=1e-7)


def test_empty_mini_batch_leaves_deferred_statistics_alone():
    """A training call on 0 examples has no statistics to pool: the moving statistics stay
    (a forced update would decay them toward the zeros an empty pool holds)."""
    pm = tf_gpipe.PipelineModel(bn_layers(), num_stages=2, num_micro_batches=3)
    pm.build((None, 8))
    for w in pm.non_trainable_weights:
        w.assign(tf.fill(w.shape, 2.0))
    empty = np.zeros((0, 8), "float32")
    pm(empty, training=True)

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def forward(a):
        return pm(a, training=True)

    forward(empty)
    assert all(np.all(m == 2.0) for m in _moving(pm)), _moving(pm)
