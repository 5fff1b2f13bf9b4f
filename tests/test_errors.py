"""Bad arguments and bad inputs fail fast with a message that names the problem and the fix."""

import importlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gpipe
from tf_gpipe import PipelineModel


def _dense(n, units=4):
    return [keras.layers.Dense(units) for _ in range(n)]


class _AddInputs(keras.layers.Layer):
    """Adds the "a" and "b" entries of a dict input."""

    def call(self, x):
        return x["a"] + x["b"]

    def compute_output_shape(self, input_shape):
        return input_shape["a"]


def _error(exc_type, fn):
    """The message of the `exc_type` that `fn()` raises; fails if it raises nothing."""
    with pytest.raises(exc_type) as info:
        fn()
    return str(info.value)


# ---------------------------------------------------------------- construction


def test_empty_layers():
    with pytest.raises(ValueError, match=r"`layers` is empty") as info:
        PipelineModel([])
    assert "at least one layer" in str(info.value)


def test_empty_sequential():
    with pytest.raises(ValueError, match=r"`layers` is empty"):
        PipelineModel(keras.Sequential([]), num_stages=1)


def test_more_stages_than_layers():
    with pytest.raises(ValueError) as info:
        PipelineModel(_dense(2), num_stages=3)
    msg = str(info.value)
    assert "num_stages=3" in msg
    assert "number of layers (2)" in msg
    assert "num_stages<=2" in msg  # the fix


def test_num_stages_not_a_positive_int():
    for num_stages in (0, -2, 1.5):
        msg = _error(ValueError, lambda: PipelineModel(_dense(2), num_stages=num_stages))
        assert "num_stages must be an integer >= 1" in msg and repr(num_stages) in msg


def test_balance_does_not_sum_to_number_of_layers():
    with pytest.raises(ValueError) as info:
        PipelineModel(_dense(3), balance=[1, 1])
    msg = str(info.value)
    assert "balance=[1, 1]" in msg
    assert "sums to 2" in msg and "3 layers" in msg
    assert "balance=[2, 1]" in msg  # a balance that would work


def test_balance_too_large_sum():
    with pytest.raises(ValueError, match=r"sums to 5 but there are 3 layers"):
        PipelineModel(_dense(3), balance=[2, 3])


def test_balance_length_differs_from_num_stages():
    with pytest.raises(ValueError) as info:
        PipelineModel(_dense(3), num_stages=2, balance=[1, 1, 1])
    msg = str(info.value)
    assert "balance has 3 stages" in msg and "num_stages=2" in msg
    assert "pass num_stages=3" in msg


def test_balance_entries_not_positive_ints():
    for balance in ([3, 0], [4, -1], [1.5, 1.5]):
        msg = _error(ValueError, lambda: PipelineModel(_dense(3), balance=balance))
        assert f"balance={balance}" in msg and "positive integers" in msg


def test_empty_balance():
    msg = _error(ValueError, lambda: PipelineModel(_dense(3), balance=[]))
    assert "balance=[]" in msg and "positive integers" in msg


def test_device_count_differs_from_stage_count(cpu_devices):
    with pytest.raises(ValueError) as info:
        PipelineModel(_dense(3), num_stages=2, devices=cpu_devices[:3])
    msg = str(info.value)
    assert "got 3 devices for 2 stages" in msg
    assert "one device per stage" in msg


def test_device_count_differs_from_balance(cpu_devices):
    with pytest.raises(ValueError, match=r"got 1 devices for 2 stages"):
        PipelineModel(_dense(3), balance=[2, 1], devices=cpu_devices[:1])


def test_unknown_device_lists_available_devices():
    for bad in ("GPU:7", "CPU:9", "/device:TPU:0"):
        msg = _error(ValueError, lambda: PipelineModel(_dense(2), devices=["CPU:0", bad]))
        assert "unknown device" in msg and repr(bad) in msg
        for name in ("/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:CPU:3"):
            assert name in msg
        assert "configure_virtual_cpus" in msg  # how to get more devices on a CPU machine


def test_unparsable_device():
    with pytest.raises(ValueError, match=r"cannot parse device 'blah::'"):
        PipelineModel(_dense(2), devices=["CPU:0", "blah::"])


def test_devices_as_single_string():
    with pytest.raises(TypeError) as info:
        PipelineModel(_dense(2), devices="CPU:0")
    msg = str(info.value)
    assert "one device per stage" in msg and "['CPU:0', ...]" in msg


def test_num_micro_batches_must_be_positive_int():
    for value in (0, -1, 1.5, True, None, "2"):
        msg = _error(ValueError, lambda: PipelineModel(_dense(2), num_stages=2, num_micro_batches=value))
        assert "num_micro_batches must be an integer >= 1" in msg
        assert f"got {value!r}" in msg


def test_unknown_remat_mode():
    for remat in ("sometimes", "ALWAYS", True, None):
        msg = _error(ValueError, lambda: PipelineModel(_dense(2), num_stages=2, remat=remat))
        assert "unknown remat mode" in msg and repr(remat) in msg
        for mode in ("'always'", "'except_last'", "'never'"):
            assert mode in msg


def test_non_layer_in_layers():
    for bad, kind in (("relu", "str"), (tf.nn.relu, "function"), (np.ones(3), "ndarray")):
        msg = _error(
            TypeError,
            lambda: PipelineModel([keras.layers.Dense(4), bad, keras.layers.Dense(4)], num_stages=2),
        )
        assert "layers[1]" in msg and kind in msg and "not a Keras layer" in msg


def test_single_layer_instead_of_list():
    layer = keras.layers.Dense(4, name="lonely")
    with pytest.raises(TypeError) as info:
        PipelineModel(layer)
    msg = str(info.value)
    assert "'lonely'" in msg and "pass [layer]" in msg


def _functional_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4)(inputs)
    return keras.Model(inputs, keras.layers.Add()([h, keras.layers.Dense(4)(h)]), name="residual")


def test_functional_model_instead_of_layers_names_from_model():
    msg = _error(TypeError, lambda: PipelineModel(_functional_model(), num_stages=2))
    assert "'residual'" in msg and "PipelineModel.from_model(model, num_stages=" in msg


@pytest.mark.parametrize("layer", [keras.layers.Add, keras.layers.Concatenate, "attention"])
def test_layer_taking_several_inputs_names_from_model(layer):
    if layer == "attention":
        several = keras.layers.MultiHeadAttention(num_heads=1, key_dim=2, name="several")
    else:
        several = layer(name="several")
    msg = _error(Exception, lambda: PipelineModel([keras.Input((3, 4)), keras.layers.Dense(4), several]))
    assert "'several'" in msg and "takes several tensors" in msg and "PipelineModel.from_model(" in msg
    # A layer that fails for another reason gets no such hint.
    model = PipelineModel([keras.layers.Reshape((5,))])
    msg = _error(Exception, lambda: model.build((None, 4)))
    assert "Reshape" in msg or "reshape" in msg
    assert "from_model" not in msg


def test_not_iterable_layers():
    with pytest.raises(TypeError, match=r"list of Keras layers or a keras.Sequential, got int"):
        PipelineModel(3)


def test_input_layer_not_first():
    with pytest.raises(ValueError, match=r"layers\[1\] is an InputLayer; only the first"):
        PipelineModel([keras.layers.Dense(4), keras.layers.InputLayer(shape=(4,))])


# ---------------------------------------------------------------- calling


def test_build_without_shape():
    model = PipelineModel(_dense(2), num_stages=2)
    with pytest.raises(ValueError, match=r"model.build\(\(None, 32\)\)"):
        model.build()


def test_to_sequential_before_build():
    model = PipelineModel(_dense(2), num_stages=2)
    with pytest.raises(ValueError, match=r"build or call the model before to_sequential"):
        model.to_sequential()


def test_set_weights_before_build_says_how_to_build():
    model = PipelineModel(_dense(2), num_stages=2)
    msg = _error(ValueError, lambda: model.set_weights([np.ones((3, 4)), np.ones(4)] * 2))
    assert "build or call the model before set_weights()" in msg
    assert "model.build((None, ...))" in msg and "keras.Input(shape=...)" in msg


def test_from_model_on_an_unbuilt_sequential_says_how_to_build_it():
    seq = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)], name="no_input")
    msg = _error(ValueError, lambda: PipelineModel.from_model(seq, num_stages=2))
    assert "'no_input'" in msg and "not built" in msg
    assert "keras.Input(shape=...)" in msg and "model.build((None, ...))" in msg
    seq.build((None, 5))  # the fix the message names
    assert PipelineModel.from_model(seq, num_stages=2).balance == [1, 1]


def test_from_model_takes_num_stages_from_balance():
    model = _functional_model()  # 3 nodes: Dense, Dense, Add
    pm = PipelineModel.from_model(model, balance=[2, 1])
    assert pm.num_stages == 2 and len(pm.cells) == 2
    # balance shows where the model was cut, in nodes (layer calls), not one per stage.
    assert pm.balance == [2, 1]
    assert PipelineModel.from_model(model, num_stages=2).balance == [2, 1]
    assert PipelineModel.from_model(model).balance == [3]
    with pytest.raises(ValueError, match=r"balance has 2 stages but num_stages=3"):
        PipelineModel.from_model(model, num_stages=3, balance=[2, 1])


def test_more_stages_than_cpus_warns_as_for_gpus(cpu_devices, monkeypatch):
    from test_devices import hide_gpus

    hide_gpus(monkeypatch)
    expected = r"6 stages on 4 CPU.*devices=\[\.\.\.\].*configure_virtual_cpus\(6\)"
    with pytest.warns(UserWarning, match=expected):
        model = PipelineModel(_dense(6), num_stages=6)
    assert model.devices == [cpu_devices[k % 4] for k in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one CPU per stage: nothing to warn about
        PipelineModel(_dense(4), num_stages=4)


def test_another_keras_backend_fails_clearly_at_import_and_construction(monkeypatch):
    # Only the TensorFlow backend is installed here: pretend Keras reports another one.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    for attempt in (lambda: importlib.reload(tf_gpipe), lambda: PipelineModel(_dense(1))):
        msg = _error(RuntimeError, attempt)
        assert "'jax' backend" in msg and "KERAS_BACKEND=tensorflow" in msg


def _check_scalar_message(msg):
    assert "scalar" in msg
    assert "batch axis" in msg
    assert "expand_dims" in msg  # the fix


def test_scalar_input_built_model():
    model = PipelineModel(_dense(2), num_stages=2, num_micro_batches=2)
    model.build((None, 3))
    with pytest.raises(ValueError) as info:
        model(tf.constant(1.0))
    _check_scalar_message(str(info.value))


def test_scalar_input_rank_agnostic_layers():
    # Layers that would accept a scalar: the batch-axis check itself must catch it.
    model = PipelineModel(
        [keras.layers.Activation("relu"), keras.layers.Activation("tanh")],
        num_stages=2,
        num_micro_batches=2,
    )
    with pytest.raises(ValueError) as info:
        model(tf.constant(1.0))
    _check_scalar_message(str(info.value))


def test_scalar_input_inside_tf_function():
    model = PipelineModel(_dense(2), num_stages=2, num_micro_batches=2)
    model.build((None, 3))

    @tf.function
    def f(x):
        return model(x)

    with pytest.raises(ValueError) as info:
        f(tf.constant(1.0))
    _check_scalar_message(str(info.value))


def test_scalar_input_unbuilt_model():
    model = PipelineModel(_dense(2), num_stages=2, num_micro_batches=2)
    with pytest.raises(ValueError) as info:
        model(tf.constant(1.0))
    _check_scalar_message(str(info.value))


def _dict_model():
    return PipelineModel([_AddInputs(), keras.layers.Dense(4)], num_stages=2, num_micro_batches=2)


def _check_batch_mismatch_message(msg):
    assert "disagree on the batch size" in msg
    assert "[4, 5]" in msg
    assert "same number of examples" in msg


def test_dict_inputs_disagree_on_batch_size_built_model():
    model = _dict_model()
    model({"a": tf.ones((4, 3)), "b": tf.ones((4, 3))})  # builds
    with pytest.raises(ValueError) as info:
        model({"a": tf.ones((4, 3)), "b": tf.ones((5, 3))})
    _check_batch_mismatch_message(str(info.value))


def test_tuple_inputs_disagree_on_batch_size():
    class First(keras.layers.Layer):
        def call(self, x):
            return x[0] * 2.0

        def compute_output_shape(self, input_shape):
            return input_shape[0]

    model = PipelineModel([First(), keras.layers.Dense(4)], num_stages=2, num_micro_batches=2)
    with pytest.raises(ValueError) as info:
        model((tf.ones((4, 3)), tf.ones((5, 2))))
    _check_batch_mismatch_message(str(info.value))


def test_dict_inputs_disagree_on_batch_size_unbuilt_model():
    model = _dict_model()
    with pytest.raises(ValueError) as info:
        model({"a": tf.ones((4, 3)), "b": tf.ones((5, 3))})
    _check_batch_mismatch_message(str(info.value))


def test_valid_arguments_do_not_raise(cpu_devices):
    # The counterpart of the checks above: the boundary values are accepted.
    model = PipelineModel(
        _dense(3), balance=[2, 1], devices=[cpu_devices[3], "cpu:1"], num_micro_batches=1, remat="never"
    )
    assert model.balance == [2, 1]
    assert model.devices == ["/device:CPU:3", "/device:CPU:1"]
    out = model(tf.ones((2, 3)))
    assert out.shape == (2, 4)


def test_numpy_input_accepted_like_sequential():
    # keras.Sequential converts a NumPy array passed positionally; so must a drop-in.
    layers = _dense(2)
    model = PipelineModel(layers, num_stages=2, num_micro_batches=2)
    x = np.arange(6, dtype="float32").reshape(2, 3)
    out = model(x)
    seq = keras.Sequential(layers)
    np.testing.assert_allclose(np.asarray(out), np.asarray(seq(x)), rtol=1e-6, atol=1e-6)


def test_a_layer_shared_across_stages_is_named_with_its_cost():
    shared = keras.layers.Dense(4, name="tied_dense")
    layers = [shared, keras.layers.Dense(4), shared]
    for kwargs in ({"balance": [1, 1, 1]}, {"num_stages": 3}):  # no split keeps it whole
        with pytest.warns(UserWarning) as info:
            PipelineModel(layers, **kwargs)
        msg = str(info[0].message)
        assert (
            "tied_dense" in msg and "stages [0, 2]" in msg and "stage 2, the last" in msg and "balance" in msg
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PipelineModel(layers, num_stages=1)  # all uses in one stage: nothing to say


def test_a_stateful_rnn_is_refused_with_the_fix():
    """A stateful RNN carries its state between batches row by row; micro-batches would hand
    one micro-batch's state to the next: refused by name, in a list and nested in a model
    given to from_model, before anything is built."""
    with pytest.raises(ValueError, match=r"'carry'.*stage 1.*stateful=True.*stateful=False"):
        PipelineModel(
            [keras.layers.Dense(4), keras.layers.LSTM(4, stateful=True, name="carry"), keras.layers.Dense(2)],
            num_stages=2,
            balance=[1, 2],
        )
    inner = keras.Sequential([keras.layers.GRU(4, stateful=True, name="inner_gru")], name="block")
    x = keras.Input((5, 3), batch_size=8)
    h = keras.layers.Dense(3)(x)
    model = keras.Model(x, keras.layers.Dense(2)(inner(h)))
    with pytest.raises(ValueError, match=r"'inner_gru'.*stateful=True"):
        PipelineModel.from_model(model, num_stages=2)


@pytest.mark.parametrize(
    "make", [lambda d: tf.distribute.MirroredStrategy(d[:2]), lambda d: tf.distribute.OneDeviceStrategy(d[0])]
)
def test_made_inside_a_distribution_strategy_scope_is_refused_with_the_fix(make, cpu_devices):
    """A strategy's variables are mirrored over its devices, not placed per stage: under
    MirroredStrategy the first step failed deep inside Keras (DistributedVariable.handle)."""
    strategy = make(cpu_devices)
    with strategy.scope():
        with pytest.raises(ValueError, match=r"inside \w+Strategy's scope.*outside.*ReplicatedPipeline"):
            PipelineModel(_dense(3), num_stages=2, devices=cpu_devices[2:4])
        inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)])
        with pytest.raises(ValueError, match=r"inside \w+Strategy's scope"):
            PipelineModel.from_model(inner, num_stages=2)
    PipelineModel(_dense(3), num_stages=2, devices=cpu_devices[2:4])  # outside: as ever
