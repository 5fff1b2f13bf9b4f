"""Rows gradients (``tf.IndexedSlices``) of the micro-batches, gathered as the unsplit model's.

Keras' optimizers apply rows as given: an element-wise op (Adam's, RMSprop's, Adagrad's
square) runs on each row, and rows of the same index are summed only afterwards. So the
update depends on how the gradient is cut into rows, not only on its dense sum, and the
pipelined gradient must have the unsplit model's rows.

A lookup of the examples' own indices (a token embedding) gives one row per looked-up
index: the micro-batches' rows, concatenated, are the unsplit model's. A lookup of
indices that do not come from the batch (a position embedding's ``arange(length)``, its
sum broadcast to every example) gives the same rows in every micro-batch, each the sum
over that micro-batch's examples; the unsplit model has them once, each the sum over the
whole mini-batch, so the micro-batches' rows are summed row by row. Concatenated, each
index would reach the optimizer M times: SGD is linear and would not notice, Adam would.

Which kind a variable's rows are is read off a trace of its stage with the batch size
unknown: rows whose count is then still known do not grow with the batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import keras_compat, tf_compat
from tf_gpipe.cell import Cell

__all__: list[str] = []


def _relaxed(t: Any) -> Any:
    """A spec of ``t`` (a tensor or a spec) with a leading dimension of unknown size."""
    if t is None:
        return None
    shape = t.shape if isinstance(t, tf.TensorSpec) else tf.TensorSpec.from_tensor(t).shape
    dims = shape.as_list() if shape.rank is not None else None
    if dims:
        dims[0] = None
    return tf.TensorSpec(dims, t.dtype)


def relaxed_specs(structure: Any) -> Any:
    """``structure``'s tensors (or specs) as specs with a leading dimension of unknown size."""
    return tf.nest.map_structure(_relaxed, structure)


def batch_free(cell: Cell, inputs: Any, mask: Any, side: Any) -> frozenset[int]:
    """ids of ``cell``'s trainable variables whose rows do not grow with the batch.

    ``inputs``, ``mask``, ``side``: one micro-batch's (tensors or specs). The stage is
    traced once more (never run), the first time a caller asks; the answer is kept on
    the cell.
    """
    known = cell.batch_free_rows
    if known is not None:
        return known
    variables = cell.trainable_variables

    def probe(inputs, mask, side):
        # A name scope of its own: a layer named like "_x" is no valid root scope in a new graph.
        scope_name = tf.name_scope(f"stage{cell.index}_rows")
        with scope_name, tf.GradientTape() as tape, keras_compat.RecordingScope() as scope:
            outputs, _ = cell.call(inputs, mask, True, side)
            terms = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(outputs)]
            terms += [tf.cast(loss, tf.float32) for loss in scope.losses]
            total = tf.add_n([t for t in terms if t.dtype.is_floating])
        grads = tape.gradient(total, variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
        return [g.values if isinstance(g, tf.IndexedSlices) else tf.zeros([]) for g in grads]

    specs = relaxed_specs((inputs, mask, side))
    try:
        with tf.device(cell.device):
            traced = tf_compat.function(probe, autograph=False).get_concrete_function(*specs)
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError) as e:
        # Training worked without this trace; a layer that needs a known batch size
        # must not stop it, only be told what it costs.
        warnings.warn(
            f"tf_gpipe: stage {cell.index} cannot be traced with the batch size unknown "
            f"({type(e).__name__}: {e}), so its Embedding rows are concatenated over the "
            "micro-batches. Rows that recur in every micro-batch (a position embedding) then "
            "reach the optimizer M times, which Adam, RMSprop or Adagrad apply differently "
            "from the unsplit model. Let the stage's layers accept any batch size to fix it.",
            stacklevel=2,
        )
        cell.batch_free_rows = frozenset()
        return cell.batch_free_rows
    found = frozenset(
        id(v)
        for v, values in zip(variables, traced.structured_outputs)
        if values.shape.rank and values.shape[0] is not None
    )
    cell.batch_free_rows = found
    return found


def combine(parts: Sequence[Any], batch_free_rows: bool) -> Any:
    """One gradient from the micro-batches' ``parts`` (each rows, a dense tensor, or None).

    ``batch_free_rows``: the rows do not grow with the batch (``batch_free``); they are
    summed row by row where every micro-batch has the same indices, and concatenated
    otherwise (indices that differ between micro-batches have no unsplit counterpart:
    each micro-batch's rows then count once, as a linear optimizer would have them).
    """
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if not all(isinstance(p, tf.IndexedSlices) for p in parts):
        return tf.add_n([tf.convert_to_tensor(p) for p in parts])
    values = tf.concat([p.values for p in parts], 0)
    indices = tf.concat([p.indices for p in parts], 0)
    dense_shape = parts[0].dense_shape
    if not batch_free_rows:
        return tf.IndexedSlices(values, indices, dense_shape)
    first = parts[0].indices
    same = tf.reduce_all([tf.reduce_all(tf.equal(p.indices, first)) for p in parts[1:]])
    values, indices = tf.cond(
        same,
        lambda: (tf.add_n([p.values for p in parts]), first),
        lambda: (values, indices),
    )
    return tf.IndexedSlices(values, indices, dense_shape)


def accumulate(total, g):
    """Sum two gradients, keeping IndexedSlices sparse."""
    if g is None:
        return total
    if total is None:
        return g
    if isinstance(total, tf.IndexedSlices) and isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([total.values, g.values], 0),
            tf.concat([total.indices, g.indices], 0),
            total.dense_shape,
        )
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(g)


def add_to(totals: dict[int, Any], variable: Any, g: Any) -> None:
    """Add a stage's gradient ``g`` of ``variable`` to ``totals`` (``{id(variable): gradient}``).
    A variable two stages use (a tied weight) gets a gradient from each: their sum is made on
    the variable's own device, where its update runs."""
    key = id(variable)
    if g is None:
        return
    if totals.get(key) is None:
        totals[key] = g
        return
    with tf.device(keras_compat.backing_variable(variable).device), tf.name_scope("shared_gradient_sum"):
        totals[key] = accumulate(totals[key], g)
