"""cluster.ReplicatedPipeline in one process: R=2 replicas x K=2 stages on the 4 logical
CPUs, each replica's shard run by the training engine of PipelineModel.fit."""

import keras
import numpy as np
import pytest
from helpers import assert_all_close, data

from tf_gpipe import cluster, schedules, timeline

K, M = 2, 3  # shards of 10 examples: micro-batches of 4, 3 and 3


def _make(bn=False, out_dtype=None, regularizer=None):
    def make():
        keras.utils.set_random_seed(3)
        layers = [keras.layers.Dense(16, activation="tanh", kernel_regularizer=regularizer)]
        if bn:
            layers.append(keras.layers.BatchNormalization())
        layers += [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3, dtype=out_dtype)]
        return layers

    return make


def _pair(devices, make, **kwargs):
    """A ReplicatedPipeline and a keras.Sequential of the same layers and weights, compiled alike."""
    rp = cluster.ReplicatedPipeline(
        make, [devices[0:K], devices[K : 2 * K]], input_shape=(None, 8), num_micro_batches=M, **kwargs
    )
    seq = keras.Sequential(make())
    seq.build((None, 8))
    seq.set_weights(rp.replicas[0].get_weights())
    for model in (rp, seq):
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return rp, seq


def _by_device(spans):
    out = {}
    for sp in sorted(spans, key=lambda s: (s.device, s.start, s.end)):
        out.setdefault(sp.device, []).append((sp.kind, sp.stage, sp.micro_batch))
    return out


def test_1f1b_step_equals_one_sequential_step_on_the_whole_batch(cpu_devices):
    rp, seq = _pair(cpu_devices, _make(), schedule="1f1b")
    x, y = data(20)
    before = seq.get_weights()
    with timeline.record(rp.replicas[0]) as rec:
        loss_rp = rp.train_on_batch(x, y)
    loss_seq = seq.train_on_batch(x, y)
    np.testing.assert_allclose(loss_rp, loss_seq, rtol=1e-5)
    assert_all_close(rp.replicas[0].get_weights(), seq.get_weights())
    for a, b in zip(rp.replicas[0].get_weights(), rp.replicas[1].get_weights()):
        np.testing.assert_array_equal(a, b)
    assert max(np.abs(a - b).max() for a, b in zip(before, seq.get_weights())) > 1e-2
    # Replica 0 ran its shard in 1F1B order, each backward after its stage's replay.
    (spans,) = rec.steps()
    plan = schedules.get("1f1b", K, M)
    expected = {}
    for d, order in enumerate(plan.orders):
        row = []
        for a in order:
            if a.kind == "B":  # remat="always": the replay, then the backward proper
                row.append(("R", a.stage, a.micro_batch))
            row.append((a.kind, a.stage, a.micro_batch))
        expected[d] = row
    assert _by_device(spans) == expected


def test_gpipe_loss_adds_each_replicas_own_weight_regularizer_once(cpu_devices):
    rp, seq = _pair(cpu_devices, _make(regularizer=keras.regularizers.L2(0.1)))
    x, y = data(20)
    loss_rp = rp.train_on_batch(x, y)
    loss_seq = seq.train_on_batch(x, y)
    np.testing.assert_allclose(loss_rp, loss_seq, rtol=1e-5)
    assert_all_close(rp.replicas[0].get_weights(), seq.get_weights())


def test_deferred_batch_norm_moves_each_replicas_statistics_once_from_its_shard(cpu_devices):
    rp, _ = _pair(cpu_devices, _make(bn=True), schedule="1f1b")
    x, y = data(20)
    rp.train_on_batch(x, y)
    for r, replica in enumerate(rp.replicas):
        # The unsplit model on replica r's shard: its BatchNorm moves once, from the shard.
        alone = keras.Sequential(_make(bn=True)())
        alone.build((None, 8))
        alone.compile(optimizer=keras.optimizers.SGD(0.5), loss=rp.loss)
        alone.train_on_batch(x[10 * r : 10 * (r + 1)], y[10 * r : 10 * (r + 1)])
        (bn,) = [la for la in replica.stage_layers if isinstance(la, keras.layers.BatchNormalization)]
        (ref,) = [la for la in alone.layers if isinstance(la, keras.layers.BatchNormalization)]
        assert_all_close([bn.moving_mean, bn.moving_variance], [ref.moving_mean, ref.moving_variance])


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_float16_scales_the_loss_and_equals_the_unsplit_step(cpu_devices, mixed_float16):
    rp, seq = _pair(cpu_devices, _make(out_dtype="float32"), schedule="1f1b")
    assert type(rp.optimizer).__name__ == "LossScaleOptimizer"
    x, y = data(20)
    before = seq.get_weights()
    loss_rp = rp.train_on_batch(x, y)
    loss_seq = seq.train_on_batch(x, y)
    # LossScaleOptimizer.apply_gradients divides by the loss scale: without scale_loss in
    # each replica's backward, the update would be 2**15 times too small.
    tol = 1e-3  # float16 products round differently per shard and micro-batch
    np.testing.assert_allclose(loss_rp, loss_seq, rtol=tol)
    assert_all_close(rp.replicas[0].get_weights(), seq.get_weights(), rtol=tol, atol=tol)
    assert max(np.abs(a - b).max() for a, b in zip(before, seq.get_weights())) > 10 * tol
