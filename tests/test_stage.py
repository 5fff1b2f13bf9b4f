"""tf_gpipe.stage: each stage traced once whatever M; XLA stage by stage; exact replay under XLA."""

import functools
import re
import time
import warnings
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, mlp_layers, pair

import tf_gpipe
from tf_gpipe import cell_pass, keras_compat, stage
from tf_gpipe.microbatch import MicroBatch

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dropout_bn_layers(seed=3):
    keras.utils.set_random_seed(seed)
    return [
        keras.layers.Dense(12, activation="relu"),
        keras.layers.Dropout(0.5, seed=1),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(12, activation="relu"),
        keras.layers.Dropout(0.3, seed=2),
        keras.layers.Dense(3),
    ]


# ---------------------------------------------------------------- traced once


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_stage_traced_at_most_twice_and_not_per_micro_batch(schedule, stage_traces):
    """K=2, M=8 on 10 examples (micro-batches of 2 and 1): every stage's forward and
    backward body is traced at most twice (one extra trace for the smaller size; under
    zb-h1 the B of a stage but the first traces its replay instead, split for both halves),
    and M=8 traces no more than M=3 does."""
    counts = {}
    x, y = data(10)
    for M in (3, 8):
        keras.backend.clear_session()
        pm = tf_gpipe.PipelineModel(
            _dropout_bn_layers(), num_stages=2, num_micro_batches=M, schedule=schedule,
            micro_batch_loops=True,
        )  # fmt: skip
        pm.compile(optimizer="sgd", loss=LOSS)
        pm.train_on_batch(x, y)
        pm.train_on_batch(x, y)
        counts[M] = stage_traces(pm)
    for s, per_stage in enumerate(counts[8]):
        assert 1 <= per_stage["forward"] <= 2, counts
        if schedule == "zb-h1" and s > 0:
            assert per_stage["backward"] == 0 and 1 <= per_stage["replays"] <= 2, counts
        else:
            assert 1 <= per_stage["backward"] <= 2 and per_stage["replays"] == 0, counts
    assert counts[8] == counts[3]


def test_remat_never_traced_once_per_signature(stage_traces):
    x, y = data(10)
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=8, remat="never")
    pm.compile(optimizer="sgd", loss=LOSS)
    pm.train_on_batch(x, y)
    assert all(1 <= t["forward"] <= 2 and t["backward"] == 0 for t in stage_traces(pm))


def test_call_under_tape_reuses_the_traces(stage_traces):
    """Eager __call__ under a user's tape runs the same functions: a second call traces nothing."""
    x, y = data(10)
    pm = tf_gpipe.PipelineModel(_dropout_bn_layers(), num_stages=2, num_micro_batches=4)
    pm.build((None, 8))
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = LOSS(y, pm(x, training=True))
        grads = tape.gradient(loss, pm.trainable_variables)
        assert all(g is not None for g in grads)
        if _ == 0:
            first = stage_traces(pm)
    assert stage_traces(pm) == first
    assert all(t["backward"] >= 1 for t in first)


def test_the_loops_never_call_a_taped_forward_traced_outside_them():
    """Inlined in the loops, a stage's forward orders itself: its reads wait for its inputs and
    its outputs for its writes (``stage.inlined``), so that the next micro-batch's dropout draws
    after this one's draw is written. A taped forward traced first for ``__call__`` under a
    user's tape, without those orders, was the one ``fit``'s loops then called: the step then
    differed from the built-out one now and then (a race on the seed's state)."""
    keras.utils.set_random_seed(3)
    layers = [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dropout(0.5), keras.layers.Dense(16)]
    layers += [keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=4, remat="never", schedule="1f1b")
    pm.compile(optimizer="sgd", loss="mse")
    x = np.random.RandomState(0).randn(8, 8).astype("float32")

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            out = pm(x, training=True)
        return tape.gradient(out, pm.trainable_variables)

    grads(tf.constant(x))
    pm.train_on_batch(x, np.ones((8, 2), "float32"))  # as loops over micro-batches
    assert isinstance(pm.cells[1].layers[0], keras.layers.Dropout)
    with stage.inlined():  # the function the loops call for stage 1, and its trace for them
        fn, args = stage.functions(pm.cells[1]).taped_call(
            MicroBatch(tf.TensorSpec([2, 16], tf.float32), training=True), None, True
        )
        graph = fn.get_concrete_function(*args).graph
    inputs = graph.inputs[0].op
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert reads and all(inputs in op.control_inputs for op in reads)


def _step_graph(pm, x_spec):
    """The GraphDef of ``pm``'s (a compiled PipelineModel's) training step, traced for ``x_spec``."""
    pm.build(x_spec.shape)
    pm.optimizer.build(pm.trainable_variables)
    step = tf.function(pm.train_step)
    return step.get_concrete_function((x_spec, tf.TensorSpec([None], tf.int64))).graph.as_graph_def()


@functools.cache  # plain data: the tests below read the same graphs
def _step_functions(M, remat, depth):
    """Names of the functions the training step's graph holds (its bodies), and its op count."""
    keras.backend.clear_session()
    pm = tf_gpipe.PipelineModel(mlp_layers(depth=depth), num_stages=2, num_micro_batches=M, remat=remat)
    pm.compile(optimizer="sgd", loss=LOSS)
    graph = _step_graph(pm, tf.TensorSpec([None, 8], tf.float32))
    names = [re.sub(r"(_\d+)+$", "", f.signature.name) for f in graph.library.function]
    return sorted(names), len(graph.node)


# One worker for the tests that read _step_functions' graphs: its cache is per process.
@pytest.mark.xdist_group("step_functions")
@pytest.mark.parametrize("remat", ["always", "never"])
def test_step_graph_holds_stage_bodies_once(remat):
    """The step's graph holds the same function bodies for M=2 and M=6 (O(K), not O(K x M)):
    without re-materialization too, where TensorFlow derives the backward of each stage's
    forward function once, not per call. Only the calls grow with M."""
    bodies_2, nodes_2 = _step_functions(2, remat, 7)
    bodies_6, nodes_6 = _step_functions(6, remat, 7)
    assert bodies_2 == bodies_6
    assert sum("forward" in name and "body" in name for name in bodies_6) >= 2  # the stages are functions
    assert nodes_6 > nodes_2


@pytest.mark.xdist_group("step_functions")
@pytest.mark.parametrize("remat", ["always", "never"])
def test_step_graph_grows_per_micro_batch_by_calls_not_per_weight(remat):
    """A micro-batch more adds a few ops per stage (the calls and the device chain), not one
    per weight: the gradients are summed inside the stage functions (in variables on the
    stage's device), not by K x M x weights adds in the step. A stage with 4x the weights
    grows the step's graph by the same count."""

    def growth(depth):
        return _step_functions(6, remat, depth)[1] - _step_functions(2, remat, depth)[1]

    small, big = growth(1), growth(7)  # 4 and 16 weights, 2 stages
    assert small == big, (small, big)


def _unread_call_outputs(graph_def):
    """``{call: [output index, ...]}``: outputs of the stage-function calls in ``graph_def``
    that no op reads as data (an Identity counts only if its own output is read)."""
    nodes = {n.name: n for n in graph_def.node}
    readers: dict = {}
    for n in graph_def.node:
        for i in n.input:
            if not i.startswith("^"):
                name, _, idx = i.partition(":")
                readers.setdefault((name, int(idx or 0)), []).append(n.name)

    def read(name, idx, seen=()):
        for r in readers.get((name, idx), []):
            if nodes[r].op != "Identity" or (r not in seen and read(r, 0, (*seen, r))):
                return True
        return False

    unread = {}
    for n in graph_def.node:
        if n.op in ("StatefulPartitionedCall", "PartitionedCall") and re.search(
            r"_(forward|backward|zero|read)_body", n.attr["f"].func.name
        ):
            missing = [k for k in range(len(n.attr["Tout"].list.type)) if not read(n.name, k)]
            if missing:
                unread[f"{n.name} ({n.attr['f'].func.name})"] = missing
    return unread


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_every_stage_call_output_is_read_as_data(schedule):
    """Grappler's function optimizer rewrites a copy of the function for every call with an
    output no op reads as data (a token read only through a control edge, an
    IndexedSlices' dense_shape), and checking each call made the first step grow with M.
    So each gradient-sum token flows as data into the stage's next addition and the final
    read, and an Embedding's rows leave a function without their dense_shape."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Embedding(20, 4),
        keras.layers.Flatten(),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(3),
    ]
    pm = tf_gpipe.PipelineModel(
        layers, num_stages=2, num_micro_batches=3, schedule=schedule, micro_batch_loops=False
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    graph = _step_graph(pm, tf.TensorSpec([None, 5], tf.int32))
    calls = [n for n in graph.node if "_body" in n.attr["f"].func.name]
    assert len(calls) >= 2 * 3 * 2  # every stage's forward and backward, per micro-batch
    assert _unread_call_outputs(graph) == {}


@pytest.mark.parametrize("in_body", [False, True])
def test_gradient_sums_leave_out_an_empty_micro_batch(in_body):
    """A padded micro-batch (no real example) adds nothing to the sums, even gradients
    that are not finite (statistics of no rows): its additions are skipped, the others'
    made; its rows (an Embedding's) come back zeroed."""
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=2)
    pm.build((None, 8))
    sums = stage.functions(pm.cells[0]).sums
    variables = pm.cells[0].trainable_variables

    @tf.function(autograph=False)
    def step():
        token = sums.zero()
        for nonempty, fill in ((False, np.nan), (True, 1.0), (False, np.inf)):
            grads = [tf.fill(v.shape, fill) for v in variables]
            with tf.control_dependencies([token]):
                if in_body:
                    token, _ = sums.add_in_body(grads, tf.constant(nonempty))
                else:
                    token, _ = sums.add(grads, tf.constant(nonempty), token)
        return sums.read(token)

    got = step()
    assert_all_close([got[id(v)] for v in variables], [np.ones(v.shape) for v in variables])
    rows = tf.IndexedSlices(tf.fill([2, 3], np.nan), tf.constant([0, 1]), tf.constant([5, 3]))
    _, back = sums.add_in_body([rows] + [None] * (len(variables) - 1), tf.constant(False))
    assert_all_close(back[0][0], np.zeros([2, 3]))


def test_gradient_sums_are_not_weights_and_not_saved(tmp_path):
    """The variables that sum fit's gradients in a step built out are the library's scratch
    space: not in ``weights``, not in the saved model, and a loaded model trains the same."""
    x, y = data(10)
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=3, micro_batch_loops=False)
    pm.compile(optimizer="sgd", loss=LOSS)
    pm.build((None, 8))
    before = [v.path for v in pm.weights]
    pm.train_on_batch(x, y)
    assert [v.path for v in pm.weights] == before
    assert all(c.gradient_sums for c in pm.cells)  # the sums exist...
    path = str(tmp_path / "m.keras")
    pm.save(path)
    loaded = keras.models.load_model(path)
    assert len(loaded.weights) == len(before)  # ...but are not saved
    loaded.compile(optimizer="sgd", loss=LOSS)
    pm.train_on_batch(x, y)
    loaded.train_on_batch(x, y)
    assert_all_close(pm.get_weights(), loaded.get_weights(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remat", ["always", "never"])
def test_training_step_is_traced_once(remat, monkeypatch):
    """compile makes the optimizer slots and the gradient sums: a tf.function that creates
    variables in its first trace is traced twice, and the step is the longest trace."""
    from tf_gpipe import trainer

    calls = []
    original = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda model, data: calls.append(1) or original(model, data))
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=3, remat=remat)
    pm.build((None, 8))
    pm.compile(optimizer="adam", loss=LOSS)
    x, y = data(10)
    pm.train_on_batch(x, y)
    pm.train_on_batch(x, y)
    assert len(calls) == 1


def test_trace_counter_counts(stage_traces):
    """The counter the tests above rely on moves with each new trace (a new Python
    argument is a new signature), so "traced once" is not vacuous."""
    x, _ = data(8)
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=4)
    pm.build((None, 8))
    pm(x, training=False)
    once = stage_traces(pm)
    pm(x, training=True)
    assert [t["forward"] for t in stage_traces(pm)] == [t["forward"] + 1 for t in once]


def test_stage_outputs_carry_their_keras_mask():
    """A Keras mask does not leave a function on its tensor: the stage's outputs get it back,
    so whatever reads them (the next stage, a loss) sees the mask as in keras.Sequential."""
    keras.utils.set_random_seed(0)
    pm = tf_gpipe.PipelineModel(
        [keras.layers.Embedding(20, 4, mask_zero=True), keras.layers.Dense(3)], num_stages=2
    )
    x = tf.constant([[3, 5, 0], [7, 0, 0]])
    pm(x)
    record = cell_pass.forward(pm.cells[0], MicroBatch(x, training=True), remat=True)
    mask = keras_compat.get_keras_mask(record.outputs)
    assert mask is not None and np.array_equal(mask.numpy(), x.numpy() != 0)
    assert np.array_equal(record.out_mask.numpy(), x.numpy() != 0)


# ---------------------------------------------------------------- XLA per stage


def _compiled_with_xla(model):
    out = []
    for cell in model.cells:
        fns = stage.functions(cell)
        concrete = [
            cf
            for fn in (fns._forward, fns._forward_inlined, fns._forward_taped, fns._forward_taped_inlined)
            for cf in fn._list_all_concrete_functions()
        ]
        assert concrete, "the stage's forward was never traced"
        out.append(all(cf.function_def.attr["_XlaMustCompile"].b for cf in concrete))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_jit_compile_true_matches_sequential(schedule):
    """XLA on CPU, 10 examples in 4 uneven micro-batches: the loss and weights of
    keras.Sequential (XLA may reorder float sums: tolerance 1e-5)."""
    seq, pm = pair(mlp_layers, (None, 8), num_stages=2, num_micro_batches=4, schedule=schedule)
    x, y = data(10)
    losses = []
    for model, jit in ((seq, False), (pm, True)):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, jit_compile=jit)
        losses.append(model.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0).history["loss"])
    assert pm.stage_jit == [True, True]
    assert _compiled_with_xla(pm) == [True, True]
    assert pm.jit_compile is False  # the step around the stages: one cluster would span devices
    assert_all_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_jit_compile_true_masks_and_sparse_gradients_match_sequential():
    """Keras masks cross the function boundary explicitly (Embedding(mask_zero) -> LSTM on
    the next stage), and an Embedding's sparse gradient leaves an XLA stage function."""

    def make():
        keras.utils.set_random_seed(0)
        # use_cudnn=False: with cuDNN (on a GPU) Keras declares an LSTM unfit for XLA.
        lstm = keras.layers.LSTM(8, use_cudnn=False)
        return [keras.layers.Embedding(20, 8, mask_zero=True), lstm, keras.layers.Dense(3)]

    seq, pm = pair(make, (None, 6), input_dtype="int32", balance=[1, 2], num_micro_batches=3)
    rng = np.random.RandomState(0)
    x = rng.randint(1, 20, (10, 6)).astype("int32")
    x[:, 4:] = 0
    y = rng.randint(0, 3, 10)
    for model, jit in ((seq, False), (pm, True)):
        model.compile(optimizer="adam", loss=LOSS, jit_compile=jit)
        model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert _compiled_with_xla(pm) == [True, True]
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_jit_compile_auto_off_on_cpu_and_false_never(cpu_devices):
    for jit in ("auto", False):
        pm = tf_gpipe.PipelineModel(mlp_layers(), devices=cpu_devices[:2], num_micro_batches=2)
        pm.compile(optimizer="sgd", loss=LOSS, jit_compile=jit)
        assert pm.stage_jit == [False, False]  # CPU stages, a GPU visible or not
        pm.train_on_batch(*data(6))
        assert _compiled_with_xla(pm) == [False, False]


class _NoXla(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x + 1.0


def _pretend_a_gpu(monkeypatch):
    """A physical GPU listed besides the real devices (what ``choose_jit`` reads)."""
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(
        tf.config,
        "list_physical_devices",
        lambda device_type=None: real(device_type) + ([gpu] if device_type in (None, "GPU") else []),
    )


def test_jit_compile_auto_follows_each_stage_device(cpu_devices, monkeypatch):
    """``"auto"`` compiles a stage with XLA where it runs on a GPU (as Keras compiles a model
    for the accelerator it runs on), never one placed on a CPU beside it; ``False`` none."""
    from tf_gpipe.jit import choose_jit

    _pretend_a_gpu(monkeypatch)
    pm = tf_gpipe.PipelineModel(mlp_layers(), devices=cpu_devices[:2], num_micro_batches=2)
    pm.build((None, 8))
    pm.cells[0].device = "/job:localhost/replica:0/task:0/device:GPU:0"  # read, never run
    assert choose_jit(pm.cells, "auto") == [True, False]
    assert choose_jit(pm.cells, False) == [False, False]


def test_jit_compile_true_skips_a_stage_whose_layer_refuses_xla():
    layers = mlp_layers(depth=1) + [_NoXla(name="no_xla")]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=2)
    with pytest.warns(UserWarning, match=r"stage 1: no_xla"):
        pm.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
    assert pm.stage_jit == [True, False]
    pm.train_on_batch(*data(6))
    assert _compiled_with_xla(pm) == [True, False]


def test_jit_compile_auto_compiles_where_keras_would(monkeypatch):
    """With a GPU visible, "auto" compiles every stage whose layers all allow XLA,
    silently skipping the others, as Keras' "auto" does for a model."""
    _pretend_a_gpu(monkeypatch)
    pm = tf_gpipe.PipelineModel(mlp_layers(depth=1) + [_NoXla()], num_stages=2, num_micro_batches=2)
    pm.build((None, 8))
    for cell in pm.cells:  # where a GPU's stages would be (read, never run)
        cell.device = "/job:localhost/replica:0/task:0/device:GPU:0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.compile(optimizer="sgd", loss=LOSS)  # jit_compile="auto"
    assert pm.stage_jit == [True, False]


class _SeesEager(keras.layers.Layer):
    modes: ClassVar[list] = []

    def call(self, x):
        _SeesEager.modes.append(tf.executing_eagerly())
        return x


def test_run_eagerly_runs_the_stages_op_by_op():
    """compile(run_eagerly=True) runs every stage's layers eagerly, as Keras does, and trains
    as keras.Sequential does."""
    _SeesEager.modes = []
    seq, pm = pair(lambda: mlp_layers(depth=2), (None, 8), num_stages=2, num_micro_batches=4)
    pm.cells[1].layers.insert(0, _SeesEager())
    x, y = data(10)
    for model in (seq, pm):
        model.compile(optimizer="sgd", loss=LOSS, run_eagerly=True, jit_compile=False)
        model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert _SeesEager.modes and all(_SeesEager.modes)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_jit_compile_bad_value():
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2)
    with pytest.raises(ValueError, match="jit_compile must be 'auto', True or False"):
        pm.compile(optimizer="sgd", loss=LOSS, jit_compile="yes")


def test_stage_jit_survives_save_and_load(tmp_path):
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=2)
    pm.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
    pm.train_on_batch(*data(6))
    pm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.stage_jit == [True, True]


# ---------------------------------------------------------------- exact replay under XLA


@functools.cache
def _xla_fit(schedule, remat):
    """The weights (moving statistics too) after 2 steps of XLA-compiled stages, K=2, M=4."""
    keras.backend.clear_session()
    x, y = data(10)
    pm = tf_gpipe.PipelineModel(
        _dropout_bn_layers(), num_stages=2, num_micro_batches=4, remat=remat, schedule=schedule
    )
    pm.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
    pm.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert _compiled_with_xla(pm) == [True, True]
    moving = [w.numpy() for w in pm.non_trainable_weights if "moving_mean" in w.path]
    return pm.get_weights(), moving


# 1f1b under XLA: test_jit_compile_true_matches_sequential; zb-h1 replays in both B and W.
@pytest.mark.xdist_group("xla_fit")  # one worker: both read _xla_fit("gpipe", "never")
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_exact_replay_under_xla(schedule):
    """Under XLA the replay still draws the forward's dropout masks and moves BatchNorm
    once: re-materialized training equals training on a tape (remat="never"). The tape run
    is gpipe's for both: every schedule runs a stage's forwards in micro-batch order, so
    they draw the same masks."""
    taped, _ = _xla_fit("gpipe", "never")
    replayed, moving = _xla_fit(schedule, "always")
    assert_all_close(taped, replayed, rtol=1e-5, atol=1e-6)
    assert moving and not np.allclose(moving[0], 0.0)


# ---------------------------------------------------------------- the replay waits for its gradient

_EVENTS: list = []


class _StampReplay(keras.layers.Layer):
    """Logs the time its replay runs (a host callback fed by the layer's input)."""

    def call(self, x):
        if tf_gpipe.is_recomputing():
            stamp = tf.py_function(
                lambda a: _EVENTS.append(("replay", time.perf_counter())) or 0.0, [x], tf.float32
            )
            with tf.control_dependencies([stamp]):
                return tf.identity(x)
        return x


def test_replay_waits_for_the_output_gradient():
    """Inside the backward function the recomputation starts only once the gradient of the
    stage's output has arrived: started earlier, it would hold the stage's activations from
    the forward pass on, and re-materialization would save no memory."""
    _EVENTS.clear()
    keras.utils.set_random_seed(0)
    pm = tf_gpipe.PipelineModel([keras.layers.Dense(4), _StampReplay()], num_stages=1)
    pm.build((None, 3))
    cell = pm.cells[0]

    def slow_gradient(out):
        time.sleep(0.3)  # plenty of time for a replay that does not wait to run first
        _EVENTS.append(("gradient", time.perf_counter()))
        return tf.ones_like(out)

    @tf.function
    def step(x):
        record = cell_pass.forward(cell, MicroBatch(x, training=True), remat=True)
        dy = tf.py_function(slow_gradient, [record.outputs], tf.float32)
        dy.set_shape(record.outputs.shape)
        _, grads = cell_pass.backward(cell, record, [dy], [], True, cell.trainable_variables)
        return grads

    grads = step(tf.ones((2, 3)))
    assert all(g is not None for g in grads)
    assert [name for name, _ in sorted(_EVENTS, key=lambda e: e[1])] == ["gradient", "replay"]
