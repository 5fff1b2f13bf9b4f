"""fit's first step: traced once, its variables made before the trace.

A ``tf.function`` that creates variables in its first trace is traced a second time, and
where their initial values wait on ops of the step (optimizer slots made under the
update's control dependencies) TensorFlow cannot lift them out: the first call then runs
the step inside a ``cond`` that initializes them, and the second call optimizes the step's
graph again. A list of layers without an ``Input`` is built by its first data, so both
happened to every such model (first step 8.9-11 s against 4.2 s for a 4-stage Transformer,
second step 1.4 s against 0.08 s).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, mlp_layers
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.eager import lift_to_graph

import tf_gpipe
from tf_gpipe import cluster, keras_compat, trainer
from tf_gpipe import model as model_module

N, BATCH = 23, 8  # three batches, the last of 7: uneven micro-batches (M=3)


def _compiled(model):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    return model


def _pipeline(cpu_devices, schedule="gpipe"):
    """A PipelineModel of layers without an Input: built by the first data it sees."""
    pm = tf_gpipe.PipelineModel(mlp_layers(), devices=cpu_devices[:2], num_micro_batches=3, schedule=schedule)
    return _compiled(pm)


def _counted(monkeypatch, owner, name):
    """The calls of ``owner.name`` (a function, or a method of a class), counted: each is one
    trace of Keras' step."""
    count = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        count.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return count


@pytest.fixture
def traces(monkeypatch):
    """How many times the training step was traced."""
    return _counted(monkeypatch, trainer, "train_step")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_train_on_batch_traces_an_unbuilt_models_step_once(cpu_devices, traces, schedule):
    x, y = data(N)
    pm, seq = _pipeline(cpu_devices, schedule), _compiled(keras.Sequential(mlp_layers()))
    for _ in range(2):
        got, want = pm.train_on_batch(x, y), seq.train_on_batch(x, y)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    assert_all_close(pm.get_weights(), seq.get_weights())


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_fit_builds_an_unbuilt_model_before_its_trace_and_loses_no_batch(cpu_devices, traces, source):
    x, y = data(N)
    pm, seq = _pipeline(cpu_devices), _compiled(keras.Sequential(mlp_layers()))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    losses = []
    for model in (pm, seq):
        if source == "dataset":
            history = model.fit(dataset, shuffle=False, verbose=0)
        else:
            history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        losses.append(history.history["loss"])
    assert len(traces) == 1, f"the step was traced {len(traces)} times"
    # Reading the data's spec consumed nothing: the same three updates, the same weights.
    assert int(pm.optimizer.iterations) == 3
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights())


def test_optimizer_slots_made_in_a_traced_step_are_lifted_out_of_it(cpu_devices, monkeypatch):
    """A user's own ``tf.function`` around ``train_step`` still makes the model and its
    optimizer slots inside the trace: their initial values must not wait on the step."""
    unliftable = []
    original = lift_to_graph.lift_to_graph

    def spying(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except lift_to_graph.UnliftableError as e:
            unliftable.append(str(e))
            raise

    monkeypatch.setattr(lift_to_graph, "lift_to_graph", spying)
    x, y = data(N)
    pm, seq = _pipeline(cpu_devices), _compiled(keras.Sequential(mlp_layers()))
    step = tf.function(pm.train_step)
    for _ in range(2):
        step((tf.constant(x), tf.constant(y)))
        seq.train_on_batch(x, y)
    assert not unliftable, unliftable[0][:500]
    assert_all_close(pm.get_weights(), seq.get_weights())


def test_replicated_pipeline_traces_its_step_once(cpu_devices, monkeypatch):
    """Data x pipeline replicas: the optimizer's slots, over every replica's weights, are made
    before the first trace too."""
    count = _counted(monkeypatch, trainer, "finish_step")
    groups = [cpu_devices[0:2], cpu_devices[2:4]]
    rp = cluster.ReplicatedPipeline(mlp_layers, groups, input_shape=(None, 8), num_micro_batches=2)
    _compiled(rp)
    x, y = data(24)
    rp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert len(count) == 1, f"the step was traced {len(count)} times"
    assert int(rp.optimizer.iterations) == 3


def test_evaluate_traces_an_unbuilt_models_step_once(cpu_devices, monkeypatch):
    count = _counted(monkeypatch, tf_gpipe.PipelineModel, "test_step")
    x, y = data(N)
    pm, seq = _pipeline(cpu_devices), _compiled(keras.Sequential(mlp_layers()))
    got, want = (
        pm.evaluate(x, y, batch_size=BATCH, verbose=0),
        seq.evaluate(x, y, batch_size=BATCH, verbose=0),
    )
    assert len(count) == 1, f"the step was traced {len(count)} times"
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not pm.optimizer.built  # evaluating makes no optimizer slots


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_predict_traces_an_unbuilt_models_step_once(cpu_devices, monkeypatch, source):
    count = _counted(monkeypatch, tf_gpipe.PipelineModel, "predict_step")
    x, _ = data(2 * BATCH)  # whole batches: a partial one would be a trace of its own
    pm, seq = _pipeline(cpu_devices), keras.Sequential(mlp_layers())
    given = tf.data.Dataset.from_tensor_slices(x).batch(BATCH) if source == "dataset" else x
    got = pm.predict(given, batch_size=None if source == "dataset" else BATCH, verbose=0)
    assert len(count) == 1, f"the step was traced {len(count)} times"
    np.testing.assert_allclose(got, seq.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6)


def _converted_by_autograph() -> bool:
    """Whether the running library code is AutoGraph's rewrite: rewritten code runs with
    AutoGraph's status enabled; code it leaves as written (``do_not_convert``), disabled."""
    return ag_ctx.control_status_ctx().status == ag_ctx.Status.ENABLED


@pytest.mark.parametrize("entry", ["train_step", "test_step", "predict_step", "replicated"])
def test_a_users_tf_function_runs_the_step_as_written(entry, cpu_devices, monkeypatch):
    """A step called inside a user's ``tf.function`` (AutoGraph on, the default): the library
    runs as written. AutoGraph rewrites every function outside TensorFlow and Keras it meets,
    module by module: a first trace of a 2-stage MLP's step took 14-16 s instead of 0.5."""
    seen = []
    spied = ((trainer, "run_schedule"), (keras_compat, "model_compute_loss"), (model_module, "untaped"))
    for owner, name in spied:
        original = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda *a, _f=original, **k: seen.append(_converted_by_autograph()) or _f(*a, **k)
        )
    if entry == "replicated":
        pm = _compiled(cluster.ReplicatedPipeline(mlp_layers, [cpu_devices[0:2], cpu_devices[2:4]],
                                                  num_micro_batches=3, input_shape=(None, 8)))  # fmt: skip
    else:
        pm = _pipeline(cpu_devices)
    x, y = data(N)
    step = getattr(pm, "train_step" if entry == "replicated" else entry)
    tf.function(step)((tf.constant(x[:8]), tf.constant(y[:8])))
    assert seen and not any(seen), seen
