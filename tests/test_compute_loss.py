"""A compute_loss override on a PipelineModel subclass is honoured by every schedule, or refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close
from keras import ops

import tf_gpipe
from tf_gpipe import micro_batch_loop

# (schedule, M, virtual_stages): batches of 10 cut unevenly (4, 3, 3 and 3, 3, 2, 2).
SCHEDULES = [("gpipe", 3, 1), ("1f1b", 3, 1), ("zb-h1", 3, 1), ("interleaved", 4, 2)]


class _Penalized:
    """The override of issue #27: a mean over examples, added to the compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return base + 100.0 * ops.mean(y_pred**2)


class _BatchStatistic:
    """An override that is not a mean over examples: the spread of the outputs over the batch."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return base + 10.0 * ops.mean(ops.var(y_pred, axis=0))


def _layers():
    keras.utils.set_random_seed(0)
    # A kernel regularizer: Keras' compute_loss adds it, once per mini-batch.
    return [
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ]


def _pair(override, schedule, M, v, loops="auto"):
    seq = type("Seq", (override, keras.Sequential), {})(_layers())
    seq.build((None, 5))
    pm = type("Pipe", (override, tf_gpipe.PipelineModel), {})(
        _layers(),
        num_stages=2,
        num_micro_batches=M,
        schedule=schedule,
        virtual_stages=v,
        micro_batch_loops=loops,
    )
    pm.build((None, 5))
    pm.set_weights(seq.get_weights())
    for m in (seq, pm):
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return seq, pm


def _data(n=20):
    rng = np.random.RandomState(0)
    return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n)


@pytest.mark.parametrize("loops", [True, False])
@pytest.mark.parametrize("schedule,M,v", SCHEDULES)
def test_override_trains_as_keras_sequential(schedule, M, v, loops, monkeypatch):
    """Built out or as loops over micro-batches (the override's gradients w.r.t. the
    weights, the kernel regularizer's, summed over the micro-batches as the loss is)."""
    looped = []
    original = micro_batch_loop.run
    monkeypatch.setattr(micro_batch_loop, "run", lambda *a, **k: looped.append(1) or original(*a, **k))
    seq, pm = _pair(_Penalized, schedule, M, v, loops)
    x, y = _data()
    a = seq.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    assert bool(looped) == loops
    assert a[0] > 5.0  # the penalty dominates: a schedule ignoring it would report ~1.2
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-5)


class _Tracked(_Penalized):
    """An override that also updates a tracker of its own (as Keras' VAE example does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.penalty_calls = keras.metrics.Sum(name="penalty_calls")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.penalty_calls.update_state(1.0)
        return super().compute_loss(x, y, y_pred, sample_weight, training=training)


@pytest.mark.parametrize("loops", [True, False])
def test_what_an_override_updates_happens_once_per_micro_batch(loops):
    """The override runs once per micro-batch, and once on the whole mini-batch (the check
    that the micro-batches' losses add up to it), its side effects too: inside the loops,
    where no automatic control dependency orders them, each micro-batch's loss comes after
    the previous one's, and what it updates before its value is read."""
    _, pm = _pair(_Tracked, "1f1b", 3, 1, loops)
    x, y = _data()
    pm.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)  # 2 steps of 3 micro-batches
    assert float(pm.penalty_calls.result()) == 2 * (3 + 1)


def test_override_is_used_by_evaluate_under_1f1b():
    seq, pm = _pair(_Penalized, "1f1b", 3, 1)
    x, y = _data(10)
    np.testing.assert_allclose(pm.evaluate(x, y, verbose=0), seq.evaluate(x, y, verbose=0), rtol=1e-5)


def test_batch_statistic_override_under_gpipe():
    seq, pm = _pair(_BatchStatistic, "gpipe", 3, 1)
    x, y = _data()
    a = seq.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule,M,v", [("1f1b", 3, 1), ("interleaved", 4, 2)])
def test_batch_statistic_override_per_micro_batch_is_refused(schedule, M, v):
    _, pm = _pair(_BatchStatistic, schedule, M, v)
    before = pm.get_weights()
    x, y = _data(10)
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
    message = str(err.value).replace("\\'", "'")  # the assertion escapes quotes
    assert "_BatchStatistic.compute_loss" not in message  # named by the model's class
    assert "Pipe.compute_loss is not" in message and "schedule='gpipe'" in message
    assert_all_close(pm.get_weights(), before, rtol=0, atol=0)  # nothing trained


def test_override_on_a_replicated_pipeline_is_refused(cpu_devices):
    from tf_gpipe import cluster

    model = type("Replicated", (_Penalized, cluster.ReplicatedPipeline), {})(
        _layers, [cpu_devices[0:2], cpu_devices[2:4]], input_shape=(None, 5), num_micro_batches=2
    )
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    with pytest.raises(ValueError, match=r"Replicated overrides compute_loss.*add_loss"):
        model.fit(x, y, batch_size=10, verbose=0)


class _Counting(_Penalized):
    """An override that writes a variable of its own, not a Keras metric."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = keras.Variable(0.0, trainable=False)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.calls.assign_add(1.0)
        return super().compute_loss(x, y, y_pred, sample_weight, training=training)


def test_an_override_writing_other_state_in_the_loops_is_refused():
    _, pm = _pair(_Counting, "1f1b", 3, 1, True)
    before = pm.get_weights()
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"changes state other than Keras metrics.*micro_batch_loops=False"):
        pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert_all_close(pm.get_weights(), before, rtol=0, atol=0)
    _, pm = _pair(_Counting, "1f1b", 3, 1, False)  # built out: runs, once per micro-batch and the check
    pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert float(pm.calls.numpy()) == 3 + 1
