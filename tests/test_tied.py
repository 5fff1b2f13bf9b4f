"""A weight two stages share (an embedding tied to the output head): it lives on the last
stage that uses it, the others read it from there, and its gradient is the sum of every
stage's part, made on its device before its one update."""

import collections
import warnings

import keras
import numpy as np
import pytest
from helpers import TiedHead, assert_all_close, partition_graphs, same_device

import tf_gpipe
from tf_gpipe import cluster


def tied_layers():
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(30, 8, name="tok")
    return [
        keras.Input((5,), dtype="int32"),
        embedding,
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(8),
        TiedHead(embedding, name="head"),
    ]


def _data(n=11):  # batches of 5, 5, 1: micro-batches of unequal sizes
    rng = np.random.RandomState(0)
    return rng.randint(0, 30, (n, 5)).astype("int32"), rng.randint(0, 30, (n, 5))


def _compile(*models):
    for m in models:
        m.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )


def _pipeline(**kwargs):
    with pytest.warns(UserWarning, match="layer 'tok' is used in stages \\[0, .*the last that uses it"):
        return tf_gpipe.PipelineModel(tied_layers(), **kwargs)


@pytest.mark.parametrize(
    "schedule,remat,loops,M,K",
    [
        ("gpipe", "never", True, 3, 2),
        ("1f1b", "always", False, 2, 3),
        ("zb-h1", "never", False, 1, 2),  # its weight half differentiates the graph itself
        ("zb-h1", "except_last", True, 3, 3),
        ("interleaved", "always", True, 4, 2),
    ],
)
def test_a_weight_tied_across_stages_trains_as_the_unsplit_model(schedule, remat, loops, M, K, cpu_devices):
    seq = keras.Sequential(tied_layers())
    v = 2 if schedule == "interleaved" else 1
    pm = _pipeline(num_stages=K, virtual_stages=v, num_micro_batches=M, schedule=schedule, remat=remat,
                   micro_batch_loops=loops, devices=cpu_devices[1 : K + 1])  # fmt: skip
    x, y = _data()
    pm.build((None, 5))
    pm.set_weights(seq.get_weights())
    assert len(pm.trainable_variables) == len(seq.trainable_variables)  # one embedding
    _compile(seq, pm)
    a = seq.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-4, atol=1e-6)
    assert_all_close([pm.predict(x, verbose=0)], [seq.predict(x, verbose=0)], rtol=1e-5, atol=1e-6)
    assert len(pm.weights) == len(seq.weights)  # the stages' copies are no weights of the model


@pytest.mark.parametrize("loops", [True, False])
def test_a_tied_weight_lives_on_its_last_stage_and_its_gradient_is_summed_there(loops, cpu_devices):
    devices = cpu_devices[1:4]
    pm = _pipeline(num_stages=3, num_micro_batches=2, devices=devices, micro_batch_loops=loops)
    pm.build((None, 5))
    table = next(v for v in pm.trainable_variables if "tok" in v.path)
    assert same_device(table.value.device, devices[2])
    _compile(pm)
    x, y = _data(10)
    nodes = collections.defaultdict(list)
    for g in partition_graphs(lambda: pm.train_on_batch(x, y)):
        for n in g.node:
            nodes[n.device.split("/")[-1].replace("device:", "")].append((n.op, n.name))
    # The sum of the parts (stage 0's rows, stage 2's dense matrix) on the embedding's device;
    # elsewhere only what the partitioner adds to carry a control edge ("_<n>" nodes).
    summed = collections.defaultdict(list)
    for d, ns in nodes.items():
        summed[d] += [
            op for op, n in ns if "shared_gradient_sum/" in n and not n.split("/")[-1].startswith("_")
        ]
    assert "AddV2" in summed["CPU:3"] and not any(v for d, v in summed.items() if d != "CPU:3"), summed


def test_a_stage_reads_its_copy_of_a_weight_another_stage_holds(cpu_devices):
    """Stage 0's lookup reads the embedding where it runs, from a copy made once a step:
    reading the weight itself, on the last stage's device, would move the whole matrix there
    at every micro-batch and pass (benchmarks/cluster/README.md). The loops inline the stage
    calls, so their reads show in the partition graphs by name (built out, the same calls
    run as functions of their own)."""
    devices = cpu_devices[1:4]
    pm = _pipeline(num_stages=3, num_micro_batches=3, devices=devices, micro_batch_loops=True)
    pm.build((None, 5))
    _compile(pm)
    x, y = _data(10)
    reads = collections.defaultdict(list)
    for g in partition_graphs(lambda: pm.train_on_batch(x, y)):
        for n in g.node:
            if n.op in ("ReadVariableOp", "ResourceGather") and "stage0" in n.name:
                reads[n.device.split("/")[-1].replace("device:", "")].append(n.name)
    assert reads["CPU:1"] and set(reads) == {"CPU:1"}, dict(reads)


def test_a_tied_weight_needs_no_balance_of_its_own(cpu_devices):
    # The first and the last layer share it: no cut keeps them together, so the even
    # split runs, with the warning; a balance given that cuts between them runs too.
    with pytest.warns(UserWarning, match="'tok' is used in stages \\[0, 1\\]"):
        tf_gpipe.PipelineModel(tied_layers(), num_stages=2, devices=cpu_devices[1:3])
    with pytest.warns(UserWarning, match="'tok' is used in stages \\[0, 2\\]"):
        pm = tf_gpipe.PipelineModel(tied_layers(), balance=[1, 2, 2], devices=cpu_devices[1:4])
    assert pm.balance == [1, 2, 2]
    with warnings.catch_warnings():  # all in one stage: nothing to say
        warnings.simplefilter("error")
        tf_gpipe.PipelineModel(tied_layers(), num_stages=1, devices=cpu_devices[1:2])


def test_replicas_of_a_tied_pipeline_train_as_the_unsplit_model(cpu_devices):
    def make():
        return tied_layers()[1:]

    seq = keras.Sequential(tied_layers())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rp = cluster.ReplicatedPipeline(make, [cpu_devices[0:2], cpu_devices[2:4]], input_shape=(None, 5),
                                        num_micro_batches=2, schedule="zb-h1", remat="never")  # fmt: skip
    seq.set_weights(rp.replicas[0].get_weights())
    _compile(seq, rp)
    x, y = _data(12)  # shards of equal size
    a = seq.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"]
    b = rp.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    for replica in rp.replicas:
        assert_all_close(replica.get_weights(), seq.get_weights(), rtol=1e-4, atol=1e-6)
