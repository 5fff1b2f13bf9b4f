"""The optimizer update runs on the stages' devices, and still equals keras.Sequential's.

Stages sit on CPU:1..3; CPU:0 is the default device (tests/conftest.py), where no stage
lives. Keras' default-strategy path would put every stage's update there; each test
reads the partition graphs that ran.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, mlp_layers, pair, partition_graphs, same_device

import tf_gpipe
from tf_gpipe import trainer, update
from tf_gpipe.cell import move_variables

# Through whole pipelined steps (the cost of a test is its traces): the optimizers the
# step's placement differs for. Every other optimizer and option: the direct test below.
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
}


def _ran(fn):
    """Run ``fn()`` and return {device: [(op type, node name), ...]} of what ran."""
    nodes = collections.defaultdict(list)
    for partition in partition_graphs(fn):
        for node in partition.node:
            nodes[node.device.split("/")[-1].replace("device:", "")].append((node.op, node.name))
    return nodes


def _stage_pair(optimizer, cpu_devices):
    seq, pm = pair(
        lambda: mlp_layers(width=6, depth=4),
        (None, 8),
        devices=cpu_devices[1:],
        balance=[2, 2, 1],
        num_micro_batches=3,
    )
    seq.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pm.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return seq, pm


def _optimizer_ops(nodes, optimizer, extra=()):
    """The ops made in ``optimizer``'s name scopes (a LossScaleOptimizer's and its inner
    optimizer's, wherever they nest), those under the ``extra`` top-level scopes, and any
    IdentityN (the default strategy's all-reduce)."""
    scopes = {o.name for o in (optimizer, getattr(optimizer, "inner_optimizer", None)) if o}

    def ours(op, name):
        parts = name.split("/")
        return op == "IdentityN" or parts[0] in extra or bool(scopes.intersection(parts))

    return {dev: [n for n in ns if ours(*n)] for dev, ns in nodes.items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_update_runs_on_its_stage_device(name, cpu_devices):
    seq, pm = _stage_pair(OPTIMIZERS[name], cpu_devices)
    x, y = data(10)  # 10 rows in 3 micro-batches: 4, 3, 3
    nodes = _ran(lambda: pm.train_on_batch(x, y))
    seq.train_on_batch(x, y)
    ops = _optimizer_ops(nodes, pm.optimizer)
    assert not ops.get("CPU:0"), f"optimizer ops on CPU:0, where no stage lives: {ops['CPU:0'][:10]}"
    # No all-reduce without a strategy: an IdentityN would route every gradient through one device.
    assert not [n for ns in nodes.values() for n in ns if n[0] == "IdentityN"]
    for device in ("CPU:1", "CPU:2", "CPU:3"):
        assigns = [n for n in ops.get(device, []) if n[0].startswith("Assign")]
        assert assigns, f"no optimizer update on {device}: {sorted(ops)}"
    x2, y2 = data(10, seed=1)  # a second step reads the first one's slots
    pm.train_on_batch(x2, y2)
    seq.train_on_batch(x2, y2)
    assert_all_close(pm.get_weights(), seq.get_weights())
    assert_all_close([v for v in pm.optimizer.variables], [v for v in seq.optimizer.variables])


def test_loss_scale_optimizer_updates_on_stage_devices(mixed_float16, cpu_devices):
    seq, pm = _stage_pair(lambda: keras.optimizers.Adam(0.01), cpu_devices)
    assert isinstance(pm.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = data(10)
    nodes = _ran(lambda: pm.train_on_batch(x, y))
    seq.train_on_batch(x, y)
    ops = _optimizer_ops(nodes, pm.optimizer, extra=("cond",))  # its tf.cond on finite gradients
    assert not ops.get("CPU:0"), f"optimizer ops on CPU:0, where no stage lives: {ops['CPU:0'][:10]}"
    for device in ("CPU:1", "CPU:2", "CPU:3"):
        assert any(n[0].startswith("Assign") for n in ops.get(device, [])), device
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-3, atol=1e-3)


def test_optimizer_scalars_live_on_the_first_stage(cpu_devices):
    _, pm = _stage_pair(lambda: keras.optimizers.Adam(0.01), cpu_devices)
    assert pm.optimizer.iterations.value.device.endswith("CPU:1")
    assert pm.optimizer.learning_rate.value.device.endswith("CPU:1")
    x, y = data(10)
    pm.train_on_batch(x, y)
    assert int(pm.optimizer.iterations.numpy()) == 1


def test_eager_step_updates_on_stage_devices(cpu_devices):
    """``run_eagerly=True``: no graph to place, each variable's update_step is scoped."""
    seq, pm = pair(
        lambda: mlp_layers(width=6, depth=2), (None, 8), devices=cpu_devices[1:3], num_micro_batches=2
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    seq.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, run_eagerly=True)
    x, y = data(5)
    pm.train_on_batch(x, y)
    seq.train_on_batch(x, y)
    for v in pm.optimizer.variables[2:]:  # the slots: beside their variables
        assert not v.value.device.endswith("CPU:0"), v.path
    assert_all_close(pm.get_weights(), seq.get_weights())
    np.testing.assert_equal(int(pm.optimizer.iterations.numpy()), 1)


EVERY_OPTIMIZER = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=2),
    "sgd_accumulation": lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.05, clipnorm=0.3),
    "rmsprop_clipvalue": lambda: keras.optimizers.RMSprop(0.01, clipvalue=0.02),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
}


def _steps(opt, ours, ref, theirs, devices):
    @tf.function
    def ours_step(g0, g1):
        with tf.device(devices[0]):
            a = tf.identity(g0)
        with tf.device(devices[1]):
            b = tf.identity(g1)
        update.apply(opt, [a, b], ours)

    @tf.function
    def their_step(g0, g1):
        ref.apply_gradients(zip([g0, g1], theirs))

    return ours_step, their_step


def test_every_keras_optimizer_updates_on_its_variables_devices(cpu_devices):
    """The update of two variables on CPU:1 and CPU:2, optimizer by optimizer: no op of it
    on CPU:0, and the same values as Keras' own apply_gradients on CPU:0."""
    rng = np.random.RandomState(0)
    start = [rng.randn(3, 4).astype("float32"), rng.randn(4).astype("float32")]
    grads = [[rng.randn(*w.shape).astype("float32") for w in start] for _ in range(3)]
    misplaced = {}
    for name, make in EVERY_OPTIMIZER.items():
        ours = [keras.Variable(w) for w in start]
        for v, device in zip(ours, cpu_devices[1:3]):
            move_variables([v], device)
        theirs = [keras.Variable(w) for w in start]
        opt, ref = make(), make()
        update.place_optimizer(opt, cpu_devices[1])
        opt.build(ours)
        update.place_optimizer(opt, cpu_devices[1])
        ref.build(theirs)

        ours_step, their_step = _steps(opt, ours, ref, theirs, cpu_devices[1:3])

        for g in grads:
            their_step(*g)
        for g in grads:  # after Keras' own steps: the run metadata holds ours alone
            nodes = _ran(lambda g=g, step=ours_step: step(*g))
            ops = _optimizer_ops(nodes, opt, extra=("cond",))
            if ops.get("CPU:0"):
                misplaced[name] = ops["CPU:0"][:5]
        assert_all_close(ours, theirs, rtol=1e-6, atol=1e-6)
        assert_all_close(opt.variables, ref.variables, rtol=1e-6, atol=1e-6)
    assert not misplaced, f"optimizer ops on CPU:0, where no variable lives: {misplaced}"


class _PerWeightRate(keras.optimizers.SGD):
    """SGD handing each weight's update its own learning rate (a rate multiplier per
    weight, as layer-wise rates are written): a rate read once per device must stay each
    weight's own."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for k, (g, v) in enumerate(zip(grads, trainable_variables)):
            self.update_step(g, v, learning_rate * (k + 1))


def test_each_weight_keeps_the_learning_rate_its_optimizer_hands_it(cpu_devices):
    """Two weights on one device, updated with different learning rates, as Keras' own
    apply_gradients updates them."""
    rng = np.random.RandomState(0)
    start = [rng.randn(3, 4).astype("float32"), rng.randn(4).astype("float32")]
    ours, theirs = [keras.Variable(w) for w in start], [keras.Variable(w) for w in start]
    move_variables(ours, cpu_devices[1])
    opt, ref = (_PerWeightRate(0.1, name="per_weight_rate") for _ in "ab")
    update.place_optimizer(opt, cpu_devices[1])
    opt.build(ours)
    ref.build(theirs)
    ours_step, their_step = _steps(opt, ours, ref, theirs, [cpu_devices[1]] * 2)
    g = [rng.randn(*w.shape).astype("float32") for w in start]
    ours_step(*g)
    their_step(*g)
    assert_all_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_each_device_reads_the_step_count_and_learning_rate_once(cpu_devices):
    """Adam's update of each weight reads the step count and the learning rate, which live
    on device 0: read once per device and step, each crosses to a stage's device once, not
    once per weight (read from the partition graphs that ran: a ``_Send`` of a variable's
    read from CPU:0 to each other device)."""
    x, y = data(12)
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=5), num_stages=3, num_micro_batches=3, devices=cpu_devices[:3], schedule="1f1b"
    )
    pm.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, y))
    nodes = {n.name: n for g in graphs for n in g.node}
    reads = collections.Counter()  # the optimizer's (the loss metric's are read beside the loss)
    for n in nodes.values():
        source = nodes.get(n.input[0].split(":")[0]) if n.op == "_Send" and n.input else None
        if source is None or not source.name.startswith(f"{pm.optimizer.name}/"):
            continue
        if source.op == "ReadVariableOp" and same_device(source.device, cpu_devices[0]):
            reads[n.attr["recv_device"].s.decode()[-5:]] += 1
    weights = [len(c.trainable_variables) for c in pm.cells]
    assert weights[1] > 2 and weights[2] > 2  # once per weight would show
    assert reads == {"CPU:1": 2, "CPU:2": 2}, reads


def test_update_waits_for_every_gradient_through_one_op(cpu_devices):
    """The update starts once every gradient is made, and each of its ops waits through
    one control edge, not one per gradient or per device: a loop step's summed gradients
    are each read by an op of their own, ~70 of them at K=4, on each of ~1,000 ops."""
    devices = cpu_devices[1:3]
    ours = [keras.Variable(np.ones((3,), "float32")) for _ in range(6)]
    for i, v in enumerate(ours):
        move_variables([v], devices[i % 2])
    opt = keras.optimizers.Adam(0.01)
    update.place_optimizer(opt, devices[0])
    opt.build(ours)
    update.place_optimizer(opt, devices[0])

    made = set()

    @tf.function
    def step(g):
        grads = []
        for i in range(len(ours)):
            with tf.device(devices[i % 2]):
                grads.append(tf.identity(g * (i + 1)))
        made.update(t.op.name for t in grads)
        update.apply(opt, grads, ours)

    graph = step.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    gates = [op for op in graph.get_operations() if op.name.startswith("gradients_done")]
    assert len(gates) == 2 and {g.device for g in gates} == set(devices)
    assert set().union(*({c.name for c in g.control_inputs} for g in gates)) == made
    (gate,) = [op for op in graph.get_operations() if op.name.startswith("all_gradients_done")]
    assert set(gate.control_inputs) == set(gates) and same_device(gate.device, devices[0])
    gated = [op for op in graph.get_operations() if gate in op.control_inputs]
    assert gated, "no op of the update waits for the gradients"
    doubly = [
        op.name for op in graph.get_operations() if set(op.control_inputs) & set(gates) and op is not gate
    ]
    assert not doubly, f"ops waiting for a device's gradients through edges of their own: {doubly[:5]}"
    direct = [
        op.name
        for op in graph.get_operations()
        if op not in gates and {c.name for c in op.control_inputs} & made
    ]
    assert not direct, f"ops waiting for a gradient through an edge of their own: {direct[:5]}"
    step(tf.ones([3]))


class _Penalized:
    """A ``compute_loss`` override as Keras' docs write one: the compiled loss and the layers'
    regularization (``super()``), plus a term of its own."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return base + keras.ops.mean(y_pred**2)


class _PenalizedSequential(_Penalized, keras.Sequential):
    pass


class _PenalizedPipeline(_Penalized, tf_gpipe.PipelineModel):
    pass


@pytest.mark.parametrize(
    "schedule,loops,override",
    [
        ("gpipe", True, False),
        ("1f1b", True, False),
        ("1f1b", False, False),
        ("1f1b", True, True),
        ("gpipe", True, True),
    ],
)
def test_weight_regularization_runs_on_each_weights_device(schedule, loops, override, cpu_devices):
    """Keras computes a regularizer where ``model.losses`` is read: on the default device
    (CPU:0, where no stage lives), or the loss's (the last stage's); the step computes each
    weight's term and its gradient on the weight's device."""

    def make_layers():
        keras.utils.set_random_seed(0)
        l2, l1 = keras.regularizers.L2(0.01), keras.regularizers.L1(0.02)
        return [
            keras.layers.Dense(6, activation="tanh", kernel_regularizer=l2),
            keras.layers.Dense(6, activation="tanh", kernel_regularizer=l2, bias_regularizer=l1),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.Dense(3, kernel_regularizer=l2),
        ]

    seq = (_PenalizedSequential if override else keras.Sequential)(make_layers(), name="seq")
    seq.build((None, 8))
    kind = _PenalizedPipeline if override else tf_gpipe.PipelineModel
    pm = kind(make_layers(), devices=cpu_devices[1:], balance=[2, 1, 1], num_micro_batches=3,
              schedule=schedule, micro_batch_loops=loops)  # fmt: skip
    pm.build((None, 8))
    pm.set_weights(seq.get_weights())
    for m in (seq, pm):
        m.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = data(10)  # micro-batches of 4, 3, 3
    losses = []
    nodes = _ran(lambda: losses.append(pm.train_on_batch(x, y)))
    # Each term's ops (named for the step's scope), its L2 Squares and L1 Abs on its weight's
    # device; none of theirs, nor of the override, on the default device.
    ours = collections.defaultdict(list)
    for dev, ns in nodes.items():
        ours[dev] += [
            op for op, n in ns if "Send" not in op and "Recv" not in op and "/regularization" in f"/{n}"
        ]
    assert not ours["CPU:0"] and not ours["CPU:2"] and ours["CPU:1"] and ours["CPU:3"], dict(ours)
    assert (ours["CPU:1"].count("Square"), ours["CPU:1"].count("Abs"), ours["CPU:3"].count("Square")) == (
        2,
        1,
        1,
    )
    assert not [n for n in nodes.get("CPU:0", []) if n[0] in ("Square", "Pow", "Abs")], nodes["CPU:0"]
    assert_all_close([losses[0]], [seq.train_on_batch(x, y)], rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "schedule,loops", [("gpipe", True), ("gpipe", False), ("1f1b", True), ("1f1b", False)]
)
def test_loss_and_metrics_run_beside_the_outputs(schedule, loops, cpu_devices):
    """The loss (GPipe's on the whole mini-batch), the merged outputs and the metrics on the
    last stage's device: the default device would take every micro-batch's outputs."""
    seq, pm = pair(lambda: mlp_layers(width=6, depth=3), (None, 8), devices=cpu_devices[1:],
                   num_micro_batches=3, schedule=schedule, micro_batch_loops=loops)  # fmt: skip
    for m in (seq, pm):
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])  # fmt: skip
    x, y = data(10)
    logs = []
    nodes = _ran(lambda: logs.append(pm.train_on_batch(x, y, return_dict=True)))
    kinds = ("SparseSoftmaxCrossEntropyWithLogits", "ConcatV2", "ArgMax", "Equal")
    found = {dev: sorted({op for op, _ in ns if op in kinds}) for dev, ns in nodes.items()}
    assert found["CPU:0"] == [] and "ArgMax" in found["CPU:3"], found
    assert "SparseSoftmaxCrossEntropyWithLogits" in found["CPU:3"], found
    ref = seq.train_on_batch(x, y, return_dict=True)
    assert_all_close([logs[0]["loss"], logs[0]["sparse_categorical_accuracy"]],
                     [ref["loss"], ref["sparse_categorical_accuracy"]], rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("loops", [True, False])
def test_evaluate_runs_beside_what_it_reads(loops, cpu_devices):
    """``evaluate``: the loss and the metrics on the last stage's device, each weight's
    regularization on its own; ``predict`` merges the outputs there too."""

    def make_layers():
        keras.utils.set_random_seed(0)
        l2 = keras.regularizers.L2(0.01)
        return [keras.layers.Dense(6, activation="tanh", kernel_regularizer=l2), keras.layers.Dense(6),
                keras.layers.Dense(3, kernel_regularizer=l2)]  # fmt: skip

    seq, pm = pair(
        make_layers, (None, 8), devices=cpu_devices[1:], num_micro_batches=3, micro_batch_loops=loops
    )
    for m in (seq, pm):
        m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"])  # fmt: skip
    x, y = data(10)
    results = []
    nodes = _ran(lambda: results.append(pm.evaluate(x, y, verbose=0, return_dict=True)))
    kinds = ("SparseSoftmaxCrossEntropyWithLogits", "ConcatV2", "ArgMax", "Square")
    found = {dev: sorted(op for op, _ in ns if op in kinds) for dev, ns in nodes.items()}
    assert found["CPU:0"] == [] and found["CPU:1"] == ["Square"], found
    assert found["CPU:3"] == ["ArgMax", "ConcatV2", "SparseSoftmaxCrossEntropyWithLogits", "Square"], found
    ref = seq.evaluate(x, y, verbose=0, return_dict=True)
    assert_all_close([results[0]["loss"], results[0]["sparse_categorical_accuracy"]],
                     [ref["loss"], ref["sparse_categorical_accuracy"]], rtol=1e-6)  # fmt: skip
    nodes = _ran(lambda: pm.predict(x, verbose=0))
    assert {dev for dev, ns in nodes.items() for op, _ in ns if op == "ConcatV2"} == {"CPU:3"}


def test_a_regularization_gradient_waits_for_the_weights_summed_gradient(cpu_devices):
    """Computed once the schedule's gradient of its weight is summed, a weight-sized
    regularization gradient is not held through the step's peak (the activations)."""
    l2 = keras.regularizers.L2(0.01)
    layers = [keras.layers.Dense(6, kernel_regularizer=l2), keras.layers.Dense(3, kernel_regularizer=l2)]
    pm = tf_gpipe.PipelineModel(layers, devices=cpu_devices[1:3], num_micro_batches=2)
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(6)
    pm.build((None, 8))
    step = tf.function(lambda x, y: trainer.gradients(pm, (x, y)).grads, autograph=False)
    concrete = step.get_concrete_function(tf.constant(x), tf.constant(y))
    # Each kernel's gradient: the schedule's sum plus the regularization's.
    summed = set()
    for i in (0, 2):
        op = concrete.structured_outputs[i].op
        while op.type == "Identity":
            op = op.inputs[0].op
        summed.add(op.inputs[0].op.name)  # AddV2(the schedule's sum, the regularization's)
    reads = [
        op
        for op in concrete.graph.get_operations()
        if op.type == "ReadVariableOp" and "/regularization" in f"/{op.name}"
    ]
    assert len(reads) == 4, [op.name for op in reads]  # each kernel's term, then its gradient
    waiting = [op for op in reads if summed & {c.name for c in op.control_inputs}]
    assert len(waiting) == 2, ([(op.name, [c.name for c in op.control_inputs]) for op in reads], summed)
