"""tf_gpipe.trainer: with padded sequences, fit's loss, metrics and gradients honour the Keras mask."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, pair

from tf_gpipe import keras_compat

T, VOCAB, CLASSES = 6, 20, 5


def _wide(seed):
    # Large embeddings and logits: per-token losses then differ, so the padding moves the mean.
    return keras.initializers.RandomNormal(stddev=1.5, seed=seed)


class _MaskedLSTM(keras.layers.LSTM):
    """An LSTM that reads the mask (skips padded steps) and passes it on to the loss.

    Keras 3.15's LSTM does both; keras-nightly 3.16's reads the mask but drops it
    (``supports_masking = False``), so the loss would count the padding in both models
    and the "lstm" cases would no longer test masking. Identical to LSTM on 3.15.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_masking = True


def _layers(kind, regularize=False):
    """Four layers, so that interleaved (K=2, v=2) has one per cell."""
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Embedding(VOCAB, 8, mask_zero=True, embeddings_initializer=_wide(4))]
    if kind == "lstm":
        layers.append(_MaskedLSTM(8, return_sequences=True))
    else:
        layers.append(keras.layers.Dense(8, activation="tanh"))
    extra = {"activity_regularizer": keras.regularizers.L2(0.01)} if regularize else {}
    layers += [
        keras.layers.Dense(8, activation="tanh", **extra),
        keras.layers.Dense(CLASSES, kernel_initializer=_wide(5)),
    ]
    return layers


def _padded(n, seed=0):
    """Token ids padded with 0 after 1..T valid tokens (every length occurs), labels, weights."""
    rng = np.random.RandomState(seed)
    lengths = np.resize(np.arange(1, T + 1), n)
    rng.shuffle(lengths)
    x = np.zeros((n, T), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.randint(1, VOCAB, length)
    y = rng.randint(0, CLASSES, (n, T))
    # Per-token weights: Keras cannot broadcast per-sequence weights against a (n, T) mask.
    sw = rng.uniform(0.2, 2.0, (n, T)).astype("float32")
    return x, y, sw


def _compile(model, loss=None):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    )


def _pair(kind, schedule, M, v, regularize=False):
    return pair(
        lambda: _layers(kind, regularize),
        (None, T),
        input_dtype="int32",
        num_stages=2,
        num_micro_batches=M,
        schedule=schedule,
        virtual_stages=v,
    )


def _assert_mask_matters(model, x, y, sw):
    """The masked loss differs from the unmasked one by far more than the tests' tolerance."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = model(x)
    assert keras_compat.get_keras_mask(out) is not None
    masked = float(loss_fn(y, out, sample_weight=sw))
    unmasked = float(loss_fn(y, tf.identity(out), sample_weight=sw))
    assert abs(masked - unmasked) > 1e-3 * abs(masked)  # 100 x the tolerance


# Each schedule with both kinds, and with and without sample weights; each kind with and
# without (every pair of the three choices meets). The kind decides what carries the mask
# to the loss; the weights multiply the per-token losses, whatever carried the mask.
# schedule, M, virtual_stages, examples (uneven micro-batches: 7 = 3+2+2, 10 = 3+3+2+2),
# kind, weighted.
TRAIN_ON_BATCH_CASES = [
    ("gpipe", 3, 1, 7, "dense", False),
    ("gpipe", 3, 1, 7, "lstm", True),
    ("1f1b", 4, 1, 10, "dense", True),
    ("1f1b", 4, 1, 10, "lstm", False),
    ("interleaved", 4, 2, 10, "dense", False),
    ("interleaved", 4, 2, 10, "lstm", True),
]


@pytest.mark.parametrize("schedule,M,v,n,kind,weighted", TRAIN_ON_BATCH_CASES)
def test_train_on_batch_matches_keras(schedule, M, v, n, kind, weighted):
    seq, pm = _pair(kind, schedule, M, v)
    x, y, sw = _padded(n)
    sw = sw if weighted else None
    _assert_mask_matters(seq, x, y, sw)
    logs = []
    for model in (seq, pm):
        _compile(model)
        logs.append(model.train_on_batch(x, y, sample_weight=sw, return_dict=True))
    assert logs[1]["loss"] == pytest.approx(logs[0]["loss"], rel=1e-5)
    assert logs[1]["acc"] == pytest.approx(logs[0]["acc"], rel=1e-6)
    assert_all_close(seq.get_weights(), pm.get_weights())


# Interleaved stands for 1F1B too: the same per-micro-batch loss and loop code.
@pytest.mark.parametrize("schedule,M,v", [("gpipe", 3, 1), ("interleaved", 4, 2), ("zb-h1", 3, 1)])
def test_fit_with_unknown_batch_and_empty_micro_batches(schedule, M, v):
    # 17 examples in batches of 8: the last batch of 1 leaves empty micro-batches (and, under
    # the per-micro-batch schedules, micro-batches without any valid token); its size is
    # only known at run time.
    seq, pm = _pair("lstm", schedule, M, v)
    x, y, sw = _padded(17, seed=1)
    hist = []
    for model in (seq, pm):
        _compile(model)
        fitted = model.fit(x, y, sample_weight=sw, batch_size=8, epochs=2, shuffle=False, verbose=0)
        hist.append(fitted.history)
    np.testing.assert_allclose(hist[1]["loss"], hist[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist[1]["acc"], hist[0]["acc"], rtol=1e-6)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-4, atol=1e-5)
    assert_all_close([seq.evaluate(x, y, verbose=0)], [pm.evaluate(x, y, verbose=0)])


@pytest.mark.parametrize("reduction,weighted", [("sum", True), ("mean_with_sample_weight", False)])
def test_other_reductions_with_mask_under_1f1b(reduction, weighted):
    seq, pm = _pair("dense", "1f1b", 3, 1)
    x, y, sw = _padded(7)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    logs = []
    for model in (seq, pm):
        _compile(model, loss=loss)
        logs.append(model.train_on_batch(x, y, sample_weight=sw if weighted else None, return_dict=True))
    assert logs[1]["loss"] == pytest.approx(logs[0]["loss"], rel=1e-5)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-4, atol=1e-5)


def test_masked_loss_with_layer_losses_under_gpipe():
    seq, pm = _pair("dense", "gpipe", 3, 1, regularize=True)
    x, y, _ = _padded(7)
    logs = []
    for model in (seq, pm):
        _compile(model)
        logs.append(model.train_on_batch(x, y, return_dict=True))
    assert logs[1]["loss"] == pytest.approx(logs[0]["loss"], rel=1e-5)
    assert_all_close(seq.get_weights(), pm.get_weights())


@pytest.mark.parametrize("schedule,M,v", [("1f1b", 3, 1), ("interleaved", 4, 2)])
def test_masked_loss_with_layer_losses_per_micro_batch_is_refused(schedule, M, v):
    _, pm = _pair("dense", schedule, M, v, regularize=True)
    _compile(pm)
    x, y, _ = _padded(8)
    with pytest.raises(ValueError, match=r"activity regularizers.*schedule='gpipe'"):
        pm.train_on_batch(x, y)


def test_custom_loop_with_tape_sees_the_mask():
    seq, pm = _pair("lstm", "gpipe", 3, 1)
    x, y, sw = _padded(10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for model in (seq, pm):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = loss_fn(y, out, sample_weight=sw)
        results.append((loss, tape.gradient(loss, model.trainable_weights)))
    assert_all_close([results[0][0]], [results[1][0]])
    assert_all_close(results[0][1], results[1][1])


def test_masked_loss_under_loss_scaling(mixed_float16):
    def make():
        layers = _layers("dense")
        layers[-1] = keras.layers.Dense(CLASSES, kernel_initializer=_wide(5), dtype="float32")
        return layers

    seq, pm = pair(make, (None, T), input_dtype="int32", num_stages=2, num_micro_batches=3, schedule="1f1b")
    x, y, sw = _padded(7)
    logs = []
    for model in (seq, pm):
        _compile(model)
        logs.append(model.train_on_batch(x, y, sample_weight=sw, return_dict=True))
    assert type(pm.optimizer).__name__ == "LossScaleOptimizer"
    assert logs[1]["loss"] == pytest.approx(logs[0]["loss"], rel=2e-3)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=2e-2, atol=2e-3)


class _TwoHeads(keras.layers.Layer):
    """Two masked per-token outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.a = keras.layers.Dense(CLASSES, kernel_initializer=_wide(6))
        self.b = keras.layers.Dense(CLASSES, kernel_initializer=_wide(7))

    def call(self, x):
        return self.a(x), self.b(x)

    def compute_mask(self, x, mask=None):
        return mask, mask


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_several_masked_outputs(schedule):
    def make():
        return _layers("dense")[:-1] + [_TwoHeads()]

    seq, pm = pair(make, (None, T), input_dtype="int32", num_stages=2, num_micro_batches=3, schedule=schedule)
    x, y, _ = _padded(7)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (seq, pm):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=[loss, loss])
    expected = seq.train_on_batch(x, (y, y[:, ::-1]), return_dict=True)
    if schedule != "gpipe":  # each output's loss has its own count of valid tokens
        with pytest.raises(ValueError, match=r"several outputs.*schedule='gpipe'"):
            pm.train_on_batch(x, (y, y[:, ::-1]))
        return
    got = pm.train_on_batch(x, (y, y[:, ::-1]), return_dict=True)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert_all_close(seq.get_weights(), pm.get_weights())
