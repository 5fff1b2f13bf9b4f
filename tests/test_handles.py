"""tf_gpipe.handles: a function's captured handles replaced by tensors of the caller's graph
(tf_compat.call_with_captures), and handles stacked per device."""

import tensorflow as tf

from tf_gpipe import handles


def test_call_takes_the_replacement_for_a_captured_handle():
    a, b = tf.Variable(1.0), tf.Variable(2.0)

    @tf.function
    def read_a(x):
        return a.read_value() + x

    concrete = read_a.get_concrete_function(tf.TensorSpec([], tf.float32))
    assert [id(h) for h in handles.captured(concrete)] == [id(a.handle)]

    @tf.function
    def step():
        packed = handles.pack([a.handle, b.handle])
        found = handles.unpack(packed, packed.tensors)
        with handles.replaced({id(a.handle): found[id(b.handle)]}):
            replaced = handles.call(read_a, tf.constant(10.0))
        return handles.call(read_a, tf.constant(10.0)), replaced

    plain, replaced = step()
    assert float(plain) == 11.0
    assert float(replaced) == 12.0


def test_pack_stacks_two_or_more_handles_of_a_cpu_device():
    variables = [tf.Variable(float(i)) for i in range(3)]

    @tf.function
    def step():
        packed = handles.pack([v.handle for v in variables])
        assert len(packed.groups) == 1 and len(packed.groups[0]) == 3
        assert len(handles.pack([variables[0].handle]).tensors) == 0  # one handle: left as it is
        found = handles.unpack(packed, packed.tensors)
        return [tf.raw_ops.ReadVariableOp(resource=found[id(v.handle)], dtype=tf.float32) for v in variables]

    assert [float(t) for t in step()] == [0.0, 1.0, 2.0]


def test_only_cpu_devices_are_packed():
    """No other device has a Pack kernel for resource handles (a GPU's handles stay apart)."""
    assert handles._packable("/job:localhost/replica:0/task:0/device:CPU:1")
    assert not handles._packable("/job:localhost/replica:0/task:0/device:GPU:0")
    assert not handles._packable("")
