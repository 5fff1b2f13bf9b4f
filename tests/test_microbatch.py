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


def test_dynamic_batch_pads_empty_micro_batches_with_a_real_example():
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def roundtrip(x):
        s = microbatch.split(x, 4)
        assert not s.static and s.padded and len(s) == 4
        rows = tf.stack([tf.shape(c)[0] for c in s.chunks])
        last = s.chunks[-1]
        nonempty = tf.stack([s.nonempty(m) for m in range(4)])
        return s.merge(s.chunks), tf.stack(s.sizes), nonempty, rows, last

    for n, sizes in [(10, [3, 3, 2, 2]), (2, [1, 1, 0, 0]), (0, [0, 0, 0, 0])]:
        x = tf.reshape(tf.range(n * 3, dtype=tf.float32), (n, 3))
        merged, got, nonempty, rows, last = roundtrip(x)
        np.testing.assert_array_equal(merged, x)
        assert got.numpy().tolist() == sizes
        assert nonempty.numpy().tolist() == [s > 0 for s in sizes]
        # No chunk is empty unless the whole batch is: a padded one holds the last example.
        assert rows.numpy().tolist() == [max(s, 1) if n else 0 for s in sizes]
        if sizes[-1] == 0:
            np.testing.assert_array_equal(last, x[-1:] if n else x)


@pytest.mark.parametrize(
    "n,M,k,sizes", [(3, 8, 2, [2, 1]), (5, 8, 4, [2, 1, 1, 1]), (1, 4, 2, [1, 0]), (3, 8, 4, [1, 1, 1, 0])]
)
def test_static_counts_are_a_multiple_of_k_padding_only_below_k(n, M, k, sizes):
    x = tf.reshape(tf.range(n * 2), (n, 2))
    s = microbatch.split(x, M, multiple_of=k)
    assert s.sizes == sizes and s.static == all(sizes)
    assert all(int(c.shape[0]) == max(size, 1) for c, size in zip(s.chunks, sizes))
    for c, size in zip(s.chunks, sizes):
        if not size:
            np.testing.assert_array_equal(c, x[-1:])
            assert not s.nonempty(sizes.index(0)).numpy()
    np.testing.assert_array_equal(s.merge(s.chunks), x)


def test_empty_static_batch_stays_empty():
    x = tf.zeros((0, 3))
    s = microbatch.split({"a": x, "b": None}, 4)
    assert s.sizes == [0] and s.chunks[0]["a"].shape == (0, 3) and s.chunks[0]["b"] is None
    assert s.merge(s.chunks)["a"].shape == (0, 3)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="leading batch axis"):
        microbatch.split(tf.constant(3.0), 2)
    with pytest.raises(ValueError, match="same number of examples"):
        microbatch.split((tf.ones((3, 1)), tf.ones((4, 1))), 2)
    with pytest.raises(ValueError, match=">= 1"):
        microbatch.split(tf.ones((3, 1)), 0)
    with pytest.raises(ValueError, match="no tensor"):
        microbatch.split((None,), 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        microbatch.split(tf.ones((3, 1)), 3, multiple_of=2)
