"""Exact replay: what one (cell, micro-batch) forward recorded, and its replay.

A forward runs under a recording ``StatelessScope`` (``tf_gpipe.stage``): every variable
write is captured, the value each written variable had before is kept, and the writes
are applied once. ``run`` replays the cell under a ``StatelessScope`` that maps each of
those variables back to its old value and swallows the writes, so the replay reads
exactly what the forward read, draws the same random numbers and changes nothing::

    forward:  read v0 ─► cell ─► write v1 (applied once)      Record(before=[v0], ...)
    replay:   read v0 ─► cell ─► write dropped                 (same masks, same statistics)

The stage functions (``tf_gpipe.stage``, ``tf_gpipe.gated``) build on these pieces, and
``tf_gpipe.cell_pass`` drives them; this module imports neither, so both can import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat, scoped
from tf_gpipe.cell import Cell

__all__ = ["is_recomputing"]

_recomputing = scoped.Flag()


def is_recomputing() -> bool:
    """True while tf_gpipe traces the backward-pass replay of a cell.

    Custom layers with side effects that tf_gpipe cannot see (Python counters,
    ``tf.random`` stateful ops, prints) can skip them during the replay. Keras
    variable updates and ``keras.random`` draws need nothing: they are replayed
    exactly.
    """
    return bool(_recomputing)


def recomputing() -> contextlib.AbstractContextManager[None]:
    """The scope in which a cell's replay is traced."""
    return _recomputing.scope()


def read_stored(variable) -> tf.Tensor:
    """The variable's value as stored, honouring an enclosing StatelessScope.

    Not ``variable.value``, which is cast inside an ``AutocastScope`` (mixed precision):
    the replay must restore the stored value.
    """
    scope = keras_compat.current_stateless_scope()
    if scope is not None:
        value = scope.get_current_value(variable)
        if value is not None:
            return value
    return tf.identity(keras_compat.backing_variable(variable))


@dataclass
class Record:
    """What the backward pass of one (cell, micro-batch) needs from its forward pass."""

    inputs: Any
    mask: Any
    outputs: Any
    out_mask: Any
    losses: list[tf.Tensor]
    replay_state: list[tuple[Any, tf.Tensor]] = field(default_factory=list)
    tape: tf.GradientTape | None = None  # set when the cell is not re-materialized
    nonempty: tf.Tensor | None = None
    side: dict | None = None  # side inputs of this micro-batch (not differentiated)
    before: list[tf.Tensor] = field(default_factory=list)  # written variables' values, for the replay
    pooled: bool = False  # its forward pooled BatchNormalization moments (``DeferredStats``)
    # Taped, for a split schedule, in a graph: each half differentiates with ``tf.gradients``.
    split: bool = False
    # Taped as two halves (``tf_gpipe.stash``): what the gradient half reads, and how.
    kept: list[tf.Tensor] | None = None
    plan: Any = None
    # Taped inside the loops: ``{id(variable): the handle tensor}`` the call read each
    # trainable variable through (``tf_gpipe.handles``), which its gradient is taken w.r.t.;
    # empty where the call read the variables themselves.
    fed: dict[int, tf.Tensor] = field(default_factory=dict)


def run(cell: Cell, record: Record, training: bool | None) -> tuple[Any, list[tf.Tensor]]:
    with recomputing(), keras_compat.RecordingScope(record.replay_state) as scope:
        outputs, _ = cell.call(record.inputs, record.mask, training, record.side)
    return outputs, list(scope.losses)


def mask_grad(g, nonempty):
    if g is None or nonempty is None:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.where(nonempty, g.values, tf.zeros_like(g.values)), g.indices, g.dense_shape
        )
    return tf.where(nonempty, g, tf.zeros_like(g))


def float_positions(flat: list[Any]) -> list[int]:
    """Positions of the float tensors in ``flat``: the inputs that get a gradient."""
    return [
        i
        for i, t in enumerate(flat)
        if isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)
    ]


def tape_gradients(
    tape: tf.GradientTape | None,
    targets: Sequence[Any],
    target_grads: Sequence[tf.Tensor | None],
    flat_in: list[Any],
    float_pos: list[int],
    sources_in: list[tf.Tensor],
    variables: Sequence[Any],
    need_input_grads: bool,
    nonempty: Any,
    gated: bool = False,
) -> tuple[list[tf.Tensor | None], list[tf.Tensor | None]]:
    """``tape``'s gradients of ``targets`` (weighted by ``target_grads``, None = unused)
    w.r.t. ``sources_in`` and ``variables`` (``tf.gradients``' when ``tape`` is None, in a
    graph): input grads laid out like ``flat_in`` (None for non-float inputs), variable
    grads zeroed for an empty micro-batch. ``gated`` (``tf.gradients`` only): each op
    passes on its gradients together (``gate_gradients``), so the chain of input
    gradients never runs ahead of the weight gradients, which free the activations."""
    pairs = [(t, g) for t, g in zip(targets, target_grads) if g is not None and t is not None]
    # A layer's loss in float16 (an activity regularizer under mixed_float16) takes its
    # float32 weight in its own dtype.
    pairs = [(t, g if g.dtype == t.dtype else tf.cast(g, t.dtype)) for t, g in pairs]
    sources = (list(sources_in) if need_input_grads else []) + list(variables)
    if pairs and sources and tape is None:  # symbolic: the ops' own first-order gradients
        result = tf.gradients(
            [t for t, _ in pairs],
            [keras_compat.backing_variable(v) if isinstance(v, keras.Variable) else v for v in sources],
            grad_ys=[g for _, g in pairs],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
            gate_gradients=gated,
            # Not past the stage's inputs: a weight an earlier stage also reads (a tied
            # embedding) gets its gradient there, from that stage's own backward.
            stop_gradients=list(sources_in),
        )
    elif pairs and sources and tape is not None:
        result = tape.gradient(
            [t for t, _ in pairs],
            sources,
            output_gradients=[g for _, g in pairs],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
    else:
        result = [None] * len(sources)
    n_in = len(sources_in) if need_input_grads else 0
    input_grads: list[tf.Tensor | None] = [None] * len(flat_in)
    for i, g in zip(float_pos, result[:n_in]):
        input_grads[i] = g
    return input_grads, [mask_grad(g, nonempty) for g in result[n_in:]]
