"""GPipe's training step as loops over micro-batches (tf_gpipe.micro_batch_loop): the
engine's built-out results, 2K stage-function call sites whatever M, no barrier between stages."""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, mlp_layers
from test_side_inputs import _inputs as side_data
from test_side_inputs import _layers as side_layers

import tf_gpipe
from tf_gpipe import loop_choice, loop_state, micro_batch_loop

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CALLS = ("StatefulPartitionedCall", "PartitionedCall")


def _fit(make_layers, x, y, use_loop, monkeypatch, **kwargs):
    calls = []
    original = micro_batch_loop.run
    monkeypatch.setattr(micro_batch_loop, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    keras.utils.set_random_seed(7)
    pm = tf_gpipe.PipelineModel(make_layers(), num_micro_batches=5, micro_batch_loops=use_loop, **kwargs)
    pm.compile(optimizer="adam", loss=LOSS)
    # 29 examples in batches of 13: micro-batches of 3 and 2, then a batch of 3 cut
    # into 5 (two of them padded stand-ins that must change nothing).
    history = pm.fit(x, y, batch_size=13, epochs=2, shuffle=False, verbose=0)
    return pm, history.history["loss"], bool(calls)


def test_loop_gives_the_built_out_steps_results_with_side_inputs(monkeypatch):
    """Loss, weights, BatchNormalization statistics and optimizer state after two epochs of
    uneven and padded micro-batches equal those of the engine's built-out step, with side
    inputs every stage reads. (Token layers under every schedule and remat mode:
    ``test_micro_batch_loop.test_the_loop_computes_what_the_built_out_step_does``.)"""
    data = side_data(29)
    make, x, y = side_layers, data, np.arange(29) % 3
    kwargs = dict(num_stages=3, side_inputs=("scale", "keep"))
    looped, loss_l, used = _fit(make, x, y, True, monkeypatch, **kwargs)
    assert used
    built, loss_b, used = _fit(make, x, y, False, monkeypatch, **kwargs)
    assert not used
    assert_all_close(loss_l, loss_b, rtol=1e-6, atol=1e-6)
    assert_all_close(looped.weights, built.weights, rtol=1e-6, atol=1e-6)
    assert_all_close(looped.optimizer.variables, built.optimizer.variables, rtol=1e-6, atol=1e-6)
    # The loops carry the gradient sums as loop variables, in memory only while a step runs;
    # built out, the step adds to variables as large as the weights, kept between steps.
    assert not any(c.gradient_sums for c in looped.cells)
    assert all(c.gradient_sums for c in built.cells)


@functools.cache  # read, never changed: two tests share the M=6 loop graph
def _step_graph(M, use_loop, remat="always", batch=None, schedule="gpipe"):
    keras.backend.clear_session()
    # On logical CPUs even where GPUs are visible: only there are the handles packed.
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=3),
        num_stages=2,
        num_micro_batches=M,
        micro_batch_loops=use_loop,
        devices=cpus,
        remat=remat,
        schedule=schedule,
    )
    pm.compile(optimizer="sgd", loss=LOSS)
    pm.build((None, 8))
    pm.optimizer.build(pm.trainable_variables)
    step = tf.function(pm.train_step)
    spec = (tf.TensorSpec([batch, 8], tf.float32), tf.TensorSpec([batch], tf.int64))
    return step.get_concrete_function(spec).graph.as_graph_def()


def _stage_calls(nodes):
    return [
        n
        for n in nodes
        if n.op in CALLS and any(k in n.attr["f"].func.name for k in ("_forward_body", "_backward_body"))
    ]


def _count_stage_calls(graph_def):
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return len(_stage_calls(nodes))


def test_stage_call_sites_do_not_grow_with_micro_batches():
    """K=2: as many stage-function call sites for M=9 as for M=2 (one forward and one
    backward per stage), where the built-out step has one per (stage, micro-batch)."""
    looped = {M: _count_stage_calls(_step_graph(M, True)) for M in (2, 9)}
    assert looped[2] == looped[9] == 4, looped
    built = _count_stage_calls(_step_graph(9, False))
    assert built == 2 * 2 * 9, built


def test_step_grows_by_a_few_ops_per_micro_batch():
    """What grows with M in the loops' step is each micro-batch's own input: its part of the
    batch, written to the loop's arrays, and its weight n_m/N. With the batch size unknown
    while tracing (``fit`` on a dataset), K=2, 1F1B: at most 30 ops a micro-batch, 28 now
    (57 when each micro-batch was cut by a slice of its own)."""

    def size(M):
        graph_def = _step_graph(M, True, schedule="1f1b")
        return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)

    per_micro_batch = (size(9) - size(2)) / 7
    assert per_micro_batch <= 30, per_micro_batch


def _name(ref):
    return ref.lstrip("^").split(":")[0]


def _through_identities(fdef, ref):
    """The op a value comes from, through Identities and tokens (a constant ready once a
    call's outputs are: its control input)."""
    nodes = {n.name: n for n in fdef.node_def}
    name = _name(ref)
    while name in nodes and (
        nodes[name].op == "Identity" or (nodes[name].op == "Const" and nodes[name].input)
    ):
        name = _name(nodes[name].input[0])
    return name


def _ancestors(fdef, name):
    nodes = {n.name: n for n in fdef.node_def}
    seen, stack = set(), [name]
    while stack:
        node = nodes.get(stack.pop())
        for ref in [] if node is None else node.input:
            if _name(ref) not in seen:
                seen.add(_name(ref))
                stack.append(_name(ref))
    return seen


def _calls_by_stage(body):
    """``{call node name: stage}`` for the stage-function calls in a loop body."""
    return {
        n.name: int(re.search(r"stage(\d+)_(?:forward|backward)/", n.name).group(1))
        for n in _stage_calls(body.node_def)
    }


def _loop_bodies(graph_def):
    fdefs = {f.signature.name: f for f in graph_def.library.function}
    return [f for name, f in fdefs.items() if re.match(r"while(_\d+)?_body", name)]


def _handed_on(body):
    """``(loop variable as the next iteration reads it, as this one returns it, the call it
    comes from)`` for each loop variable a stage-function call produces."""
    args = [a.name for a in body.signature.input_arg]
    calls = _calls_by_stage(body)
    for j, a in enumerate(body.signature.output_arg):
        source = _through_identities(body, body.ret[a.name])
        if source in calls:
            yield args[j], body.ret[a.name], source


def _uses_loop(monkeypatch, **options):
    calls = []
    original = micro_batch_loop.run
    monkeypatch.setattr(micro_batch_loop, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    pm = tf_gpipe.PipelineModel(mlp_layers(depth=3), **{"num_stages": 2, "num_micro_batches": 4, **options})
    pm.compile(optimizer="sgd", loss=LOSS)
    x = np.random.RandomState(0).rand(8, 8).astype("float32")
    pm.train_on_batch(x, np.arange(8) % 3)
    return bool(calls)


def test_the_default_loops_on_cpus(cpu_devices, monkeypatch):
    """``micro_batch_loops="auto"`` (the default) builds GPipe's step as the loops where every
    stage is on a CPU, logical CPUs included."""
    assert tf_gpipe.PipelineModel(mlp_layers(depth=3)).micro_batch_loops == "auto"
    assert _uses_loop(monkeypatch, devices=cpu_devices[:2])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(micro_batch_loops=False),
        dict(micro_batch_loops=True, num_micro_batches=1),
        dict(num_micro_batches=1),
        dict(remat="except_last", micro_batch_loops=False),
        dict(schedule="1f1b", micro_batch_loops=False),
        dict(schedule="1f1b", num_micro_batches=1),
    ],
)
def test_other_steps_are_built_out(kwargs, monkeypatch):
    """With ``micro_batch_loops=False``, or at M=1 (nothing to loop over), the engine
    builds every action."""
    assert not _uses_loop(monkeypatch, **kwargs)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("remat", ["always", "never"])
def test_per_micro_batch_schedules_loop_by_default(schedule, remat, monkeypatch):
    """Every schedule whose loss is per micro-batch, with any remat mode, is one loop over
    micro-batches by default on CPUs (``tf_gpipe.micro_batch_loop``)."""
    assert _uses_loop(monkeypatch, schedule=schedule, remat=remat)


def test_auto_asks_for_the_loops_on_every_device():
    """``"auto"`` (the default) and ``True`` mean the loops, on CPU and GPU stages alike;
    ``False`` builds every action out."""
    assert loop_choice.chosen("auto") and loop_choice.chosen(True)
    assert not loop_choice.chosen(False)


@pytest.mark.parametrize("remat", ["never", "except_last"])
def test_gpipe_with_taped_stages_loops_by_default(remat, monkeypatch):
    """GPipe with stages that keep their activations is loops too: their forward halves keep
    what the backward halves read (``tf_gpipe.stash``)."""
    assert _uses_loop(monkeypatch, remat=remat)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_micro_batch_loops_refuses_other_values(value):
    with pytest.raises(ValueError, match="micro_batch_loops must be True, False or 'auto'"):
        tf_gpipe.PipelineModel(mlp_layers(depth=3), num_stages=2, micro_batch_loops=value)


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_micro_batch_loops_survives_the_config_round_trip(value):
    pm = tf_gpipe.PipelineModel(
        mlp_layers(depth=3), num_stages=2, num_micro_batches=4, micro_batch_loops=value
    )
    assert tf_gpipe.PipelineModel.from_config(pm.get_config()).micro_batch_loops == value


@pytest.mark.parametrize(
    "schedule, remat",
    [("gpipe", "always"), ("gpipe", "never"), ("1f1b", "never"), ("zb-h1", "never")],
)
def test_loops_carry_one_handle_tensor_per_stage(schedule, remat):
    """Each loop carries a stage's variable handles (weights, seed states)
    as one stacked tensor, not one loop variable per variable (tf_gpipe.handles): ~7 graph
    nodes per loop variable once TensorFlow lowers the loop. A taped stage's calls too:
    GPipe's (``remat="never"``: its rewritten forward, its gradient half), and those one
    loop differentiates with a tape or ``tf.gradients`` (1F1B, ZB-H1's B and W), taken
    w.r.t. the handles the loop passes (``cell_pass._fed_handles``)."""
    graph_def = _step_graph(6, True, remat, schedule=schedule)
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    loops = [n for n in nodes if n.op in ("While", "StatelessWhile")]
    assert len(loops) == (2 if schedule == "gpipe" else 1)
    for n in loops:
        resources = [t for t in n.attr["T"].list.type if t == tf.resource.as_datatype_enum]
        assert len(resources) <= 2, (n.name, len(resources))  # two stages: one tensor each


def test_no_iteration_waits_for_the_other_stages():
    """What a stage hands on to its next iteration waits for its own call and for the calls
    that feed it data in this iteration (forward: the stages before it; backward: those
    after it), never for a stage that follows it: no barrier of all stages per iteration.
    In a tf.function TensorFlow makes every output of a loop body wait for every stateful
    op in it, so the loop is built without those dependencies
    (``loop_state.independent_stages``, a private TensorFlow flag: this fails if an upgrade
    ignores it)."""
    checked = 0
    for body in _loop_bodies(_step_graph(6, True)):
        calls = _calls_by_stage(body)
        backward = any("backward" in c for c in calls)
        for _, returned, call in _handed_on(body):
            stage = calls[call]
            waits_for = {
                calls[c] for c in _ancestors(body, _name(returned)) | {_name(returned)} if c in calls
            }
            later = {k for k in waits_for if (k < stage if backward else k > stage)}
            assert not later, (returned, call, waits_for)
            checked += 1
    assert checked >= 2 * 2


def test_the_iterations_may_overlap():
    """The loops let every iteration run at once (``parallel_iterations`` = M): what
    pipelines the stages is iteration m + 1's stage 0 running beside iteration m's stage 1.
    With one iteration at a time each micro-batch would cross every stage before the next
    began, and the step would take K times as long on serial devices."""
    graph_def = _step_graph(6, True)
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    loops = [n for n in nodes if n.op in ("While", "StatelessWhile")]
    assert [n.attr["parallel_iterations"].i for n in loops] == [6, 6]


# A backward body's arguments as its function names them: a nested argument's tensors are
# named after it, the first plainly. The stage's inputs are the first tensor of its
# ``MicroBatch`` (``mb``).
_INPUTS = "mb"


def test_a_replay_waits_for_its_gradients_whatever_its_inputs():
    """Inlined, a backward body's replay would start as soon as its inputs exist, holding a
    stage's activations from the forward phase on: every input waits for the output
    gradients first (which wait for the stage's previous action), integer inputs (token ids)
    too."""
    keras.backend.clear_session()
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    layers = [keras.layers.Embedding(40, 8), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]
    pm = tf_gpipe.PipelineModel(layers, num_stages=2, num_micro_batches=4, devices=cpus)
    pm.compile(optimizer="sgd", loss=LOSS)
    pm.build((None, 6))
    pm.optimizer.build(pm.trainable_variables)
    spec = (tf.TensorSpec([None, 6], tf.int32), tf.TensorSpec([None], tf.int64))
    graph_def = tf.function(pm.train_step).get_concrete_function(spec).graph.as_graph_def()
    bodies = [f for f in graph_def.library.function if "_backward_body" in f.signature.name]
    assert len(bodies) == 2
    for f in bodies:
        readers = [n for n in f.node_def if _INPUTS in map(_name, n.input)]
        assert readers, f.signature.name
        for n in readers:
            assert n.op == "Identity" and "^output_grads" in set(n.input), (n.name, n.input)


def test_layout_fills_arrays_entry_by_entry_and_empties_them_as_stacks_where_shapes_agree():
    """``Layout.filled`` writes each entry (a stack would hold a second copy of them all);
    ``Layout.entries`` reads one stack per value whose entries share a fully defined shape
    (no op per micro-batch), one entry at a time elsewhere or with ``stack=False``: the
    same entries either way."""
    values = [(tf.fill([2, 3], float(m)), tf.range(m + 1), tf.constant(m)) for m in range(4)]
    same = [(a, c) for a, _, c in values]

    def round_trip(values, relax, stack):
        layout = loop_state.Layout(values[0], relax=relax)
        arrays = layout.filled([tf.nest.map_structure(tf.identity, v) for v in values])
        return [layout.expand(row) for row in layout.entries(arrays, len(values), stack)]

    ragged = tf.function(lambda: round_trip(values, True, True), autograph=False)
    static = tf.function(lambda: round_trip(same, False, True), autograph=False)
    unstacked = tf.function(lambda: round_trip(same, False, False), autograph=False)
    for v, g in zip(values, ragged()):
        assert_all_close(list(v), list(g))
    for fn in (static, unstacked):
        for (a, _, c), g in zip(values, fn()):
            assert_all_close([a, c], list(g))

    def ops(fn):
        return [op.type for op in fn.get_concrete_function().graph.get_operations()]

    assert ops(ragged).count("TensorListSetItem") == 12  # one write per entry
    assert ops(ragged).count("TensorListGetItem") == 12  # relaxed shapes: one read per entry
    assert (ops(static).count("TensorListStack"), ops(static).count("TensorListGetItem")) == (2, 0)
    assert (ops(unstacked).count("TensorListStack"), ops(unstacked).count("TensorListGetItem")) == (0, 8)


def test_layout_holds_values_for_a_later_loop_in_one_array_per_dtype():
    """``Layout.hold``: M values of several tensors (three dtypes, uneven shapes, scalars) in
    one TensorArray per dtype; ``take`` gives each back with its static shape and frees
    it, in micro-batch order: each list keeps exactly the entries not yet taken, whatever
    order they were held in. A dtype of one value (the bool) and of several: both ways of
    finding an entry's list positions (``_slots``)."""
    M = 3
    values = [
        [tf.fill([m + 1, 2], float(m)), tf.range(m + 2), tf.fill([2], -float(m)), tf.constant(7 * m)]
        + [tf.fill([m + 1], float(10 * m + k)) for k in range(3)]
        + [tf.constant(m % 2 == 0)]
        for m in range(M)
    ]
    layout = loop_state.Layout(values[0], relax=True)

    @tf.function(autograph=False)
    def round_trip():
        arrays = layout.held_arrays(M)
        for m in (2, 0, 1):
            arrays = layout.hold(arrays, tf.constant(m), M, values[m])
        back, lengths = [], []
        for m in range(M):
            got, arrays = layout.take(arrays, tf.constant(m), M)
            back.append(got)
            lengths.append([tf.raw_ops.TensorListLength(input_handle=a) for a in arrays])
        shapes.extend(t.shape.as_list() for t in back[0])
        return len(arrays), back, lengths

    shapes: list = []
    n_arrays, back, lengths = round_trip()
    assert n_arrays == 3  # float32, int32 and bool
    for want, got in zip(values, back):
        assert_all_close(want, got)
    # Entries left after each take, per list: 5 float32 tensors, 2 int32, 1 bool an entry.
    assert [[int(n) for n in row] for row in lengths] == [[10, 4, 2], [5, 2, 1], [0, 0, 0]]
    assert shapes == [[None, 2], [None], [None], [], [None], [None], [None], []]  # relaxed specs
