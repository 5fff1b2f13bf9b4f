"""A taped stage call as two halves: a forward that returns what its gradient reads, and that gradient.

GPipe's step runs every forward before the whole mini-batch's loss and every backward
after it. Built as loops (``tf_gpipe.micro_batch_loop``), that is a loop of forwards and a
loop of backwards, and no tape can wait from one loop to the other. A re-materialized
stage needs only its input there and replays the rest (``tf_gpipe.replay``). A stage that
keeps its activations (``remat="never"``, the last stage of ``"except_last"``) is
differentiated the way TensorFlow differentiates any function call in a graph: the call
is rewritten to also output the intermediates its gradient reads, and the gradient is a
second function of those intermediates (``tf_compat.forward_backward``). Here the forward
loop makes the rewritten call and keeps the intermediates in TensorArrays, one entry per
micro-batch on the stage's device; the backward loop calls the gradient function with
them. What is the same in every micro-batch, the weights the forward only reads and its
constants, is not kept: the backward reads or makes it again. Nothing is recomputed; the
memory is the built-out step's.

The forward is the taped forward function of the stage (``StageFunctions.forward``,
``taped=True``): its gradient is gated (``tf_gpipe.gated``), its variable writes happen
once, in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tf_gpipe import handles, keras_compat, stage, tf_compat
from tf_gpipe.cell import Cell, attach_mask
from tf_gpipe.microbatch import MicroBatch

__all__: list[str] = []


def _differentiable(dtype: tf.DType) -> bool:
    """What a gradient function takes a gradient for (TensorFlow's ``IsTrainable``)."""
    return dtype.is_floating or dtype.is_complex or dtype in (tf.resource, tf.variant)


@dataclass
class Plan:
    """How one stage's backward half reads what its forward half kept.

    ``feeds[i]``, for the i-th input the gradient function captured: ``("kept", j)``, the
    forward's j-th kept tensor; ``("given", t)``, the tensor ``t`` itself (a variable
    handle the forward captured, the same in every micro-batch); ``("read", (h, dtype))``,
    the value of the trainable variable behind handle ``h``, read again; or
    ``("constant", value)``, a constant of the forward.
    """

    backward: Any
    feeds: list[tuple[str, Any]]
    trainable_outputs: list[int]  # positions in the forward's outputs that take a gradient
    output_specs: list[tf.TensorSpec]  # of every forward output (a zero gradient's shape)
    output_slots: dict[int, tuple[str, int]]  # forward output -> ("outputs" | "losses", index)
    input_positions: list[int]  # for each of tf.nest.flatten(inputs): its flat argument, or -1
    variable_positions: list[int]  # for each trainable variable: its gradient's position


def forward(
    cell: Cell, mb: MicroBatch, deferred: Any, input_grads: bool
) -> tuple[Any, Any, list[tf.Tensor], list[tf.Tensor], list[tf.Tensor], Plan]:
    """The stage's taped forward on micro-batch ``mb``, as its forward half.

    Returns ``(outputs, out_mask, losses, before, kept, plan)``: ``kept`` is what the
    backward half (``backward``, with ``plan``) reads, to keep until then.
    """
    fns = stage.functions(cell)
    fn, args = fns.taped_call(mb, deferred, input_grads)
    concrete = fn.get_concrete_function(*args)
    first, second, n = tf_compat.forward_backward(concrete)
    flat_args = tf_compat.flat_arguments(concrete, args)
    captured = list(concrete.captured_inputs)
    graph_inputs = list(concrete.graph.inputs)
    graph_outputs = list(first.graph.outputs)
    with tf.device(cell.device):  # the handles as the loop packed them (``tf_gpipe.handles``)
        produced = tf_compat.call_forward(first, flat_args + handles.fed(captured))
    outputs, out_mask, losses, before, moments = concrete.function_type.pack_output(produced[:n])
    fns.collect_moments(deferred, mb.training, moments)
    if out_mask is not None:
        attach_mask(outputs, out_mask)

    by_id = {id(t): j for j, t in enumerate(graph_outputs)}
    kept: list[tf.Tensor] = []
    kept_at: dict[int, int] = {}
    feeds: list[tuple[str, Any]] = []
    outer = flat_args + captured
    weights = _read_only_weights(cell, graph_inputs, outer, len(flat_args))
    for c in second.captured_inputs:
        j = by_id.get(id(c))
        same = None if j is None else _same_in_every_call(graph_outputs[j], weights)
        if j is None:  # a value from outside the forward: the same for every call
            feeds.append(("given", c))
        elif same is not None:  # a weight's value or a constant: read or made again, not kept
            feeds.append(same)
        elif produced[j].dtype in (tf.resource, tf.variant):
            # A handle the forward was given (a variable's): no TensorArray holds one, and
            # every micro-batch's call gets the same.
            k = next((k for k, t in enumerate(graph_inputs) if t is graph_outputs[j]), None)
            if k is None or k < len(flat_args):
                raise RuntimeError(
                    f"tf_gpipe: stage {cell.index}'s gradient reads a {produced[j].dtype.name} tensor "
                    "its forward makes, which GPipe's loop of backwards cannot be given; use "
                    "remat='always', schedule='1f1b', or micro_batch_loops=False."
                )
            feeds.append(("given", outer[k]))
        else:
            if j not in kept_at:
                kept_at[j] = len(kept)
                kept.append(produced[j])
            feeds.append(("kept", kept_at[j]))

    structure = concrete.structured_outputs
    slots: dict[int, tuple[str, int]] = {}
    position = 0
    for part, values in (("outputs", structure[0]), ("mask", structure[1]), ("losses", structure[2])):
        for i, t in enumerate(tf.nest.flatten(values)):
            if t is not None:
                if part != "mask":
                    slots[position] = (part, i)
                position += 1
    flat_in = tf.nest.flatten(mb.inputs)
    positions, at = [], 0
    for t in flat_in:
        positions.append(at if t is not None else -1)
        at += t is not None
    # A variable's gradient is that of the handle the forward captured; a frozen one has none.
    at_handle = {id(h): len(flat_args) + i for i, h in enumerate(captured)}
    variable_positions = [
        at_handle.get(id(keras_compat.backing_variable(v).handle), -1) for v in cell.trainable_variables
    ]
    plan = Plan(
        backward=second,
        feeds=feeds,
        trainable_outputs=[j for j in range(n) if _differentiable(graph_outputs[j].dtype)],
        output_specs=[tf.TensorSpec(t.shape, t.dtype) for t in graph_outputs[:n]],
        output_slots=slots,
        input_positions=positions,
        variable_positions=variable_positions,
    )
    return outputs, out_mask, list(losses), list(before), kept, plan


# Ops that read a variable and write nothing: a weight only these touch in the forward
# holds one value through the whole step (the optimizer writes it after every backward).
_READS = frozenset({"ReadVariableOp", "ResourceGather", "VariableShape"})
_SMALL_CONSTANT_BYTES = 1024


def _read_only_weights(
    cell: Cell, graph_inputs: list[tf.Tensor], outer: list[Any], n_args: int
) -> dict[int, tuple[Any, tf.DType]]:
    """``{id(placeholder): (outer handle, dtype)}`` for the forward's captured handles of
    the cell's trainable variables that the forward only reads."""
    trainable = {}
    for v in cell.trainable_variables:
        backing = keras_compat.backing_variable(v)
        trainable[id(backing.handle)] = backing.dtype
    found = {}
    for k in range(n_args, len(graph_inputs)):
        placeholder, handle = graph_inputs[k], outer[k]
        if id(handle) not in trainable:
            continue
        if all(op.type in _READS for op in placeholder.consumers()):
            found[id(placeholder)] = (handle, trainable[id(handle)])
    return found


def _same_in_every_call(t: tf.Tensor, weights: dict[int, tuple[Any, tf.DType]]) -> tuple[str, Any] | None:
    """How the backward gets ``t`` (an intermediate its gradient reads) without keeping it,
    where ``t`` is the same for every micro-batch of the step: a constant, or a trainable
    variable's value that nothing in the forward writes (through the identities that
    ``tf.custom_gradient`` puts around it). Each stashed tensor costs a list write and
    read an iteration; a transformer block's weights are ~40% of what its gradient reads."""
    while t.op.type in ("IdentityN", "Identity"):
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
    if t.op.type == "Const":
        # Made again in the backward, a constant is a second copy that the step holds as
        # long as it lives, where a kept one is the forward's own buffer: only small ones.
        value = tf.get_static_value(t)
        small = value is not None and value.nbytes <= _SMALL_CONSTANT_BYTES
        return ("constant", value) if small else None
    if t.op.type == "ReadVariableOp":
        source = weights.get(id(t.op.inputs[0]))
        if source is not None and source[1] == t.dtype:
            return ("read", source)
    return None


def backward(
    cell: Cell,
    plan: Plan,
    kept: list[tf.Tensor],
    output_grads: list[Any],
    loss_grads: list[Any],
    need_input_grads: bool,
) -> tuple[list[Any], list[Any]]:
    """The gradient half of a stage call made by ``forward``, given what it kept:
    ``(input grads following tf.nest.flatten(inputs), None for non-float ones;
    grads following cell.trainable_variables)``."""
    given = {"outputs": list(output_grads), "losses": list(loss_grads)}
    grads_in = []
    for j in plan.trainable_outputs:
        slot = plan.output_slots.get(j)
        g = None if slot is None else given[slot[0]][slot[1]]
        if g is None:  # a state the forward read or pooled: nothing differentiates it
            spec = plan.output_specs[j]
            if not spec.shape.is_fully_defined():
                raise RuntimeError(
                    f"tf_gpipe: stage {cell.index}'s forward has an output of unknown shape "
                    "that nothing differentiates; use remat='always' or micro_batch_loops=False."
                )
            g = tf.zeros(spec.shape, spec.dtype)
        grads_in.append(g)
    with tf.device(cell.device):
        feeds = []
        for how, x in plan.feeds:
            if how == "kept":
                feeds.append(kept[x])
            elif how == "read":  # the handle as the loop passes it (``tf_gpipe.handles``)
                handle, dtype = x
                feeds.append(tf.raw_ops.ReadVariableOp(resource=handles.fed([handle])[0], dtype=dtype))
            elif how == "constant":
                feeds.append(tf.constant(x))
            else:
                feeds.append(x)
        grads = tf_compat.call_backward(plan.backward, grads_in, handles.fed(feeds))
    in_grads = [None if p < 0 or not need_input_grads else grads[p] for p in plan.input_positions]
    var_grads = [None if p < 0 else grads[p] for p in plan.variable_positions]
    return in_grads, var_grads
