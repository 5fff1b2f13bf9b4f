"""A schedule whose loss is per micro-batch (1F1B, interleaved, ZB-H1) as one loop over micro-batches.

Built out, a step holds one stage-function call per action: O(K x M) call ops, and
TensorFlow instantiates and optimizes a stateful function's body once per call site, so
the first step grows with M. Here the step is one ``tf.while_loop`` whose iteration
``m`` runs every action of micro-batch ``m``:

    iteration m:  F(m)@s0 ─► F(m)@s1 ─► ... ─► loss(m) ─► B(m)@s_last ─► ... ─► B(m)@s0

as many stage calls as one micro-batch needs, whatever M, each inlined (``stage.inlined``).
Every iteration may run at once (``parallel_iterations``): what overlaps micro-batches
across stages is dataflow. What keeps each device to the schedule is
``schedules.loop_waits``: each action waits for the actions of its device that the
schedule puts before it, in its own or an earlier micro-batch (``F(m)@s`` after
``B(m - K + s)@s`` in 1F1B: at most K - s micro-batches in flight), the tokens of the last
few iterations travelling as loop variables. Each stage's actions of one kind run in
micro-batch order (its forwards read what the previous one wrote: random draws,
statistics; its backwards add to the gradient sums in order), so the step computes
what the built-out step computes.

A stage that keeps its activations (``remat="never"``) runs its taped forward and its
gradient in the same iteration: the tape never leaves the loop body, and the K - s
micro-batches a 1F1B stage holds are the iterations in flight.

What leaves an iteration (the last stage's outputs, layer losses, loss terms, sparse
gradient rows, BatchNormalization moments) has a structure known only once the body is
traced; the body is traced once more for it, as a function that is never called
(``_emitted``): the stage functions' traces are shared, so that costs the glue only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import batchnorm, handles, loop_state, ordering, remat, sparse, stage
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split
from tf_gpipe.schedules import loop_waits

__all__: list[str] = []

# Given a micro-batch's last-stage outputs, their mask and its target (the trainer's),
# the gradients of its loss w.r.t. the outputs and the terms to sum over micro-batches.
MicroLossFn = Callable[[Any, Any, Any], tuple[list[tf.Tensor | None], list[tf.Tensor | None]]]


def applies(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    sides: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    tracer: Any,
) -> bool:
    """Whether ``run`` builds this step (else every action is built out)."""
    if targets is None or tracer is not None or tf.executing_eagerly() or len(split) < 2:
        return False
    if any(getattr(c, "run_eagerly", False) for c in cells):
        return False
    try:
        loop_waits.waits(schedule)
    except ValueError:
        return False
    # TensorArrays hold dense tensors only (no SparseTensor or RaggedTensor input).
    leaves = tf.nest.flatten((split.chunks, list(masks), list(sides or []), list(targets)))
    return all(t is None or isinstance(t, tf.Tensor) for t in leaves)


class _Tokens:
    """Each (kind, stage)'s tokens of the last iterations, as loop variables: ``get(key, lag)``
    is the token of micro-batch ``m - lag``, ready once that action is done."""

    def __init__(self, waits: list[loop_waits.Wait], cells: Sequence[Cell]):
        self.waits = waits
        self.depth: dict[tuple[str, int], int] = {}
        for w in waits:
            key = (w.on_kind, w.on_stage)
            self.depth[key] = max(self.depth.get(key, 0), w.lag)
        self.cells = cells

    def initial(self) -> dict[Any, list[tf.Tensor]]:
        state = {}
        for (kind, s), depth in self.depth.items():
            if depth:
                with tf.device(self.cells[s].device):
                    state["token", kind, s] = [tf.constant(True) for _ in range(depth)]
        return state

    def before(self, state: dict, now: dict, kind: str, s: int) -> list[tf.Tensor]:
        """What ``(kind, s)`` of this iteration waits for: ``now`` holds this iteration's tokens."""
        found = []
        for w in self.waits:
            if (w.kind, w.stage) != (kind, s):
                continue
            if w.lag == 0:
                found.append(now[w.on_kind, w.on_stage])
            else:
                found.append(state["token", w.on_kind, w.on_stage][-w.lag])
        return found

    def advance(self, state: dict, now: dict) -> None:
        for (kind, s), depth in self.depth.items():
            if depth:
                state["token", kind, s] = state["token", kind, s][1:] + [now[kind, s]]


def _token(*structures: Any) -> tf.Tensor:
    with tf.control_dependencies(ordering.done(*structures)):
        return tf.constant(True)


def run(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    rematerializes: Callable[[int], bool],
    sides: Sequence[Any] | None,
    targets: Sequence[Any],
    micro_loss: MicroLossFn,
    cell_loss_grads: Sequence[tf.Tensor] | None,
    deferred: DeferredStats | None,
) -> tuple[list[Any], list[Any], dict[int, Any], list[list[tf.Tensor]], list[list[Any]]]:
    """Build one step of ``schedule``; arguments and results as ``executor.run_schedule``'s,
    ``targets`` being each micro-batch's data for ``micro_loss``. The loss terms come back
    summed over the micro-batches (one row)."""
    with stage.inlined():
        return _run(
            schedule,
            cells,
            split,
            masks,
            rematerializes,
            sides,
            targets,
            micro_loss,
            cell_loss_grads,
            deferred,
        )


def _run(
    schedule, cells, split, masks, rematerializes, sides, targets, micro_loss, cell_loss_grads, deferred
):
    S, M = len(cells), len(split)
    halves = bool(getattr(schedule, "split_backward", False))
    tokens = _Tokens(loop_waits.waits(schedule), cells)
    # Micro-batches of one known shape keep it (static shapes trace and run leaner); of
    # several, or unknown, they share a leading dimension of unknown size.
    shapes = {
        tuple(tuple(t.shape.as_list()) for t in tf.nest.flatten(c) if t is not None) for c in split.chunks
    }
    relax = len(shapes) != 1 or any(None in shape for shape in next(iter(shapes)))
    sides = list(sides) if sides is not None else [None] * M
    flags = [split.nonempty(m) for m in range(M)]
    nonempty_all = None
    if split.padded:
        nonempty_all = tf.stack([tf.constant(True) if f is None else f for f in flags])
    loss_weights = None if cell_loss_grads is None else tf.stack(list(cell_loss_grads))
    data = loop_state.Layout((split.chunks[0], masks[0], sides[0], targets[0]), relax)
    with tf.device(cells[0].device):
        arrays = data.arrays(M)
        for m in range(M):
            chunk = (split.chunks[m], masks[m], sides[m], targets[m])
            arrays = loop_state.write(arrays, m, data.compress(chunk))
    input_specs: dict[int, Any] = {}

    def iteration(m: tf.Tensor, state: dict) -> dict[str, Any]:
        """Micro-batch ``m``'s actions; updates ``state`` (tokens, sum tokens) and returns
        what leaves the iteration."""
        x, mask, side, target = data.expand(data.read(arrays, m))
        nonempty = None if nonempty_all is None else nonempty_all[m]
        now: dict[tuple[str, int], tf.Tensor] = {}
        records, found, losses = [], [], []
        for s, cell in enumerate(cells):
            with tf.device(cell.device), tf.name_scope(f"stage{s}_forward"):
                x = ordering.after(tokens.before(state, now, "F", s), x)
                local = DeferredStats() if deferred is not None else None
                rec = remat.forward(
                    cell,
                    x,
                    mask,
                    True,
                    remat=rematerializes(s),
                    nonempty=nonempty,
                    deferred=local,
                    side=side,
                    persistent=halves,
                    input_grads=s > 0,
                )
                now["F", s] = _token(rec.outputs)
            input_specs.setdefault(s, sparse.relaxed_specs((rec.inputs, rec.mask, rec.side)))
            records.append(rec)
            found.append([] if local is None else [list(sums) for _, sums in local.sums()])
            losses.append(list(rec.losses))
            x, mask = rec.outputs, rec.out_mask
        with tf.device(cells[-1].device), tf.name_scope("loss"):
            dy, terms = micro_loss(x, mask, target)
        rows: list[list[Any]] = []
        for s in reversed(range(S)):
            cell, rec = cells[s], records[s]
            weight = None if loss_weights is None else loss_weights[m]
            loss_grads = [weight] * len(rec.losses)
            if rec.losses and weight is None:
                raise ValueError("tf_gpipe: layers added losses; run_schedule needs cell_loss_grads.")
            with tf.device(cell.device), tf.name_scope(f"stage{s}_backward"):
                go = tokens.before(state, now, "B", s)
                in_grads: list[Any] = []
                if not (halves and s == 0):  # stage 0's input needs no gradient: no B to run
                    in_grads, result = remat.backward(
                        cell,
                        rec,
                        ordering.after(go, list(dy)),
                        ordering.after(go, loss_grads),
                        True,
                        [] if halves else cell.trainable_variables,
                        need_input_grads=s > 0,
                        to_sums=not halves,
                        need_weight_grads=not halves,
                        after=None if halves else state["sums", s][0],
                    )
                if halves:
                    now["B", s] = _token(in_grads) if s > 0 else _token(go, dy)
                    go = tokens.before(state, now, "W", s)
                    _, result = remat.backward(
                        cell,
                        rec,
                        ordering.after(go, list(dy)),
                        ordering.after(go, loss_grads),
                        True,
                        cell.trainable_variables,
                        need_input_grads=False,
                        to_sums=True,
                        after=state["sums", s][0],
                    )
                token, grads = result
                state["sums", s] = [token]
                now["W" if halves else "B", s] = token
            rows.insert(0, [None if g is None else (g.values, g.indices) for g in grads])
            dy = in_grads
        tokens.advance(state, now)
        return {"out": (x, mask), "losses": losses, "terms": terms, "moments": found, "rows": rows}

    # ------------------------------------------------ what leaves an iteration: its structure
    def sums_state() -> dict:
        state = tokens.initial()
        for s, cell in enumerate(cells):
            with tf.device(cell.device):
                state["sums", s] = [stage.functions(cell).sums.zero(inline=True)]
        return state

    start = sums_state()
    probe_state = {k: [tf.TensorSpec([], tf.bool) for _ in v] for k, v in start.items()}
    keys = sorted(probe_state, key=repr)

    def probe(m, *flat):
        it = iter(flat)
        state = {k: [next(it) for _ in probe_state[k]] for k in keys}
        return iteration(m, state)

    specs = [tf.TensorSpec([], tf.int32)] + [s for k in keys for s in probe_state[k]]
    with handles.collected() as captured:
        emitted = tf.function(probe, autograph=False).get_concrete_function(*specs).structured_outputs
    # The stage calls' variable handles cross the loop as one stacked tensor per CPU device.
    packed = handles.pack(captured)
    out = loop_state.Layout(emitted["out"], relax)
    losses = [loop_state.Layout(row) for row in emitted["losses"]]
    terms = loop_state.Layout(emitted["terms"])
    moments = [loop_state.Layout(row) for row in emitted["moments"]]
    rows = [[None if r is None else loop_state.Layout(r, relax=True) for r in row] for row in emitted["rows"]]

    # ------------------------------------------------------------------------- the loop
    state = start
    with tf.device(cells[-1].device):
        state["out"] = out.arrays(M)
        state["terms"] = terms.zeros()
    with tf.device(cells[0].device):
        state["micro_batch", 0] = [tf.constant(0)]
    state["handles"] = packed.tensors
    for s, cell in enumerate(cells):
        with tf.device(cell.device):
            state["losses", s] = losses[s].arrays(M)
            state["moments", s] = moments[s].zeros()
            for i, layout in enumerate(rows[s]):
                if layout is not None:
                    state["rows", s, i] = layout.arrays(M)

    def body(_: tf.Tensor) -> None:
        m = loop_state.count(state, 0)
        with handles.replaced(handles.unpack(packed, state["handles"])):
            got = iteration(m, state)
        with tf.device(cells[-1].device):
            state["out"] = loop_state.write(state["out"], m, out.compress(got["out"]))
            state["terms"] = [a + b for a, b in zip(state["terms"], terms.compress(got["terms"]))]
        for s, cell in enumerate(cells):
            with tf.device(cell.device):
                added = losses[s].compress(got["losses"][s])
                state["losses", s] = loop_state.write(state["losses", s], m, added)
                if moments[s].positions:
                    # Pooled in micro-batch order, as the built-out step pools them.
                    state["moments", s] = batchnorm.merge(
                        state["moments", s], moments[s].compress(got["moments"][s])
                    )
                for i, layout in enumerate(rows[s]):
                    if layout is not None:
                        state["rows", s, i] = loop_state.write(
                            state["rows", s, i], m, layout.compress(got["rows"][s][i])
                        )

    with tf.name_scope("micro_batch_loop"):
        loop_state.run(state, M, body, {})
    return _results(cells, M, state, out, losses, terms, moments, rows, input_specs, deferred)


def _results(cells, M, state, out, losses, terms, moments, rows, input_specs, deferred):
    S = len(cells)
    outputs, out_masks = [], []
    with tf.device(cells[-1].device):
        for m in range(M):
            o, mask = out.expand(out.read(state["out"], m))
            outputs.append(o)
            out_masks.append(mask)
    cell_losses: list[list[tf.Tensor]] = [[] for _ in range(M)]
    for s in range(S):
        if losses[s].positions:
            with tf.device(cells[s].device):
                for m in range(M):
                    cell_losses[m].extend(losses[s].expand(losses[s].read(state["losses", s], m)))
    if deferred is not None:
        for s, cell in enumerate(cells):
            pooled = moments[s].expand(state["moments", s])
            for bn, sums in zip(stage.functions(cell).pooled_layers(True), pooled):
                deferred.add_sums(bn, sums)
    totals: dict[int, Any] = {}
    for s, cell in enumerate(cells):
        variables = cell.trainable_variables
        fns = stage.functions(cell)
        with tf.device(cell.device):
            sparse_rows = [(i, layout) for i, layout in enumerate(rows[s]) if layout is not None]
            free = sparse.batch_free(cell, *input_specs[s]) if sparse_rows else frozenset()
            for i, _ in sparse_rows:  # in micro-batch order, as the built-out step has them
                values, indices = state["rows", s, i]
                shape = tf.constant(variables[i].shape.as_list(), tf.int32)
                parts = [tf.IndexedSlices(values.read(m), indices.read(m), shape) for m in range(M)]
                totals[id(variables[i])] = sparse.combine(parts, id(variables[i]) in free)
            totals.update(fns.sums.read(state["sums", s][0], inline=True))
    return outputs, out_masks, totals, cell_losses, [terms.expand(state["terms"])]
