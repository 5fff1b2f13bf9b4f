"""Every schedule trains exactly like the unsplit model."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, data, mlp_layers, pair

import tf_gpipe

SCHEDULE_CASES = [
    # schedule, K, M, v, remat, batch_size (24 examples: uneven last batches)
    ("1f1b", 2, 4, 1, "always", 10),
    ("1f1b", 4, 8, 1, "except_last", 7),  # last batch of 3 < M: empty micro-batches
    ("1f1b", 3, 3, 1, "never", 9),
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
        lambda: mlp_layers(depth=11),
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
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


def test_1f1b_refuses_a_loss_it_cannot_split():
    pm = tf_gpipe.PipelineModel(mlp_layers(), num_stages=2, num_micro_batches=2, schedule="1f1b")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
    _compile(pm, loss=loss)
    x, y = data(8)
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        pm.fit(x, y, sample_weight=np.ones(8), batch_size=8, epochs=1, verbose=0)


def test_dropout_and_batchnorm_replayed_under_1f1b():
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
    for remat in ("never", "always"):
        keras.backend.clear_session()
        pm = tf_gpipe.PipelineModel(make(), num_stages=4, num_micro_batches=4, remat=remat, schedule="1f1b")
        _compile(pm)
        pm.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
        weights.append(pm.get_weights())
    assert_all_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


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
