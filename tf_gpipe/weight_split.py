"""ZB-H1's two halves of a stage's backward, split at the ops that read its weights.

A stage's backward split into a B (the input gradient) and a W (the weight gradients) as
two gradients of its forward would make the activation gradients twice. Here the B
differentiates the outputs w.r.t. the stage's inputs and the outputs of each op that reads
a weight, and the W differentiates those ops alone, from the gradients the B handed on:
what each computes, a full backward computes once. ``tf_gpipe.stash`` runs the halves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tf_gpipe import ordering, sparse, tf_compat

__all__: list[str] = []


def differentiable(dtype: tf.DType) -> bool:
    """What a gradient function takes a gradient for (TensorFlow's ``IsTrainable``)."""
    return dtype.is_floating or dtype.is_complex or dtype in (tf.resource, tf.variant)


class Frontier(NamedTuple):
    held: int  # gradients at ops that read a weight, which the B returns and the W takes
    alone: tuple[int, ...]  # the differentiable outputs made from weights alone: the W's
    bytes: int  # what the W holds from its B: those gradients and what it reads of the forward


def weight_half_bytes(concrete: Any, n_args: int, weighed: list[int]) -> int | None:
    """What a split W holds of one call of ``concrete`` (an ungated forward; ``n_args`` and
    ``weighed`` as for ``halves``) from its B to its W, in bytes: the gradients the B hands
    it and what it reads of the forward. None where not split. The planner's measure
    (``tf_gpipe.plan.profile``)."""
    found = halves({}, concrete, n_args, weighed)
    return None if found is None else found[3].bytes


def halves(
    cache: dict, concrete: Any, n_args: int, weighed: list[int]
) -> tuple[Any, Any, Any, Frontier, int] | None:
    """``(forward, B, W, frontier, n)`` for a traced ungated forward, made once per trace
    (``cache``: by ``id(concrete)``, ``StageFunctions.split_halves``);
    ``weighed``: the positions of the trainable weights' handles among its inputs (a frozen
    weight, a random generator's state and moving statistics get no W). None where a weight
    is read inside a loop or a function call (a recurrent layer): the gradient of such an op
    is made whole, B and W would each make it, so the stage keeps one backward function.

    The B differentiates the outputs w.r.t. the stage's inputs and the outputs of each op
    that combines a weight (or a value made from weights alone: a read, a cast) with
    anything else: the activation gradients, once. The W takes those and differentiates
    each such op alone, its other inputs held constant, then the weights-only ops back to
    the weights: every path from a weight to the loss leaves the weights-only part of the
    graph through one such op (or is an output made from weights alone, whose gradient the
    W takes too), so their parts sum to the weight's gradient, and nothing of the B is
    computed again.
    """
    key = id(concrete)
    if key in cache:
        return cache[key][1]
    graph = concrete.graph
    n = len(concrete.function_type.flat_outputs)
    inputs = list(graph.inputs)
    handles_at = {id(inputs[k]) for k in weighed}
    readers, only = _weight_readers(graph.get_operations(), handles_at)
    if any(op.type in ordering.FUNCTION_OPS for op, _, _, _ in readers):
        cache[key] = (concrete, None)
        return None
    reading = [t for _, outs, _, _ in readers for t in outs]
    outputs = list(graph.outputs[:n])
    trainable = [t for t in outputs if differentiable(t.dtype)]

    def b_body(gradients, *grad_ys):
        got = gradients(trainable, inputs[:n_args] + reading, grad_ys)
        return got[:n_args] + [None if g is None else tf.convert_to_tensor(g) for g in got[n_args:]]

    _, b, b_got = tf_compat.part_gradient(concrete, specs(trainable), b_body)
    reached = [t for t, g in zip(reading, b_got[n_args:]) if g is not None]
    alone = [j for j, t in enumerate(outputs) if id(t) in only and differentiable(t.dtype)]

    def w_body(gradients, *grad_ys):
        dy = {id(t): g for t, g in zip(reached, grad_ys)}
        parts: dict[int, tuple[tf.Tensor, list[Any]]] = {}
        for _, outs, weights, others in readers:
            given = [(t, dy[id(t)]) for t in outs if id(t) in dy]
            if given:
                got = gradients([t for t, _ in given], weights, [g for _, g in given], others)
                for t, g in zip(weights, got):
                    if g is not None:
                        parts.setdefault(id(t), (t, []))[1].append(g)
        for j, g in zip(alone, grad_ys[len(reached) :]):
            parts.setdefault(id(outputs[j]), (outputs[j], []))[1].append(g)
        # A read's gradient is its weight's (kept sparse, an embedding's rows); the rest goes
        # back through the weights-only ops (casts) to the weights.
        direct: dict[int, list[Any]] = {}
        through, their = [], []
        for t, got in parts.values():
            source = t.op.inputs[0] if t.op.type == "ReadVariableOp" else t
            if id(source) in handles_at:
                direct.setdefault(id(source), []).extend(got)
            else:
                through.append(t)
                their.append(tf.add_n([tf.convert_to_tensor(g) for g in got]))
        back = gradients(through, inputs, their) if through else [None] * len(inputs)
        return [sparse.combine([back[k], *direct.get(id(t), [])], False) for k, t in enumerate(inputs)]

    # The W's forward also outputs what the B reads: the one forward the stage runs.
    first, w, _ = tf_compat.part_gradient(concrete, specs(reached + [outputs[j] for j in alone]), w_body)
    # What the W holds: the gradients the B hands it (one buffer where two ops share one), and
    # what it reads of the forward but the weights' values and constants, made again.
    handed = {id(g): g for g in b_got[n_args:] if g is not None}
    read = {id(c): c for c in w.captured_inputs if getattr(c, "graph", None) is graph}
    again = ("ReadVariableOp", "Const")
    held_bytes = sum(_nbytes(t) for t in handed.values()) + sum(
        _nbytes(t) for t in read.values() if t.dtype != tf.resource and t.op.type not in again
    )
    found = (first, b, w, Frontier(len(reached), tuple(alone), held_bytes), n)
    cache[key] = (concrete, found)  # the trace kept alive with what was made of it
    return found


def _nbytes(t: tf.Tensor) -> int:
    """A tensor's bytes, where its shape is known while tracing (else none)."""
    return int(np.prod(t.shape.as_list())) * t.dtype.size if t.shape.is_fully_defined() else 0


def specs(tensors: list[tf.Tensor]) -> list[tf.TensorSpec]:
    """The specs of ``tensors`` (a traced function's): what a function of them takes."""
    return [tf.TensorSpec(t.shape, t.dtype) for t in tensors]


def _weight_readers(
    ops: list[Any], handles_at: set[int]
) -> tuple[list[tuple[Any, list, list, list]], set[int]]:
    """In a forward's ops (in the order made, an order of their dataflow), each op that
    reads a trainable weight's handle (``handles_at``: their ids), or a value made from
    those alone, together with anything else: ``(op, its float outputs, those inputs, its
    other inputs)``; and the ids of the tensors made from weights (and constants) alone."""
    only, free = set(handles_at), set[int]()
    readers = []
    for op in ops:
        ins = list(op.inputs)
        if not ins:
            if op.type == "Const":
                free.update(id(t) for t in op.outputs)
            continue
        weights = [t for t in ins if id(t) in only]
        others = [t for t in ins if id(t) not in only and id(t) not in free]
        if not weights:
            if not others:
                free.update(id(t) for t in op.outputs)
            continue
        if not others:
            only.update(id(t) for t in op.outputs)
            continue
        weights = [t for t in weights if differentiable(t.dtype)]
        outs = [t for t in op.outputs if t.dtype.is_floating or t.dtype.is_complex]
        if weights and outs:  # else a weight's shape: nothing to differentiate
            readers.append((op, outs, weights, others))
    return readers, only
