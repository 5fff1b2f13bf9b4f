"""Regression tests: each says what users saw, then the commit that fixed it
(``fixed in <short hash> (<commit subject>)``; ``git show <hash>`` has the change)."""

import keras
import numpy as np
import tensorflow as tf
from helpers import assert_all_close, memory_probe, pair, partition_graphs

import tf_gpipe


class _Pair(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape["a"][-1],), initializer="ones")

    def call(self, inputs):
        return inputs["a"] * self.w + inputs["b"]


def test_to_sequential_with_tuple_and_dict_inputs():
    """to_sequential() built the copy symbolically, which raised for Concatenate on a tuple
    and left a dict-taking custom layer unbuilt.

    Fixed in 081f5d4 (Deferred BatchNorm statistics (GPipe semantics), layer-loss weighting,
    to_sequential for nested inputs, stale-loss fix; example script, README, regression tests).
    """
    rng = np.random.RandomState(0)
    a, b = rng.randn(6, 3).astype("float32"), rng.randn(6, 2).astype("float32")
    pm = tf_gpipe.PipelineModel(
        [keras.layers.Concatenate(), keras.layers.Dense(4), keras.layers.Dense(3)],
        num_stages=2,
        num_micro_batches=2,
    )
    expected = pm.predict((a, b), verbose=0)
    assert_all_close([pm.to_sequential().predict((a, b), verbose=0)], [expected])

    pm = tf_gpipe.PipelineModel([_Pair(), keras.layers.Dense(2)], num_stages=2, num_micro_batches=3)
    x = {"a": a, "b": a * 2}
    expected = pm.predict(x, verbose=0)
    assert_all_close([pm.to_sequential().predict(x, verbose=0)], [expected])


def test_fit_after_evaluate_with_layer_losses():
    """Losses added by layers during evaluate()/predict() stayed on the model, and the next
    fit() failed with 'tensor ... is out of scope'.

    Fixed in 081f5d4 (Deferred BatchNorm statistics (GPipe semantics), layer-loss weighting,
    to_sequential for nested inputs, stale-loss fix; example script, README, regression tests).
    """
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.1)), keras.layers.Dense(3)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=3)
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(1)
    x, y = rng.randn(12, 5).astype("float32"), rng.randint(0, 3, 12)
    pm.evaluate(x, y, verbose=0)
    pm.predict(x, verbose=0)
    history = pm.fit(x, y, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))


_MEMORY_PROBE = """
import tf_gpipe
tf_gpipe.configure_virtual_cpus(1)
import keras, numpy as np, tensorflow as tf
for M in (1, 8):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(512, activation="relu") for _ in range(8)] + [keras.layers.Dense(10)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=1, num_micro_batches=M, remat="always")
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.rand(256, 512).astype("float32"), np.random.randint(0, 10, 256)
    pm.train_on_batch(x, y)
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    pm.train_on_batch(x, y)
    print("PEAK", M, tf.config.experimental.get_memory_info("CPU:0")["peak"] - base)
"""


def test_weight_gradients_are_summed_as_they_arrive():
    """Grappler folded the per-micro-batch gradient sums into one AddN, so a step held M
    copies of the weight gradients (8 MiB of weights: +7 x 8 MiB at M=8).

    Fixed in e79170a (Sum weight gradients as each micro-batch's arrive (Grappler's AddN
    held M copies); regression test).
    """
    # Both models in one process: starting TensorFlow is most of the probe's cost.
    out = memory_probe(_MEMORY_PROBE)
    peaks = {
        int(m): int(b) for _, m, b in (line.split() for line in out.splitlines() if line.startswith("PEAK "))
    }
    weights = 8 * 512 * 512 * 4
    assert peaks[8] < peaks[1] + 1.5 * weights, peaks


def test_exported_sequential_keeps_input_dtype_and_free_batch():
    """to_sequential() recorded float32 inputs with the batch size of the data that built
    the model.

    Fixed in e75939c (Balance by params/time/memory (tf_gpipe.balance, wired into
    PipelineModel); flags module, Transformer LM and image examples, docs; to_sequential
    keeps input dtype; tensorboard pinned).
    """
    pm = tf_gpipe.PipelineModel(
        [keras.layers.Embedding(50, 8), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)],
        num_stages=2,
    )
    tokens = np.arange(40).reshape(4, 10) % 50
    pm.predict(tokens, verbose=0)
    seq = pm.to_sequential()
    assert tuple(seq.inputs[0].shape) == (None, 10)
    assert seq.inputs[0].dtype == "int32" or seq.inputs[0].dtype == "int64"
    assert_all_close([seq.predict(tokens[:3], verbose=0)], [pm.predict(tokens[:3], verbose=0)])


def test_balance_by_method_and_numpy_balance():
    """balance='time' was split into characters, and a numpy balance was refused as 'not
    positive integers'.

    Fixed in e75939c (Balance by params/time/memory (tf_gpipe.balance, wired into
    PipelineModel); flags module, Transformer LM and image examples, docs; to_sequential
    keeps input dtype; tensorboard pinned).
    """
    keras.utils.set_random_seed(0)
    layers = [keras.Input((16,))] + [keras.layers.Dense(16) for _ in range(5)] + [keras.layers.Dense(2048)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, balance="params")
    assert pm.balance == [5, 1]  # the heavy head alone
    pm = tf_gpipe.PipelineModel([keras.layers.Dense(2) for _ in range(4)], balance=np.array([3, 1]))
    assert pm.balance == [3, 1]


def test_fit_loss_honours_the_output_mask():
    """With a Keras mask on the outputs (Embedding(mask_zero=True) then
    Dense), fit's loss and metrics counted the padding. gpipe reported the unmasked loss
    (1.105031 against Keras' 1.106655, weights 5e-2 apart after one SGD step); 1f1b weighted
    each micro-batch's masked mean by its share of examples, not of valid tokens (1.106191,
    weights 7e-3 apart). evaluate() and __call__ were right.
    Fixed in 49f827e (Masked outputs: the loss and metrics of fit see the Keras mask for every
    schedule)."""
    rng = np.random.RandomState(0)
    x = np.zeros((8, 6), "int32")
    for i, length in enumerate([1, 2, 3, 4, 5, 6, 2, 1]):
        x[i, :length] = rng.randint(1, 20, length)
    y = rng.randint(0, 5, (8, 6))

    def make():
        keras.utils.set_random_seed(0)
        init = keras.initializers.RandomNormal(stddev=1.5, seed=1)
        return [
            keras.layers.Embedding(20, 8, mask_zero=True, embeddings_initializer=init),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(5),
        ]

    for schedule in ("gpipe", "1f1b"):
        seq, pm = pair(
            make, (None, 6), input_dtype="int32", num_stages=2, num_micro_batches=2, schedule=schedule
        )
        logs = []
        for model in (seq, pm):
            model.compile(
                optimizer=keras.optimizers.SGD(0.5),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["sparse_categorical_accuracy"],
            )
            logs.append(model.train_on_batch(x, y, return_dict=True))
        np.testing.assert_allclose(logs[1]["loss"], logs[0]["loss"], rtol=1e-5)
        np.testing.assert_allclose(
            logs[1]["sparse_categorical_accuracy"], logs[0]["sparse_categorical_accuracy"], rtol=1e-6
        )
        assert_all_close(seq.get_weights(), pm.get_weights())


def _fit_both(make, x, y, batch_size, **pipeline_kwargs):
    seq, pm = pair(make, (None,) + x.shape[1:], **pipeline_kwargs)
    for model in (seq, pm):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    got = pm.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history["loss"]
    want = seq.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history["loss"]
    assert_all_close(got, want)
    assert_all_close(pm.get_weights(), seq.get_weights())
    return seq, pm


def test_1f1b_batch_smaller_than_m_is_not_cut_into_empty_micro_batches():
    """schedule='1f1b' (and 'interleaved') cut a batch whose size was
    known while tracing into exactly M pieces, some empty: LSTM + Dense, K=1, M=2, one
    example raised `ValueError: Exception encountered when calling LSTMCell.call() ...
    Shape must be rank 1 but is rank 2` where schedule='gpipe' fitted.
    Fixed in 4b1612a (No layer sees an empty micro-batch: fewer micro-batches for small static
    batches, pad-and-discard for dynamic ones)."""

    def make():
        keras.utils.set_random_seed(2)
        return [keras.layers.LSTM(3, return_sequences=True), keras.layers.Dense(3)]

    rng = np.random.RandomState(0)
    x, y = rng.randn(1, 4, 2).astype("float32"), rng.randn(1, 4, 3).astype("float32")
    seq, pm = pair(make, (None, 4, 2), num_stages=1, num_micro_batches=2, schedule="1f1b")
    for model in (seq, pm):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert_all_close([pm.train_on_batch(x, y)], [seq.train_on_batch(x, y)])
    assert_all_close(pm.get_weights(), seq.get_weights())


class StrictConv2D(keras.layers.Conv2D):
    """Conv2D as the reporter's TensorFlow ran it: an empty batch of unknown size came
    back unchanged (wrong shape) instead of as an empty output. Here it fails loudly."""

    def call(self, x):
        check = tf.debugging.assert_greater(tf.shape(x)[0], 0, message="Conv2D got an empty batch")
        with tf.control_dependencies([check]):
            return super().call(tf.identity(x))


def test_partial_last_batch_smaller_than_m_gives_no_empty_micro_batch():
    """under 'gpipe' a last batch smaller than M (13 examples,
    batch_size=10, M=8: last batch 3) was cut into M micro-batches, 5 of them empty, and
    Conv2D(4, 1, strides=2, padding='same') + Dense(4) failed with `InvalidArgumentError:
    Matrix size-incompatible: In[0]: [0,3], In[1]: [4,4]` (TensorFlow's Conv2D returned
    the empty input unchanged; Conv1D did the same).
    Fixed in 4b1612a (No layer sees an empty micro-batch: fewer micro-batches for small static
    batches, pad-and-discard for dynamic ones)."""

    def make():
        keras.utils.set_random_seed(2)
        return [StrictConv2D(4, 1, strides=2, padding="same"), keras.layers.Dense(4)]

    rng = np.random.RandomState(0)
    x, y = rng.randn(13, 4, 4, 3).astype("float32"), rng.randn(13, 2, 2, 4).astype("float32")
    seq, pm = _fit_both(make, x, y, 10, num_stages=2, num_micro_batches=8)
    assert_all_close([pm.predict(x, batch_size=10, verbose=0)], [seq.predict(x, batch_size=10, verbose=0)])


def test_masked_embedding_reshape_conv2d_under_1f1b():
    """Embedding(mask_zero=True) -> Reshape -> Conv2D, schedule='1f1b',
    M=6, batches of 7 and 8 failed with a bare `InvalidArgumentError: Graph execution
    error`. Not reproduced on this CPU build (TensorFlow 2.21); kept as an equivalence check
    of that model, with a strict Conv2D that fails if an empty micro-batch reaches it.
    Fixed in 4b1612a (No layer sees an empty micro-batch: fewer micro-batches for small static
    batches, pad-and-discard for dynamic ones)."""

    def make():
        keras.utils.set_random_seed(2)
        return [
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.Reshape((2, 3, 8)),
            StrictConv2D(4, 1, strides=2, padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]

    rng = np.random.RandomState(0)
    x = rng.randint(0, 20, (15, 6))
    x[:, -2:] = 0
    y = rng.randn(15, 2).astype("float32")
    # Batches of 8 and 7 (M=6), then 4 < M: the last leaves micro-batches without an example.
    _fit_both(make, x, y, 8, num_stages=2, num_micro_batches=6, schedule="1f1b")
    _fit_both(make, x[:12], y[:12], 8, num_stages=2, num_micro_batches=6, schedule="1f1b")


def test_layer_names_starting_with_underscore_under_a_traced_tape():
    """A layer named like "_hidden" failed under ``model(x)`` inside a user's
    ``tf.function`` with a tape (``ValueError: '_hidden/...' is not a valid root scope
    name``): the stage's replay opened the layer's name scope at the root of a new graph.

    Fixed in 84a5353 (Stage functions: each stage's forward and re-materializing backward
    traced once (tf_gpipe.stage)): every stage function opens its own name scope first."""
    layers = [
        keras.layers.Dense(4, name="_hidden"),
        keras.layers.Dropout(0.5, seed=1),
        keras.layers.Dense(2, name="_out"),
    ]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=2)
    pm.build((None, 3))
    x = np.random.RandomState(0).rand(6, 3).astype("float32")

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(pm(x, training=True))
        return tape.gradient(loss, pm.trainable_variables)

    assert all(g is not None for g in grads(x))


def test_taped_recurrent_stage_keeps_its_gradient_loop_on_its_device(cpu_devices):
    """A stage that is not re-materialized (``remat="never"``, the last stage of
    ``"except_last"``) holding an RNN placed its gradient loop's variables on the default
    device and the loop's body on the stage's device: every time step of the backward sent
    its saved values across devices. The keras-io bidirectional LSTM at K=2, M=4 stepped
    1.5x slower with ``remat="never"`` than with ``"always"``, which recomputes its forward
    (benchmarks/recurrent/README.md). Counted here: the transfers the runtime placed inside
    gradient loops.

    Fixed in 310fe64 (gated: a taped stage's gradient loop (an RNN's backward) stays on the
    stage's device; each time step crossed devices before (remat='never'/'except_last' with
    an LSTM)).
    """

    keras.utils.set_random_seed(0)
    layers = [
        keras.Input((None,), dtype="int32"),
        keras.layers.Embedding(50, 8),
        keras.layers.LSTM(8, return_sequences=True),
        keras.layers.LSTM(8),
        keras.layers.Dense(1),
    ]
    pm = tf_gpipe.PipelineModel(
        layers, num_stages=2, num_micro_batches=2, remat="never", devices=cpu_devices[:2]
    )
    pm.compile(optimizer="sgd", loss="mse")
    x = np.random.RandomState(0).randint(1, 50, (8, 5)).astype("int32")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, np.ones((8, 1), "float32")))
    sends = [n.name for g in graphs for n in g.node if n.op == "_Send"]
    assert sends, "the stage boundary crosses devices: the run metadata must show it"
    assert [s for s in sends if "while_grad" in s] == []


def test_taped_recurrent_stage_trains_with_xla(cpu_devices):
    """``compile(jit_compile=True)`` (or ``"auto"`` on a GPU) with ``remat="never"`` or
    ``"except_last"`` failed on the first step when a stage that is not re-materialized
    held an LSTM: "Support for TensorList crossing the XLA/TF boundary is not implemented".
    TensorFlow's gradient of the XLA-compiled forward needs the stacks the LSTM's loop saves,
    which cannot leave an XLA function. That stage's taped forward now runs without XLA.

    Fixed in 1f5fb82 (stage: a taped stage running a recurrent layer's loop keeps its forward
    out of XLA; jit_compile=True with remat='never'/'except_last' and an LSTM failed on the
    first step (TensorList crossing the XLA/TF boundary)).
    """

    def layers():
        keras.utils.set_random_seed(0)
        return [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            # use_cudnn=False: with cuDNN (on a GPU) Keras declares an LSTM unfit for XLA (a
            # Bidirectional one whatever it is given: its backward copy is rebuilt with "auto").
            keras.layers.LSTM(8, return_sequences=True, use_cudnn=False),
            keras.layers.LSTM(8, use_cudnn=False),
            keras.layers.Dense(1),
        ]

    rng = np.random.RandomState(0)
    x, y = rng.randint(1, 50, (8, 5)).astype("int32"), rng.randn(8, 1).astype("float32")
    seq = keras.Sequential(layers())
    seq.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    for remat in ("never", "except_last"):
        pm = tf_gpipe.PipelineModel(
            layers(), num_stages=2, num_micro_batches=2, remat=remat, devices=cpu_devices[:2]
        )
        pm.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
        assert pm.stage_jit == [True, True]
        got = pm.train_on_batch(x, y)
        np.testing.assert_allclose(got, seq.evaluate(x, y, verbose=0), rtol=1e-4)
