"""A compute_loss override on a PipelineModel subclass is honoured by every schedule, or refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close
from keras import ops

import tf_gpipe

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


def _pair(override, schedule, M, v):
    seq = type("Seq", (override, keras.Sequential), {})(_layers())
    seq.build((None, 5))
    pm = type("Pipe", (override, tf_gpipe.PipelineModel), {})(
        _layers(), num_stages=2, num_micro_batches=M, schedule=schedule, virtual_stages=v
    )
    pm.build((None, 5))
    pm.set_weights(seq.get_weights())
    for m in (seq, pm):
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return seq, pm


def _data(n=20):
    rng = np.random.RandomState(0)
    return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n)


@pytest.mark.parametrize("schedule,M,v", SCHEDULES)
def test_override_trains_as_keras_sequential(schedule, M, v):
    seq, pm = _pair(_Penalized, schedule, M, v)
    x, y = _data()
    a = seq.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"]
    assert a[0] > 5.0  # the penalty dominates: a schedule ignoring it would report ~1.2
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-5)


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
