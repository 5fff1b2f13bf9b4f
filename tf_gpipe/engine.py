"""The engine: a schedule (plain data) turned into ops, one training step or a forward pass alone.

``run_schedule`` builds ``fit``'s step. Where the loops over micro-batches apply
(``tf_gpipe.micro_batch_loop``: M >= 2, every schedule, dense inputs, no timeline, on
every kind of device; ``tf_gpipe.loop_choice``), they build the step, and its graph does
not grow with M. Elsewhere (one micro-batch, a timeline, eager steps, GPipe with a taped
recurrent stage, ``micro_batch_loops=False``) every (stage, micro-batch) forward and
backward is built out, in an order consistent with the schedule, and each device's
actions are chained with control dependencies so the device runs them in the schedule's
order: that is what bounds the stashed activations of 1F1B to K per device, where plain
dataflow would run every forward as early as it could. Both builders drive the same
stages (``tf_gpipe.pipeline_stage``); built out, what a stage keeps from one of its
actions to the next (each micro-batch's record, the gradients sent to it, its gradient
sums) is the stage's, and the step passes each micro-batch's outputs on and its input
gradients back.

A split schedule (zb-h1) runs each backward as two actions: ``B`` differentiates w.r.t.
the stage input (what the previous stage waits for) and w.r.t. the outputs of the ops
that read a weight, and keeps what its ``W`` reads; the later ``W`` differentiates those ops
w.r.t. the weights and adds the gradients to the sums (``tf_gpipe.weight_split``). A
re-materialized stage's ``B`` replays its forward first, once for both halves.

``run_forward`` builds the forward alone (``PipelineModel.__call__``, ``evaluate``,
``predict``): the schedule's ``F`` actions in its order, each micro-batch's forward
through every stage, and leaves the backward to any enclosing tape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import loop_choice, micro_batch_loop, ordering, sparse
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import MicroBatch, Split
from tf_gpipe.pipeline_stage import PipelineStage

__all__: list[str] = []

StepLoss = micro_batch_loop.StepLoss


def _whole_batch_grads(schedule: Any, batch_loss: micro_batch_loop.BatchLossFn | None, outputs, out_masks):
    """The last stage's output gradients of every micro-batch, from the whole mini-batch's loss."""
    if batch_loss is None:
        raise ValueError(
            f"tf_gpipe: schedule {schedule.name!r} runs a backward before every "
            "forward is done; it needs a per-micro-batch loss."
        )
    if any(o is None for o in outputs):
        raise ValueError(
            f"tf_gpipe: schedule {schedule.name!r} starts a backward before every "
            "forward is done, so the whole mini-batch loss is not ready; use "
            "schedule='gpipe' for this loss."
        )
    return batch_loss(outputs, out_masks)


def _sized(schedule: Any, cells: Sequence[Cell], split: Split) -> tuple[int, int]:
    """``(stages, micro-batches)`` of the model, refused unless ``schedule`` is for as many."""
    S, M = len(cells), len(split)
    if schedule.num_virtual_stages != S or schedule.num_micro_batches != M:
        raise ValueError(
            f"tf_gpipe: schedule {schedule.name!r} is for {schedule.num_virtual_stages} stages x "
            f"{schedule.num_micro_batches} micro-batches, the model has {S} x {M}."
        )
    return S, M


def run_forward(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: list[Any],
    training: bool | None,
    rematerializes: Callable[[int], bool],
    sides: list[Any] | None = None,
    deferred: Any = None,
    loops: bool | str = False,
) -> tuple[list[Any], list[Any], list[list[tf.Tensor]]]:
    """Build the forward pass of ``schedule`` over ``cells``: its ``F`` actions, in its order.

    What ``PipelineModel.__call__`` runs: any enclosing tape differentiates through it,
    re-materializing where ``rematerializes`` says (training only). Where ``loops``
    (``micro_batch_loops``) asks for it and it applies, one loop over micro-batches
    (``micro_batch_loop.forward``): not training, or training with ``loops`` True and every
    stage re-materialized (``loop_choice.taped_applies``); else one call per action.

    Args:
        schedule: a ``tf_gpipe.schedules.Schedule`` with ``num_virtual_stages == len(cells)``;
            its backward actions are not built (the tape runs the backward).
        cells: the stages, in order.
        split: the micro-batched inputs of stage 0; masks: their Keras masks.
        training: Keras' ``training`` argument.
        rematerializes: whether stage ``s`` is re-materialized when training.
        sides: per micro-batch, the side inputs every stage may read (or None).
        deferred: optional ``batchnorm.DeferredStats`` pooling BatchNormalization moments,
            applied here once every forward is built.
        loops: ``micro_batch_loops``: True, False or "auto" (``loop_choice.chosen``).

    Returns:
        ``(outputs per micro-batch, their Keras masks, the losses the layers added, per
        micro-batch)``.
    """
    _, M = _sized(schedule, cells, split)
    if loops and loop_choice.chosen(loops):
        if not training and loop_choice.forward_applies(cells, split, masks, sides):
            return micro_batch_loop.forward(cells, split, masks, sides, training)
        # Under a tape only when asked for (True, not "auto"): the first step stops growing
        # with M, but TensorFlow's gradient of the loop makes the steady step up to 1.12x
        # slower at small M (benchmarks/first_step/README.md).
        if (
            training
            and loops is True
            and loop_choice.taped_applies(cells, split, masks, sides, rematerializes)
        ):
            out = micro_batch_loop.forward(cells, split, masks, sides, training, True, deferred)
            if deferred is not None:
                deferred.apply()
            return out
    acts = list(split.chunks)
    masks = list(masks)
    losses: list[list[tf.Tensor]] = [[] for _ in range(M)]
    sides = list(sides) if sides is not None else [None] * M
    stages = [PipelineStage(c, s == 0, rematerializes(s), False, False) for s, c in enumerate(cells)]
    for action in schedule.topological_order():
        if action.kind != "F":
            continue
        s, m = action.stage, action.micro_batch
        mb = MicroBatch(acts[m], masks[m], sides[m], split.nonempty(m), training)
        with tf.name_scope(f"stage{s}_mb{m}"):
            acts[m], masks[m], extra = stages[s].call(mb, deferred)
        losses[m].extend(extra)
    if deferred is not None:
        deferred.apply()
    return acts, masks, losses


def run_schedule(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: list[Any],
    rematerializes: Callable[[int], bool],
    sides: list[Any] | None = None,
    loss: StepLoss | None = None,
    tracer: Any = None,
    deferred: Any = None,
    micro_batch_loops: bool | str = False,
) -> tuple[list[Any], list[Any], dict[int, Any], list[list[tf.Tensor]], list[list[Any]]]:
    """Build one training step of ``schedule`` over ``cells``.

    Args:
        schedule: a ``tf_gpipe.schedules.Schedule`` with ``num_virtual_stages == len(cells)``.
        cells: the stages; stage ``s`` runs on ``cells[s].device``.
        split: the micro-batched inputs of stage 0; masks: their Keras masks.
        rematerializes: whether stage ``s`` is re-materialized.
        sides: per micro-batch, the side inputs every stage may read (or None).
        loss: how the loss reaches the stages (``StepLoss``).
        tracer: optional ``tf_gpipe.timeline.Recorder`` that marks each span.
        deferred: optional ``batchnorm.DeferredStats`` pooling BatchNormalization
            moments; the caller applies it once the step is built.
        micro_batch_loops: build the step as loops over micro-batches where they apply
            (``tf_gpipe.micro_batch_loop``): True, False, or "auto" (``loop_choice.chosen``).

    Returns:
        ``(outputs per micro-batch, their Keras masks (None where unmasked),
        {id(variable): summed gradient}, losses the layers added, per micro-batch,
        the loss terms: per micro-batch, or summed over them as one row)``.
    """
    S, M = _sized(schedule, cells, split)
    batch_loss, micro_loss, targets, layer_loss_grads = loss = loss or StepLoss()
    per_micro_batch = micro_loss is not None
    # A weight another stage holds is copied to this one's device once a step: its stage
    # calls read the copy (``PipelineStage``), where they would read it across devices at
    # every micro-batch (automatic control dependencies order the copy before them).
    for cell in cells:
        for weight, copy in cell.copied():
            with tf.device(cell.device):
                copy.assign(weight.read_value())
    if (
        micro_batch_loops
        and loop_choice.chosen(micro_batch_loops)
        and loop_choice.applies(
            schedule, cells, split, masks, rematerializes, sides, targets, per_micro_batch, tracer
        )
    ):
        # 2K (or 3K) stage call sites whatever M, not one per action.
        return micro_batch_loop.run(schedule, cells, split, masks, rematerializes, sides, loss, deferred)
    halves = bool(getattr(schedule, "split_backward", False))
    # A split stage that keeps its activations runs its B and W as two functions of its
    # forward (``tf_gpipe.stash``): two gradients of one taped call would each compute the
    # activation gradients. Eagerly a persistent tape gives both halves instead.
    halved = halves and tf.inside_function()
    stages = [
        PipelineStage(c, s == 0, rematerializes(s), halves, M > 1, halved and s > 0 and not rematerializes(s))
        for s, c in enumerate(cells)
    ]
    acts, act_masks = list(split.chunks), list(masks)  # each micro-batch's latest stage output
    outputs: list[Any] = [None] * M
    out_masks: list[Any] = [None] * M
    last: dict[int, list[tf.Tensor]] = {}  # device -> what its previous action produced
    cell_losses: list[list[tf.Tensor]] = [[] for _ in range(M)]
    terms: list[list[Any]] = []
    names = {"B": "backward", "W": "weight_grads"}

    def mark(label: str, device: int, deps: list[tf.Tensor]) -> list[tf.Tensor]:
        if tracer is None:
            return deps
        return [tracer.marker(label, device, deps)]

    for action in schedule.topological_order():
        s, m = action.stage, action.micro_batch
        d = schedule.device_of(s)
        cell, st = cells[s], stages[s]
        tag = f"{action.kind}{m}@s{s}"
        if action.kind == "F":
            with tf.name_scope(f"stage{s}_mb{m}"), tf.device(cell.device):
                start = mark("start " + tag, d, last.get(d, []) + ordering.done(acts[m]))
                x = ordering.after(start, acts[m])
                mb = MicroBatch(x, act_masks[m], None if sides is None else sides[m], split.nonempty(m), True)
                rec = st.records[m] = st.forward(mb, deferred)
            acts[m], act_masks[m] = rec.outputs, rec.out_mask
            cell_losses[m].extend(rec.losses)
            with tf.device(cell.device):
                last[d] = mark("end " + tag, d, ordering.done(rec.outputs))
            if s == S - 1:
                outputs[m], out_masks[m] = rec.outputs, rec.out_mask
                if micro_loss is not None:
                    with tf.device(cell.device), tf.name_scope(f"loss_mb{m}"):
                        target = None if targets is None else targets[m]
                        st.output_grads[m], row = micro_loss(rec.outputs, rec.out_mask, target)
                        terms.append(row)
            continue
        # "B" (the full backward, or its input half when split) or "W"
        if action.kind == "B" and m not in st.output_grads:  # the whole mini-batch's loss, once
            # Beside the outputs it reads (the default device would take every one of them).
            with tf.device(cells[-1].device), tf.name_scope("loss"):
                for i, g in enumerate(_whole_batch_grads(schedule, batch_loss, outputs, out_masks)):
                    stages[-1].output_grads[i] = g
        weights = st.weight_half(action.kind)
        weight = None if layer_loss_grads is None else layer_loss_grads[m]
        rec, dy, loss_grads = st.due(m, action.kind, weight)
        with tf.name_scope(f"stage{s}_mb{m}_{names[action.kind]}"), tf.device(cell.device):
            deps = last.get(d, []) + ordering.done(dy)
            if st.summing and weights and st.summed is None:  # before the stage's first addition
                st.zero_sums()
            start = mark("start " + tag, d, deps)
            in_grads: list[Any] = []
            grads: list[Any] = []
            # Stage 0's input needs no gradient: its split B has nothing to compute.
            if not (halves and action.kind == "B" and s == 0):
                in_grads, grads = st.backward(
                    rec, dy, loss_grads, start, action.kind == "B", weights,
                    None if tracer is None else (tracer, d, tag),
                )  # fmt: skip
            st.keep_apart(rec, grads)
        if s > 0 and action.kind == "B":
            stages[s - 1].output_grads[m] = in_grads
        with tf.device(cell.device):
            token = st.summed if weights else None
            last[d] = mark("end " + tag, d, ordering.done(in_grads, token, grads) or start)
    totals: dict[int, Any] = {}
    for st in stages:
        variables = {id(v): v for v in st.cell.trainable_variables}
        for key, g in st.totals().items():
            sparse.add_to(totals, variables[key], g)
    return outputs, out_masks, totals, cell_losses, terms
