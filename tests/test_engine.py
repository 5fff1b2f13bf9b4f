"""Every schedule trains exactly like the unsplit model."""

import itertools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, mlp_layers, pair

import tf_gpipe
from tf_gpipe import engine, microbatch, schedules, trainer

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

SCHEDULE_CASES = [
    # schedule, K, M, v, remat, batch_size (24 examples: uneven last batches)
    ("1f1b", 4, 8, 1, "except_last", 7),  # last batch of 3 < M: empty micro-batches
    ("1f1b", 3, 3, 1, "never", 9),
    ("zb-h1", 4, 8, 1, "except_last", 7),
    ("interleaved", 2, 4, 2, "always", 10),
    ("interleaved", 3, 3, 2, "never", 8),
    ("interleaved", 2, 2, 3, "always", 5),
    ("gpipe", 2, 3, 1, "always", 10),
]


def _compile(model, **kw):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=kw.pop("loss", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        metrics=["accuracy"],
        **kw,
    )


@pytest.mark.parametrize("schedule,K,M,v,remat,batch_size", SCHEDULE_CASES)
def test_every_schedule_fits_like_unsplit(schedule, K, M, v, remat, batch_size):
    seq, pm = pair(
        lambda: mlp_layers(depth=5),
        (None, 8),
        num_stages=K,
        num_micro_batches=M,
        remat=remat,
        schedule=schedule,
        virtual_stages=v,
    )
    assert len(pm.cells) == K * v
    assert [c.device for c in pm.cells] == [pm.devices[s % K] for s in range(K * v)]
    x, y = data(24)
    w = np.linspace(0.5, 1.5, 24).astype("float32")
    hist = []
    for model in (seq, pm):
        _compile(model)
        hist.append(
            model.fit(x, y, sample_weight=w, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        )
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hist[0].history["loss"], hist[1].history["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist[0].history["accuracy"], hist[1].history["accuracy"])
    assert int(pm.optimizer.iterations) == int(seq.optimizer.iterations)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_layer_losses_and_regularizers_counted_once(schedule):
    def make():
        keras.utils.set_random_seed(8)
        return [
            keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05)),
            keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(3, bias_regularizer=keras.regularizers.L1(0.02)),
        ]

    seq, pm = pair(make, (None, 8), num_stages=3, num_micro_batches=4, schedule=schedule)
    x, y = data(16)
    hist = []
    for model in (seq, pm):
        _compile(model)
        hist.append(model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"])
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist[0], hist[1], rtol=1e-5)


def test_1f1b_with_sum_reduction():
    seq, pm = pair(mlp_layers, (None, 8), num_stages=2, num_micro_batches=4, schedule="1f1b")
    x, y = data(12)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    for model in (seq, pm):
        _compile(model, loss=loss)
        model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_per_micro_batch_schedules_refuse_a_loss_they_cannot_split(schedule):
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=2, schedule=schedule)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
    _compile(pm, loss=loss)
    x, y = data(8)
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        pm.fit(x, y, sample_weight=np.ones(8), batch_size=8, epochs=1, verbose=0)


def test_dropout_and_batchnorm_replayed_under_1f1b_and_zb_h1():
    """The replay of each half of zb-h1's split backward reads the state the forward read
    (dropout seeds, BatchNormalization statistics): re-materialized training equals
    training on a tape, and both equal 1F1B's, whose forwards run in the same order.
    Dropout and BatchNormalization sit in the second stage: zb-h1 replays them in its B
    (input gradients) and in its W (weight gradients); the first stage's B computes nothing."""

    def make():
        keras.utils.set_random_seed(21)
        return [
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dropout(0.4, seed=3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(3),
        ]

    x, y = data(20)
    weights = []
    for schedule in ("1f1b", "zb-h1"):
        for remat in ("never", "always"):
            keras.backend.clear_session()
            pm = tf_gpipe.PipelineModel(
                make(), balance=[1, 4], num_micro_batches=4, remat=remat, schedule=schedule,
                micro_batch_loops=True,  # both schedules as loops: the same sums, in the same order
            )  # fmt: skip
            # Without XLA (which a GPU's stages get by default): its fusions round each
            # function its own way, ~1e-5 apart after two epochs, and exact replay is the
            # subject here.
            _compile(pm, jit_compile=False)
            pm.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
            weights.append(pm.get_weights())  # BatchNormalization's moving statistics too
    for other in weights[1:]:
        assert_all_close(weights[0], other, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat,M", [("always", 4), ("never", 4), ("always", 1)])
def test_zb_h1_step_matches_sequential(remat, M, stage_traces):
    """One zb-h1 step, K=4 (devices 1..3 run lagging W's), 10 examples in micro-batches of
    3, 3, 2, 2: outputs, loss and gradients, then the weights after the update, equal
    keras.Sequential's. With M=1 the gradients are returned, not summed."""
    seq, pm = pair(
        lambda: mlp_layers(depth=5),
        (None, 8),
        num_stages=4,
        num_micro_batches=M,
        remat=remat,
        schedule="zb-h1",
    )
    x, y = data(10)
    for model in (seq, pm):
        _compile(model)
    with tf.GradientTape() as tape:
        out = seq(x, training=True)
        loss = LOSS(y, out)
    want = tape.gradient(loss, seq.trainable_variables)
    gradients = tf.function(lambda a, b: trainer.gradients(pm, (a, b)), autograph=False)
    step = gradients(tf.constant(x), tf.constant(y))
    assert_all_close([step.y_pred, step.loss], [out, loss], rtol=1e-5, atol=1e-6)
    assert all(g is not None for g in step.grads)
    assert_all_close(step.grads, want, rtol=1e-5, atol=1e-6)
    for model in (seq, pm):
        model.train_on_batch(x, y)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)
    # B and W are separate calls, never one full backward. Stage 0's B computes nothing; its
    # W replays the stage for the weight gradients. Every other re-materialized stage's B
    # replays it split (``stash.replay``): the W reads that replay, no backward of its own.
    traces = stage_traces(pm)
    halves = [t["halves"] for t in traces]
    if remat == "always":
        assert halves == [{(False, True)}] + [set()] * 3
        assert [t["replays"] > 0 for t in traces] == [False] + [True] * 3
    else:
        assert halves == [set()] * 4  # the taped call's split halves (``tf_gpipe.stash``)


def test_schedule_arguments_are_checked_up_front():
    with pytest.raises(ValueError, match="valid names"):
        tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, schedule="zero_bubble")
    with pytest.raises(ValueError, match="interleaved"):
        tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, virtual_stages=2)
    with pytest.raises(ValueError, match="multiple of num_devices"):
        tf_gpipe.PipelineModel(
            mlp_layers(), num_stages=2, num_micro_batches=3, schedule="interleaved", virtual_stages=2
        )
    with pytest.raises(ValueError, match="virtual_stages must be an integer"):
        tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, schedule="interleaved", virtual_stages=0)


def test_layer_losses_in_custom_training_loop():
    def make():
        keras.utils.set_random_seed(8)
        return [
            keras.layers.Dense(8, activation="relu", activity_regularizer=keras.regularizers.L2(0.05)),
            keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.01)),
        ]

    seq, pm = pair(make, (None, 8), num_stages=2, num_micro_batches=3)
    x, y = data(10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = []
    for model in (seq, pm):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = loss_fn(y, out) + tf.add_n(model.losses)
        results.append((loss, tape.gradient(loss, model.trainable_weights)))
    assert_all_close([results[0][0]], [results[1][0]])
    assert_all_close(results[0][1], results[1][1])


class _Probe:
    """A stand-in for the timeline recorder: one op per marker, to read the step's graph."""

    def __init__(self):
        self.ops = {}

    def marker(self, label, device, deps):
        with tf.control_dependencies([t for t in deps if t is not None]):
            token = tf.identity(tf.zeros(()))
        if isinstance(label, str):  # not the replay markers inside the stage functions
            self.ops[label] = token.op
        return token


def _ancestors(op):
    """Every op ``op`` waits for, through data and control inputs."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("remat", ["always", "never"])
def test_zb_h1_chains_each_action_after_the_previous_one_on_its_device(remat):
    """In the step's graph each action (F, B or W) starts only once the action before it on
    its device has ended: W's are in the chain like the others, and each after its B. (The
    graph is read, not timed: tf.function's automatic control dependencies would also order
    the calls of one stage, which hides a missing link from any run.)"""
    K, M = 4, 6
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=5), num_stages=K, num_micro_batches=M, remat=remat, schedule="zb-h1"
    )
    pm.build((None, 8))
    _compile(pm)
    probe = pm.tracer = _Probe()
    x, y = data(10)
    step = tf.function(lambda a, b: trainer.gradients(pm, (a, b)).loss, autograph=False)
    step.get_concrete_function(tf.constant(x), tf.constant(y))
    plan = schedules.get("zb-h1", K, M)
    for order in plan.orders:
        for a, b in itertools.pairwise(order):
            assert probe.ops[f"end {a!r}"] in _ancestors(probe.ops[f"start {b!r}"]), (a, b)


@pytest.mark.parametrize("K,M,v", [(3, 3, 1), (2, 4, 2)])
def test_call_builds_the_schedules_forwards_in_its_order_on_their_devices(K, M, v):
    """``__call__`` under a tape builds each (stage, micro-batch) forward once, in the order of
    the GPipe schedule over every cell (``engine.run_forward``), each on its cell's device:
    re-materialized stages and the taped last one alike."""
    kwargs = {"schedule": "interleaved", "virtual_stages": v} if v > 1 else {}
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=5), num_stages=K, num_micro_batches=M, remat="except_last", **kwargs
    )
    pm.build((None, 8))

    def grads(x):
        with tf.GradientTape() as tape:
            y = pm(x, training=True)
        return tape.gradient(y, pm.trainable_variables)

    graph = tf.function(grads).get_concrete_function(tf.TensorSpec((9, 8))).graph
    built = []  # (stage, micro-batch, device) of each forward's stage call, as the graph holds them
    for op in graph.get_operations():
        scope = re.search(r"(?:^|/)stage(\d+)_mb(\d+)/", op.name)
        if scope and op.type in ("StatefulPartitionedCall", "PartitionedCall"):
            s, m = int(scope[1]), int(scope[2])
            if (s, m) not in [b[:2] for b in built]:
                built.append((s, m, op.device))
    plan = schedules.gpipe(K * v, M)
    expected = [(a.stage, a.micro_batch) for a in plan.topological_order() if a.kind == "F"]
    assert [b[:2] for b in built] == expected
    devices = [c.device for c in pm.cells]
    assert [tf.DeviceSpec.from_string(d).to_string() for _, _, d in built] == [
        tf.DeviceSpec.from_string(devices[s]).to_string() for s, _ in expected
    ]


def test_a_schedule_for_another_shape_is_refused():
    """The engine builds a step, or a forward, only from a schedule for as many stages and
    micro-batches as the model has."""
    pm = tf_gpipe.PipelineModel(mlp_layers(depth=3), num_stages=2, num_micro_batches=2)
    pm.build((None, 8))
    split = microbatch.split(tf.zeros([4, 8]), 2)
    wrong = schedules.get("gpipe", 2, 3)
    with pytest.raises(ValueError, match=r"is for 2 stages x 3 micro-batches, the model has 2 x 2"):
        engine.run_schedule(wrong, pm.cells, split, [None, None], pm.pipeline.rematerializes)
    with pytest.raises(ValueError, match=r"is for 2 stages x 3 micro-batches, the model has 2 x 2"):
        engine.run_forward(wrong, pm.cells, split, [None, None], False, pm.pipeline.rematerializes)
