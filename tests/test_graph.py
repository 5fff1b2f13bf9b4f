"""Functional models with skip connections, split into stages by from_model."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TiedHead, assert_all_close, same_device

import tf_gpipe
from tf_gpipe import graph, micro_batch_loop
from tf_gpipe.graph import graph_nodes


def resnet_like():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    for _ in range(3):
        r = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
        r = keras.layers.Conv2D(8, 3, padding="same")(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def transformer_like(two_inputs=False, blocks=2):
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 16)(tokens)
    if two_inputs:
        extra = keras.Input((6, 16), name="extra")
        h = keras.layers.Add()([h, extra])
    for _ in range(blocks):
        a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
        f = keras.layers.Dense(32, activation="relu")(h)
        f = keras.layers.Dense(16)(f)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
    pooled = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(3, name="logits")(pooled)
    if two_inputs:
        aux = keras.layers.Dense(1, name="aux")(pooled)
        return keras.Model({"tokens": tokens, "extra": extra}, {"logits": logits, "aux": aux})
    return keras.Model(tokens, logits)


def _clone(model):
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    return ref


def _grads(model, x, y, loss_fn):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_weights)


def _by_name(model, grads):
    return {"/".join(v.path.split("/")[-2:]): g for v, g in zip(model.trainable_weights, grads)}


@pytest.mark.parametrize("K,M,remat", [(4, 3, "never"), (3, 4, "except_last")])
def test_resnet_outputs_gradients_and_fit(K, M, remat, cpu_devices):
    model = resnet_like()
    ref = _clone(model)
    pm = tf_gpipe.PipelineModel.from_model(
        model, num_stages=K, num_micro_batches=M, remat=remat, devices=cpu_devices[:K]
    )
    rng = np.random.RandomState(0)
    x, y = rng.rand(10, 8, 8, 3).astype("float32"), rng.randint(0, 3, 10)
    assert_all_close([ref(x)], [pm(x)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    l1, g1 = _grads(ref, x, y, loss_fn)
    l2, g2 = _grads(pm, x, y, loss_fn)
    assert_all_close([l1], [l2])
    n1, n2 = _by_name(ref, g1), _by_name(pm, g2)
    assert len(n1) == len(n2) == len(g1)
    for v in ref.trainable_weights:  # layers keep their names: match weights by layer path
        key = "/".join(v.path.split("/")[-2:])
        assert_all_close([n1[key]], [n2[key]])
    for m in (ref, pm):
        m.compile(optimizer="adam", loss=loss_fn)
        m.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert_all_close([ref.predict(x, verbose=0)], [pm.predict(x, verbose=0)], rtol=1e-4, atol=1e-5)
    # The pipeline trained the source model's own variables: it serves unsplit as is.
    assert_all_close([model.predict(x, verbose=0)], [pm.predict(x, verbose=0)])


# Uneven micro-batches (3 and 2) under the schedule that takes the loss on the merged batch
# and under ZB-H1's split backward; even ones (2 and 2) under 1F1B.
@pytest.mark.parametrize("schedule,batch_size", [("gpipe", 5), ("1f1b", 4), ("zb-h1", 5)])
def test_transformer_with_dict_inputs_and_outputs(schedule, batch_size, monkeypatch):
    """Each output's loss in fit's history: Keras updates a loss metric per output inside the
    loss, which the step updates once from the whole mini-batch (micro-batches of 2 and 2, or
    3 and 2), in the loops over micro-batches."""
    looped = []
    original = micro_batch_loop.run
    monkeypatch.setattr(micro_batch_loop, "run", lambda *a, **k: looped.append(1) or original(*a, **k))
    model = transformer_like(two_inputs=True, blocks=1)  # its 12 nodes still make 3 stages of 4
    ref = _clone(model)
    pm = tf_gpipe.PipelineModel.from_model(
        model, num_stages=3, num_micro_batches=2, schedule=schedule, micro_batch_loops=True
    )
    rng = np.random.RandomState(1)
    x = {"tokens": rng.randint(0, 20, (10, 6)), "extra": rng.randn(10, 6, 16).astype("float32")}
    y = {"logits": rng.randint(0, 3, 10), "aux": rng.randn(10, 1).astype("float32")}
    out_ref, out = ref(x), pm(x)
    assert_all_close([out_ref["logits"], out_ref["aux"]], [out["logits"], out["aux"]])
    for m in (ref, pm):
        m.compile(
            optimizer="adam",
            loss={"logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "aux": "mse"},
        )
    fits = [m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0) for m in (ref, pm)]
    history = [f.history for f in fits]
    assert looped
    assert sorted(history[1]) == ["aux_loss", "logits_loss", "loss"]
    for key, values in history[0].items():
        np.testing.assert_allclose(history[1][key], values, rtol=1e-4, atol=1e-5)
    a, b = ref.predict(x, verbose=0), pm.predict(x, verbose=0)
    assert_all_close([a["logits"], a["aux"]], [b["logits"], b["aux"]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loops", [True, False])
def test_each_outputs_loss_with_a_partial_last_batch(loops):
    """19 examples in batches of 8: the last one's micro-batches hold 2 and 1, sizes known
    only at run time. Keras updates each output's loss metric once a batch (weight 1: the
    batch size is not static in fit); so does the step, from the whole mini-batch."""

    def two_heads():
        keras.utils.set_random_seed(3)
        inp = keras.Input((8,))
        h = keras.layers.Dense(10, activation="tanh")(inp)
        cls = keras.layers.Dense(3, name="cls")(keras.layers.Dense(10, activation="tanh")(h))
        return keras.Model(inp, {"cls": cls, "reg": keras.layers.Dense(1, name="reg")(h)})

    ref = two_heads()
    pm = tf_gpipe.PipelineModel.from_model(two_heads(), num_stages=2, num_micro_batches=2, schedule="1f1b",
                                           micro_batch_loops=loops)  # fmt: skip
    rng = np.random.RandomState(0)
    x, y = rng.randn(19, 8).astype("float32"), {"cls": rng.randint(0, 3, 19), "reg": rng.randn(19, 1)}
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for m in (ref, pm):
        m.compile(optimizer="sgd", loss={"cls": ce, "reg": "mse"}, loss_weights={"cls": 1.0, "reg": 0.3})
    history = [m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history for m in (ref, pm)]
    assert sorted(history[1]) == ["cls_loss", "loss", "reg_loss"]
    for key, values in history[0].items():
        np.testing.assert_allclose(history[1][key], values, rtol=1e-5, err_msg=key)


def test_skip_connection_is_carried_and_stages_placed(cpu_devices):
    model = transformer_like()
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=4, balance="params")
    assert sum(pm.balance) == len(graph_nodes(model))
    for cell in pm.cells:
        for v in cell.layers[0].weights:
            assert same_device(v.value.device, cell.device)
    # Middle stages receive dicts: every tensor a later stage needs is carried.
    assert all(isinstance(c.layers[0]._out_keys, dict) for c in pm.cells[:-1])
    assert any(len(c.layers[0]._out_keys) > 1 for c in pm.cells[:-1])


def test_a_layer_used_by_the_first_and_last_node_runs_across_stages(cpu_devices):
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(8, name="tied")
    inp = keras.Input((8,))
    h = shared(inp)
    for _ in range(4):
        h = keras.layers.Dense(8)(h)
    out = shared(h)  # the same weights at both ends
    model = keras.Model(inp, out)
    x = np.ones((2, 8), "float32")
    expected = model(x)
    # No cut into two stages keeps the first and the last node together: the even split
    # (or the one given) runs, the weights on the last stage, with a warning.
    for balance in (None, "params", [3, 3]):
        with pytest.warns(UserWarning, match="'tied' is used in stages \\[0, 1\\]"):
            pm = tf_gpipe.PipelineModel.from_model(
                model, num_stages=2, balance=balance, devices=cpu_devices[1:3]
            )
        assert pm.balance == [3, 3]
        assert same_device(shared.kernel.value.device, cpu_devices[2])
        assert_all_close([expected], [pm(x)])


def _shared_in_the_middle():
    """Nine nodes; the layer ``shared`` is called at nodes 2 and 4 (a siamese-like block)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    h = keras.layers.Dense(8, activation="tanh")(h)
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = shared(keras.layers.Dense(8)(shared(h)))
    for _ in range(3):
        h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


@pytest.mark.parametrize("balance", [None, "params"])
def test_automatic_cuts_keep_a_shared_layers_uses_in_one_stage(balance):
    # The even split [3, 3, 3] would cut between the two calls of `shared` (nodes 2 and 4).
    ref, src = _shared_in_the_middle(), _shared_in_the_middle()
    src.set_weights(ref.get_weights())
    devices = tf_gpipe.configure_virtual_cpus(3)
    pm = tf_gpipe.PipelineModel.from_model(
        src, num_stages=3, balance=balance, num_micro_batches=2, schedule="1f1b", devices=devices
    )
    ends = np.cumsum(pm.balance)[:-1]
    assert not any(2 < c <= 4 for c in ends), pm.balance
    if balance is None:  # the fewest nodes in the largest stage that keeps them together
        assert max(pm.balance) == 4 and sorted(pm.balance) == [2, 3, 4], pm.balance
    holder = [c for c in pm.cells if any(layer.name == "shared" for layer in c.layers[0].stage_ops)]
    assert len(holder) == 1
    assert same_device(src.get_layer("shared").kernel.value.device, holder[0].device)
    rng = np.random.RandomState(0)
    x, y = rng.randn(11, 8).astype("float32"), rng.randint(0, 3, 11)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for m in (ref, pm):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    a = ref.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(ref.get_weights(), pm.get_weights(), rtol=1e-5, atol=1e-6)


def test_a_layer_listed_twice_is_kept_in_one_stage():
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(6, activation="tanh", name="twice")
    layers = [keras.layers.Dense(6), keras.layers.Dense(6), shared, keras.layers.Dense(6), shared]
    layers += [keras.layers.Dense(6), keras.layers.Dense(6), keras.layers.Dense(6), keras.layers.Dense(2)]
    pm = tf_gpipe.PipelineModel([keras.Input((6,)), *layers], num_stages=3)
    ends = np.cumsum(pm.balance)[:-1]
    assert not any(2 < c <= 4 for c in ends) and max(pm.balance) == 4, pm.balance
    x = np.random.RandomState(1).randn(4, 6).astype("float32")
    expected = x
    for layer in layers:
        expected = layer(expected)
    assert_all_close([expected], [pm(x)])
    # A layer listed twice holds its weights once.
    assert tf_gpipe.balance.by_params(layers, (4, 6))[2:5] == [42.0, 42.0, 0.0]
    memory = tf_gpipe.balance.by_memory(layers, (4, 6), optimizer_slots=0)
    assert memory[2] == 2 * 42 * 4 + 4 * 6 * 4 and memory[4] == 4 * 6 * 4
    for solver in ("minmax", "min_variance"):
        got = tf_gpipe.balance.balance_by("params", layers, 3, (4, 6), solver=solver)
        assert not any(2 < c <= 4 for c in np.cumsum(got)[:-1]), (solver, got)
    by_params = tf_gpipe.PipelineModel([keras.Input((6,)), *layers], num_stages=3, balance="params")
    assert not any(2 < c <= 4 for c in np.cumsum(by_params.balance)[:-1]), by_params.balance
    with pytest.warns(UserWarning, match="'twice' is used in stages \\[0, 1\\]"):  # a balance given
        tf_gpipe.PipelineModel(layers, balance=[3, 3, 3])
    with pytest.warns(UserWarning, match="'twice' is used in stages \\[1, 3\\]"):  # 8 stages: no way round
        assert tf_gpipe.PipelineModel(layers, num_stages=8).balance == [2] + [1] * 7


class _MatrixHead(keras.layers.Layer):
    """Logits from a matrix variable it was handed (tied without the layer that owns it)."""

    def __init__(self, matrix, **kwargs):
        super().__init__(**kwargs)
        self.matrix = matrix

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.matrix))


def _tied_lm():
    """A causal-LM shape: a nested backbone reads the embedding, the output head reads it again."""
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(30, 8, name="token_embedding")
    inner = keras.Input((6,), dtype="int32")
    backbone = keras.Model(inner, keras.layers.Dense(8)(embedding(inner)), name="backbone")
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Dense(8, name="mid")(backbone(tokens))
    logits = TiedHead(embedding, name="tied_head")(h)
    return keras.Model(tokens, keras.layers.Activation("linear", name="out")(logits)), embedding


def test_weights_shared_through_a_nested_model_are_named_across_stages(cpu_devices):
    model, embedding = _tied_lm()
    tokens = np.arange(24).reshape(4, 6) % 30
    expected = model(tokens)
    with pytest.warns(UserWarning, match="'token_embedding' is used in stages \\[0, 1\\]") as info:
        pm = tf_gpipe.PipelineModel.from_model(model, num_stages=2, balance=[1, 3], devices=cpu_devices[1:3])
    text = str(info[0].message)
    assert "'backbone' in stage 0" in text and "'tied_head' in stage 1" in text and "balance" in text
    assert same_device(embedding.embeddings.value.device, cpu_devices[2])  # the last that uses it
    assert_all_close([expected], [pm(tokens)])
    # The same layers given as a list: the same warning.
    with pytest.warns(UserWarning, match="'token_embedding' is used in stages \\[0, 1\\]"):
        tf_gpipe.PipelineModel([model.layers[1], model.layers[2], model.layers[3]], balance=[1, 2])
    # A variable handed to another stage's layer, without its layer: named as a variable.
    head = _MatrixHead(embedding.embeddings, name="matrix_head")
    with pytest.warns(UserWarning, match="variable 'token_embedding/embeddings' is used in stages"):
        tf_gpipe.PipelineModel([model.layers[1], model.layers[2], head], balance=[1, 2])
    # A cut that keeps both uses in one stage puts the embedding on that stage's device.
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=2, balance=[3, 1], num_micro_batches=2)
    assert same_device(embedding.embeddings.value.device, pm.devices[0])
    assert_all_close([expected], [pm(tokens)])


def test_save_and_load_a_split_functional_model(tmp_path):
    model = resnet_like()
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=2, num_micro_batches=2)
    x = np.random.RandomState(3).rand(4, 8, 8, 3).astype("float32")
    pm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert_all_close([pm.predict(x, verbose=0)], [loaded.predict(x, verbose=0)])
    assert loaded.balance == pm.balance


def test_not_a_functional_model():
    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="functional"):
        tf_gpipe.PipelineModel.from_model(Sub(), num_stages=1)


def test_source_model_serves_without_xla_once_split_over_devices(cpu_devices):
    """Compiled with XLA (as Keras' "auto" is on a GPU), the source model's predict failed
    once from_model had moved its variables to two devices: one XLA program reads every
    variable on its own device; and the predict it had traced read the variables from_model
    replaced. It now serves unsplit, without XLA, the pipeline's variables."""
    model = resnet_like()
    model.compile(jit_compile=True)
    x = np.random.RandomState(0).rand(4, 8, 8, 3).astype("float32")
    before = model.predict(x, verbose=0)
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=2, devices=cpu_devices[:2])
    pm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pm.fit(x, np.arange(4) % 3, batch_size=4, verbose=0)
    trained = pm.predict(x, verbose=0)
    assert np.abs(trained - before).max() > 1e-3
    assert_all_close([trained], [model.predict(x, verbose=0)])
    with pytest.warns(UserWarning, match="jit_compile"):  # Keras: it proceeds without XLA
        model.compile(jit_compile=True)
    assert_all_close([trained], [model.predict(x, verbose=0)])


def test_from_model_balances_by_every_method():
    """A heavy head: every cost estimate isolates it; the result still equals the model."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((16,))
    h = inp
    for _ in range(5):
        h = keras.layers.Add()([h, keras.layers.Dense(16)(h)])
    out = keras.layers.Dense(2048)(keras.layers.Dense(2048)(h))  # most params, bytes and time
    model = keras.Model(inp, out)
    ref = _clone(model)
    x = np.random.RandomState(0).rand(6, 16).astype("float32")
    n = len(graph_nodes(model))
    for method in ("params", "memory", "time"):
        pm = tf_gpipe.PipelineModel.from_model(model, num_stages=2, balance=method, num_micro_batches=2)
        # An even split by node count would be [6, 6]: the cut moves toward the head.
        assert sum(pm.balance) == n and pm.balance[1] <= n // 2 - 2, (method, pm.balance)
        assert_all_close([ref(x)], [pm(x)])
    with pytest.raises(ValueError, match="'flops'"):
        tf_gpipe.PipelineModel.from_model(model, num_stages=2, balance="flops")


def test_node_costs_leave_no_side_effects():
    """Timing runs every node in training mode: BatchNorm statistics and Dropout seeds are put back."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((8,))
    h = keras.layers.Dense(8)(inp)
    h = keras.layers.Dropout(0.5, seed=1)(keras.layers.BatchNormalization()(h))
    model = keras.Model(inp, keras.layers.Add()([inp, h]))
    before = [v.numpy().copy() for v in model.variables]
    costs = graph.node_costs(model, "time", batch_size=4, repeats=1)
    assert len(costs) == len(graph_nodes(model)) and all(c > 0 for c in costs)
    for a, v in zip(before, model.variables):
        np.testing.assert_array_equal(a, v.numpy())


def _two_in_two_out():
    """Two inputs, a residual Add, a shared layer, a Concatenate branch, BatchNorm, two outputs."""
    keras.utils.set_random_seed(4)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(a)
    h = keras.layers.Add()([h, keras.layers.Dense(8)(b)])
    r = keras.layers.Dense(8, activation="relu")(h)
    h = keras.layers.Concatenate()([h, r])
    y = keras.layers.Dense(3, name="y")(keras.layers.BatchNormalization()(h))
    return keras.Model({"a": a, "b": b}, {"y": y, "z": keras.layers.Dense(1, name="z")(h)})


def test_to_functional_exports_an_unsplit_copy(tmp_path):
    model = _two_in_two_out()
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=3, num_micro_batches=2)
    rng = np.random.RandomState(5)
    x = {"a": rng.randn(8, 6).astype("float32"), "b": rng.randn(8, 4).astype("float32")}

    def move_weights():  # as training would, BatchNorm statistics included
        for v in pm.weights:
            v.assign(v.numpy() + rng.uniform(0.1, 0.5, v.shape).astype("float32"))

    move_weights()
    with pytest.raises(ValueError, match=r"from_model.*to_functional\(\)"):
        pm.to_sequential()
    unsplit = pm.to_functional(name="served")
    assert type(unsplit) is not tf_gpipe.PipelineModel and unsplit.name == "served"
    assert len(unsplit.layers) == len(model.layers)
    # Copied weights: the same values under the same layer names, in variables of its own.
    theirs = {v.path: v.numpy() for v in pm.weights}
    assert sorted(theirs) == sorted(v.path for v in unsplit.weights)
    for v in unsplit.weights:
        np.testing.assert_array_equal(v.numpy(), theirs[v.path])
    assert not {id(v) for v in unsplit.weights} & {id(v) for v in pm.weights}
    out, ref = unsplit.predict(x, verbose=0), pm.predict(x, verbose=0)
    assert_all_close([out["y"], out["z"]], [ref["y"], ref["z"]])
    unsplit.save(tmp_path / "served.keras")
    loaded = keras.models.load_model(tmp_path / "served.keras")
    again = loaded.predict(x, verbose=0)
    assert_all_close([again["y"], again["z"]], [ref["y"], ref["z"]])
    before = unsplit.get_weights()
    move_weights()
    for a, b in zip(before, unsplit.get_weights()):  # training the pipeline leaves the copy alone
        np.testing.assert_array_equal(a, b)


def test_weights_pass_in_the_source_models_order():
    # Two equal-shaped heads that the cut orders otherwise than Keras lists them (h, y2, y1
    # stage by stage; h, y1, y2 in the functional model): a weight list in stage order
    # would swap the heads without an error.
    keras.utils.set_random_seed(4)
    inp = keras.Input((4,))
    y1 = keras.layers.Dense(4, name="y1")(inp)
    y2 = keras.layers.Dense(4, name="y2")(keras.layers.Dense(4, name="h")(inp))
    model = keras.Model(inp, {"o2": y2, "o1": y1})
    pm = tf_gpipe.PipelineModel.from_model(model, num_stages=3, num_micro_batches=2)
    assert [v.path for v in pm.weights] != [v.path for v in model.weights]  # what the test needs
    for a, b in zip(pm.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    other = keras.models.clone_model(model)
    rng = np.random.RandomState(0)
    other.set_weights([rng.randn(*w.shape).astype("float32") for w in other.get_weights()])
    pm.set_weights(other.get_weights())
    x = rng.randn(5, 4).astype("float32")
    out, ref = pm.predict(x, verbose=0), other.predict(x, verbose=0)
    assert_all_close([out["o1"], out["o2"]], [ref["o1"], ref["o2"]])
    with pytest.raises(ValueError, match=r"got 5 arrays for the 6 weights"):
        pm.set_weights(other.get_weights()[:5])
    with pytest.raises(ValueError, match=r"shape \(4,\) for the weight 'h/kernel'"):
        pm.set_weights(other.get_weights()[1:] + other.get_weights()[:1])


def test_to_functional_needs_from_model():
    pm = tf_gpipe.PipelineModel([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"list of layers: use model.to_sequential\(\)"):
        pm.to_functional()


def test_a_mask_crosses_each_cut_as_in_the_unsplit_model():
    """Embedding(mask_zero) | Dense, LSTM | masked average, Dense: the mask crosses both cuts
    (padding would otherwise count), and Keras is not told that a stage given a masked input
    drops its mask. Keras 3.15's functional graph passes the mask as a tensor of its own (a
    node of its own, in the first stage); 3.16 carries it on the tensors."""

    def masked():
        keras.utils.set_random_seed(4)
        tokens = keras.Input((7,), dtype="int32")
        h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        h = keras.layers.LSTM(6, return_sequences=True)(keras.layers.Dense(8, activation="tanh")(h))
        return keras.Model(tokens, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))

    ref = masked()
    names = [type(node.operation).__name__ for node in graph_nodes(ref)]
    cuts = [names.index("Dense"), names.index("GlobalAveragePooling1D")]
    balance = [cuts[0], cuts[1] - cuts[0], len(names) - cuts[1]]
    rng = np.random.RandomState(2)
    x = rng.randint(1, 20, (11, 7)) * (np.arange(7) < rng.randint(2, 8, (11, 1)))  # padded tails
    y = rng.randint(0, 3, 11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = tf_gpipe.PipelineModel.from_model(
            masked(), balance=balance, num_micro_batches=3, schedule="1f1b"
        )
        assert_all_close(ref(x), pm(x))
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for m in (ref, pm):
            m.compile(optimizer=keras.optimizers.Adam(0.02), loss=ce)
        history = [m.fit(x, y, batch_size=11, epochs=2, shuffle=False, verbose=0).history for m in (ref, pm)]
    assert not [w for w in caught if "GraphStage" in str(w.message)], [str(w.message) for w in caught]
    np.testing.assert_allclose(history[1]["loss"], history[0]["loss"], rtol=1e-5)
    assert_all_close(ref.get_weights(), pm.get_weights(), rtol=1e-4, atol=1e-6)
