"""Split/merge of mini-batches into micro-batches."""

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe import microbatch


@pytest.mark.parametrize(
    "n,M,sizes", [(10, 4, [3, 3, 2, 2]), (8, 8, [1] * 8), (3, 8, [1, 1, 1]), (7, 1, [7])]
)
def test_static_sizes_follow_array_split(n, M, sizes):
    x = tf.reshape(tf.range(n * 2), (n, 2))
    s = microbatch.split(x, M)
    assert s.static and s.sizes == sizes
    assert [int(c.shape[0]) for c in s.chunks] == sizes
    np.testing.assert_array_equal(microbatch.merge(s.chunks), x)


def test_nested_structures_split_together():
    x = {"a": tf.range(5), "b": (tf.ones((5, 2)), None)}
    s = microbatch.split(x, 2)
    assert s.sizes == [3, 2]
    assert s.chunks[1]["b"][1] is None
    np.testing.assert_array_equal(s.chunks[1]["a"], [3, 4])
    merged = microbatch.merge(s.chunks)
    np.testing.assert_array_equal(merged["a"], x["a"])
    np.testing.assert_array_equal(merged["b"][0], x["b"][0])


def test_dynamic_batch_inside_tf_function_allows_empty_micro_batches():
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def roundtrip(x):
        s = microbatch.split(x, 4)
        assert not s.static and len(s) == 4
        return microbatch.merge(s.chunks), tf.stack(s.sizes), tf.stack([s.nonempty(m) for m in range(4)])

    for n, sizes in [(10, [3, 3, 2, 2]), (2, [1, 1, 0, 0]), (0, [0, 0, 0, 0])]:
        x = tf.reshape(tf.range(n * 3, dtype=tf.float32), (n, 3))
        merged, got, nonempty = roundtrip(x)
        np.testing.assert_array_equal(merged, x)
        assert got.numpy().tolist() == sizes
        assert nonempty.numpy().tolist() == [s > 0 for s in sizes]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="leading batch axis"):
        microbatch.split(tf.constant(3.0), 2)
    with pytest.raises(ValueError, match="same number of examples"):
        microbatch.split((tf.ones((3, 1)), tf.ones((4, 1))), 2)
    with pytest.raises(ValueError, match=">= 1"):
        microbatch.split(tf.ones((3, 1)), 0)
    with pytest.raises(ValueError, match="no tensor"):
        microbatch.split((None,), 2)
