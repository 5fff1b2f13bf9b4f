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

ZB-H1 splits each backward into a B (the input gradient) and a W (the weight gradients).
Two gradients of one call would each compute the stage's activation gradients. So a stage
that keeps its activations is split at the ops that read its weights instead
(``forward(split=True)``, ``tf_gpipe.weight_split``): its ungated forward
(``StageFunctions.split_call``) gets two gradient functions, and what the W reads waits in
the record until then, in place of every activation. A re-materialized stage's B replays
it, split the same way (``replay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from tf_gpipe import handles, keras_compat, ordering, stage, tf_compat, weight_split
from tf_gpipe.cell import Cell, attach_mask
from tf_gpipe.microbatch import MicroBatch

__all__: list[str] = []


@dataclass
class Plan:
    """How one stage's backward half reads what its forward half kept.

    ``feeds[i]``, for the i-th input the gradient function captured: ``("kept", j)``, the
    forward's j-th kept tensor; ``("given", t)``, the tensor ``t`` itself (a variable
    handle the forward captured, the same in every micro-batch); ``("read", (h, dtype))``,
    the value of the trainable variable behind handle ``h``, read again; or
    ``("constant", value)``, a constant of the forward.

    Split (ZB-H1's B and W, ``forward(split=True)``): the forward's plan is the B's, whose
    function also returns the gradients at each op that reads a weight (from position
    ``weight_inputs_at`` of its results); ``weights`` is the W's plan, whose function takes
    those (the last ``held`` kept tensors, once the B made them) and the gradients of the
    outputs that depend on weights alone, and reads ``kept[weights_from:]`` of the forward.
    """

    backward: Any
    feeds: list[tuple[str, Any]]
    trainable_outputs: list[int]  # positions in the forward's outputs that take a gradient
    output_specs: list[tf.TensorSpec]  # of every forward output (a zero gradient's shape)
    output_slots: dict[int, tuple[str, int]]  # forward output -> ("outputs" | "losses", index)
    input_positions: list[int]  # for each of tf.nest.flatten(inputs): its flat argument, or -1
    variable_positions: list[int]  # for each trainable variable: its gradient's position
    weight_inputs_at: int = -1
    weights: Plan | None = None
    weights_from: int = 0
    held: int = 0


class _Kept:
    """What a forward keeps for the gradient functions that read it, and how each reads it."""

    def __init__(self, cell, produced, graph_outputs, graph_inputs, outer, n_args):
        self.cell, self.produced, self.outputs, self.inputs, self.outer = (
            cell, produced, graph_outputs, graph_inputs, outer,
        )  # fmt: skip
        self.n_args = n_args
        self.by_id = {id(t): j for j, t in enumerate(graph_outputs)}
        self.weights = _read_only_weights(cell, graph_inputs, outer, n_args)
        self.kept: list[tf.Tensor] = []
        self._at: dict[int, int] = {}
        self._base = 0

    def feeds(self, backward: Any) -> list[tuple[str, Any]]:
        feeds: list[tuple[str, Any]] = []
        for c in backward.captured_inputs:
            j = self.by_id.get(id(c))
            same = None if j is None else _same_in_every_call(self.outputs[j], self.weights)
            if j is None:  # a value from outside the forward: the same for every call
                feeds.append(("given", c))
            elif same is not None:  # a weight's value or a constant: read or made again, not kept
                feeds.append(same)
            elif self.produced[j].dtype in (tf.resource, tf.variant) and stage.is_inlined():
                # Inside the loops, a handle the forward was given (a variable's): no TensorArray
                # holds one, and every micro-batch's call gets the same. Built out, what the
                # forward made (a recurrent layer's stacks) goes to the backward as it is.
                k = next((k for k, t in enumerate(self.inputs) if t is self.outputs[j]), None)
                if k is None or k < self.n_args:
                    raise RuntimeError(
                        f"tf_gpipe: stage {self.cell.index}'s gradient reads a {self.produced[j].dtype.name} "
                        "tensor its forward makes (a recurrent layer's per-step values), which a later "
                        "loop over micro-batches (GPipe's backwards, ZB-H1's W) cannot be given; use "
                        "remat='always', schedule='1f1b', or micro_batch_loops=False."
                    )
                feeds.append(("given", self.outer[k]))
            else:
                if j not in self._at:
                    self._at[j] = len(self.kept) - self._base
                    self.kept.append(self.produced[j])
                feeds.append(("kept", self._at[j]))
        return feeds

    def restart(self) -> int:
        """Keep what the next functions read apart, from here on, counted from here;
        where that begins."""
        self._at, self._base = {}, len(self.kept)
        return self._base


def forward(
    cell: Cell, mb: MicroBatch, deferred: Any, input_grads: bool, split: bool = False
) -> tuple[Any, Any, list[tf.Tensor], list[tf.Tensor], list[tf.Tensor], Plan]:
    """The stage's taped forward on micro-batch ``mb``, as its forward half.

    Returns ``(outputs, out_mask, losses, before, kept, plan)``: ``kept`` is what the
    backward half (``backward``, with ``plan``) reads, to keep until then. ``split``: the
    backward comes as ZB-H1's two halves (``Plan``; the stage's inputs take gradients).
    """
    fns = stage.functions(cell)
    made = _halved(cell, *fns.split_call(mb, deferred), mb) if split else None
    if made is None:
        made = _halved(cell, *fns.taped_call(mb, deferred, input_grads), mb, split=False)
    assert made is not None
    (outputs, out_mask, losses, before, moments), kept, plan = made
    fns.collect_moments(deferred, mb.training, moments)
    if out_mask is not None:
        attach_mask(outputs, out_mask)
    return outputs, out_mask, list(losses), list(before), kept, plan


def replay(cell: Cell, record: Any, training: Any, arrived: list[Any], tracer: Any = None) -> None:
    """ZB-H1's B of a re-materialized stage: replay ``record``'s forward (``tf_gpipe.replay``)
    once the gradients ``arrived``, as the forward half of a split backward, and keep in
    ``record`` what its B reads (``record.kept``, ``record.plan``). Then the B and the W
    are a kept stage's (``forward(split=True)``): the W differentiates only the ops that read
    a weight, from the gradients the B hands on, and holds what it reads of the replay from
    the B to the W. Replayed in each half instead, the W would make the stage's activation
    gradients a second time. ``record`` is left as it is where the stage's backward is not
    split (a weight read inside a loop, ``weight_split.halves``). ``tracer``: a timeline's
    ``(Recorder, device, tag)``, marking the end of the replay."""
    inputs, mask, side = ordering.after(arrived, (record.inputs, record.mask, record.side))
    mb = MicroBatch(inputs, mask, side, None, training)
    fn, args = stage.functions(cell).replay_split_call(mb, record.pooled, record.before)
    made = _halved(cell, fn, args, mb)
    if made is None:
        return
    (outputs, _, losses, _, _), kept, plan = made
    if tracer is not None:
        recorder, device, tag = tracer
        mark = recorder.marker("replayed " + tag, device, tf.nest.flatten(outputs) + list(losses))
        kept = ordering.after([mark], kept)
    record.kept, record.plan = kept, plan


def _halved(
    cell: Cell, fn: Any, args: tuple, mb: MicroBatch, split: bool = True
) -> tuple[tuple, list, Plan] | None:
    """``fn`` (a stage function returning ``(outputs, out_mask, losses, before, moments)``)
    called on ``args`` as its forward half: what it returns, what it keeps for its backward
    half, and the plan. ``split``: as ZB-H1's B and W; None where ``weight_split.halves`` refuses."""
    concrete, flat_args, captured, variable_positions = _traced(cell, fn, args)
    if split:
        weighed = [p for p in variable_positions if p >= 0]
        halves = weight_split.halves(stage.functions(cell).split_halves, concrete, len(flat_args), weighed)
        if halves is None:
            return None
        first, second, weights_fn, frontier, n = halves
    else:
        first, second, n = tf_compat.forward_backward(concrete)
    graph_inputs = list(concrete.graph.inputs)
    graph_outputs = list(first.graph.outputs)
    with tf.device(cell.device):  # the handles as the loop packed them (``tf_gpipe.handles``)
        produced = tf_compat.call_forward(first, flat_args + handles.fed(captured))
    returned = concrete.function_type.pack_output(produced[:n])

    keep = _Kept(cell, produced, graph_outputs, graph_inputs, flat_args + captured, len(flat_args))
    feeds = keep.feeds(second)
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
    trainable = [j for j in range(n) if weight_split.differentiable(graph_outputs[j].dtype)]
    specs = weight_split.specs(graph_outputs[:n])
    if not split:
        plan = Plan(second, feeds, trainable, specs, slots, positions, variable_positions)
        return returned, keep.kept, plan
    weights_from = keep.restart()
    no_inputs, no_variables = [-1] * len(positions), [-1] * len(variable_positions)
    weights = Plan(
        weights_fn, keep.feeds(weights_fn), list(frontier.alone), specs, slots, no_inputs, variable_positions,
        held=frontier.held,
    )  # fmt: skip
    plan = Plan(
        second, feeds, trainable, specs, slots, positions, no_variables, len(flat_args), weights, weights_from
    )
    return returned, keep.kept, plan


def _traced(cell: Cell, fn: Any, args: tuple) -> tuple[Any, list[Any], list[Any], list[int]]:
    """``fn``'s trace for ``args``: the concrete function, its flat arguments, what it
    captured, and for each trainable variable the position of its handle among the
    function's inputs (-1 for one it does not read: a frozen one has no gradient)."""
    concrete = fn.get_concrete_function(*args)
    flat_args = tf_compat.flat_arguments(concrete, args)
    captured = list(concrete.captured_inputs)
    at_handle = {id(h): len(flat_args) + i for i, h in enumerate(captured)}
    handle_ids = [id(keras_compat.backing_variable(v).handle) for v in cell.trainable_variables]
    return concrete, flat_args, captured, [at_handle.get(h, -1) for h in handle_ids]


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
) -> tuple[list[Any], list[Any], list[tf.Tensor]]:
    """The gradient half of a stage call made by ``forward``, given what it kept:
    ``(input grads following tf.nest.flatten(inputs), None for non-float ones;
    grads following cell.trainable_variables; what the W reads of a split B)``: with a
    split plan, the B's input gradients and the gradients its W takes (``Plan``), or the
    W's weight gradients (``plan.weights``, ``kept`` ending with what the B gave it)."""
    given = {"outputs": list(output_grads), "losses": list(loss_grads)}
    grads_in = list(kept[len(kept) - plan.held :]) if plan.held else []
    kept = kept[: len(kept) - plan.held]
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
        elif g.dtype != plan.output_specs[j].dtype:  # a float16 layer's loss, weighed in float32
            g = tf.cast(g, plan.output_specs[j].dtype)
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
    held = [g for g in grads[plan.weight_inputs_at :] if g is not None] if plan.weights is not None else []
    return in_grads, var_grads, held
