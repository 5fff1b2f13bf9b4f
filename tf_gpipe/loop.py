"""GPipe's training step as two loops over micro-batches: a graph, and a first step, flat in M.

``executor.run_schedule`` builds one stage-function call per (stage, micro-batch)
action: O(K x M) call ops. TensorFlow builds each called function's body again for
every call site while it optimizes and partitions the step graph, so the first step
grows with M (benchmarks/compiled_stages/README.md). For the GPipe schedule with every
stage re-materialized, this module builds the same step around 2K call sites, as many
as one micro-batch needs, whatever M, and inlines them (``run`` builds under
``stage.inlined``): an action is its stage's body, not a function call.

* forward phase: a ``tf.while_loop`` over the M micro-batches; iteration ``m`` runs
  every stage's forward of micro-batch ``m``, stage after stage;
* the loss of the whole mini-batch, once every forward is done (GPipe's);
* backward phase: the same, iteration ``m`` running the stages' backwards of
  micro-batch ``m``, last stage first.

The pipelining comes from TensorFlow running iterations at once (``parallel_iterations``):
nothing holds iteration ``m + 1``'s stage 0 until iteration ``m`` is done, only stage 0's
own previous forward, so while stage 1 runs micro-batch ``m`` stage 0 runs ``m + 1``. Each
stage's actions are chained, forward through its previous output and backward through its
gradient-sum token, both loop variables, so each device runs its actions in GPipe's order,
as the executor's control dependencies make it, and no iteration waits for the stages
after it. No stage ever idles in a loop: no conditionals, none of the K - 1 clock ticks a
tick-by-tick loop spends filling and draining the pipe (conds and ticks would cost twice
the host work per step, benchmarks/compiled_stages/README.md). The option is still named
after them: ``PipelineModel(micro_batch_loops=...)``.

Within an iteration a stage hands its outputs (backward: its input gradients) straight to
the next. What a stage's backward needs of its forwards (its inputs, side inputs and mask,
the state each forward read, its layers' losses) waits in TensorArrays on the stage's
device, indexed by micro-batch; they hold micro-batches of different sizes, so an uneven
split needs no padding. The loops need each stage's output structure before they are
built: the stage functions are traced (``get_concrete_function``), not called, for it;
the trace also names the variable handles a call captures, which cross the loop as one
stacked tensor per CPU device (``tf_gpipe.handles``), not one loop variable each.

The results are the executor's: the same stage functions on the same micro-batches, the
gradients summed, and BatchNormalization moments pooled, in the same order. An uneven
split gives every stage input a leading dimension of unknown size, so one trace serves
every micro-batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import tensorflow as tf

from tf_gpipe import batchnorm, handles, loop_state, ordering, remat, replay, sparse, stage
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split

__all__: list[str] = []

# Fewer micro-batches than this and the executor builds every action: at M = 1 nothing
# is summed, and the loops would only add their machinery.
MIN_MICRO_BATCHES = 2

_Build = TypeVar("_Build", bound=Callable[..., Any])


def chosen(setting: bool | str, cells: Sequence[Cell]) -> bool:
    """Whether ``PipelineModel(micro_batch_loops=setting)`` asks for the loops on these stages.

    ``"auto"`` asks for them where every stage is on a CPU: the loops have not run on a
    GPU yet (none was available while they were built), so GPU stages keep the step
    built out, one call per (stage, micro-batch), unless ``micro_batch_loops=True``.
    """
    if setting == "auto":
        return all(tf.DeviceSpec.from_string(c.device or "").device_type == "CPU" for c in cells)
    return bool(setting)


def applies(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    rematerializes: Callable[[int], bool],
    sides: Sequence[Any] | None,
    tracer: Any,
) -> bool:
    """Whether ``run`` builds this step (else the executor builds every action)."""
    S, M = len(cells), len(split)
    if schedule.name != "gpipe" or tracer is not None or tf.executing_eagerly():
        return False
    if M < MIN_MICRO_BATCHES or not all(rematerializes(s) for s in range(S)):
        return False
    if any(getattr(c, "run_eagerly", False) for c in cells):
        return False
    # TensorArrays hold dense tensors only (no SparseTensor or RaggedTensor input).
    leaves = tf.nest.flatten((split.chunks, list(masks), list(sides or [])))
    return all(t is None or isinstance(t, tf.Tensor) for t in leaves)


def _inlined(build: _Build) -> _Build:
    """``build`` with the stage functions inlined (``stage.inlined``): the loops call each once."""

    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with stage.inlined():
            return build(*args, **kwargs)

    return cast(_Build, wrapper)


@_inlined
def run(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    sides: Sequence[Any] | None,
    batch_loss: Callable[[list[Any], list[Any]], list[list[tf.Tensor | None]]],
    cell_loss_grads: Sequence[tf.Tensor] | None,
    deferred: DeferredStats | None,
) -> tuple[list[Any], list[Any], dict[int, Any], list[list[tf.Tensor]]]:
    """Build one GPipe training step; arguments and results as ``executor.run_schedule``'s."""
    S, M = len(cells), len(split)
    fns = [stage.functions(c) for c in cells]
    sides = list(sides) if sides is not None else [None] * M
    # Micro-batches of one known size keep it (static shapes trace and run leaner); of
    # several sizes, or of unknown size, they share a leading dimension of unknown size.
    relax = not (split.static and len(set(split.sizes)) == 1)
    nonempty_all = None
    if split.padded:
        flags = [split.nonempty(m) for m in range(M)]
        nonempty_all = tf.stack([tf.constant(True) if f is None else f for f in flags])

    def nonempty(m: Any) -> Any:
        return None if nonempty_all is None else nonempty_all[m]

    def nonempty_spec() -> Any:
        return None if nonempty_all is None else tf.TensorSpec([], tf.bool)

    loss_weights = None if cell_loss_grads is None else tf.stack(list(cell_loss_grads))
    defer = None if deferred is None else DeferredStats()  # only tested for None while tracing

    # ------------------------------------------------ each stage's structures, traced once
    ins: list[loop_state.Layout] = []  # per stage: (inputs, mask, side)
    outs: list[loop_state.Layout] = []  # per stage: (outputs, out_mask, side)
    kept: list[loop_state.Layout] = []  # per stage: the state its forward read
    added: list[loop_state.Layout] = []  # per stage: the losses its layers added
    moments: list[loop_state.Layout] = []  # per stage: its BatchNormalization moments
    forward_handles: list[handles.Packed] = []  # per stage: its forward's handles, packed
    ins.append(loop_state.Layout((split.chunks[0], masks[0], sides[0]), relax))
    for s in range(S):
        x, mask, side = ins[s].spec_structure()
        outputs, out_mask, losses, before, sums, captured = fns[s].forward_outputs(
            x, mask, side, nonempty_spec(), True, defer
        )
        forward_handles.append(handles.pack(captured))
        outs.append(loop_state.Layout((outputs, out_mask, side), relax))
        kept.append(loop_state.Layout(before))
        added.append(loop_state.Layout(losses))
        moments.append(loop_state.Layout(sums))
        if s + 1 < S:
            ins.append(outs[s])
    if any(a.positions for a in added) and loss_weights is None:
        raise ValueError("tf_gpipe: layers added losses; run_schedule needs cell_loss_grads.")

    # ------------------------------------------------------------------ forward phase
    state: dict[Any, list[Any]] = {}  # what changes from iteration to iteration
    with tf.device(cells[0].device):
        arrays = ins[0].arrays(M)
        for m in range(M):
            arrays = loop_state.write(arrays, m, ins[0].compress((split.chunks[m], masks[m], sides[m])))
    state["in", 0] = arrays
    for s in range(S):
        with tf.device(cells[s].device):
            if s > 0:
                state["in", s] = ins[s].arrays(M)
            state["out", s] = outs[s].zeros(relax=True)
            state["kept", s] = kept[s].arrays(M)
            state["added", s] = added[s].arrays(M)
            state["moments", s] = moments[s].zeros()
            state["micro_batch", s] = [tf.constant(0)]
        state["handles", s] = forward_handles[s].tensors
    with tf.device(cells[-1].device):
        state["last", S - 1] = outs[-1].arrays(M)

    def forward(s: int, carried: list[tf.Tensor]) -> list[tf.Tensor]:
        """Stage ``s``'s forward of the iteration's micro-batch; ``carried``: stage s - 1's outputs."""
        cell = cells[s]
        with tf.device(cell.device), tf.name_scope(f"stage{s}_forward"):
            m = loop_state.count(state, s)
            if s == 0:
                carried = ins[0].read(state["in", 0], m)
            else:
                state["in", s] = loop_state.write(state["in", s], m, carried)
            x, mask, side = ins[s].expand(carried)
            local = None if deferred is None else DeferredStats()
            with handles.replaced(handles.unpack(forward_handles[s], state["handles", s])):
                rec = remat.forward(
                    cell,
                    ordering.after(
                        ordering.done(state["out", s][:1]), x
                    ),  # after this stage's previous forward
                    mask,
                    True,
                    remat=True,
                    nonempty=nonempty(m),
                    deferred=local,
                    side=side,
                )
            found = [] if local is None else [t for _, sums in local.sums() for t in sums]
            out = outs[s].compress((rec.outputs, rec.out_mask, side))
            state["out", s] = out
            state["kept", s] = loop_state.write(state["kept", s], m, kept[s].compress(rec.before))
            state["added", s] = loop_state.write(state["added", s], m, added[s].compress(rec.losses))
            # Pooled in the executor's order, micro-batch after micro-batch.
            state["moments", s] = batchnorm.merge(state["moments", s], found)
            if s == S - 1:
                state["last", s] = loop_state.write(state["last", s], m, out)
            return out

    def forward_iteration(_: tf.Tensor) -> None:
        carried: list[tf.Tensor] = []
        for s in range(S):
            carried = forward(s, carried)

    with tf.name_scope("gpipe_forward"):
        loop_state.run(state, M, forward_iteration, {("out", s): outs[s].relaxed() for s in range(S)})

    # ------------------------------------------- every forward is done: the batch's loss
    outputs, out_masks, cell_losses = [], [], []
    with tf.device(cells[-1].device):
        for m in range(M):
            out, out_mask, _ = outs[S - 1].expand(outs[S - 1].read(state["last", S - 1], m))
            outputs.append(out)
            out_masks.append(out_mask)
    for m in range(M):
        row: list[tf.Tensor] = []
        for s in range(S):
            if added[s].positions:
                with tf.device(cells[s].device):
                    row.extend(added[s].expand(added[s].read(state["added", s], m)))
        cell_losses.append(row)
    if deferred is not None:
        for s, fn in enumerate(fns):
            pooled = moments[s].expand(state["moments", s])
            for bn, sums in zip(fn.pooled_layers(True), pooled):
                deferred.add_sums(bn, sums)
    with tf.device(cells[-1].device), tf.name_scope("loss"):
        grads = batch_loss(outputs, out_masks)
        given = loop_state.Layout(list(grads[0]), relax)
        arrays = given.arrays(M)
        for m in range(M):
            arrays = loop_state.write(arrays, m, given.compress(list(grads[m])))
    for key in [k for k in state if k[0] in ("out", "added", "moments", "last", "handles")]:
        del state[key]
    state["given", S - 1] = arrays

    # ------------------------------------------------------------------ backward phase
    in_grads_of: dict[int, loop_state.Layout] = {}  # per stage > 0: its input gradients
    # per stage: (variable index, dense_shape, layout)
    rows: dict[int, list[tuple[int, Any, loop_state.Layout]]] = {}
    backward_handles: dict[int, handles.Packed] = {}  # per stage: its backward's handles, packed
    output_grads = given.spec_structure()
    for s in reversed(range(S)):
        x, mask, side = ins[s].spec_structure()
        n_losses = len(added[s].positions)
        lw = []
        if n_losses and loss_weights is not None:
            lw = [tf.TensorSpec([], loss_weights.dtype)] * n_losses
        in_grads, (_, found), captured = fns[s].backward_outputs(
            x,
            mask,
            side,
            kept[s].spec_structure(),
            list(output_grads),
            lw,
            nonempty_spec(),
            True,
            deferred is not None,
            s > 0,
            tf.TensorSpec([], tf.bool),
        )
        backward_handles[s] = handles.pack(captured)
        rows[s] = []
        for i, r in enumerate(found):
            if r is not None:
                shape = tf.constant(cells[s].trainable_variables[i].shape.as_list(), tf.int32)
                rows[s].append((i, shape, loop_state.Layout(r, relax=True)))
        if s > 0:
            in_grads_of[s] = loop_state.Layout(in_grads, relax)
            output_grads = in_grads_of[s].spec_structure()
    for s in range(S):
        with tf.device(cells[s].device):
            state["token", s] = [fns[s].sums.zero(inline=True)]
            state["micro_batch", s] = [tf.constant(0)]
            state["handles", s] = backward_handles[s].tensors
            for i, _, layout in rows[s]:
                state["rows", s, i] = layout.arrays(M)

    def backward(s: int, upper: list[tf.Tensor]) -> list[tf.Tensor]:
        """Stage ``s``'s backward of the iteration's micro-batch; ``upper``: stage s + 1's input
        gradients (the loss's, for the last stage). Returns its own input gradients."""
        cell = cells[s]
        with tf.device(cell.device), tf.name_scope(f"stage{s}_backward"):
            m = loop_state.count(state, s)
            stash, token = state["in", s], state["token", s][0]
            n_losses = len(added[s].positions)
            weight = loss_weights[m] if n_losses and loss_weights is not None else None
            if s == S - 1:
                dy = given.expand(given.read(state["given", s], m))
            else:
                dy = in_grads_of[s + 1].expand(upper)
            x, mask, side = ins[s].expand(ins[s].read(stash, m))
            before = kept[s].expand(kept[s].read(state["kept", s], m))
            # Dropped after this backward, as the executor drops each record (the read
            # above, of this list's version before the write, still sees it).
            state["in", s] = ins[s].free(stash, m)
            record = replay.Record(
                inputs=x,
                mask=mask,
                outputs=None,
                out_mask=None,
                losses=[],
                nonempty=nonempty(m),
                side=side,
                before=before,
                training=True,
                deferred=deferred is not None,
            )
            with handles.replaced(handles.unpack(backward_handles[s], state["handles", s])):
                in_grads, (new_token, grads) = remat.backward(
                    cell,
                    record,
                    list(dy),
                    [weight] * n_losses if n_losses else [],
                    True,
                    cell.trainable_variables,
                    need_input_grads=s > 0,
                    to_sums=True,
                    after=token,
                )
            state["token", s] = [new_token]
            for i, _, layout in rows[s]:
                values = layout.compress((grads[i].values, grads[i].indices))
                state["rows", s, i] = loop_state.write(state["rows", s, i], m, values)
            return in_grads_of[s].compress(in_grads) if s > 0 else []

    def backward_iteration(_: tf.Tensor) -> None:
        upper: list[tf.Tensor] = []
        for s in reversed(range(S)):
            upper = backward(s, upper)

    with tf.name_scope("gpipe_backward"):
        loop_state.run(state, M, backward_iteration, {})

    totals: dict[int, Any] = {}
    for s in range(S):
        variables = cells[s].trainable_variables
        with tf.device(cells[s].device):
            free = sparse.batch_free(cells[s], *ins[s].spec_structure()) if rows[s] else frozenset()
            for i, dense_shape, _ in rows[s]:  # in micro-batch order, as the executor has them
                values, indices = state["rows", s, i]
                parts = [tf.IndexedSlices(values.read(m), indices.read(m), dense_shape) for m in range(M)]
                totals[id(variables[i])] = sparse.combine(parts, id(variables[i]) in free)
        totals.update(fns[s].sums.read(state["token", s][0], inline=True))
    return outputs, out_masks, totals, cell_losses
