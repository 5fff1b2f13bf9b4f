"""No layer sees an empty micro-batch that the unsplit model would not have seen.

A batch smaller than M (fit's partial last batch, a batch of one) is cut into
fewer micro-batches when its size is known while tracing, and padded with a
stand-in example whose results are discarded when it is not. Layers that cannot
take an empty batch (LSTM, strided Conv1D/Conv2D) then train, evaluate and
predict exactly as in keras.Sequential, under every schedule.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, pair

import tf_gpipe


class NoEmpty(keras.layers.Layer):
    """Identity that fails if a batch with no example reaches it, and records the
    batch sizes it was traced with (None: known only at run time)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.traced = []

    def call(self, x):
        self.traced.append(x.shape[0])
        rows = tf.shape(x)[0]
        check = tf.debugging.assert_greater(rows, 0, message="NoEmpty: a layer received an empty batch")
        with tf.control_dependencies([check]):
            return tf.identity(x)


def _lstm():
    keras.utils.set_random_seed(7)
    return [NoEmpty(), keras.layers.LSTM(3, return_sequences=True), NoEmpty(), keras.layers.Dense(3)]


def _conv1d():
    keras.utils.set_random_seed(7)
    return [
        NoEmpty(),
        keras.layers.Conv1D(4, 1, strides=2, padding="same"),
        NoEmpty(),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ]


def _conv2d():
    keras.utils.set_random_seed(7)
    return [
        NoEmpty(),
        keras.layers.Conv2D(4, 1, strides=2, padding="same"),
        NoEmpty(),
        keras.layers.Dense(4),
    ]


# name: (layers, input shape without batch, target shape without batch)
CASES = {
    "lstm": (_lstm, (4, 2), (4, 3)),
    "conv1d": (_conv1d, (6, 3), (3,)),
    "conv2d": (_conv2d, (4, 4, 3), (2, 2, 4)),
}
SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "interleaved": dict(schedule="interleaved", virtual_stages=2),
    "zb-h1": dict(schedule="zb-h1"),
}


def _xy(n, in_shape, out_shape, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, *in_shape).astype("float32"), rng.randn(n, *out_shape).astype("float32")


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")


def _probes(model):
    return [layer for layer in model.layers if isinstance(layer, NoEmpty)]


# One schedule that takes the loss on the merged batch (gpipe), one that takes it per
# micro-batch (1f1b; interleaved shares its loop code), and ZB-H1's split B and W, each on
# one kind of layer: convolutions (inputs of rank 3 and 4) and the LSTM (a weight read inside
# a loop). No library code looks at the kind of layer: a padded micro-batch is a padded
# micro-batch. Interleaved with empty micro-batches: test_trainer.py.
@pytest.mark.parametrize("case,schedule", [("conv1d", "gpipe"), ("lstm", "1f1b"), ("conv2d", "zb-h1")])
def test_partial_batches_smaller_than_m_match_keras(case, schedule):
    """13 examples, batch_size=10, M=8: the last batch (3) leaves 5 micro-batches without
    an example; fit, evaluate, predict and a static batch of one match keras.Sequential."""
    make, in_shape, out_shape = CASES[case]
    seq, pm = pair(make, (None,) + in_shape, num_stages=2, num_micro_batches=8, **SCHEDULES[schedule])
    _compile(seq)
    _compile(pm)
    x, y = _xy(13, in_shape, out_shape)

    got = pm.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"]
    want = seq.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert_all_close(got, want)
    assert_all_close(pm.get_weights(), seq.get_weights())
    # The padded path ran: the layers were traced for a batch size known only at run time.
    assert None in _probes(pm)[0].traced

    assert_all_close(
        [pm.evaluate(x, y, batch_size=10, verbose=0)], [seq.evaluate(x, y, batch_size=10, verbose=0)]
    )
    assert_all_close([pm.predict(x, batch_size=10, verbose=0)], [seq.predict(x, batch_size=10, verbose=0)])

    # A batch of one example, its size known while tracing: fewer micro-batches, each traced
    # with its static size. On a fresh model with the trained weights: pm's stage functions
    # already hold traces from fit (which ones depends on how Keras traced fit's steps:
    # 3.15 and 3.16 differ), and reduce_retracing lets a trace for an unknown batch size,
    # or an earlier one for size 1, serve this batch, so pm may trace nothing new.
    fresh = tf_gpipe.PipelineModel(make(), num_stages=2, num_micro_batches=8, **SCHEDULES[schedule])
    fresh.build((None,) + in_shape)
    fresh.set_weights(pm.get_weights())
    _compile(fresh)
    traced = len(_probes(fresh)[0].traced)  # the build's symbolic call
    step = tf.function(fresh.train_step)  # not train_on_batch: Keras may relax the batch size
    got = step((tf.constant(x[:1]), tf.constant(y[:1])))["loss"]
    want = seq.train_on_batch(x[:1], y[:1])
    assert_all_close([got], [want])
    assert_all_close(fresh.get_weights(), seq.get_weights())
    assert set(_probes(fresh)[0].traced[traced:]) == {1}  # the static batch, never 0 or None
    assert_all_close([fresh(x[:1])], [seq(x[:1])])


@pytest.mark.parametrize("case", list(CASES))
def test_static_batch_of_one_with_two_micro_batches(case):
    """The reported case: K=1, M=2, one example; gpipe fitted, 1f1b raised in LSTMCell."""
    make, in_shape, out_shape = CASES[case]
    seq, pm = pair(make, (None,) + in_shape, num_stages=1, num_micro_batches=2, schedule="1f1b")
    _compile(seq)
    _compile(pm)
    x, y = _xy(1, in_shape, out_shape, seed=1)
    step = tf.function(pm.train_step)  # the batch size (1) is known while tracing
    step((tf.constant(x), tf.constant(y)))
    seq.train_on_batch(x, y)
    assert_all_close(pm.get_weights(), seq.get_weights())
    built, *traced = _probes(pm)[0].traced
    assert built is None and traced and set(traced) == {1}  # the static batch, never 0 or None


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_tape_through_call_with_a_dynamic_partial_batch(case):
    """model(x) differentiated by a user's tape, batch size unknown while tracing, 3 < M."""
    make, in_shape, out_shape = CASES[case]
    seq, pm = pair(make, (None,) + in_shape, num_stages=2, num_micro_batches=8)
    x, y = _xy(3, in_shape, out_shape, seed=2)
    spec = tf.TensorSpec((None,) + in_shape, tf.float32)

    def loss_and_grads(model):
        @tf.function(input_signature=[spec, tf.TensorSpec((None,) + out_shape, tf.float32)])
        def run(x, y):
            with tf.GradientTape() as tape:
                out = model(x, training=True)
                loss = tf.reduce_mean(tf.square(out - y))
            return out, loss, tape.gradient(loss, model.trainable_variables)

        return run(x, y)

    got, want = loss_and_grads(pm), loss_and_grads(seq)
    assert_all_close([got[0], got[1]], [want[0], want[1]])
    assert_all_close(got[2], want[2])
    assert None in _probes(pm)[0].traced


def _bn_layers():
    keras.utils.set_random_seed(9)
    return [
        NoEmpty(),
        keras.layers.BatchNormalization(momentum=0.5),
        NoEmpty(),
        keras.layers.Dense(3),
    ]


def _moving(model):
    return [w.numpy() for w in model.non_trainable_weights if "moving" in w.path]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_deferred_batch_norm_ignores_the_stand_in_examples(schedule):
    """Deferred moving statistics after batches of 10 and 3 (M=8) equal keras.Sequential's:
    a padded micro-batch's stand-in example is not pooled."""
    seq, pm = pair(_bn_layers, (None, 5), num_stages=2, num_micro_batches=8, **SCHEDULES[schedule])
    _compile(seq)
    _compile(pm)
    rng = np.random.RandomState(3)
    x, y = (rng.randn(13, 5) * 2 + 1).astype("float32"), rng.randn(13, 3).astype("float32")
    pm.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    seq.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert None in _probes(pm)[0].traced
    assert_all_close(_moving(pm), _moving(seq))


def test_per_micro_batch_batch_norm_skips_padded_micro_batches():
    """deferred_batch_norm=False, batches of 8 and 7, M=8: fifteen updates from one example
    each, as Keras would apply them; the padded micro-batch of the batch of 7 moves
    nothing, and every weight stays finite."""
    keras.utils.set_random_seed(4)
    probe = NoEmpty()
    layers = [probe, keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(2)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=1, num_micro_batches=8, deferred_batch_norm=False)
    pm.build((None, 4))
    _compile(pm)
    rng = np.random.RandomState(5)
    x, y = (rng.randn(15, 4) + 2).astype("float32"), rng.randn(15, 2).astype("float32")
    reference = keras.layers.BatchNormalization(momentum=0.5)
    reference.build((None, 4))
    for i in range(15):
        reference(x[i : i + 1], training=True)
    pm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert None in probe.traced  # the batch size was known only at run time: padded
    assert_all_close(_moving(pm), [reference.moving_mean.numpy(), reference.moving_variance.numpy()])
    assert all(np.all(np.isfinite(w)) for w in pm.get_weights())


def test_empty_mini_batch_passes_through_empty():
    """N == 0: the unsplit model sees an empty batch, so the micro-batches are empty too."""
    seq, pm = pair(
        lambda: [keras.layers.Dense(4), keras.layers.Dense(3)], (None, 5), num_stages=2, num_micro_batches=4
    )
    x = np.zeros((0, 5), "float32")
    assert tuple(pm(x).shape) == (0, 3)

    @tf.function(input_signature=[tf.TensorSpec((None, 5), tf.float32)])
    def run(x):
        return pm(x), seq(x)

    got, want = run(x)
    assert tuple(got.shape) == tuple(want.shape) == (0, 3)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_sum_reduced_loss_leaves_out_the_stand_in_examples(schedule):
    """A per-micro-batch loss reduced by 'sum' is not scaled by the micro-batch's share:
    a padded micro-batch's loss must still count for nothing."""
    make, in_shape, out_shape = CASES["conv2d"]
    seq, pm = pair(make, (None,) + in_shape, num_stages=2, num_micro_batches=8, **SCHEDULES[schedule])
    for model in (seq, pm):
        model.compile(
            optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.MeanSquaredError(reduction="sum")
        )
    x, y = _xy(13, in_shape, out_shape, seed=4)
    got = pm.fit(x, y, batch_size=10, shuffle=False, verbose=0).history["loss"]
    want = seq.fit(x, y, batch_size=10, shuffle=False, verbose=0).history["loss"]
    assert_all_close(got, want)
    assert_all_close(pm.get_weights(), seq.get_weights())
