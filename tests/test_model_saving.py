"""Saving and loading: config round-trip, .keras files, weight order, to_sequential, tf.train.Checkpoint."""

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import PipelineModel
from tf_gpipe import devices as devices_lib

IN_DIM, OUT_DIM = 5, 3


def _dense_layers():
    return [
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(OUT_DIM),
    ]


def _bn_dropout_layers():
    return [
        keras.layers.Dense(8, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(OUT_DIM),
    ]


MAKERS = {"dense": _dense_layers, "bn_dropout": _bn_dropout_layers}


def _data(n=16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, IN_DIM).astype("float32")
    y = rng.randn(n, OUT_DIM).astype("float32")
    return x, y


def _fit_steps(model, steps, seed=0):
    """Exactly `steps` optimizer steps (batch 8)."""
    x, y = _data(8 * steps, seed=seed)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _trained(kind, num_stages, **kwargs):
    model = PipelineModel(MAKERS[kind](), num_stages=num_stages, num_micro_batches=2, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    _fit_steps(model, 2)
    return model


def _assert_weights_equal(a_list, b_list, exact=True):
    a_list, b_list = list(a_list), list(b_list)
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _assert_some_weight_differs(a_list, b_list):
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(a_list, b_list))


# ---------------------------------------------------------------- get_config / from_config


def test_config_round_trip(cpu_devices):
    devices = [cpu_devices[2], cpu_devices[0], cpu_devices[3]]
    model = PipelineModel(
        _bn_dropout_layers(),
        balance=[1, 3, 1],
        num_micro_batches=3,
        devices=devices,
        remat="except_last",
        name="piped",
    )
    x, _ = _data(6)
    model(tf.constant(x))
    config = model.get_config()
    json.dumps(config)  # plain JSON: a .keras file can hold it

    clone = PipelineModel.from_config(config)
    assert isinstance(clone, PipelineModel)
    assert clone.name == "piped"
    assert clone.balance == [1, 3, 1]
    assert clone.num_stages == 3
    assert clone.num_micro_batches == 3
    assert clone.remat == "except_last"
    assert clone.devices == ["/device:CPU:2", "/device:CPU:0", "/device:CPU:3"]
    assert [type(layer).__name__ for layer in clone.stage_layers] == [
        "Dense",
        "BatchNormalization",
        "Dropout",
        "Dense",
        "Dense",
    ]
    assert clone.stage_layers[2].rate == 0.25
    assert clone.stage_layers is not model.stage_layers
    assert all(a is not b for a, b in zip(clone.stage_layers, model.stage_layers))
    assert clone.get_config() == config

    # Same architecture: the weights transfer and the outputs agree.
    clone(tf.constant(x))
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(
        np.asarray(clone(tf.constant(x))), np.asarray(model(tf.constant(x))), rtol=1e-6, atol=1e-6
    )


def test_config_round_trip_unbuilt_default_devices():
    model = PipelineModel(_dense_layers(), num_stages=2, num_micro_batches=4)
    config = model.get_config()
    assert config["devices"] is None
    assert config["balance"] == [2, 1]
    clone = PipelineModel.from_config(config)
    assert clone.balance == [2, 1] and clone.num_micro_batches == 4 and clone.remat == "always"
    assert clone.devices == model.devices
    assert clone.get_config() == config


@pytest.mark.parametrize("key", ["micro_batch_loops", "tick_loop"])
def test_a_config_names_the_micro_batch_loops_either_way(key):
    config = PipelineModel(_dense_layers(), num_stages=2, num_micro_batches=4).get_config()
    del config["micro_batch_loops"]
    config[key] = False  # saved with the loops switched off, under either name
    clone = PipelineModel.from_config(config)
    assert clone.micro_batch_loops is False
    assert clone.get_config()["micro_batch_loops"] is False


def test_tick_loop_is_the_deprecated_name_of_micro_batch_loops():
    with pytest.warns(FutureWarning, match="micro_batch_loops"):
        model = PipelineModel(_dense_layers(), num_stages=2, num_micro_batches=4, tick_loop=False)
    assert model.micro_batch_loops is False


def test_from_config_with_unavailable_devices_falls_back(cpu_devices):
    model = PipelineModel(_dense_layers(), num_stages=2, devices=cpu_devices[2:4])
    config = model.get_config()
    config["devices"] = ["/device:GPU:5", "/device:GPU:6"]  # saved on a GPU machine
    with pytest.warns(UserWarning, match="not all available"):
        clone = PipelineModel.from_config(config)
    assert clone.devices == devices_lib.default_devices(2)  # the defaults here


# ---------------------------------------------------------------- .keras files


@pytest.mark.parametrize("kind, num_stages", [("dense", 2), ("bn_dropout", 3)])
def test_save_load_keras_file(tmp_path, kind, num_stages):
    model = _trained(kind, num_stages)
    x, _ = _data(10, seed=3)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)

    assert isinstance(loaded, PipelineModel)
    assert loaded.balance == model.balance
    assert loaded.num_micro_batches == model.num_micro_batches
    assert loaded.remat == model.remat
    assert loaded.devices == model.devices
    assert [w.path.split("/")[-1] for w in loaded.weights] == [w.path.split("/")[-1] for w in model.weights]
    _assert_weights_equal(loaded.get_weights(), model.get_weights())
    np.testing.assert_array_equal(
        loaded.predict(x, batch_size=5, verbose=0), model.predict(x, batch_size=5, verbose=0)
    )
    # Inference with training=False must be deterministic even with Dropout.
    np.testing.assert_array_equal(
        np.asarray(loaded(tf.constant(x), training=False)), np.asarray(model(tf.constant(x), training=False))
    )


def test_save_load_restores_compile_state(tmp_path):
    model = _trained("bn_dropout", 3)
    path = tmp_path / "m.keras"
    model.save(path)
    with warnings.catch_warnings():
        # No "compile() was not called" warning (others, such as stages sharing the one GPU of
        # a machine, may come).
        warnings.filterwarnings("error", message=".*compile", category=UserWarning)
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    _assert_weights_equal(
        [v.numpy() for v in loaded.optimizer.variables],
        [v.numpy() for v in model.optimizer.variables],
    )
    x, y = _data(8, seed=5)
    np.testing.assert_allclose(loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6)
    _fit_steps(loaded, 1, seed=7)
    assert int(loaded.optimizer.iterations.numpy()) == 3


def _functional_source():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((IN_DIM,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.Add()([h, keras.layers.Dense(8)(h)])
    return keras.Model(inputs, keras.layers.Dense(OUT_DIM)(keras.layers.BatchNormalization()(h)))


@pytest.mark.parametrize("source", ["layers", "from_model"])
def test_legacy_h5_checkpoint_loads(tmp_path, source):
    """keras.callbacks.ModelCheckpoint("best_model.h5") writes Keras' legacy format, which
    looks the model's class up by its bare name."""
    if source == "layers":
        model = PipelineModel([keras.Input((IN_DIM,))] + _dense_layers(), num_stages=2, num_micro_batches=2)
    else:
        model = PipelineModel.from_model(_functional_source(), num_stages=2, num_micro_batches=2)
    # Objects, not strings: Keras' legacy loader cannot read back a loss given as "mse".
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError())
    x, y = _data(16, seed=1)
    path = str(tmp_path / "best_model.h5")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, PipelineModel)
    assert loaded.balance == model.balance and loaded.num_micro_batches == 2
    _assert_weights_equal(loaded.get_weights(), model.get_weights())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    if source == "layers":  # the legacy loader leaves an optimizer fit cannot use: compile again
        loaded.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        _fit_steps(loaded, 1)
        _assert_some_weight_differs(loaded.get_weights(), model.get_weights())


# ---------------------------------------------------------------- weight order vs keras.Sequential


def test_weight_order_matches_sequential():
    model = PipelineModel(_bn_dropout_layers(), num_stages=3)
    model.build((None, IN_DIM))
    seq = keras.Sequential(_bn_dropout_layers())
    seq.build((None, IN_DIM))
    assert [w.path.split("/")[-1] for w in model.weights] == [w.path.split("/")[-1] for w in seq.weights]
    assert [w.shape for w in model.get_weights()] == [w.shape for w in seq.get_weights()]
    # The stage split does not reorder: stage by stage, layer by layer.
    assert [id(v) for v in model.weights] == [
        id(v) for cell in model.cells for layer in cell.layers for v in layer.weights
    ]


def test_train_pipelined_serve_unsplit():
    model = _trained("bn_dropout", 3)
    bn = model.stage_layers[1]
    assert not np.allclose(bn.moving_mean.numpy(), 0.0)  # training moved the statistics
    seq = keras.Sequential(_bn_dropout_layers())
    seq.build((None, IN_DIM))
    seq.set_weights(model.get_weights())
    x, _ = _data(12, seed=4)
    np.testing.assert_allclose(seq.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_train_unsplit_serve_pipelined(cpu_devices):
    seq = keras.Sequential(_bn_dropout_layers())
    seq.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    _fit_steps(seq, 2)
    devices = [cpu_devices[3], cpu_devices[1], cpu_devices[2]]
    model = PipelineModel(_bn_dropout_layers(), num_stages=3, num_micro_batches=3, devices=devices)
    model.build((None, IN_DIM))
    model.set_weights(seq.get_weights())
    _assert_weights_equal(model.get_weights(), seq.get_weights())
    x, _ = _data(12, seed=4)
    np.testing.assert_allclose(model.predict(x, verbose=0), seq.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # set_weights assigns in place: the variables stay on their stages' devices.
    for cell in model.cells:
        for layer in cell.layers:
            for v in layer.weights:
                assert v.value.device.endswith(cell.device.split("device:")[-1]), (v.path, cell.device)


def test_to_sequential():
    model = _trained("bn_dropout", 3)
    seq = model.to_sequential()
    assert isinstance(seq, keras.Sequential) and not isinstance(seq, PipelineModel)
    assert len(seq.layers) == 5
    _assert_weights_equal(seq.get_weights(), model.get_weights())
    x, _ = _data(12, seed=4)
    np.testing.assert_allclose(seq.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # A copy: its variables are its own, training the pipeline leaves it unchanged.
    assert not {id(v) for v in seq.weights} & {id(v) for v in model.weights}
    before = seq.get_weights()
    _fit_steps(model, 1, seed=9)
    _assert_some_weight_differs(model.get_weights(), before)
    _assert_weights_equal(seq.get_weights(), before)


def test_to_sequential_before_build_raises():
    with pytest.raises(ValueError, match="build or call"):
        PipelineModel(_dense_layers(), num_stages=2).to_sequential()


def _load_served(path):
    """A SavedModel loaded as docs/saving_and_serving.md says: its variables on the devices
    it records (all loaded on one device, a GPU stage could not read them)."""
    policy = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
    options = tf.saved_model.LoadOptions(experimental_variable_policy=policy)
    return tf.saved_model.load(str(path), options=options)


def test_export_serves_what_the_model_predicts_each_stage_weights_on_its_device(tmp_path, cpu_devices):
    """``model.export(path)`` after ``fit`` alone (the model never called directly, so Keras
    cannot infer a signature): a SavedModel whose ``serve`` gives ``predict``'s outputs. It
    keeps each variable's device: loaded with TensorFlow's variable-device policy, every
    stage's weights sit on its stage's device, beside the ops that read them (loaded without
    it, TensorFlow puts them all on one device, which a GPU stage cannot read)."""
    # Three devices of their own on any machine (one GPU alone would take all three stages).
    model = _trained("bn_dropout", 3, devices=cpu_devices[:3])
    model.export(str(tmp_path / "served"), verbose=False)
    served = _load_served(tmp_path / "served")
    placed = sorted((v.name, v.device) for v in served.variables)
    assert placed == sorted((v.value.name, v.value.device) for v in model.variables)
    assert len({d for _, d in placed}) == 3
    x, _ = _data(7, seed=4)  # a batch size it was not built for
    np.testing.assert_allclose(served.serve(x).numpy(), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_export_keeps_the_input_dtype(tmp_path):
    """Token ids stay int32 in the exported signature (Keras alone would infer float32)."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Embedding(50, 4), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)]
    model = PipelineModel(layers, num_stages=2, num_micro_batches=2)
    ids = np.random.RandomState(0).randint(0, 50, (6, 5)).astype("int32")
    model(ids)
    model.export(str(tmp_path / "served"), verbose=False)
    served = _load_served(tmp_path / "served")
    assert served.serve.concrete_functions[0].structured_input_signature[0][0].dtype == tf.int32
    np.testing.assert_allclose(served.serve(ids).numpy(), model.predict(ids, verbose=0), rtol=1e-6)


def test_export_before_build_raises():
    with pytest.raises(ValueError, match="build or call the model before export"):
        PipelineModel(_dense_layers(), num_stages=2).export("unused")


# ---------------------------------------------------------------- tf.train.Checkpoint


@pytest.mark.parametrize(
    "kind",
    [
        "dense",
        "bn_dropout",
    ],
)
def test_tf_checkpoint_restores_weights_and_optimizer(tmp_path, kind):
    opt = keras.optimizers.Adam(0.01)
    model = PipelineModel(MAKERS[kind](), num_stages=3, num_micro_batches=2)
    model.compile(optimizer=opt, loss="mse")
    _fit_steps(model, 2)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    save_path = ckpt.save(str(tmp_path / "ckpt"))
    saved_weights = model.get_weights()
    saved_opt = [v.numpy() for v in opt.variables]
    assert int(opt.iterations.numpy()) == 2

    _fit_steps(model, 2, seed=1)
    assert int(opt.iterations.numpy()) == 4
    _assert_some_weight_differs(model.get_weights(), saved_weights)

    ckpt.restore(save_path).assert_consumed()
    assert int(opt.iterations.numpy()) == 2
    _assert_weights_equal(model.get_weights(), saved_weights)
    _assert_weights_equal([v.numpy() for v in opt.variables], saved_opt)


def test_tf_checkpoint_model_only(tmp_path):
    model = PipelineModel(_dense_layers(), num_stages=3)
    model.build((None, IN_DIM))
    saved = model.get_weights()
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "model_only"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert any(name.startswith("model/") for name in names), names
    model.set_weights([np.zeros_like(w) for w in saved])
    tf.train.Checkpoint(model=model).read(path).assert_consumed()
    _assert_weights_equal(model.get_weights(), saved)


# ---------------------------------------------------------------- input specs


def test_from_sequential_with_input(tmp_path):
    seq = keras.Sequential([keras.Input((IN_DIM,))] + _dense_layers())
    model = PipelineModel(seq, num_stages=3)
    assert model.built  # the Input fixed the shape: no call needed
    assert model.balance == [1, 1, 1]
    assert model.get_build_config()["input_spec"]["shape"] == [None, IN_DIM]
    x, _ = _data(6)
    np.testing.assert_allclose(
        np.asarray(model(tf.constant(x))), np.asarray(seq(tf.constant(x))), rtol=1e-6, atol=1e-6
    )  # the very same layers and weights
    path = tmp_path / "from_seq.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.built
    assert loaded.get_build_config() == model.get_build_config()
    np.testing.assert_array_equal(np.asarray(loaded(tf.constant(x))), np.asarray(model(tf.constant(x))))


def test_from_list_with_input_layer():
    model = PipelineModel([keras.layers.InputLayer(shape=(IN_DIM,))] + _dense_layers(), num_stages=3)
    assert model.built
    assert len(model.stage_layers) == 3  # the InputLayer is not a stage layer
    assert model.balance == [1, 1, 1]
    assert model.get_weights()[0].shape == (IN_DIM, 8)
    assert model.get_build_config()["input_spec"]["shape"] == [None, IN_DIM]


def test_from_list_with_keras_input(tmp_path):
    model = PipelineModel([keras.Input(shape=(IN_DIM,))] + _dense_layers(), num_stages=3)
    assert model.built
    assert model.balance == [1, 1, 1]
    assert model.get_weights()[0].shape == (IN_DIM, 8)
    x, _ = _data(6)
    assert model(tf.constant(x)).shape == (6, OUT_DIM)
    path = tmp_path / "from_input.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(tf.constant(x))), np.asarray(model(tf.constant(x))))
