"""tf_gpipe.model, the core property: a PipelineModel computes what keras.Sequential(layers) computes."""

import itertools
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, child_env, data, loss_and_grads, mlp_layers, pair
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_gpipe

REMATS = ["always", "except_last", "never"]


# Every K x M under "always"; the other modes pair each K with a different M, so that each
# meets every K and every M. Whether a stage is re-materialized depends on K and its index
# only (Pipeline.rematerializes), never on M: the per-micro-batch calls are the same.
OUTPUT_CASES = [(K, M, "always") for K, M in itertools.product([1, 2, 3, 4], [1, 2, 3, 8])]
OUTPUT_CASES += [(K, M, "except_last") for K, M in [(1, 3), (2, 8), (3, 1), (4, 2)]]
OUTPUT_CASES += [(K, M, "never") for K, M in [(1, 8), (2, 1), (3, 2), (4, 3)]]


@pytest.mark.parametrize("K,M,remat", OUTPUT_CASES)
def test_outputs_loss_gradients_match_unsplit(K, M, remat):
    seq, pm = pair(mlp_layers, (None, 8), num_stages=K, num_micro_batches=M, remat=remat)
    x, y = data(10)
    o1, l1, g1 = loss_and_grads(seq, x, y)
    o2, l2, g2 = loss_and_grads(pm, x, y)
    assert_all_close([o1, l1], [o2, l2])
    assert_all_close(g1, g2)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    K=st.integers(1, 4),
    M=st.integers(1, 9),
    n=st.integers(1, 13),
    remat=st.sampled_from(REMATS),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_property_random_shapes_in_tf_function(K, M, n, remat, dtype):
    keras.backend.clear_session()
    tol = 1e-5 if dtype == "float32" else 1e-10
    seq, pm = pair(
        lambda: mlp_layers(dtype=dtype, depth=4),
        (None, 8),
        input_dtype=dtype,
        num_stages=K,
        num_micro_batches=M,
        remat=remat,
    )
    x, y = data(n, dtype=dtype)
    # A None batch dimension: micro-batch sizes are only known at run time.
    spec = [tf.TensorSpec([None, 8], dtype), tf.TensorSpec([None], tf.int64)]
    f1 = tf.function(lambda a, b: loss_and_grads(seq, a, b), input_signature=spec)
    f2 = tf.function(lambda a, b: loss_and_grads(pm, a, b), input_signature=spec)
    o1, l1, g1 = f1(x, y)
    o2, l2, g2 = f2(x, y)
    assert o2.dtype == tf.as_dtype(dtype)
    assert_all_close([o1, l1], [o2, l2], rtol=tol, atol=tol)
    assert_all_close(g1, g2, rtol=tol, atol=tol)


FIT_CASES = [
    # K, M, remat, batch_size (20 examples: uneven last batches)
    (1, 1, "never", 8),
    (2, 8, "always", 6),  # last batch of 2 < M: empty micro-batches at run time
    (3, 3, "except_last", 7),
    (4, 8, "always", 20),
    (4, 3, "never", 9),
]


@pytest.mark.parametrize("K,M,remat,batch_size", FIT_CASES)
def test_fit_matches_unsplit(K, M, remat, batch_size):
    seq, pm = pair(mlp_layers, (None, 8), num_stages=K, num_micro_batches=M, remat=remat)
    x, y = data(20)
    hist = []
    for model in (seq, pm):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        h = model.fit(x, y, batch_size=batch_size, epochs=3, shuffle=False, verbose=0)
        hist.append(h.history)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(hist[0]["loss"], hist[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist[0]["accuracy"], hist[1]["accuracy"])
    # One optimizer update per mini-batch, not one per micro-batch.
    assert int(pm.optimizer.iterations) == int(seq.optimizer.iterations) == 3 * -(-20 // batch_size)
    assert_all_close([seq.evaluate(x, y, verbose=0)[0]], [pm.evaluate(x, y, verbose=0)[0]], rtol=1e-5)
    assert_all_close([seq.predict(x, verbose=0)], [pm.predict(x, verbose=0)], rtol=1e-5, atol=1e-5)


def test_fit_with_regularizers_and_sample_weights():
    def make():
        keras.utils.set_random_seed(3)
        return [
            keras.layers.Dense(10, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)),
            keras.layers.Dense(10, activation="relu", bias_regularizer=keras.regularizers.L1(0.01)),
            keras.layers.Dense(3),
        ]

    seq, pm = pair(make, (None, 8), num_stages=3, num_micro_batches=4)
    x, y = data(16)
    w = np.linspace(0.1, 2.0, 16).astype("float32")
    for model in (seq, pm):
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, sample_weight=w, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_steps_per_execution_runs_several_steps_in_one_call():
    """``compile(steps_per_execution=4)``: Keras runs four pipeline steps inside one function
    call (its own loop around the step's loops); losses, metrics, weights, evaluate and
    predict as keras.Sequential's with the same setting, the last call holding fewer steps
    (8 batches of 7 then one of 4: 53 examples), uneven micro-batches (M=3)."""

    def make():
        keras.utils.set_random_seed(5)
        return mlp_layers(width=16, depth=3)

    seq, pm = pair(make, (None, 8), num_stages=2, num_micro_batches=3, schedule="1f1b")
    x, y = data(53)
    results = []
    for model in (seq, pm):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=4,
        )
        calls: list[int] = []  # Keras reports each call's last batch: two calls of four steps an epoch
        counted = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs, c=calls: c.append(b))
        fitted = model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0, callbacks=[counted])
        history = fitted.history
        results.append([history["loss"], history["accuracy"], model.evaluate(x, y, batch_size=7, verbose=0)])
        results[-1] += [model.predict(x, batch_size=7, verbose=0), int(model.optimizer.iterations), calls]
    (*seq_values, seq_steps, seq_calls), (*pm_values, pm_steps, pm_calls) = results
    assert pm_steps == seq_steps == 2 * 8
    assert pm_calls == seq_calls == [3, 7, 3, 7], (pm_calls, seq_calls)
    for a, b in zip(seq_values, pm_values):
        assert_all_close([np.asarray(a)], [np.asarray(b)], rtol=1e-5, atol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


def _partly_frozen():
    keras.utils.set_random_seed(6)
    layers = [keras.layers.Dense(12, activation="relu"), keras.layers.BatchNormalization()]
    layers += [keras.layers.Dense(12, activation="relu"), keras.layers.Dense(3)]
    for layer in layers[:2]:  # stage 0 has no trainable weight; its BatchNormalization infers
        layer.trainable = False
    return layers


@pytest.mark.parametrize(
    "schedule, remat, loops",
    [
        ("gpipe", "always", "auto"),
        ("gpipe", "always", False),
        ("1f1b", "never", "auto"),
        ("zb-h1", "never", "auto"),
    ],
)
def test_frozen_layers_train_as_sequential(schedule, remat, loops):
    """``layer.trainable = False`` before compile, a whole stage frozen: the same losses and
    weights as keras.Sequential's (uneven micro-batches: 29 examples, batches of 10, M=3)."""
    seq, pm = pair(
        _partly_frozen, (None, 8), num_stages=2, num_micro_batches=3, schedule=schedule, remat=remat,
        micro_batch_loops=loops,
    )  # fmt: skip
    assert len(pm.trainable_weights) == len(seq.trainable_weights) == 4
    x, y = data(29)
    losses = []
    for model in (seq, pm):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True)
        )
        losses.append(model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


# The stage functions' traces are shared by every engine: built out once, looped once.
@pytest.mark.parametrize("schedule, loops", [("gpipe", False), ("1f1b", "auto")])
def test_unfrozen_layers_train_after_compile_again(schedule, loops):
    """Fine-tuning: frozen layers trained, then unfrozen and compiled again (as Keras asks);
    the stage functions traced for the old trainable set must not serve the new one
    (they differentiated only the weights trainable then: the unfrozen ones would not
    move). Losses and weights as keras.Sequential's."""

    def make():
        keras.utils.set_random_seed(6)
        return mlp_layers(width=12, depth=4)

    seq, pm = pair(
        make, (None, 8), num_stages=2, num_micro_batches=3, schedule=schedule, micro_batch_loops=loops
    )
    x, y = data(29)
    losses = []
    for model in (seq, pm):
        frozen = model.layers[:2] if model is seq else model.stage_layers[:2]
        history = []
        for trainable, rate in ((False, 0.01), (True, 0.003)):
            for layer in frozen:
                layer.trainable = trainable
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(optimizer=keras.optimizers.Adam(rate), loss=loss)
            history += model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history["loss"]
        losses.append(history)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


def test_a_frozen_stage_built_out_runs_without_runtime_errors():
    """A stage with no trainable weight has no gradient sums to zero: the step calls no
    function whose body is one constant, which TensorFlow's runtime failed to find in
    Keras' step (NOT_FOUND warnings logged, the result still right)."""
    script = textwrap.dedent(
        """
        import keras, numpy as np, tf_gpipe
        devices = tf_gpipe.configure_virtual_cpus(2)  # before TensorFlow starts
        layers = [keras.layers.Dense(12, activation="relu"), keras.layers.BatchNormalization(),
                  keras.layers.Dense(12, activation="relu"), keras.layers.Dense(3)]
        for layer in layers[:2]:
            layer.trainable = False
        pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=3, micro_batch_loops=False,
                                    devices=devices)
        pm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
        x, y = np.random.RandomState(0).rand(29, 8).astype("float32"), np.arange(29) % 3
        pm.fit(x, y, batch_size=10, epochs=1, verbose=0)
        print("trained")
        """
    )
    env = child_env(TF_CPP_MIN_LOG_LEVEL="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr[-3000:]
    assert "Failed to find definition" not in out.stderr, out.stderr[-3000:]


class _SplitHeads(keras.layers.Layer):
    """Several outputs, no compute_output_shape: Keras must trace it."""

    def call(self, x):
        return x[:, :4], x[:, 4:] * 2.0


class _JoinHeads(keras.layers.Layer):
    def call(self, parts):
        a, b = parts
        return keras.ops.concatenate([keras.ops.tanh(a), b], axis=-1)


class _FromDict(keras.layers.Layer):
    def call(self, inputs):
        return keras.ops.concatenate([inputs["a"], inputs["b"] * 0.5], axis=-1)


def test_multi_output_custom_layers_across_stages():
    def make():
        keras.utils.set_random_seed(5)
        return [keras.layers.Dense(8), _SplitHeads(), _JoinHeads(), keras.layers.Dense(3)]

    seq, pm = pair(make, (None, 8), num_stages=4, num_micro_batches=3)
    x, y = data(7)
    o1, l1, g1 = loss_and_grads(seq, x, y)
    o2, l2, g2 = loss_and_grads(pm, x, y)
    assert_all_close([o1, l1], [o2, l2])
    assert_all_close(g1, g2)


@pytest.mark.parametrize("remat", REMATS)
def test_dict_inputs_fit(remat):
    def make():
        keras.utils.set_random_seed(9)
        return [_FromDict(), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)]

    rng = np.random.RandomState(2)
    x = {"a": rng.randn(11, 3).astype("float32"), "b": rng.randn(11, 5).astype("float32")}
    y = rng.randint(0, 3, 11)
    seq = keras.Sequential(make())
    seq(x)
    pm = tf_gpipe.PipelineModel(make(), num_stages=3, num_micro_batches=4, remat=remat)
    pm(x)
    pm.set_weights(seq.get_weights())
    for model in (seq, pm):
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_mask_flows_across_stages():
    def make():
        keras.utils.set_random_seed(4)
        return [
            keras.layers.Embedding(20, 6, mask_zero=True),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.GlobalAveragePooling1D(),  # uses the mask made two stages earlier
            keras.layers.Dense(3),
        ]

    tokens = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 9, 1], [3, 0, 0, 0, 0]] * 2)
    y = np.arange(8) % 3
    seq = keras.Sequential(make())
    seq(tokens)
    pm = tf_gpipe.PipelineModel(make(), num_stages=3, num_micro_batches=3)
    pm(tokens)
    pm.set_weights(seq.get_weights())
    o1, l1, g1 = loss_and_grads(seq, tokens, y)
    o2, l2, g2 = loss_and_grads(pm, tokens, y)
    assert_all_close([o1, l1], [o2, l2])
    assert_all_close([tf.convert_to_tensor(g) for g in g1], [tf.convert_to_tensor(g) for g in g2])
    # The mask really mattered: without it the pooled mean differs.
    unmasked = tokens.copy()
    assert not np.allclose(o1, seq(np.where(unmasked == 0, 1, unmasked)))


def test_pipeline_as_layer_in_functional_model():
    def build(pipelined):
        layers = mlp_layers(seed=7, depth=3)
        inp = keras.Input((8,))
        h = keras.layers.Dense(8, name="pre")(inp)
        if pipelined:
            body = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=2)
        else:
            body = keras.Sequential(layers)
        return keras.Model(inp, body(h))

    keras.utils.set_random_seed(1)
    plain = build(False)
    piped = build(True)
    piped.set_weights(plain.get_weights())
    x, y = data(12)
    for model in (plain, piped):
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert_all_close(plain.get_weights(), piped.get_weights(), rtol=1e-5, atol=1e-6)


def test_custom_training_loop_one_update_per_step():
    seq, pm = pair(mlp_layers, (None, 8), num_stages=4, num_micro_batches=4)
    x, y = data(16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (seq, pm):
        opt = keras.optimizers.Adam(0.01)

        @tf.function
        def step(a, b, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = loss_fn(b, model(a, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for _ in range(3):
            step(x, y)
        assert int(opt.iterations) == 3
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_rnn_with_mask_in_a_later_stage():
    def make():
        keras.utils.set_random_seed(12)
        return [
            keras.layers.Embedding(30, 8, mask_zero=True),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.LSTM(6),
            keras.layers.Dense(3),
        ]

    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 30, (9, 7))
    for i, length in enumerate([7, 3, 5, 1, 6, 2, 7, 4, 3]):
        tokens[i, length:] = 0
    y = np.arange(9) % 3
    seq = keras.Sequential(make())
    seq(tokens)
    for remat in ("always", "never"):
        pm = tf_gpipe.PipelineModel(make(), num_stages=3, num_micro_batches=4, remat=remat)
        pm(tokens)
        pm.set_weights(seq.get_weights())
        o1, l1, g1 = loss_and_grads(seq, tokens, y)
        o2, l2, g2 = loss_and_grads(pm, tokens, y)
        assert_all_close([o1, l1], [o2, l2])
        assert_all_close([tf.convert_to_tensor(g) for g in g1], [tf.convert_to_tensor(g) for g in g2])


def test_six_stages_called_eagerly_and_timed_log_no_retracing_warning(
    cpu_devices, caplog, fresh_tracing_counts
):
    """Each stage's functions trace once per signature, as do the per-layer ones that time a
    balance: TensorFlow, which counts traces per code, would call that a retracing bug."""
    layers = [keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(6)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=6, num_micro_batches=3, balance="time")
    x = np.ones((7, 4), "float32")  # micro-batches of 3, 2 and 2
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(pm(x, training=True))
    assert all(g is not None for g in tape.gradient(loss, pm.trainable_variables))
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]


def test_eager_calls_trace_each_stage_function_once_per_signature(cpu_devices):
    """What makes TensorFlow's retracing warning a false alarm here (it is off for the
    library's functions): calls that repeat a shape trace nothing again."""
    layers = [keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(6)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=3, num_micro_batches=3)
    x = np.ones((7, 4), "float32")  # micro-batches of 3, 2 and 2

    def traces():
        fns = [f for cell in pm.cells for s in cell.stage_functions.values() for f in vars(s).values()]
        return [
            f.experimental_get_tracing_count() for f in fns if hasattr(f, "experimental_get_tracing_count")
        ]

    for training in (False, True):
        pm(x, training=training)
        before = traces()
        assert sum(before) > 0
        pm(x, training=training)
        pm(x + 1.0, training=training)
        assert traces() == before, (training, before, traces())
