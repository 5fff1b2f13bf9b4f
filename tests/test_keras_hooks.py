"""The private Keras behaviour tf_gpipe relies on, one test per hook.

The exact replay is built on the public ``keras.StatelessScope`` (a state mapping,
``get_current_value``, collected losses); what it cannot do without Keras
internals is listed here, so that a Keras upgrade that moves one of them fails
a test that names it rather than a distant equivalence test.
"""

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as kbackend

from tf_gpipe import checkpoint
from tf_gpipe.batchnorm import DeferredStats, batch_norm_layers
from tf_gpipe.cell import _eager_build_scope


def _dropout_bn():
    drop = keras.layers.Dropout(0.5, seed=3)
    bn = keras.layers.BatchNormalization()
    bn.build((None, 4))
    return drop, bn


def test_stateless_scope_add_update_sees_every_write():
    """checkpoint._RecordingScope overrides StatelessScope.add_update (private) to learn
    which variables a forward pass writes: the seed state and the moving statistics."""
    drop, bn = _dropout_bn()
    x = tf.ones((2, 4))
    before = [v.numpy().copy() for v in (drop.seed_generator.state, bn.moving_mean)]
    with checkpoint._RecordingScope() as scope:
        bn(drop(x, training=True), training=True)
    written = {id(v) for v in scope.written.values()}
    assert {id(drop.seed_generator.state), id(bn.moving_mean), id(bn.moving_variance)} <= written
    # The scope kept the writes to itself.
    assert all(
        np.array_equal(b, v.numpy()) for b, v in zip(before, (drop.seed_generator.state, bn.moving_mean))
    )


def test_get_stateless_scope_maps_variable_reads():
    """checkpoint._read uses keras.src's get_stateless_scope (private) to read a variable
    as the enclosing scope maps it."""
    v = keras.Variable(np.zeros(3, "float32"))
    with keras.StatelessScope(state_mapping=[(v, tf.ones(3))]):
        assert np.array_equal(checkpoint._read(v).numpy(), np.ones(3))
    assert np.array_equal(checkpoint._read(v).numpy(), np.zeros(3))


def test_global_state_stateless_scope_swap_builds_real_variables():
    """cell._eager_build_scope clears Keras' global "stateless_scope" attribute (private) so
    a layer first built inside a StatelessScope still gets initialized variables."""
    layer = keras.layers.Dense(2)
    with keras.StatelessScope():
        assert kbackend.in_stateless_scope()
        with _eager_build_scope("/device:CPU:0"):
            assert not kbackend.in_stateless_scope()
            layer.build((None, 3))
        assert kbackend.in_stateless_scope()
    assert layer.kernel.numpy().shape == (3, 2)


def test_batch_normalization_moments_hook():
    """batchnorm.DeferredStats wraps BatchNormalization._moments and reads
    _reduction_axes (private): it must be called once per training call, never in inference."""
    _, bn = _dropout_bn()
    assert tuple(bn._reduction_axes) == (0,)
    stats = DeferredStats()
    with stats.capture([bn]):
        bn(tf.ones((2, 4)), training=False)
        assert stats.sums() == []
        bn(tf.ones((2, 4)), training=True)
    ((layer, (count, _, _)),) = stats.sums()
    assert layer is bn and float(count) == 2.0


def test_raw_variable_behind_keras_variable():
    """checkpoint._read, cell._move_variables and trainer.colocate_slots reach the
    tf.Variable behind a Keras variable through ``_value`` (private)."""
    v = keras.Variable(np.zeros(3, "float32"))
    assert isinstance(v._value, tf.Variable)


def test_flatten_layers_reaches_nested_layers():
    """stage.stage_supports_jit and batchnorm.batch_norm_layers walk sublayers with
    Layer._flatten_layers (private)."""
    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.BatchNormalization()])
    assert batch_norm_layers([inner]) == [inner.layers[1]]
    assert inner.layers[1] in list(inner._flatten_layers())


def test_keras_mask_attributes():
    """cell.Cell passes masks as keras.Sequential does, through keras.src.backend's
    get/set_keras_mask and the layers' _call_has_mask_arg (private)."""
    emb = keras.layers.Embedding(5, 2, mask_zero=True)
    out = emb(tf.constant([[1, 0]]))
    assert np.array_equal(kbackend.get_keras_mask(out).numpy(), [[True, False]])
    lstm = keras.layers.LSTM(2)
    assert lstm._call_has_mask_arg and lstm._call_has_training_arg
    t = tf.ones((1, 2))
    kbackend.set_keras_mask(t, tf.constant([True, False]))
    assert kbackend.get_keras_mask(t) is not None
