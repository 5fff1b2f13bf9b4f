"""cluster.ReplicatedPipeline in one process: R=2 replicas x K=2 stages (and R=4 x K=1) on
the 4 logical CPUs, each replica's shard run by the training engine of PipelineModel.fit,
the stages' gradients averaged by collective all-reduces on the stages' own devices."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, partition_graphs

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


def _pair(devices, make, groups=None, **kwargs):
    """A ReplicatedPipeline and a keras.Sequential of the same layers and weights, compiled alike."""
    groups = groups or [devices[0:K], devices[K : 2 * K]]
    rp = cluster.ReplicatedPipeline(make, groups, input_shape=(None, 8), num_micro_batches=M, **kwargs)
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


def test_evaluate_adds_one_replicas_regularization(cpu_devices):
    """``evaluate`` runs replica 0: its loss adds replica 0's regularization, not every
    replica's (Keras' own test step reads the losses of every layer the model holds)."""
    rp, seq = _pair(cpu_devices, _make(regularizer=keras.regularizers.L2(0.1)), schedule="1f1b")
    x, y = data(20)
    rp.train_on_batch(x, y)
    seq.train_on_batch(x, y)
    np.testing.assert_allclose(rp.evaluate(x, y, verbose=0), seq.evaluate(x, y, verbose=0), rtol=1e-5)


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


def _devices(spec):
    d = tf.DeviceSpec.from_string(spec)
    return d.device_type, d.device_index


def test_four_replicas_of_one_stage_stay_identical_and_equal_the_unsplit_steps(cpu_devices):
    rp, seq = _pair(cpu_devices, _make(), groups=[[d] for d in cpu_devices])  # R=4 x K=1
    x, y = data(40)  # shards of 10 examples
    before = seq.get_weights()
    for _ in range(3):
        loss_rp = rp.train_on_batch(x, y)
        loss_seq = seq.train_on_batch(x, y)
    np.testing.assert_allclose(loss_rp, loss_seq, rtol=1e-5)
    assert_all_close(rp.replicas[0].get_weights(), seq.get_weights())
    for replica in rp.replicas[1:]:
        for a, b in zip(rp.replicas[0].get_weights(), replica.get_weights()):
            np.testing.assert_array_equal(a, b)
    assert max(np.abs(a - b).max() for a, b in zip(before, seq.get_weights())) > 1e-2


@pytest.mark.parametrize("shape", ["2x2", "4x1"])
def test_each_stage_all_reduces_one_packed_buffer_on_its_replicas_devices(cpu_devices, shape):
    R, K_ = map(int, shape.split("x"))
    groups = [cpu_devices[r * K_ : (r + 1) * K_] for r in range(R)]
    rp, _ = _pair(cpu_devices, _make(), groups=groups)
    x, y = data(10 * R)
    graphs = partition_graphs(lambda: rp.train_on_batch(x, y))
    collectives = [n for g in graphs for n in g.node if n.op == "CollectiveReduceV2"]
    # One all-reduce per device, i.e. per stage of each replica: the stage's gradients
    # travel as one buffer.
    assert sorted(_devices(n.device) for n in collectives) == sorted(_devices(d) for d in cpu_devices)
    for g in graphs:
        nodes = {n.name: n for n in g.node}
        for n in g.node:
            if n.op == "CollectiveReduceV2":
                # The buffer is packed on the collective's own device from gradients
                # computed there: no gradient comes in from another device first.
                packed = nodes[n.input[0]]
                assert packed.op == "ConcatV2" and packed.device == n.device
                assert not any(nodes[i.split(":")[0]].op == "_Recv" for i in packed.input), packed
                size = nodes[n.input[1]]
                assert size.op == "Const" and size.attr["value"].tensor.int_val == [R]


def test_the_all_reduce_moves_no_gradient_between_devices_but_its_own(cpu_devices):
    """The averaging alone, on gradients that live on the stages' devices: every device
    ends with the mean and no device ships its gradient to another as a tensor
    (ReductionToOneDevice would: to the first replica's device and back)."""
    groups = [cpu_devices[0:2], cpu_devices[2:4]]
    rp, _ = _pair(cpu_devices, _make(), groups=groups)
    variables = [r.trainable_variables for r in rp.replicas]

    @tf.function
    def step(fills):
        grads = []
        for r, replica in enumerate(variables):
            row = []
            for v in replica:
                with tf.device(v.value.device):
                    row.append(tf.fill(v.shape, fills[r]))
            grads.append(row)
        for replica, means in zip(variables, rp._all_reduce.mean(grads)):
            for v, mean in zip(replica, means):
                with tf.device(v.value.device):
                    v.assign(mean)

    # Only step's own graphs (those that read its argument): other functions that run
    # meanwhile may be recorded too.
    graphs = partition_graphs(lambda: step(tf.constant([1.0, 2.0])))
    graphs = [g for g in graphs if any(n.name.startswith("fills") for n in g.node)]
    assert len(graphs) == 4
    for g in graphs:
        moved = [
            n
            for n in g.node
            if n.op in ("_Send", "_Recv", "_HostSend", "_HostRecv") and n.attr["_src"].s != b"fills"
        ]  # the fill values go out from the caller's device: only gradients count
        assert not moved, [(n.op, n.device, n.attr["_src"].s, n.attr["_dst"].s) for n in moved]
    for replica in rp.replicas:
        for w in replica.get_weights():
            np.testing.assert_array_equal(w, np.full_like(w, 1.5))


def test_replicas_of_different_layers_are_refused_with_the_fix(cpu_devices):
    widths = iter([16, 8])

    def make():  # a different width on each call: the replicas' weights cannot be averaged
        return [keras.layers.Dense(next(widths)), keras.layers.Dense(3)]

    with pytest.raises(ValueError, match=r"replica 1's weights differ in shape.*same layers each call"):
        cluster.ReplicatedPipeline(make, [cpu_devices[0:2], cpu_devices[2:4]], input_shape=(None, 8))


def test_embedding_rows_reach_adam_as_the_unsplit_models(cpu_devices):
    """An Embedding's gradient is rows; Adam squares each row before adding up the rows of
    one index, so the replicas gather every replica's rows (on the devices of the stage that
    holds the table) rather than add them into one dense gradient."""

    def make():
        keras.utils.set_random_seed(3)
        return [keras.layers.Embedding(12, 6), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]

    rp = cluster.ReplicatedPipeline(make, [cpu_devices[0:2], cpu_devices[2:4]], input_shape=(None, 5),
                                    num_micro_batches=2, schedule="1f1b")  # fmt: skip
    seq = keras.Sequential([keras.Input((5,), dtype="int32")] + make())
    seq.set_weights(rp.replicas[0].get_weights())
    for model in (rp, seq):
        model.compile(
            optimizer=keras.optimizers.Adam(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.RandomState(0)
    x, y = rng.randint(0, 4, (12, 5)), rng.randint(0, 3, 12)  # few tokens: many repeated rows
    graphs = partition_graphs(lambda: rp.train_on_batch(x, y))
    seq.train_on_batch(x, y)
    rp.train_on_batch(x[::-1], y[::-1])  # the slots of the first step, read
    seq.train_on_batch(x[::-1], y[::-1])
    assert_all_close(rp.replicas[1].get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)
    gathers = sorted(n.device[-5:] for g in graphs for n in g.node if n.op == "CollectiveGatherV2")
    assert gathers == ["CPU:0"] * 3 + ["CPU:2"] * 3, gathers  # the table's stage, each replica
