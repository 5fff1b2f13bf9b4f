"""The private Keras behaviour tf_gpipe relies on, one test per hook.

Every hook of ``tf_gpipe.keras_compat`` is checked here against the installed Keras,
so that a Keras upgrade that moves or changes one fails a test that names it (and the
Keras version) rather than a distant equivalence test. The last tests are the loudness
of the hooks themselves: a missing private API is a ``KerasCompatError``, never a silent
skip.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, record_slots

import tf_gpipe
from tf_gpipe import keras_compat
from tf_gpipe.batchnorm import DeferredStats, batch_norm_layers
from tf_gpipe.cell import Cell, attach_mask, eager_build_scope
from tf_gpipe.keras_compat import layers as compat_layers
from tf_gpipe.keras_compat.errors import private_module

VERSION = f"Keras {keras.__version__}"


def _dropout_bn():
    drop = keras.layers.Dropout(0.5, seed=3)
    bn = keras.layers.BatchNormalization()
    bn.build((None, 4))
    return drop, bn


def _op():
    """A keras.Operation that is not a layer: an op node of a functional model."""
    x = keras.Input((2,))
    return keras_compat.functional_nodes(keras.Model(x, keras.ops.add(x, x)))[0].operation


def _functional():
    """A functional model with a skip connection, a dict input and a nested output."""
    a = keras.Input((4,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(4, name="d1")(a)
    h = keras.layers.Dropout(0.5, seed=1, name="drop")(h)
    out = keras.layers.Add(name="add")([h, b])
    return keras.Model({"a": a, "b": b}, {"y": out, "h": h})


# ------------------------------------------------------------------------------ masks
def test_get_keras_mask_reads_the_mask_a_layer_sets():
    out = keras.layers.Embedding(5, 2, mask_zero=True)(tf.constant([[1, 0]]))
    mask = keras_compat.get_keras_mask(out)
    assert mask is not None, f"{VERSION}: Embedding(mask_zero=True) output carries no mask"
    np.testing.assert_array_equal(mask.numpy(), [[True, False]], err_msg=VERSION)
    assert keras_compat.get_keras_mask(tf.ones((1, 2))) is None, VERSION


def test_set_keras_mask_is_what_keras_layers_read():
    t = tf.ones((1, 2, 3)) * tf.constant([[[1.0], [5.0]]])
    keras_compat.set_keras_mask(t, tf.constant([[True, False]]))
    np.testing.assert_array_equal(keras_compat.get_keras_mask(t).numpy(), [[True, False]], err_msg=VERSION)
    # The masked average ignores the second step (else 3.0): Keras layers see the mask we set.
    pooled = keras.layers.GlobalAveragePooling1D()(t)
    np.testing.assert_allclose(pooled.numpy(), np.ones((1, 3)), err_msg=VERSION)


# ------------------------------------------------------------------------------ layers
def test_call_takes_mask_and_training_as_keras_sequential_passes_them():
    lstm, relu, drop = keras.layers.LSTM(2), keras.layers.ReLU(), keras.layers.Dropout(0.5)
    assert keras_compat.call_takes_mask(lstm) and keras_compat.call_takes_training(lstm), VERSION
    assert not keras_compat.call_takes_mask(relu) and not keras_compat.call_takes_training(relu), VERSION
    assert keras_compat.call_takes_training(drop) and not keras_compat.call_takes_mask(drop), VERSION


def test_nested_layers_reaches_every_sublayer():
    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.BatchNormalization()])
    outer = keras.Sequential([keras.layers.Dense(2), inner])
    found = keras_compat.nested_layers(outer)
    assert found[0] is outer, VERSION
    assert all(any(x is layer for x in found) for layer in [*outer.layers, *inner.layers]), VERSION
    assert batch_norm_layers([outer]) == [inner.layers[1]], VERSION
    op = _op()
    assert not isinstance(op, keras.layers.Layer) and keras_compat.nested_layers(op) == [op]


# ------------------------------------------------------------------------------ subclassing keras.Model
def test_first_call_argument_is_what_maybe_build_builds_for():
    events = []

    class Recording(keras.layers.Layer):
        def _maybe_build(self, call_spec):
            events.append(("build", keras_compat.first_call_argument(call_spec)))
            return super()._maybe_build(call_spec)

        def call(self, x):
            events.append(("call", x))
            return x

    tokens = tf.constant([[1, 2]], tf.int32)
    Recording()(tokens)
    assert [e for e, _ in events] == ["build", "call"], f"{VERSION}: {events}"
    assert events[0][1] is tokens, f"{VERSION}: _maybe_build saw {events[0][1]!r}"


def test_data_spec_reads_what_maybe_symbolic_build_is_given():
    seen = []

    class Recording(keras.Sequential):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            seen.append(keras_compat.data_spec(iterator, data_batch))
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    model = Recording([keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((6, 3), "int32"), np.zeros((6, 2), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    model.train_on_batch(x, y)
    assert len(seen) == 2, f"{VERSION}: _maybe_symbolic_build ran {len(seen)} times"
    fit_x, batch_x = seen[0][0], seen[1][0]
    assert isinstance(fit_x, tf.TensorSpec), f"{VERSION}: fit gave {fit_x!r}"
    assert fit_x.shape.as_list() == [None, 3] and fit_x.dtype == tf.int32, f"{VERSION}: {fit_x!r}"
    assert batch_x is x, f"{VERSION}: train_on_batch gave {batch_x!r}"
    assert keras_compat.data_spec(None, None) is None


class _Dtypes(keras.layers.Layer):
    def call(self, x):
        self.seen = x
        return x


def test_keep_input_dtypes_passes_inputs_as_given():
    x = np.ones((1, 2), "float64")
    cast = _Dtypes()
    cast(tf.constant(x))
    assert cast.seen.dtype == tf.float32, f"{VERSION}: a plain layer no longer casts its inputs"
    kept = _Dtypes()
    keras_compat.keep_input_dtypes(kept)
    kept(x)  # an array, positionally
    assert kept.seen is x, f"{VERSION}: the layer got {kept.seen!r}"
    kept(tf.constant(x))
    assert kept.seen.dtype == tf.float64, f"{VERSION}: the layer got {kept.seen.dtype}"


def test_track_checkpoint_dependency_saves_the_layer(tmp_path):
    owner, dense = keras.layers.Layer(), keras.layers.Dense(2)
    dense.build((None, 3))
    keras_compat.track_checkpoint_dependency(owner, dense, "layer_0")
    assert not [v for v in vars(owner).values() if v is dense], "tracked without an attribute"
    saved = [w.numpy() for w in dense.weights]
    path = tf.train.Checkpoint(root=owner).save(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert any(n.startswith("layer_0/") for n in names), f"{VERSION}: {names}"
    for w in dense.weights:
        w.assign(tf.zeros_like(w))
    tf.train.Checkpoint(root=owner).restore(path).assert_existing_objects_matched()
    assert_all_close([w.numpy() for w in dense.weights], saved)


# ------------------------------------------------------------------------------ variables
def test_backing_variable_is_the_tf_variable(cpu_devices):
    v = keras.Variable(np.zeros(3, "float32"))
    raw = keras_compat.backing_variable(v)
    assert isinstance(raw, tf.Variable), f"{VERSION}: Variable._value is {type(raw).__name__}"
    raw.assign([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0], err_msg=VERSION)


def test_variable_device_is_where_the_tf_variable_lives(cpu_devices):
    with tf.device(cpu_devices[2]):
        v = keras.Variable(np.zeros(3, "float32"))
    assert keras_compat.variable_device(v).endswith("CPU:2"), VERSION
    assert keras_compat.variable_device(keras_compat.backing_variable(v)).endswith("CPU:2"), VERSION


def test_set_backing_variable_moves_the_variable(cpu_devices):
    v = keras.Variable(np.zeros(3, "float32"))
    with tf.device(cpu_devices[2]):
        moved = tf.Variable([4.0, 5.0, 6.0])
    keras_compat.set_backing_variable(v, moved)
    assert keras_compat.backing_variable(v) is moved, VERSION
    assert v.value.device.endswith("CPU:2"), f"{VERSION}: {v.value.device}"
    v.assign([7.0, 8.0, 9.0])
    np.testing.assert_array_equal(moved.numpy(), [7.0, 8.0, 9.0], err_msg=VERSION)


def _build_in_a_traced_step(optimizer, variables):
    @tf.function
    def step():  # where fit's first step builds the optimizer
        if not optimizer.built:  # a function that makes variables is traced twice
            optimizer.build(variables)

    step()


def test_colocate_optimizer_slots_puts_each_slot_on_its_variables_device(cpu_devices):
    variables = []
    for device in (cpu_devices[1], cpu_devices[2]):
        with tf.device(device):
            variables.append(keras.Variable(np.zeros((2, 2), "float32")))
    adam = keras.optimizers.Adam()
    plain, scaled = record_slots(adam), keras.optimizers.LossScaleOptimizer(adam)
    keras_compat.colocate_optimizer_slots(scaled)  # the inner optimizer makes the slots
    keras_compat.colocate_optimizer_slots(scaled)  # idempotent
    _build_in_a_traced_step(scaled, variables)
    placed = sorted((v.value.device[-5:], slot.value.device[-5:]) for v, slot in plain)
    assert placed == [("CPU:1", "CPU:1")] * 2 + [("CPU:2", "CPU:2")] * 2, f"{VERSION}: {placed}"
    # Without the hook Keras puts them on the default device: the check above is not vacuous.
    other = keras.optimizers.Adam()
    unplaced = record_slots(other)
    _build_in_a_traced_step(other, variables)
    assert {slot.value.device[-5:] for _, slot in unplaced} == {"CPU:0"}, f"{VERSION}: {unplaced}"


def test_update_on_variable_device_runs_each_update_step_there(cpu_devices):
    with tf.device(cpu_devices[2]):
        v = keras.Variable(np.ones((2, 2), "float32"))
    sgd = keras.optimizers.SGD(0.1, momentum=0.5)
    keras_compat.colocate_optimizer_slots(sgd)
    keras_compat.update_on_variable_device(sgd)
    keras_compat.update_on_variable_device(sgd)  # idempotent
    placed = []

    @tf.function
    def step(g):
        sgd.apply_gradients([(g, v)])
        placed.extend(op.device for op in tf.compat.v1.get_default_graph().get_operations())

    sgd.build([v])
    step(tf.ones((2, 2)))
    assert any(d.endswith("CPU:2") for d in placed), f"{VERSION}: {set(placed)}"
    np.testing.assert_allclose(v.numpy(), 0.9 * np.ones((2, 2)), err_msg=VERSION)
    # Keras' own path gives the update's arithmetic no device: the check above is not vacuous.
    other, unplaced = keras.optimizers.SGD(0.1, momentum=0.5), []

    @tf.function
    def plain(g):
        other.apply_gradients([(g, v)])
        unplaced.extend(op.device for op in tf.compat.v1.get_default_graph().get_operations())

    other.build([v])
    plain(tf.ones((2, 2)))
    assert not any(d.endswith("CPU:2") for d in unplaced), f"{VERSION}: {set(unplaced)}"


def test_skip_default_all_reduce_keeps_gradients_as_given():
    v = keras.Variable(np.ones(2, "float32"))
    adam = keras.optimizers.Adam()
    adam.build([v])

    def traced_op_types():
        made = []

        @tf.function
        def step(g):
            adam.apply_gradients([(g, v)])
            made.extend(op.type for op in tf.compat.v1.get_default_graph().get_operations())

        step(tf.ones(2))
        return made

    assert "IdentityN" in traced_op_types(), f"{VERSION}: the default all-reduce is no longer an IdentityN"
    keras_compat.skip_default_all_reduce(adam)
    assert "IdentityN" not in traced_op_types(), VERSION


def test_optimizer_own_variables_are_its_scalars():
    adam = keras.optimizers.Adam(0.01)
    own = keras_compat.optimizer_own_variables(adam)
    assert [v.path for v in own] == [adam.iterations.path, adam.learning_rate.path], VERSION
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    scheduled = keras.optimizers.Adam(decay)  # the learning rate is computed, not a variable
    assert keras_compat.optimizer_own_variables(scheduled) == [scheduled.iterations], VERSION
    accumulating = keras.optimizers.SGD(gradient_accumulation_steps=2)  # iterations is computed
    first = next(iter(keras_compat.optimizer_own_variables(accumulating)))
    assert first.path.endswith("iteration"), VERSION
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    scaled.build([keras.Variable(np.ones(2, "float32"))])
    paths = {v.path for v in keras_compat.optimizer_own_variables(scaled)}
    assert {scaled.step_counter.path, scaled.dynamic_scale.path} <= paths, f"{VERSION}: {paths}"


def test_factored_slots_pair_adafactors_moments_with_their_variables():
    variables = [keras.Variable(np.ones((3, 4), "float32")), keras.Variable(np.ones(4, "float32"))]
    adafactor = keras.optimizers.Adafactor()
    adafactor.build(variables)
    pairs = keras_compat.factored_slots(adafactor)
    shapes = sorted((tuple(slot.shape), tuple(v.shape)) for slot, v in pairs)
    assert shapes == [((), (4,)), ((), (4,)), ((3,), (3, 4)), ((4,), (3, 4))], f"{VERSION}: {shapes}"
    assert keras_compat.factored_slots(keras.optimizers.Adam()) == [], VERSION
    nadam = keras.optimizers.Nadam()
    nadam.build(variables)
    assert any(
        "u_product" in v.path or v.shape == () for v in keras_compat.optimizer_own_variables(nadam)[2:]
    )


# ------------------------------------------------------------------------------ stateless scope
def test_suspend_stateless_scope_builds_real_variables():
    layer = keras.layers.Dense(2)
    with keras.StatelessScope() as scope:
        assert keras_compat.current_stateless_scope() is scope, VERSION
        with keras_compat.suspend_stateless_scope():
            assert keras_compat.current_stateless_scope() is None, VERSION
            layer.build((None, 3))
        assert keras_compat.current_stateless_scope() is scope, VERSION
    assert layer.kernel.numpy().shape == (3, 2), VERSION
    # cell.eager_build_scope, which builds every stage, relies on it.
    with keras.StatelessScope(), eager_build_scope("/device:CPU:0"):
        assert keras_compat.current_stateless_scope() is None, VERSION


def test_current_stateless_scope_maps_variable_reads():
    v = keras.Variable(np.zeros(3, "float32"))
    assert keras_compat.current_stateless_scope() is None, VERSION
    with keras.StatelessScope(state_mapping=[(v, tf.ones(3))]) as scope:
        assert keras_compat.current_stateless_scope() is scope, VERSION
        np.testing.assert_array_equal(scope.get_current_value(v).numpy(), np.ones(3), err_msg=VERSION)


def test_recording_scope_sees_every_write_and_keeps_it():
    drop, bn = _dropout_bn()
    x = tf.ones((2, 4))
    before = [v.numpy().copy() for v in (drop.seed_generator.state, bn.moving_mean)]
    with keras_compat.RecordingScope() as scope:
        bn(drop(x, training=True), training=True)
    written = {id(v) for v in scope.written.values()}
    expected = {id(drop.seed_generator.state), id(bn.moving_mean), id(bn.moving_variance)}
    assert expected <= written, f"{VERSION}: add_update saw {len(written)} writes"
    assert all(
        np.array_equal(b, v.numpy()) for b, v in zip(before, (drop.seed_generator.state, bn.moving_mean))
    ), f"{VERSION}: a write left the scope"


# ------------------------------------------------------------------------------ BatchNormalization
def test_batch_norm_reduction_axes():
    bn = keras.layers.BatchNormalization()
    bn.build((None, 5, 4))
    assert keras_compat.batch_norm_reduction_axes(bn) == [0, 1], VERSION
    conv_bn = keras.layers.BatchNormalization(axis=1)
    conv_bn.build((None, 3, 8, 8))
    assert keras_compat.batch_norm_reduction_axes(conv_bn) == [0, 2, 3], VERSION


def test_observe_batch_norm_moments_sees_training_calls_only():
    _, bn = _dropout_bn()
    x = tf.constant(np.random.RandomState(0).rand(6, 4).astype("float32"))
    seen = []
    with keras_compat.observe_batch_norm_moments(bn, lambda *a: seen.append(a)):
        bn(x, training=False)
        assert seen == [], f"{VERSION}: inference computed batch moments"
        bn(x, training=True)
    ((inputs, mask, mean, variance),) = seen
    assert mask is None and inputs.shape == (6, 4), VERSION
    np.testing.assert_allclose(mean.numpy(), x.numpy().mean(0), rtol=1e-5, err_msg=VERSION)
    np.testing.assert_allclose(variance.numpy(), x.numpy().var(0), rtol=1e-4, err_msg=VERSION)
    bn(x, training=True)  # the hook is gone after the block
    assert len(seen) == 1, VERSION


def test_deferred_stats_records_through_the_hooks():
    _, bn = _dropout_bn()
    stats = DeferredStats()
    with stats.capture([bn]):
        bn(tf.ones((2, 4)), training=False)
        assert stats.sums() == []
        bn(tf.ones((2, 4)), training=True)
    ((layer, (count, _, _)),) = stats.sums()
    assert layer is bn and float(count) == 2.0, VERSION


# ------------------------------------------------------------------------------ functional models
def test_functional_nodes_in_run_order():
    model = _functional()
    names = [node.operation.name for node in keras_compat.functional_nodes(model)]
    assert names == ["d1", "drop", "add"], f"{VERSION}: {names}"

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert keras_compat.functional_nodes(Subclassed()) is None, VERSION


def test_node_arguments_fill_in_the_inputs():
    model = _functional()
    add = keras_compat.functional_nodes(model)[-1]
    h, b = tf.ones((1, 4)), tf.zeros((1, 4))
    values = {id(add.input_tensors[0]): h, id(add.input_tensors[1]): b}
    args, kwargs = keras_compat.node_arguments(add, values)
    assert args[0][0] is h and args[0][1] is b and kwargs == {}, f"{VERSION}: {args}, {kwargs}"


def test_operation_caller_passes_training():
    drop = _functional().get_layer("drop")
    x = tf.ones((4, 100))
    dropped = keras_compat.operation_caller(drop, True)(x)
    assert float(tf.reduce_min(dropped)) == 0.0, f"{VERSION}: training=True did not reach Dropout"
    assert keras_compat.operation_caller(drop, None) is drop
    np.testing.assert_array_equal(
        keras_compat.operation_caller(drop, False)(x, training=True).numpy(), x.numpy()
    )
    op = _op()  # not a layer: called as it is
    assert keras_compat.operation_caller(op, True) is op


def test_operation_caller_matches_keras_3_15_operation_fn():
    functional = pytest.importorskip("keras.src.models.functional")
    if not hasattr(functional, "operation_fn"):
        pytest.skip(f"{VERSION} has no operation_fn (removed in 3.16)")
    x = tf.ones((4, 50))
    for training in (True, False, None):  # a node's own training= is overridden unless None
        ours = keras_compat.operation_caller(keras.layers.Dropout(0.5, seed=2), training)
        theirs = functional.operation_fn(keras.layers.Dropout(0.5, seed=2), training=training)
        np.testing.assert_array_equal(
            ours(x, training=not training).numpy(), theirs(x, training=not training).numpy()
        )


def test_standardize_inputs_orders_like_model_inputs():
    model = _functional()
    a, b = tf.ones((1, 4)), tf.zeros((1, 4))
    flat = keras_compat.standardize_inputs(model, {"b": b, "a": a})
    expected = [{"a": a, "b": b}[x.name] for x in model.inputs]
    assert len(flat) == 2 and all(t is e for t, e in zip(flat, expected)), VERSION


def test_inputs_and_outputs_structure():
    model = _functional()
    outputs = keras_compat.outputs_structure(model)
    assert isinstance(outputs, dict) and set(outputs) == {"y", "h"}, f"{VERSION}: {outputs}"
    inputs = keras_compat.inputs_structure(model)
    assert isinstance(inputs, dict) and set(inputs) == {"a", "b"}, f"{VERSION}: {inputs}"
    packed = keras.tree.pack_sequence_as(outputs, [1, 2])
    assert set(packed) == {"y", "h"}, VERSION


# ------------------------------------------------------------------------------ training internals
def _compiled(**kwargs):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", **kwargs)
    return model


def test_compiled_loss_is_the_compiled_loss():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert keras_compat.compiled_loss(model) is None, VERSION
    model.compile(optimizer="sgd", loss="mse")
    y, y_pred = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])
    value = keras_compat.compiled_loss(model)(y, y_pred, None)
    assert float(value) == pytest.approx(5.0), f"{VERSION}: compiled mse gave {float(value)}"


def test_loss_tracker_is_what_fit_reports():
    model = _compiled()
    tracker = keras_compat.loss_tracker(model)
    tracker.update_state(3.0)
    assert any(m is tracker for m in model.metrics), f"{VERSION}: the loss tracker is not a model metric"
    assert float(tracker.result()) == 3.0, VERSION


def test_set_initial_epoch_resumes_fit():
    model = _compiled()

    class Resume(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keras_compat.set_initial_epoch(self.model, 3)

    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=5, verbose=0, callbacks=[Resume()])
    assert history.epoch == [3, 4], f"{VERSION}: fit ran epochs {history.epoch}"
    keras_compat.set_initial_epoch(model, None)
    assert model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=2, verbose=0).epoch == [0, 1], VERSION


def test_flat_compiled_losses_name_each_outputs_loss():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert keras_compat.flat_compiled_losses(model) == [], VERSION
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    keras_compat.compiled_loss(model)(tf.ones((1, 1)), tf.zeros((1, 1)), None)  # built on first use
    (entry,) = keras_compat.flat_compiled_losses(model)
    assert entry.loss.reduction == "sum", f"{VERSION}: {entry}"


def test_loss_code_is_a_wrapped_function_or_the_loss_class():
    def worst(y_true, y_pred):
        return tf.reduce_max(y_true - y_pred)

    class Own(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return y_true - y_pred

    inp = keras.Input((2,))
    model = keras.Model(inp, {"a": keras.layers.Dense(1)(inp), "b": keras.layers.Dense(1)(inp), "c": inp})
    model.compile(optimizer="sgd", loss={"a": worst, "b": "mse", "c": Own()})
    y = {"a": tf.ones((1, 1)), "b": tf.ones((1, 1)), "c": tf.ones((1, 2))}
    keras_compat.compiled_loss(model)(
        y, {"a": tf.ones((1, 1)), "b": tf.ones((1, 1)), "c": tf.ones((1, 2))}, None
    )
    codes = [keras_compat.loss_code(entry.loss) for entry in keras_compat.flat_compiled_losses(model)]
    assert codes[0] is worst and codes[2] is Own, f"{VERSION}: {codes}"
    assert codes[1].__module__.startswith("keras."), f"{VERSION}: {codes[1]} ({codes[1].__module__})"


def test_compiled_loss_metrics_are_a_loss_mean_per_output():
    inp = keras.Input((2,))
    model = keras.Model(inp, {"a": keras.layers.Dense(1)(inp), "b": keras.layers.Dense(1)(inp)})
    assert keras_compat.compiled_loss_metrics(model) == [], VERSION  # no compiled loss
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
    assert keras_compat.compiled_loss_metrics(model) is None, VERSION  # not built yet
    y = {"a": tf.ones((1, 1)), "b": tf.ones((1, 1))}
    keras_compat.compiled_loss(model)(y, {"a": tf.zeros((1, 1)), "b": tf.zeros((1, 1))}, None)
    names = sorted(m.name for m in keras_compat.compiled_loss_metrics(model))
    assert names == ["a_loss", "b_loss"], f"{VERSION}: {names}"


def test_recorded_metric_updates_update_nothing_and_are_replayable():
    metric, ours = keras.metrics.Mean(), keras.metrics.Sum()
    with keras_compat.recorded_metric_updates() as calls:
        metric.update_state(3.0, sample_weight=2)
        ours.update_state(tf.constant(5.0))
    assert float(metric.result()) == 0.0 and float(ours.result()) == 0.0, VERSION
    assert calls[0] == (metric, (3.0,), {"sample_weight": 2}), VERSION
    for m, args, kwargs in calls:  # out of the scope: the calls update
        m.update_state(*args, **kwargs)
    assert float(metric.result()) == 3.0 and float(ours.result()) == 5.0, VERSION


def test_model_compute_loss_serves_old_style_overrides():
    class OldStyle(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):  # no training=
            return super().compute_loss(x, y, y_pred, sample_weight) * 2.0

    for cls, factor in ((keras.Sequential, 1.0), (OldStyle, 2.0)):
        model = cls([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        y, y_pred = tf.constant([[1.0]]), tf.constant([[0.0]])
        loss = keras_compat.model_compute_loss(model, None, y, y_pred, None, training=True)
        assert float(loss) == pytest.approx(factor), f"{VERSION}: {cls.__name__} gave {float(loss)}"


def test_aggregate_additional_loss_sums_and_casts():
    model = _compiled()
    total = keras_compat.aggregate_additional_loss(model, tf.constant([1, 2, 3]))
    assert total.dtype == tf.float32 and float(total) == 6.0, f"{VERSION}: {total}"


def test_clear_losses_forgets_earlier_calls():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activity_regularizer="l2")])
    model(tf.ones((1, 2)))
    assert len(model.losses) == 1, VERSION
    keras_compat.clear_losses(model)
    assert model.losses == [], f"{VERSION}: {model.losses}"


def test_losses_listed_is_what_compute_loss_adds():
    class Added(keras.layers.Layer):
        def call(self, x):
            self.add_loss(tf.reduce_sum(x))
            return x

    model = keras.Sequential(
        [keras.Input((2,)), Added(), keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L1(1.0))]
    )
    model.compile(loss="mse")
    x, y = tf.ones((1, 2)), tf.zeros((1, 1))
    y_pred = model(x)
    kernel = model.layers[-1].kernel
    # What tf_gpipe.regularization relies on: the added losses first, the weights' last.
    assert [float(v) for v in model.losses] == [2.0, float(tf.reduce_sum(tf.abs(kernel)))], VERSION
    with keras_compat.losses_listed(model, [tf.constant(5.0)]):
        assert [float(v) for v in model.losses] == [5.0], VERSION
        listed = float(model.compute_loss(x, y, y_pred))
    assert listed == pytest.approx(float(tf.reduce_mean(tf.square(y_pred))) + 5.0), f"{VERSION}: {listed}"
    assert len(model.losses) == 2, VERSION  # computed again outside the scope
    object.__delattr__(model, "_losses_override")  # as a Keras without it would have it
    with (
        pytest.raises(keras_compat.KerasCompatError, match=r"no longer provides"),
        keras_compat.losses_listed(model, []),
    ):
        pass


def test_unscale_loss_for_distribution_is_the_identity_on_one_replica():
    loss = tf.constant(3.0)
    assert float(keras_compat.unscale_loss_for_distribution(loss)) == 3.0, VERSION


def test_sequential_functional_holds_the_graph():
    model = keras.Sequential([keras.layers.Dense(2)])
    assert keras_compat.sequential_functional(model) is None, VERSION
    model.build((None, 3))
    functional = keras_compat.sequential_functional(model)
    assert functional is not None and tuple(functional.inputs[0].shape) == (None, 3), VERSION
    assert len(keras_compat.functional_nodes(functional)) == 1, VERSION


# ------------------------------------------------------------------------------ failing loudly
def test_a_missing_mask_api_fails_loudly_naming_the_keras_version(monkeypatch):
    """The 3.16 break: get/set_keras_mask gone from where tf_gpipe looks. A stage must not
    silently stop passing masks on (cell.attach_mask once swallowed the AttributeError)."""
    from keras.src.backend.common import masking

    monkeypatch.delattr(masking, "set_keras_mask")
    x, mask = tf.ones((1, 2, 3)), tf.constant([[True, False]])
    with pytest.raises(keras_compat.KerasCompatError, match=rf"Keras {keras.__version__} .*set_keras_mask"):
        attach_mask(x, mask)
    cell = Cell(0, [keras.layers.Dense(3)], "/device:CPU:0")
    with pytest.raises(keras_compat.KerasCompatError, match=r"tf_gpipe/keras_compat/"):
        cell.call(x, mask, training=False)


def test_a_missing_module_fails_loudly(monkeypatch):
    # get_keras_mask looks the module up in tf_gpipe.keras_compat.layers.
    monkeypatch.setattr(compat_layers, "_masking", lambda: private_module("keras.src.no_such", "x"))
    with pytest.raises(
        keras_compat.KerasCompatError, match=r"no longer provides the module keras\.src\.no_such"
    ):
        keras_compat.get_keras_mask(tf.ones(1))


@pytest.mark.parametrize(
    "hook, make, private",
    [
        (keras_compat.call_takes_mask, lambda: keras.layers.Dense(2), "_call_has_mask_arg"),
        (keras_compat.call_takes_training, lambda: keras.layers.Dense(2), "_call_has_training_arg"),
        (keras_compat.keep_input_dtypes, lambda: keras.layers.Dense(2), "_convert_input_args"),
        (keras_compat.backing_variable, lambda: keras.Variable(np.zeros(2, "float32")), "_value"),
        (keras_compat.outputs_structure, _functional, "_outputs_struct"),
        (keras_compat.functional_nodes, _functional, "_nodes_by_depth"),
        (keras_compat.compiled_loss, _compiled, "_compile_loss"),
        (
            keras_compat.sequential_functional,
            lambda: keras.Sequential([keras.layers.Dense(1)]),
            "_functional",
        ),
        # Each update reads the step count once per device (``update_on_variable_device``).
        (keras_compat.update_on_variable_device, lambda: keras.optimizers.Adam(), "_iterations"),
    ],
)
def test_a_missing_private_attribute_fails_loudly(hook, make, private):
    obj = make()
    assert private in vars(obj), f"{VERSION}: {private} is not where keras_compat looks"
    object.__delattr__(obj, private)  # as a Keras without it would have it
    with pytest.raises(keras_compat.KerasCompatError, match=rf"Keras {keras.__version__} no longer provides"):
        hook(obj)


@pytest.mark.parametrize(
    "base, private, make",
    [
        (
            keras.layers.Layer,
            "_maybe_build",
            lambda: tf_gpipe.PipelineModel([keras.layers.Dense(2)]),
        ),
        (
            next(c for c in keras.Model.__mro__ if "_maybe_symbolic_build" in vars(c)),
            "_maybe_symbolic_build",
            lambda: tf_gpipe.PipelineModel([keras.layers.Dense(2)]),
        ),
        (keras.StatelessScope, "add_update", keras_compat.RecordingScope),
    ],
)
def test_a_missing_overridden_method_fails_loudly(monkeypatch, base, private, make):
    """An override of a method Keras no longer has would silently never run."""
    make()
    monkeypatch.delattr(base, private)
    with pytest.raises(keras_compat.KerasCompatError, match=rf"Keras {keras.__version__} .*{private}"):
        make()


def test_pipeline_model_still_passes_masks_through_the_hooks():
    """End to end: a mask made in stage 0 reaches stage 1's LSTM through keras_compat."""
    layers = [keras.layers.Embedding(10, 4, mask_zero=True), keras.layers.LSTM(3)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=2)
    tokens = tf.constant([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0]])
    seq = keras.Sequential(layers)
    np.testing.assert_allclose(pm(tokens).numpy(), seq(tokens).numpy(), rtol=1e-5, atol=1e-6)
