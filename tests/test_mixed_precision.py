"""Mixed precision: same results as the unsplit model under the same policy."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TRAINED_TOL, assert_all_close, data, pair


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def _layers(bn):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(16, activation="relu")]
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3, dtype="float32")]
    return layers


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
@pytest.mark.parametrize("schedule,M,bn", [("gpipe", 1, True), ("1f1b", 3, False), ("gpipe", 4, False)])
def test_fit_matches_unsplit_under_policy(policy, schedule, M, bn):
    seq, pm = pair(lambda: _layers(bn), (None, 8), num_stages=3, num_micro_batches=M, schedule=schedule)
    x, y = data(24)
    hist = []
    for model in (seq, pm):
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        hist.append(model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0).history["loss"])
    if policy == "mixed_float16":
        assert type(pm.optimizer).__name__ == "LossScaleOptimizer"
    tol = TRAINED_TOL / 10 if M == 1 else 2e-2  # micro-batch sums round differently in 16 bits
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=tol, atol=tol)
    np.testing.assert_allclose(hist[0], hist[1], rtol=tol)
    # Stage boundaries carry the compute dtype, not float32.
    boundary, _ = pm.cells[0].call(tf.constant(x), None, False)
    assert boundary.dtype == tf.as_dtype(keras.mixed_precision.global_policy().compute_dtype)


def _regularized_layers():
    keras.utils.set_random_seed(0)
    return [
        keras.layers.Dense(16, activation="relu"),
        # float32: Keras cannot add a float16 regularization loss to its float32 loss.
        keras.layers.Dense(16, "tanh", activity_regularizer=keras.regularizers.l2(1.0), dtype="float32"),
        keras.layers.Dense(3, dtype="float32"),
    ]


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_layer_losses_are_loss_scaled_like_the_main_loss(policy, schedule):
    """A LossScaleOptimizer unscales every gradient once, so the gradients of the losses
    layers add (an activity regularizer, seeded per micro-batch in the backward passes)
    must be scaled as the main loss's are: unscaled, the regularizer's effect vanished."""
    seq, pm = pair(_regularized_layers, (None, 8), num_stages=3, num_micro_batches=3, schedule=schedule)
    x, y = data(10)  # micro-batches of 4, 3 and 3
    for model in (seq, pm):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        model.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0)
    assert type(pm.optimizer).__name__ == "LossScaleOptimizer"
    assert_all_close(seq.get_weights(), pm.get_weights(), rtol=1e-3, atol=1e-3)  # unscaled: 0.2 off


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
@pytest.mark.parametrize(
    "schedule,loops,remat",
    [
        ("gpipe", True, "always"),
        ("zb-h1", True, "always"),
        ("zb-h1", False, "never"),
        ("1f1b", False, "always"),
    ],
)
def test_a_float16_layer_loss_trains(policy, schedule, loops, remat):
    """An activity regularizer in float16 (Keras' own fit fails to add it to its float32
    loss) trains as an unsplit step that adds it in float32 does; under zb-h1 its float32
    weight reaches the split backward as float16 (``stash.backward``)."""

    def layers():
        keras.utils.set_random_seed(0)
        l1 = keras.regularizers.L1(0.01)
        return [keras.layers.Dense(8, "relu"), keras.layers.Dense(8, "relu", activity_regularizer=l1),
                keras.layers.Dense(3, dtype="float32")]  # fmt: skip

    seq, pm = pair(
        layers,
        (None, 8),
        num_stages=3,
        num_micro_batches=2,
        schedule=schedule,
        micro_batch_loops=loops,
        remat=remat,
    )
    x, y = data(7)  # micro-batches of 4 and 3
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        out = seq(x, training=True)
        assert seq.losses[0].dtype == tf.float16  # what the test is about
        loss = ce(y, out) + tf.add_n([tf.cast(v, tf.float32) for v in seq.losses])
    keras.optimizers.SGD(0.1).apply(tape.gradient(loss, seq.trainable_variables), seq.trainable_variables)
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=ce)
    got = pm.train_on_batch(x, y)
    assert_all_close([got], [float(loss)], rtol=2e-3)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=2e-3, atol=2e-3)
    out = seq(x, training=False)
    loss = ce(y, out) + tf.add_n([tf.cast(v, tf.float32) for v in seq.losses])
    assert_all_close([pm.evaluate(x, y, verbose=0)], [float(loss)], rtol=2e-3)
