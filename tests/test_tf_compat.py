"""The private TensorFlow behaviour tf_gpipe relies on, one test per hook."""

import contextlib
import importlib

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import tf_compat

VERSION = f"TensorFlow {tf.__version__}"


def test_captured_source_is_the_outer_value(cpu_devices):
    with tf.device(cpu_devices[2]):
        outer = tf.Variable(tf.zeros(2000))
        eager = tf.ones(2000)  # small eager tensors are captured as constants
    found = {}

    @tf.function
    def f():
        y = outer.read_value() + eager
        graph = tf.compat.v1.get_default_graph()
        for op in graph.get_operations():
            if op.type == "Placeholder":
                found[op.outputs[0].dtype] = tf_compat.captured_source(op.outputs[0])
        found["sum"] = tf_compat.captured_source(y)
        return y

    f()
    assert found[tf.resource].device.endswith("CPU:2"), f"{VERSION}: {found}"
    assert found[tf.float32] is eager, VERSION
    assert found["sum"] is None, VERSION  # not a placeholder


def test_is_symbolic():
    assert not tf_compat.is_symbolic(tf.ones(1))
    seen = []
    tf.function(lambda: seen.append(tf_compat.is_symbolic(tf.ones(1) + 1)))()
    assert seen == [True], VERSION


def test_a_missing_captures_fails_loudly(monkeypatch):
    from tensorflow.python.framework import func_graph

    monkeypatch.delattr(func_graph.FuncGraph, "captures")

    @tf.function
    def f(x):
        with pytest.raises(tf_compat.TFCompatError, match=rf"TensorFlow {tf.__version__} no longer"):
            tf_compat.captured_source(x)
        return x

    f(tf.ones(1))


def test_call_with_captures_feeds_other_captured_inputs():
    a, b = tf.Variable(1.0), tf.Variable(2.0)

    @tf.function
    def read_a(x):
        return a.read_value() + x

    concrete = read_a.get_concrete_function(tf.TensorSpec([], tf.float32))

    @tf.function
    def step():
        inputs = [b.handle if t is a.handle else t for t in concrete.captured_inputs]
        return tf_compat.call_with_captures(concrete, [tf.constant(10.0)], inputs)

    assert float(step()) == 12.0, VERSION


def _while_body_control_inputs(lift):
    """The control inputs of the loop body's outputs, the loop built with the flag lowered or not."""
    v = tf.Variable(0.0)

    @tf.function
    def f():
        def body(i):
            v.assign_add(1.0)  # a stateful op the automatic dependencies would make i wait for
            return (i + 1,)

        with tf_compat.no_automatic_control_dependencies() if lift else contextlib.nullcontext():
            return tf.while_loop(lambda i: i < 2, body, (tf.constant(0),))

    graph_def = f.get_concrete_function().graph.as_graph_def()
    bodies = [fn for fn in graph_def.library.function if "body" in fn.signature.name]
    return [i for fn in bodies for n in fn.node_def for i in n.input if i.startswith("^")]


def test_no_automatic_control_dependencies_leaves_the_loop_body_unordered():
    assert _while_body_control_inputs(lift=False), VERSION  # what the hook takes away
    assert not _while_body_control_inputs(lift=True), VERSION


def test_no_automatic_control_dependencies_restores_the_flag():
    seen = []

    @tf.function
    def f():
        graph = tf.compat.v1.get_default_graph()
        with tf_compat.no_automatic_control_dependencies():
            seen.append(graph._add_control_dependencies)
        seen.append(graph._add_control_dependencies)
        return tf.constant(0)

    f()
    assert seen == [False, True], VERSION


def test_traced_unordered_orders_nothing_by_itself():
    v = tf.Variable(1.0)

    def fn(x):
        v.assign_add(x)
        return {"sum": v.read_value(), "twice": 2.0 * x}

    @tf.function
    def outer():
        graph = tf_compat.traced_unordered("probe", fn, [tf.TensorSpec([], tf.float32)])
        assert sorted(graph.structured_outputs) == ["sum", "twice"], VERSION
        assert graph.structured_outputs["twice"].dtype == tf.float32, VERSION
        # tf.function's tracer would make the read wait for the write (and more).
        assert not [op.name for op in graph.get_operations() if op.control_inputs], VERSION
        return tf.constant(0)

    outer()
    assert float(v.numpy()) == 1.0  # traced, never run


def test_a_missing_tracer_fails_loudly(monkeypatch):
    from tensorflow.python.framework import func_graph

    monkeypatch.delattr(func_graph, "func_graph_from_py_func")
    with pytest.raises(
        tf_compat.TFCompatError, match=r"func_graph_from_py_func.*what a loop's iteration emits"
    ):
        tf_compat.traced_unordered("probe", lambda: tf.constant(0), [])


def test_gradient_function_of_a_function_call():
    @tf.function
    def square(x):
        return x * x

    @tf.function
    def step(x):
        y = square(x)
        assert y.op.type in ("StatefulPartitionedCall", "PartitionedCall")
        own = tf_compat.gradient_function(y.op)
        assert own is not None, VERSION
        assert tf_compat.gradient_function(x.op) is None, VERSION  # a plain op: by its type
        tf_compat.set_gradient_function(y.op, lambda op, dy: [own(op, dy)[0] * 10.0])
        return tf.gradients(y, x)[0]

    assert float(step(tf.constant(3.0))) == 60.0, VERSION


def test_py_function_callable_of_a_py_function_op():
    graph = tf.Graph()
    with graph.as_default():
        tf.py_function(lambda t: t * 2.0 + 1.0, [tf.constant([1.0])], tf.float32)
    (op,) = [op for op in graph.get_operations() if op.type == "EagerPyFunc"]
    function = tf_compat.py_function_callable(op)  # tf.py_function's wrapper of the lambda
    assert float(tf.reshape(function(tf.constant([3.0])), [])) == 7.0, VERSION


def test_op_determinism_enabled():
    from tensorflow.python.framework import config

    assert not tf_compat.op_determinism_enabled(), VERSION
    tf.config.experimental.enable_op_determinism()
    try:
        assert tf_compat.op_determinism_enabled(), VERSION
    finally:
        config.disable_op_determinism()


def test_server_def_is_none_outside_a_cluster():
    assert tf_compat.server_def() is None, VERSION


@pytest.mark.parametrize(
    "module, name, hook",
    [
        ("tensorflow.python.framework.config", "is_op_determinism_enabled", tf_compat.op_determinism_enabled),
        ("tensorflow.python.eager.context", "get_server_def", tf_compat.server_def),
    ],
)
def test_a_missing_module_function_fails_loudly(monkeypatch, module, name, hook):
    monkeypatch.delattr(importlib.import_module(module), name)
    with pytest.raises(tf_compat.TFCompatError, match=rf"TensorFlow {tf.__version__} no longer.*{name}"):
        hook()


def test_a_missing_py_function_registry_fails_loudly(monkeypatch):
    from tensorflow.python.ops import script_ops

    graph = tf.Graph()
    with graph.as_default():
        tf.py_function(lambda t: t, [tf.constant([1.0])], tf.float32)
    (op,) = [op for op in graph.get_operations() if op.type == "EagerPyFunc"]
    monkeypatch.delattr(script_ops, "_py_funcs")
    with pytest.raises(tf_compat.TFCompatError, match=r"_py_funcs.*remat='always'"):
        tf_compat.py_function_callable(op)


def test_a_missing_call_flat_fails_loudly():
    class Concrete:  # a ConcreteFunction of a TensorFlow without _call_flat
        pass

    with pytest.raises(tf_compat.TFCompatError, match=r"_call_flat"):
        tf_compat.call_with_captures(Concrete(), [], [])


def test_a_missing_gradient_function_fails_loudly():
    class Op:  # an Operation of a TensorFlow without _gradient_function
        pass

    with pytest.raises(tf_compat.TFCompatError, match=r"_gradient_function"):
        tf_compat.gradient_function(Op())  # type: ignore[arg-type]
    with pytest.raises(tf_compat.TFCompatError, match=r"_gradient_function"):
        tf_compat.set_gradient_function(Op(), lambda *_: None)  # type: ignore[arg-type]


def test_a_missing_control_dependencies_flag_fails_loudly(monkeypatch):
    class Graph:  # a graph of a TensorFlow without the flag
        pass

    monkeypatch.setattr(tf.compat.v1, "get_default_graph", Graph)
    with (
        pytest.raises(tf_compat.TFCompatError, match=r"_add_control_dependencies"),
        tf_compat.no_automatic_control_dependencies(),
    ):
        pass


def test_add_control_input_makes_an_op_wait():
    """A variable's read made to wait for a write made after it reads the written value (a
    graph function: no automatic control dependencies to order them otherwise)."""
    v = tf.Variable(1.0)

    def f():
        # The read op itself (``read_value`` wraps it in an identity, which waiting would not
        # hold the read back: the test would pass or fail by the executor's order).
        read = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
        write = v.assign(5.0)
        tf_compat.add_control_input(read.op, write.op)
        return read

    for _ in range(20):  # without the wait, the read runs first in some of them
        v.assign(1.0)
        assert float(tf.compat.v1.wrap_function(f, [])()) == 5.0, VERSION


def test_update_input_rewires_an_op():
    seen = []

    @tf.function
    def f(x):
        y = x + 1.0
        tf_compat.update_input(y.op, 0, tf.constant(10.0))
        seen.append(True)
        return y

    assert float(f(tf.constant(0.0))) == 11.0, VERSION
    assert seen == [True]


def test_forward_backward_splits_a_call_into_its_halves(cpu_devices):
    """The forward half returns the outputs and what the gradient reads; the gradient half,
    given that, returns what a tape gives (a dense and a rows gradient of captured variables)."""
    with tf.device(cpu_devices[1]):
        w = tf.Variable(tf.random.normal([4, 3], seed=1))
        emb = tf.Variable(tf.random.normal([10, 4], seed=2))

    @tf.function(autograph=False)
    def f(x, ids):
        return tf.nn.relu(x @ w) + tf.reduce_sum(tf.gather(emb, ids) @ w, 0)

    x, ids = tf.random.normal([5, 4], seed=3), tf.constant([1, 2, 2])
    dy = tf.random.normal([5, 3], seed=4)
    concrete = f.get_concrete_function(x, ids)
    first, second, n = tf_compat.forward_backward(concrete)
    assert n == 1
    args = tf_compat.flat_arguments(concrete, (x, ids))
    outs = tf_compat.call_forward(first, args + list(concrete.captured_inputs))
    position = {id(t): j for j, t in enumerate(first.graph.outputs)}
    kept = [outs[position[id(c)]] if id(c) in position else c for c in second.captured_inputs]
    grads = tf_compat.call_backward(second, [dy], kept)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = f(x, ids)
    want = tape.gradient(out, [x, w, emb], output_gradients=dy)
    handles = [id(h) for h in concrete.captured_inputs]
    got = [grads[0]] + [grads[len(args) + handles.index(id(v.handle))] for v in (w, emb)]
    np.testing.assert_allclose(outs[0], out)
    assert isinstance(got[2], tf.IndexedSlices)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(ref), rtol=1e-6)


def test_part_gradient_differentiates_part_of_a_traced_function():
    """Two gradient functions of one traced function, as ZB-H1's halves: the first gives
    the input's gradient and the gradient at a product; the second, from that, the weight's
    (the product alone, the input held constant, and the weight's direct use); the second's
    forward feeds both and returns the outputs first. Together they give what a tape gives."""

    @tf.function(autograph=False)
    def f(x, w):
        return tf.sin(x * w) + w

    x, w, dy = tf.constant([0.5, 1.0, -2.0]), tf.constant([2.0, 3.0, 0.25]), tf.constant([1.0, -1.0, 0.5])
    concrete = f.get_concrete_function(x, w)
    graph = concrete.graph
    x_in, w_in = graph.inputs[:2]
    product = next(op for op in graph.get_operations() if op.type == "Mul").outputs[0]
    out = graph.outputs[0]
    spec = [tf.TensorSpec(out.shape, out.dtype)]
    _, first, first_got = tf_compat.part_gradient(
        concrete, spec, lambda grads, g: grads([out], [x_in, product], [g])
    )
    assert [g is not None for g in first_got] == [True, True]

    def weight(grads, at_product, at_out):
        through = grads([product], [w_in], [at_product], stops=[x_in])[0]
        return [through + grads([out], [w_in], [at_out], stops=[product])[0]]

    forward, second, _ = tf_compat.part_gradient(concrete, spec * 2, weight)
    outs = tf_compat.call_forward(forward, [x, w])
    position = {id(t): j for j, t in enumerate(forward.graph.outputs)}

    def reads(fn):
        return [outs[position[id(c)]] if id(c) in position else c for c in fn.captured_inputs]

    dx, d_product = tf_compat.call_backward(first, [dy], reads(first))
    (dw,) = tf_compat.call_backward(second, [d_product, dy], reads(second))
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        ref = f(x, w)
    want = tape.gradient(ref, [x, w], output_gradients=dy)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-6)
    np.testing.assert_allclose(dx, want[0], rtol=1e-6)
    np.testing.assert_allclose(dw, want[1], rtol=1e-6)


def test_a_missing_forward_backward_pair_fails_loudly():
    class Bare:
        pass

    with pytest.raises(tf_compat.TFCompatError, match="_delayed_rewrite_functions"):
        tf_compat.forward_backward(Bare())


def _retracing_warnings(caplog):
    return [r for r in caplog.records if "triggered tf.function retracing" in r.getMessage()]


def test_function_traces_once_per_instance_without_a_warning(fresh_tracing_counts, caplog):
    """Six instances, each with its own function of the same method, each traced once: a plain
    ``tf.function`` is warned of (the control), ``tf_compat.function`` not."""

    class Plain:
        def __init__(self):
            self.f = tf.function(self.body)

        def body(self, x):
            return x + 1

    class Compat(Plain):
        def __init__(self):
            self.f = tf_compat.function(self.body)

        def body(self, x):  # code of its own: TensorFlow counts traces per code object
            return x + 2

    for kind in (Plain, Compat):
        caplog.clear()
        for _ in range(6):
            kind().f(tf.constant(1.0))
        assert bool(_retracing_warnings(caplog)) == (kind is Plain), (VERSION, kind.__name__)
    assert hasattr(tf.function(lambda: 0), "_omit_frequent_tracing_warning"), VERSION
