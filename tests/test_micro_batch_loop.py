"""1F1B, interleaved and ZB-H1 as one loop over micro-batches (tf_gpipe.micro_batch_loop):
the built-out step's results, a graph that does not grow with M, and each device held to
its schedule's order across micro-batches (schedules.loop_waits)."""

import collections
import re
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TRAINED_TOL, assert_all_close, mlp_layers, partition_graphs, same_device

import tf_gpipe
from tf_gpipe import keras_compat, loop_state, micro_batch_loop, schedules, stash, trainer
from tf_gpipe.schedules.loop_waits import Wait, waits, weight_lags

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "zb-h1": dict(schedule="zb-h1"),
    "interleaved": dict(schedule="interleaved", virtual_stages=2),
}


def test_one_f_one_b_waits_bound_what_each_stage_holds():
    """1F1B's order, kept across micro-batches: stage s's forward of m waits for its backward
    of m - (K - s), and each stage's actions of one kind stay in micro-batch order."""
    found = set(waits(schedules.get("1f1b", 4, 8)))
    for s in range(4):
        assert Wait("F", s, "B", s, 4 - s) in found
        assert {Wait("F", s, "F", s, 1), Wait("B", s, "B", s, 1)} <= found


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("M", [2, 5, 8])
def test_every_wait_holds_in_the_schedules_order(name, M):
    """Each wait is part of the schedule's own order for every micro-batch, so the schedule's
    order runs the loop: it cannot deadlock."""
    K = 2 if name == "interleaved" else 3
    if name == "interleaved" and M % K:
        M *= K
    schedule = schedules.get(name, K, M, 2 if name == "interleaved" else 1)
    position = {a: (d, i) for d, order in enumerate(schedule.orders) for i, a in enumerate(order)}
    # Iteration i runs stage s's W of micro-batch i - later[s], every other action of i.
    later = weight_lags(schedule)
    assert later == ({s: min(s, M - 1) for s in range(1, K)} if name == "zb-h1" else {})

    def micro_batch(kind, stage, i):
        return i - (later.get(stage, 0) if kind == "W" else 0)

    for w in waits(schedule, later):
        for i in range(M):
            m, m_on = micro_batch(w.kind, w.stage, i), micro_batch(w.on_kind, w.on_stage, i - w.lag)
            if 0 <= m < M and 0 <= m_on < M:
                d, at = position[schedules.Action(w.kind, w.stage, m)]
                d_on, at_on = position[schedules.Action(w.on_kind, w.on_stage, m_on)]
                assert d == d_on and at_on < at, (w, i)


def test_out_of_order_schedules_are_refused():
    schedule = schedules.get("1f1b", 2, 3)
    order = schedule.orders[0]
    first, second = order.index(schedules.Action("F", 0, 0)), order.index(schedules.Action("F", 0, 1))
    order[first], order[second] = order[second], order[first]
    with pytest.raises(ValueError, match="out of micro-batch order"):
        waits(schedule)


def _token_layers():
    """Rows (an Embedding's gradient), a Keras mask, dropout, deferred BatchNormalization
    statistics and an activity regularizer (a loss a layer adds) in one model."""
    keras.utils.set_random_seed(4)
    return [
        keras.layers.Embedding(40, 8, mask_zero=True),
        keras.layers.Dropout(0.25, seed=1),
        keras.layers.Dense(8, activation="relu", activity_regularizer=keras.regularizers.l2(1e-2)),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ]


def _token_data(n=29):
    rng = np.random.RandomState(0)
    x = rng.randint(1, 40, (n, 6)).astype("int32")
    x[:, 4:] *= rng.rand(n, 2) > 0.5  # some padding (token 0) at the end
    return x, rng.randint(0, 3, n)


def _fit(layers, x, y, batch_size, **kwargs):
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, **kwargs)
    pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    history = pm.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history["loss"]
    return history, pm


# Every schedule with re-materialized and taped stages, and the two that handle a mix of
# both in their own way: GPipe (a loop of forwards, then one of backwards, holding what
# taped stages keep) and ZB-H1 (split B and W). 1F1B and interleaved share one loop code.
@pytest.mark.parametrize(
    "schedule,remat",
    [(s, r) for s in SCHEDULES for r in ("always", "never")]
    + [("gpipe", "except_last"), ("zb-h1", "except_last")],
)
def test_the_loop_computes_what_the_built_out_step_does(schedule, remat, monkeypatch):
    """Rows, a Keras mask, dropout, deferred BatchNormalization, a layer's loss, Adam, and
    uneven micro-batches (29 examples, batch 13: 13 in 4 then 3 in 4) give the built-out
    step's losses, weights and optimizer state, and the loop did build them. The loops carry
    the gradient sums as loop variables, in memory only while a step runs; built out, the
    step adds to variables as large as the weights, kept between steps."""
    x, y = _token_data()
    kwargs = dict(num_micro_batches=4, remat=remat, **SCHEDULES[schedule])
    want, built = _fit(_token_layers(), x, y, 13, micro_batch_loops=False, **kwargs)
    calls = []
    original = micro_batch_loop.run
    monkeypatch.setattr(micro_batch_loop, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    got, looped = _fit(_token_layers(), x, y, 13, micro_batch_loops=True, **kwargs)
    assert calls
    assert_all_close(got, want)
    tol = dict(rtol=TRAINED_TOL, atol=TRAINED_TOL)
    assert_all_close(looped.get_weights(), built.get_weights(), **tol)
    assert_all_close(looped.optimizer.variables, built.optimizer.variables, **tol)
    assert not any(c.gradient_sums for c in looped.cells)
    assert all(c.gradient_sums for c in built.cells if c.trainable_variables)


class _Logged(keras.layers.Layer):
    """Identity that logs, as it runs, its forward ("F") and its gradient ("B")."""

    def __init__(self, stage, log, **kwargs):
        super().__init__(**kwargs)
        # A bound method, not the list: Keras would track (copy) a list attribute.
        self.stage, self.append = stage, log.append
        # A host call inside: no XLA (what Keras asks a layer to declare).
        self.supports_jit = False

    def call(self, x):
        def record(kind):
            def write(t):
                if (kind, self.stage) == ("F", 1):
                    # A slow stage 1, so that without the waits stage 0 runs ahead and
                    # stage 1's forwards pile up: which op the executor picks is otherwise a
                    # matter of load, and an unconstrained loop can happen to keep 1F1B's
                    # order. (A sleep, not a wait on stage 0: a kernel that blocks also
                    # holds the cheap ops queued behind it on its thread, the loop's own.)
                    time.sleep(0.02)
                with _LOCK:
                    self.append((kind, self.stage))
                return t

            return write

        @tf.custom_gradient
        def logged(t):
            t = tf.numpy_function(record("F"), [t], t.dtype, stateful=True)

            def grad(dy):
                return tf.numpy_function(record("B"), [dy], dy.dtype, stateful=True)

            return t, grad

        out = logged(x)
        out.set_shape(x.shape)
        return out


_LOCK = threading.Lock()


@pytest.mark.parametrize("with_waits", [True, False])
def test_each_stage_holds_what_one_f_one_b_allows(with_waits, cpu_devices, monkeypatch):
    """Run, not read: with M=8 on two stages, no stage ever has more forwards done and not
    yet backward than 1F1B allows (K - s); without the waits, a stage's forwards run ahead
    (the check that the test can fail)."""
    if not with_waits:
        monkeypatch.setattr(loop_state.Tokens, "before", lambda *a: [])
    log: list = []
    first, last = mlp_layers(depth=1)
    layers = [first, _Logged(0, log), keras.layers.Dense(12, activation="tanh"), _Logged(1, log), last]
    pm = tf_gpipe.PipelineModel(
        layers, num_stages=2, num_micro_batches=8, schedule="1f1b", remat="never", devices=cpu_devices[:2]
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(16, 8).astype("float32")
    worst = [0, 0]
    for _ in range(3):
        log.clear()
        pm.train_on_batch(x, np.arange(16) % 3)
        held = [0, 0]
        for kind, s in log:
            held[s] += 1 if kind == "F" else -1
            worst[s] = max(worst[s], held[s])
        assert len(log) == 2 * 2 * 8
    if with_waits:
        assert worst[0] <= 2 and worst[1] <= 1, worst
    else:
        assert worst[0] > 2 or worst[1] > 1, worst


class _LoggedScale(keras.layers.Layer):
    """``x * w`` that logs, as they run, its forward ("F", slow; "R" replayed) and each
    backward half's input gradient ("B") and weight gradient ("W": both come from one
    gradient function)."""

    def __init__(self, log, **kwargs):
        super().__init__(**kwargs)
        self.append = log.append
        self.supports_jit = False

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        def record(kind, pause=0.0):
            def write(t):
                time.sleep(pause)  # a slow forward: a W left free would run before the next B
                with _LOCK:
                    self.append(kind)
                return t

            return write

        @tf.custom_gradient
        def scaled(t, w):
            forward = "R" if tf_gpipe.is_recomputing() else "F"  # a replay's: "R"
            y = tf.numpy_function(record(forward, 0.02), [t * w], t.dtype, stateful=True)

            def grad(dy):
                dx = tf.numpy_function(record("B"), [dy * w], dy.dtype, stateful=True)
                return dx, tf.numpy_function(record("W"), [tf.reduce_sum(dy * t)], dy.dtype, stateful=True)

            return y, grad

        out = scaled(x, self.w)
        out.set_shape(x.shape)
        return out


@pytest.mark.parametrize("remat", ["never", "always"])
def test_zb_h1_runs_each_weight_half_where_its_schedule_puts_it(remat, cpu_devices):
    """Run, not read: zb-h1's last stage (K=2, M=4) runs W(m) after B(m + 1), as its
    schedule orders it, not right after B(m): the loop runs that W an iteration later
    (``loop_waits.weight_lags``), what it reads held until then."""
    log: list = []
    first, last = mlp_layers(depth=1)
    layers = [first, keras.layers.Dense(12, activation="tanh"), _LoggedScale(log), last]
    pm = tf_gpipe.PipelineModel(
        layers, balance=[2, 2], num_micro_batches=4, schedule="zb-h1", remat=remat,
        devices=cpu_devices[:2], micro_batch_loops=True,
    )  # fmt: skip
    pm.compile(optimizer="sgd", loss=LOSS)
    order = schedules.get("zb-h1", 2, 4).orders[1]  # F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3
    # Each action as the log shows it: a half's input gradient (the replays aside, which
    # need not run before it: the input gradient of x * w reads no output).
    want = "".join("F" if a.kind == "F" else "B" for a in order)
    x = np.random.RandomState(0).rand(8, 8).astype("float32")
    for _ in range(2):
        log.clear()
        pm.train_on_batch(x, np.arange(8) % 3)
        assert "".join(k for k in log if k not in "WR") == want, log


def _call_sites(graph_def: tf.compat.v1.GraphDef, word: str) -> int:
    """Function calls in a step's graph whose function's name has ``word``, counted through
    the bodies of the loops and conditionals that run them."""
    library = {f.signature.name: f for f in graph_def.library.function}
    found = 0

    def visit(nodes):
        nonlocal found
        for node in nodes:
            for key in ("f", "body", "then_branch", "else_branch"):
                if key in node.attr and node.attr[key].func.name:
                    name = node.attr[key].func.name
                    found += key == "f" and word in name
                    if name in library:
                        visit(library[name].node_def)

    visit(graph_def.node)
    return found


@pytest.mark.parametrize("M", [3, 6])
def test_zb_h1_runs_each_weight_half_from_one_place_in_the_step(M, cpu_devices):
    """zb-h1 as a loop (K=3) calls each stage's backward from one place whatever M: its B
    and its W, which the loop runs j iterations after the B (``weight_lags``), the last
    ones in iterations of their own that skip every forward and B; not once more per W
    after the loop (each a copy TensorFlow optimizes: 2-3 s of a K=4 first step)."""
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=4), num_stages=3, num_micro_batches=M, schedule="zb-h1",
        devices=cpu_devices[:3], micro_batch_loops=True,
    )  # fmt: skip
    pm.compile(optimizer="sgd", loss=LOSS)
    x = tf.constant(np.random.RandomState(0).rand(2 * M + 1, 8).astype("float32"))
    y = tf.constant(np.arange(2 * M + 1) % 3)
    step = tf.function(lambda x, y: trainer.gradients(pm, (x, y)).grads, autograph=False)
    graph_def = step.get_concrete_function(x, y).graph.as_graph_def()
    # Stage 0 runs no B (its input takes no gradient): three W's and two B's. Stage 0's W
    # replays the stage; the others' B replays it once for both halves (``stash.replay``).
    assert _call_sites(graph_def, "_backward_body") == 1
    assert _call_sites(graph_def, "_replay_split_body_part_backward") == 4
    assert _call_sites(graph_def, "__forward__replay_split_body") == 2


def test_zb_h1_skips_its_last_iterations_on_each_stages_device(cpu_devices):
    """Where zb-h1's loop skips a micro-batch's work (its last iterations, for the last W's),
    each stage's Switch and Merge nodes run on that stage's device, read from the
    partition graphs that ran: a ``tf.cond`` over the iteration lowers to Merges on one
    device, through which every stage's results would cross in every iteration."""
    devices = cpu_devices[1:4]
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=4), num_stages=3, num_micro_batches=4, schedule="zb-h1", devices=devices,
        micro_batch_loops=True,
    )  # fmt: skip
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(11, 8).astype("float32")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, np.arange(11) % 3))
    where = collections.defaultdict(set)
    for g in graphs:
        for n in g.node:
            if "guard" in n.name and n.op in ("Switch", "Merge"):
                where[n.op].add(n.device)
    for op in ("Switch", "Merge"):
        assert len(where[op]) == 3 and all(any(same_device(d, s) for s in devices) for d in where[op]), where


def test_evaluate_and_predict_loop_and_match_the_built_out_forward(monkeypatch):
    """``evaluate`` and ``predict`` run their forward as one loop over micro-batches (uneven
    and padded ones, a Keras mask, a layer's loss, BatchNormalization's moving statistics)
    and give what the built-out forward gives; a user's tape around ``__call__`` keeps the
    built-out forward, which it can differentiate."""
    x, y = _token_data()
    pm = tf_gpipe.PipelineModel(_token_layers(), num_stages=2, num_micro_batches=4)
    pm.compile(optimizer="adam", loss=LOSS)
    pm.fit(x, y, batch_size=13, epochs=1, shuffle=False, verbose=0)
    calls = []
    original = micro_batch_loop.forward
    monkeypatch.setattr(micro_batch_loop, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    looped = pm.evaluate(x, y, batch_size=13, verbose=0), pm.predict(x, batch_size=13, verbose=0)
    assert calls
    pm.micro_batch_loops = False
    built = pm.evaluate(x, y, batch_size=13, verbose=0), pm.predict(x, batch_size=13, verbose=0)
    assert_all_close([looped[0]], [built[0]], rtol=1e-6, atol=1e-6)
    assert_all_close([looped[1]], [built[1]], rtol=1e-6, atol=1e-6)
    pm.micro_batch_loops = "auto"
    calls.clear()
    with tf.GradientTape() as tape:
        out = pm(x[:13], training=False)
    assert not calls
    assert all(g is not None for g in tape.gradient(out, pm.trainable_variables[1:]))


_STAGE_SCOPE = re.compile(r"(?:^|/)stage(\d+)_(forward|backward|replay)/")


def test_gpipe_keeps_taped_stages_activations_between_its_loops(cpu_devices):
    """GPipe with ``remat="never"`` as two loops: each stage's forward half and the gradient
    of its kept activations run on its device (read from the partition graphs that ran), and
    nothing is replayed."""
    devices = cpu_devices[1:4]
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=4), num_stages=3, num_micro_batches=3, remat="never", devices=devices
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(12, 8).astype("float32")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, np.arange(12) % 3))
    misplaced, gradients, scopes = [], set(), set()
    for node in (n for g in graphs for n in g.node):
        found = _STAGE_SCOPE.search(node.name)
        if not found:
            continue
        s, scope = int(found.group(1)), found.group(2)
        scopes.add(scope)
        if "_grad/" in node.name and "MatMul" in node.op:
            gradients.add(s)
        # A transfer is named after what it carries: the next stage receives a stage's output.
        if node.op not in ("_Recv", "_Send") and not same_device(node.device, devices[s]):
            misplaced.append((node.name, node.op, node.device))
    assert misplaced == [], misplaced[:10]
    assert gradients == {0, 1, 2}, gradients
    assert "replay" not in scopes and {"forward", "backward"} <= scopes, scopes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_list_is_read_on_its_device(cpu_devices, schedule):
    """The micro-batches' inputs wait in lists on the first stage's device, their targets
    (and GPipe's output gradients) on the last's, and each iteration reads its entry there.
    Read on another device (the default one, CPU:0 here: a cluster's client), a list
    crosses whole, every entry, every iteration (read from the partition graphs that ran)."""
    devices = cpu_devices[1:4]
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=4), num_stages=3, num_micro_batches=3, schedule=schedule, devices=devices
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(12, 8).astype("float32")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, np.arange(12) % 3))
    nodes = {n.name: n for g in graphs for n in g.node}
    reads = collections.Counter(n.device[-5:] for n in nodes.values() if n.op == "TensorListGetItem")
    assert reads["CPU:0"] == 0 and reads["CPU:1"] >= 1 and reads["CPU:3"] >= 1, reads
    # Nothing a loop carries goes to CPU:0 and back (a loop body's input, sent there).
    carried = [
        n.input[0]
        for n in nodes.values()
        if n.op == "_Send" and n.attr["recv_device"].s.decode().endswith("CPU:0") and "/input/" in n.input[0]
    ]
    assert carried == [], carried


@pytest.mark.parametrize("remat", ["always", "never"])
def test_each_stage_sums_its_gradients_on_its_device(cpu_devices, remat):
    """The loops add each micro-batch's weight gradients to the stage's running sums on the
    stage's device (read from the partition graphs that ran): one addition per weight."""
    devices = cpu_devices[1:4]
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=4), num_stages=3, num_micro_batches=3, remat=remat, schedule="1f1b", devices=devices
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(12, 8).astype("float32")
    graphs = partition_graphs(lambda: pm.train_on_batch(x, np.arange(12) % 3))
    added: dict[int, list[str]] = {s: [] for s in range(3)}
    for node in (n for g in graphs for n in g.node):
        found = re.search(r"/grads_(\d+)/", node.name)
        if found and node.op == "AddV2":
            added[int(found.group(1))].append(node.device)
    for s, cell in enumerate(pm.cells):
        assert len(added[s]) == len(cell.trainable_variables), (s, added[s])
        assert all(same_device(d, devices[s]) for d in added[s]), (s, added[s])


def _stage_call_sites(M, **kwargs):
    """The stage-function calls in the step's graph and its functions (the loop bodies), each
    a body TensorFlow instantiates or inlines once per call site."""
    keras.backend.clear_session()
    pm = tf_gpipe.PipelineModel(mlp_layers(depth=3), num_stages=2, num_micro_batches=M, **kwargs)
    pm.compile(optimizer="sgd", loss=LOSS)
    pm.build((None, 8))
    pm.optimizer.build(pm.trainable_variables)
    spec = (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None], tf.int64))
    graph = tf.function(pm.train_step).get_concrete_function(spec).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op in ("PartitionedCall", "StatefulPartitionedCall") and "stage" in n.name for n in nodes)


@pytest.mark.parametrize("remat", ["never", "except_last"])
def test_gpipe_with_taped_stages_builds_a_step_that_does_not_grow_with_m(remat):
    """As many stage calls for M=8 as for M=2: GPipe's first step with taped stages stays flat
    in M, where built out it grows by K forwards and their gradients per micro-batch (seen
    from M=2 to M=3: the count counts what grows)."""
    sizes = {M: _stage_call_sites(M, remat=remat) for M in (2, 8)}
    assert sizes[2] == sizes[8] > 0, sizes
    built = {M: _stage_call_sites(M, remat=remat, micro_batch_loops=False) for M in (2, 3)}
    assert built[3] > built[2], built


def test_gpipe_taped_stages_with_xla_loop_and_match_built_out(cpu_devices, monkeypatch):
    """With ``jit_compile=True`` each taped stage's forward is an XLA function, split into
    its halves as any other (uneven micro-batches: 29 examples, batch 13)."""
    calls = []
    original = stash.forward
    monkeypatch.setattr(stash, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = np.random.RandomState(0).rand(29, 8).astype("float32")
    y = np.arange(29) % 3
    results = []
    for loops in (True, False):
        pm = tf_gpipe.PipelineModel(
            mlp_layers(depth=4), num_stages=2, num_micro_batches=4, remat="never",
            micro_batch_loops=loops, devices=cpu_devices[:2],
        )  # fmt: skip
        pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS, jit_compile=True)
        assert pm.stage_jit == [True, True]
        history = pm.fit(x, y, batch_size=13, epochs=2, shuffle=False, verbose=0).history["loss"]
        results.append((history, pm.get_weights()))
    assert calls
    assert_all_close(results[0][0], results[1][0])
    assert_all_close(results[0][1], results[1][1])


def _stashes(monkeypatch):
    """Every taped stage's ``(kept tensors, plan)`` as GPipe's loop of forwards makes them."""
    found = []
    original = stash.forward

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        found.append((result[4], result[5]))
        return result

    monkeypatch.setattr(stash, "forward", recording)
    return found


def test_gpipe_keeps_no_weight_or_constant_between_its_loops(cpu_devices, monkeypatch):
    """What a taped stage's gradient reads of its weights (and constants) is the same for
    every micro-batch: its backward reads the weights again instead of a list holding one
    copy per micro-batch (a list write and read each); the step still matches built out."""
    found = _stashes(monkeypatch)
    keras.utils.set_random_seed(3)
    x = np.random.RandomState(1).rand(11, 8).astype("float32")
    y = np.arange(11) % 3
    results = []
    for loops in (True, False):
        layers = mlp_layers(depth=2, extra=[keras.layers.LayerNormalization()])
        pm = tf_gpipe.PipelineModel(
            layers, num_stages=2, num_micro_batches=3, remat="never", micro_batch_loops=loops,
            devices=cpu_devices[:2],
        )  # fmt: skip
        pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
        history = pm.fit(x, y, batch_size=11, epochs=2, shuffle=False, verbose=0).history["loss"]
        results.append((history, pm.get_weights()))
    assert found
    feeds = collections.Counter(how for _, plan in found for how, _ in plan.feeds)
    # Each Dense's kernel and bias and the LayerNorm's two scales, traced twice (the loop's
    # probe and its body): none of them kept.
    assert feeds["read"] >= 2 * 6, feeds
    assert all(len(kept) == len({x for how, x in plan.feeds if how == "kept"}) for kept, plan in found)
    assert_all_close(results[0][0], results[1][0])
    assert_all_close(results[0][1], results[1][1])


class _Shrinking(keras.layers.Layer):
    """A Dense without bias that scales its (trainable) kernel after each call: the kernel
    its gradient reads differs from one micro-batch to the next."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 6), initializer="glorot_uniform")

    def call(self, x):
        y = tf.matmul(x, self.kernel)
        self.kernel.assign(self.kernel * 0.5)
        return y


def _one_step_loops_and_built_out(make_layers, x, y, devices):
    """GPipe, ``remat="never"``, K=2, M=3: the weights after one SGD step, with the loops and
    built out, and the first model's layers."""
    weights, first = [], None
    for loops in (True, False):
        keras.utils.set_random_seed(5)
        layers = make_layers()
        first = first or layers
        pm = tf_gpipe.PipelineModel(
            layers, num_stages=2, num_micro_batches=3, remat="never", micro_batch_loops=loops,
            devices=devices,
        )  # fmt: skip
        pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
        pm.train_on_batch(x, y)
        weights.append(pm.get_weights())
    return weights, first


def test_gpipe_keeps_a_weight_its_forward_writes(cpu_devices, monkeypatch):
    """A weight that the forward writes is kept as each micro-batch read it, not read again
    after the loop of forwards wrote it M times: the loops match the built-out step."""
    found = _stashes(monkeypatch)
    x = np.random.RandomState(2).rand(10, 8).astype("float32")
    (looped, built), layers = _one_step_loops_and_built_out(
        lambda: [keras.layers.Dense(8, activation="tanh"), _Shrinking(), keras.layers.Dense(3)],
        x, np.arange(10) % 3, cpu_devices[:2],
    )  # fmt: skip
    assert_all_close(looped, built)
    kernel = keras_compat.backing_variable(layers[1].kernel).handle
    reads = [x[0] for _, plan in found for how, x in plan.feeds if how == "read"]
    assert found and reads and id(kernel) not in map(id, reads)


class _Mixing(keras.layers.Layer):
    """Multiplies by a fixed 64 x 64 matrix (16 KiB) and by a scalar: constants the gradient reads."""

    def call(self, x):
        mixing = tf.constant(np.random.RandomState(0).rand(64, 64).astype("float32"))
        return tf.matmul(x, mixing) * tf.constant(0.5)


def test_gpipe_keeps_a_large_constant_its_gradient_reads(cpu_devices, monkeypatch):
    """A small constant is made again in the backward; a large one stays kept, the forward's
    own buffer, not copied into the step for as long as it lives."""
    found = _stashes(monkeypatch)
    x = np.random.RandomState(3).rand(10, 64).astype("float32")
    (looped, built), _ = _one_step_loops_and_built_out(
        lambda: [keras.layers.Dense(64), _Mixing(), keras.layers.Dense(3)],
        x, np.arange(10) % 3, cpu_devices[:2],
    )  # fmt: skip
    assert_all_close(looped, built)
    made = [np.size(x) for _, plan in found for how, x in plan.feeds if how == "constant"]
    kept = [t.shape.as_list() for ts, _ in found for t in ts]
    assert made and max(made) == 1, made  # the scalar
    assert [64, 64] in kept, kept


def _masked_layers():
    """A Keras mask (Masking), dropout, deferred BatchNormalization statistics and a loss a
    layer adds, and no Embedding (whose rows a loop's gradient would not keep)."""
    keras.utils.set_random_seed(4)
    return [
        keras.layers.Masking(0.0),
        keras.layers.Dropout(0.25, seed=1),
        keras.layers.Dense(8, activation="relu", activity_regularizer=keras.regularizers.l2(1e-2)),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ]


def _custom_step(pm, x, y):
    """A custom training step's loss and gradients: ``__call__`` under the user's tape."""

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = LOSS(y, pm(x, training=True)) + tf.add_n(pm.losses)
        grads = tape.gradient(loss, pm.trainable_variables)
        return [loss] + [tf.convert_to_tensor(g) for g in grads]

    return step


def test_call_under_a_tape_is_one_loop_with_the_built_out_gradients(cpu_devices):
    """``__call__`` in a custom training step, every stage re-materialized (the default),
    ``micro_batch_loops=True``: one loop over micro-batches, whose gradient TensorFlow
    builds as a second loop replaying each stage on its device, with the loss, the layers'
    losses, every gradient and BatchNormalization's moving statistics of the step built
    out; 29 examples in 4 micro-batches (8, 7, 7, 7)."""
    rng = np.random.RandomState(0)
    x = rng.randn(29, 6, 4).astype("float32")
    x[:, 4:] *= rng.rand(29, 2, 1) > 0.5  # some masked time steps
    y = rng.randint(0, 3, 29)
    devices = cpu_devices[1:4]
    got, loops_built = {}, {}
    for loops in (False, "auto", True):
        pm = tf_gpipe.PipelineModel(
            _masked_layers(), devices=devices, num_micro_batches=4, micro_batch_loops=loops
        )
        pm.build((None, 6, 4))
        step = _custom_step(pm, x, y)
        graph = step.get_concrete_function().graph.as_graph_def()
        loops_built[loops] = sum(n.op in ("While", "StatelessWhile") for n in graph.node)
        keras.utils.set_random_seed(3)
        if loops is True:
            graphs = partition_graphs(step)
        else:
            step()
        got[loops] = [t.numpy() for t in step()] + [w.numpy() for w in pm.non_trainable_weights]
    # True: the forward loop and its gradient; "auto" keeps a custom step built out (its
    # steady step is faster so, benchmarks/first_step/README.md).
    assert loops_built == {False: 0, "auto": 0, True: 2}
    assert_all_close(got[True], got[False], rtol=1e-5, atol=1e-6)
    # Each stage's forward (inlined in the loop) and its replay (inlined in the gradient
    # loop's body) on the stage's device, and nothing of a stage's math differentiated
    # elsewhere; stage 0 (Masking, Dropout) has no weights and no input gradient to replay for.
    placed: dict = {}
    for node in (n for g in graphs for n in g.node):
        scope = re.search(r"stage(\d+)_forward/", node.name)
        if scope and "MatMul" in node.op:
            kind = "replay" if "while_grad" in node.name else "forward"
            placed.setdefault((int(scope[1]), kind), []).append(node.device)
    assert sorted(placed) == [(1, "forward"), (1, "replay"), (2, "forward"), (2, "replay")], placed
    for (s, kind), found in placed.items():
        assert all(same_device(d, devices[s]) for d in found), (s, kind, found)


def test_call_under_a_tape_keeps_an_embeddings_rows(cpu_devices):
    """A stage holding an Embedding keeps ``__call__`` built out under a tape: a loop's
    gradient of a variable is one dense sum, the whole table; built out it is the rows."""
    x, y = _token_data()
    pm = tf_gpipe.PipelineModel(
        _token_layers(), devices=cpu_devices[1:4], num_micro_batches=4, micro_batch_loops=True
    )
    pm.build((None, 6))
    kinds = []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = LOSS(y, pm(x, training=True))
        kinds.extend(type(g).__name__ for g in tape.gradient(loss, pm.trainable_variables))
        return loss

    step.get_concrete_function()
    assert kinds[0] == "IndexedSlices", kinds  # the Embedding's table
