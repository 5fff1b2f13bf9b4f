"""A cell's forward and backward pass on one micro-batch: re-materialized, or on a tape.

Keras layers change state while they run: a Dropout draws its mask from a
SeedGenerator whose state variable advances, BatchNormalization moves its
statistics. ``tf.recompute_grad`` simply re-runs the layer, which draws new
masks and applies every update a second time, so its gradients belong to a
different forward pass. Here a re-materialized cell's forward keeps only its
input and what its writes overwrote (``tf_gpipe.replay.Record``), and its backward
replays it exactly (``tf_gpipe.replay.run``): the same random numbers, the same
statistics, no second update. A cell that keeps its activations runs its forward
under a tape instead. Both run as their stage's functions (``tf_gpipe.stage``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import handles, keras_compat, ordering, stage, stash, tf_compat
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import MicroBatch
from tf_gpipe.replay import Record, float_positions, mask_grad, tape_gradients
from tf_gpipe.stage import FULL, Part

__all__: list[str] = []


def forward(
    cell: Cell,
    mb: MicroBatch,
    remat: bool,
    deferred=None,
    persistent: bool = False,
    input_grads: bool = True,
    stashing: bool = False,
) -> Record:
    """Run ``cell`` on micro-batch ``mb`` on its device, applying its variable updates once.

    The cell runs as its stage's forward function (``tf_gpipe.stage``), traced
    once. With ``remat`` the intermediate activations are dropped and the
    backward pass replays the cell; without it a tape keeps them (``persistent``
    when a split schedule takes the input and the weight gradients from it in
    two calls; ``input_grads``: whether the inputs get gradients from it), or, with
    ``stashing``, its forward half keeps what the backward reads (``tf_gpipe.stash``). With
    ``deferred`` (a ``batchnorm.DeferredStats``) BatchNormalization moments are pooled
    there instead of moving the statistics now.
    """
    fns = stage.functions(cell)
    symbolic = persistent and not tf.executing_eagerly()
    inputs, mask, side, nonempty, _ = mb
    if stashing and not remat:
        split = persistent and input_grads and not tf.executing_eagerly()
        outputs, out_mask, losses, before, kept, plan = stash.forward(cell, mb, deferred, input_grads, split)
        return Record(
            inputs=inputs, mask=mask, outputs=outputs, out_mask=out_mask, losses=losses, nonempty=nonempty,
            side=side, before=before, pooled=deferred is not None, kept=kept, plan=plan,
        )  # fmt: skip
    with tf.device(cell.device):
        tape = None
        if remat:
            outputs, out_mask, losses, before = fns.forward(mb, deferred)
        else:
            # A persistent tape makes TensorFlow differentiate the call through its
            # higher-order path: every intermediate of the forward becomes an output, and
            # each gradient call feeds a zero for each (~50 MiB on MobileNet, K = 4). While
            # building a graph, the call's own (first-order) gradient can be taken twice
            # with ``tf.gradients`` instead (``Record.split``), so the tape need not persist.
            tape = tf.GradientTape(persistent=persistent and not symbolic)
            fed = _fed_handles(cell)
            with tape:
                tape.watch(_float_tensors(inputs))
                tape.watch(list(fed.values()))
                outputs, out_mask, losses, before = fns.forward(
                    mb, deferred, taped=True, input_grads=input_grads
                )
            if symbolic:
                _first_order_twice(outputs, losses, before)
    return Record(
        inputs=inputs,
        mask=mask,
        outputs=outputs,
        out_mask=out_mask,
        losses=losses,
        tape=tape,
        nonempty=nonempty,
        side=side,
        before=before,
        pooled=deferred is not None,
        split=symbolic and not remat,
        fed={} if remat else fed,
    )


def _first_order_twice(*structures: Any) -> None:
    """Let ``tf.gradients`` differentiate the stage call that made ``structures`` twice, first order.

    TensorFlow's gradient of a function call (``_rewrite_forward_and_call_backward``) rewrites
    the call on first use to also output the intermediates its backward reads. A second
    ``tf.gradients`` (W after B) then passes a gradient for every output of the rewritten call,
    and each missing one becomes a zero fed to a backward built for them all: the
    higher-order cost again. Here the call's gradient function gets only the gradients of the
    outputs it had when made, as a tape's record of the call passes (the same cached backward
    for B and W). The call's op carries its own gradient function in a graph
    (``tf_compat.gradient_function``).
    """
    for t in tf.nest.flatten(structures):
        op = getattr(t, "op", None)
        if op is None or op.type not in ordering.CALL_OPS:
            continue
        grad = tf_compat.gradient_function(op)
        if grad is None or getattr(grad, "_tf_gpipe", False):
            continue
        count = len(op.outputs)

        def first_order(call, *doutputs, _grad=grad, _count=count):
            return _grad(call, *doutputs[:_count])

        first_order._tf_gpipe = True  # type: ignore[attr-defined]
        tf_compat.set_gradient_function(op, first_order)


def _fed_handles(cell: Cell) -> dict[int, tf.Tensor]:
    """``{id(variable): tensor}`` for the trainable variables whose handles this scope feeds
    the stage's calls in place of the captured ones (``handles.replaced``, inside the
    loops). A tape connects a call to the variables it watches through the handles the
    call reads: these, then, are what the gradient is taken w.r.t. Passing the handles
    packed spares the loop a loop variable per weight (~70 in a 4-stage Transformer:
    benchmarks/first_step/README.md)."""
    variables = cell.trainable_variables
    given = [keras_compat.backing_variable(v).handle for v in variables]
    return {id(v): t for v, h, t in zip(variables, given, handles.fed(given)) if t is not h}


def _float_tensors(structure: Any) -> list[tf.Tensor]:
    return [
        t
        for t in tf.nest.flatten(structure)
        if isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)
    ]


def backward(
    cell: Cell,
    record: Record,
    output_grads: Sequence[tf.Tensor | None],
    loss_grads: Sequence[tf.Tensor | None],
    training: bool | None,
    variables: Sequence[Any],
    part: Part = FULL,
    tracer: Any = None,
) -> tuple[list[tf.Tensor | None], Any]:
    """Gradients of one (cell, micro-batch) w.r.t. its float inputs and ``variables``.

    ``output_grads`` follow ``tf.nest.flatten(record.outputs)``; ``loss_grads``
    follow ``record.losses``. Returns ``(input_grads, variable_grads)`` with
    input grads in the order of ``tf.nest.flatten(record.inputs)`` (None for
    non-float inputs). A re-materialized cell runs its stage's backward function
    (replay and gradients in one function, traced once). ``tracer``, a
    ``(Recorder, device, tag)`` triple, marks the end of the recomputation on a
    timeline. ``part`` (``stage.Part``) says which gradients: with ``part.sums_after``
    (``fit``) the gradients of ``cell.trainable_variables`` are added to the stage's
    gradient sums (``tf_gpipe.gradient_sums``) after that token, and a token, ready once
    they are, is returned in place of the variable grads.

    ``Part(weights=False)`` gives the input grads only (variable grads ``[]``): a split
    schedule's ``B``; its ``W`` is ``Part(inputs=False, ...)``. Re-materialized, each
    replays the cell; taped, each differentiates the forward: with ``tf.gradients`` in a
    graph (``Record.split``), on its persistent tape when eager.
    """
    part = part.normalized()
    need_input_grads, after = part.inputs, part.sums_after
    to_sums = after is not None
    if not part.weights:
        variables = []

    # ZB-H1's B of a re-materialized stage: one replay, which the W then reads
    # (``stash.replay``); eagerly, each half replays the stage.
    replayed_b = record.tape is None and record.plan is None and part.inputs and not part.weights
    if replayed_b and not tf.executing_eagerly():
        stash.replay(cell, record, training, [*output_grads, *loss_grads], tracer)
    if record.plan is not None:
        assert record.kept is not None
        plan = record.plan
        if plan.weights is not None and part.weights:
            raise RuntimeError(f"tf_gpipe: stage {cell.index}'s split backward ran its W before its B.")
        in_grads, var_grads, held = stash.backward(
            cell, plan, record.kept, list(output_grads), list(loss_grads), need_input_grads
        )
        if plan.weights is not None:  # a split B: the record now holds what its W reads
            record.kept, record.plan = record.kept[plan.weights_from :] + held, plan.weights
            return in_grads, []
        if to_sums:
            return in_grads, stage.functions(cell).sums.add(var_grads, record.nonempty, after)
        return in_grads, _for_variables(cell, [mask_grad(g, record.nonempty) for g in var_grads], variables)
    if record.tape is None:
        mb = MicroBatch(record.inputs, record.mask, record.side, record.nonempty, training)
        in_grads, cell_grads = stage.functions(cell).backward(
            mb, record.pooled, record.before, list(output_grads), list(loss_grads), part, tracer
        )
        if to_sums:
            return in_grads, cell_grads
        if not part.weights:
            return in_grads, []
        return in_grads, _for_variables(cell, cell_grads, variables)
    flat_in = tf.nest.flatten(record.inputs)
    float_pos = float_positions(flat_in)
    with tf.device(cell.device):
        in_grads, var_grads = tape_gradients(
            None if record.split else record.tape,
            list(tf.nest.flatten(record.outputs)) + list(record.losses),
            list(output_grads) + list(loss_grads),
            flat_in,
            float_pos,
            [flat_in[i] for i in float_pos],
            [record.fed.get(id(v), v) for v in (cell.trainable_variables if to_sums else variables)],
            need_input_grads,
            None if to_sums else record.nonempty,  # the sums skip an empty micro-batch's
        )
    if to_sums:
        return in_grads, stage.functions(cell).sums.add(var_grads, record.nonempty, after)
    return in_grads, var_grads


def rematerialized(cell: Cell, mb: MicroBatch, deferred=None) -> tuple[Any, Any, list[tf.Tensor]]:
    """Forward ``cell`` on micro-batch ``mb`` so that any enclosing tape re-materializes it.

    Used where the caller differentiates through ``PipelineModel.__call__`` (a
    custom training loop, or a PipelineModel inside a bigger functional model).
    Returns ``(outputs, out_mask, losses)``.
    """
    inputs, mask, side, nonempty, training = mb
    flat_in = tf.nest.flatten((inputs, mask))
    tensor_pos = [i for i, t in enumerate(flat_in) if t is not None]
    meta: dict = {}

    @tf.custom_gradient
    def run(*tensors):
        full = [None] * len(flat_in)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        x, m = tf.nest.pack_sequence_as((inputs, mask), full)
        record = forward(cell, MicroBatch(x, m, side, nonempty, training), remat=True, deferred=deferred)
        # In a loop over micro-batches (``micro_batch_loop.forward``, whose stage calls are
        # inlined) TensorFlow builds this gradient in its backward loop, which may read what
        # the forward loop's body holds but not capture a variable's handle itself (while_v2
        # refuses it): the replay reads the stage's variables through the handles this body
        # captured. And it is inlined there, as the forward is in the loop: a call per
        # iteration made the steady step 1.2-1.35x slower (benchmarks/first_step/README.md).
        in_loop = stage.is_inlined()
        inner = _captured_handles(cell) if in_loop else {}
        inline = stage.inlined if in_loop else contextlib.nullcontext
        flat_out = tf.nest.flatten((record.outputs, record.out_mask))
        meta["structure"] = (record.outputs, record.out_mask)
        meta["out_pos"] = [i for i, t in enumerate(flat_out) if t is not None]
        meta["n_out"] = len(flat_out)
        n_outputs = len(tf.nest.flatten(record.outputs))
        result = [flat_out[i] for i in meta["out_pos"]] + list(record.losses)
        n_losses = len(record.losses)

        def grad(*dys, variables=None):
            dys = list(dys)
            out_grads: list[tf.Tensor | None] = [None] * meta["n_out"]
            for i, g in zip(meta["out_pos"], dys[: len(meta["out_pos"])]):
                out_grads[i] = g
            loss_grads = dys[len(meta["out_pos"]) :] if n_losses else []
            with handles.replaced(inner), inline():
                in_grads, var_grads = backward(
                    cell,
                    record,
                    out_grads[:n_outputs],
                    loss_grads,
                    training,
                    list(variables or []),
                )
            in_flat = in_grads + [None] * (len(flat_in) - len(in_grads))
            return [in_flat[i] for i in tensor_pos], var_grads

        return result, grad

    result = run(*[flat_in[i] for i in tensor_pos])
    n_pos = len(meta["out_pos"])
    full = [None] * meta["n_out"]
    for i, t in zip(meta["out_pos"], result[:n_pos]):
        full[i] = t
    outputs, out_mask = tf.nest.pack_sequence_as(meta["structure"], full)
    return outputs, out_mask, list(result[n_pos:])


def _captured_handles(cell: Cell) -> dict[int, tf.Tensor]:
    """``{id(handle): the function graph being built's capture of it}`` for every variable of
    ``cell``'s layers."""
    graph = tf.compat.v1.get_default_graph()
    found = {}
    for layer in cell.layers:
        for v in layer.variables:
            handle = keras_compat.backing_variable(v).handle
            found[id(handle)] = graph.capture(handle)
    return found


def _for_variables(cell: Cell, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
    """``grads`` (following ``cell.trainable_variables``) for ``variables``, which may hold
    the Keras variables or their backing ``tf.Variable``s."""
    by_id = {}
    for v, g in zip(cell.trainable_variables, grads):
        by_id[id(v)] = by_id[id(keras_compat.backing_variable(v))] = g
    return [by_id.get(id(v)) for v in variables]
