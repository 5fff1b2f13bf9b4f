"""The private TensorFlow behaviour tf_gpipe relies on, one test per hook."""

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
