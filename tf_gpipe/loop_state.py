"""What a pipeline loop carries from one iteration to the next, and the loop itself.

``tf_gpipe.micro_batch_loop`` builds a step as ``tf.while_loop``s over micro-batches. Their
loop variables are flat lists of tensors, so every structure a stage passes on (its
outputs, masks, side inputs, losses, the state its forward read) travels as a ``Layout``:
flattened without its Nones, with the specs its loop variables need, and unflattened in
the next iteration. What a stage's backward needs of its forward waits in TensorLists,
one per dtype, an entry per tensor and micro-batch, freed once read::

    forward iteration m:   stage s ─► Layout.compress ─► Layout.hold(arrays, m, M, ...)
    backward iteration m:  Layout.take(arrays, m, M) ─► stage s

``emitting`` runs a loop whose iteration returns what leaves it (``Emitted``): its
structure is read from one more trace of the body; ``Tokens`` carries each action's
tokens of the last few iterations, what ``schedules.loop_waits`` makes a later one wait for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import batchnorm, handles, loop_guard, ordering, tf_compat
from tf_gpipe.cell import Cell
from tf_gpipe.schedules import loop_waits

__all__: list[str] = []


_ANY_SHAPE = -1  # a TensorList's element shape: each entry its own


def relaxed_spec(spec: tf.TensorSpec) -> tf.TensorSpec:
    if spec.shape.rank in (None, 0):
        return spec
    return tf.TensorSpec([None, *spec.shape.as_list()[1:]], spec.dtype)


def _spec(t: Any) -> Any:
    return None if t is None else tf.TensorSpec(t.shape, t.dtype)


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    """A stand-in of ``spec``'s structure: no rows where the size is unknown."""
    return tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)


class Layout:
    """A nested structure of tensors or specs as a flat list without its Nones, and back."""

    def __init__(self, structure: Any, relax: bool = False):
        self.structure = structure
        flat = tf.nest.flatten(structure)
        self.positions = [i for i, t in enumerate(flat) if t is not None]
        self.size = len(flat)
        specs = [_spec(flat[i]) for i in self.positions]
        self.specs = [relaxed_spec(s) for s in specs] if relax else specs

    def compress(self, structure: Any) -> list[tf.Tensor]:
        flat = tf.nest.flatten(structure)
        if len(flat) != self.size or any(flat[i] is None for i in self.positions):
            raise RuntimeError("tf_gpipe: a stage changed the structure of its values between micro-batches.")
        return [flat[i] for i in self.positions]

    def expand(self, values: Sequence[Any]) -> Any:
        full: list[Any] = [None] * self.size
        for i, v in zip(self.positions, values):
            full[i] = v
        return tf.nest.pack_sequence_as(self.structure, full)

    def relaxed(self) -> Layout:
        """This layout with a leading dimension of unknown size."""
        return Layout(self.structure, relax=True)

    def spec_structure(self) -> Any:
        return self.expand(self.specs)

    def zeros(self, relax: bool = False) -> list[tf.Tensor]:
        return [_zeros(relaxed_spec(s) if relax else s) for s in self.specs]

    def arrays(self, size: int) -> list[tf.TensorArray]:
        # Of any leading size, so that an entry can be freed (``free``) once read.
        return [
            tf.TensorArray(s.dtype, size=size, infer_shape=False, element_shape=relaxed_spec(s).shape)
            for s in self.specs
        ]

    def filled(self, values: Sequence[Any]) -> list[tf.TensorArray]:
        """Arrays holding ``values`` (structures of this layout), one entry each, in order.

        One write per entry, not one stack: a stack is one more copy of the M entries, and
        its entries (slices of it) keep all of it alive while any is: the inputs of the
        step, or GPipe's output gradients, would be held twice at its peak (2 of the 22
        activations a K=2, M=2 step of test_guarantees peaked at, taped)."""
        arrays = self.arrays(len(values))
        # One index tensor per entry for all arrays, not a constant per write.
        at = tf.unstack(tf.range(len(values)), num=len(values)) if len(self.specs) > 1 else range(len(values))
        for m, value in zip(at, values):
            arrays = write(arrays, m, self.compress(value))
        return arrays

    def entries(self, arrays: list[tf.TensorArray], size: int, stack: bool = True) -> list[list[tf.Tensor]]:
        """The ``size`` entries of ``arrays`` (each written once, none freed), in order: per
        entry, one tensor per array. One stack per array where this layout's shapes are
        fully defined, not ``size`` reads: M reads, and their indices, are ops the first
        step optimizes. ``stack=False`` reads each, where a stack (one more copy) would
        raise the step's peak memory."""
        if not self.specs:
            return [[] for _ in range(size)]
        if stack and all(s.shape.is_fully_defined() for s in self.specs):
            columns = [
                tf.unstack(tf.ensure_shape(a.stack(), [size, *s.shape]), num=size)
                for a, s in zip(arrays, self.specs)
            ]
            return [list(row) for row in zip(*columns)]
        return [self.read(arrays, m) for m in range(size)]

    # ------------------------------------------- held for a later loop: one list per dtype
    # What GPipe's loop of forwards keeps for its loop of backwards can be a hundred tensors
    # a stage (a taped stage's intermediates, ``tf_gpipe.stash``). An array per tensor is a
    # loop variable per tensor, and a loop variable costs a handful of ops per iteration in
    # both loops; one list per dtype, of ``M x`` its tensors, costs one. They are TensorLists
    # written and read by the ops themselves: through ``tf.TensorArray`` an entry costs
    # three ops and twice the Python (the index, its constant, the wrapper's scopes), which
    # for ~100 tensors a stage is about a second of the first step.
    #
    # Entry m sits at the list's end once the entries before it are taken (entry 0 last,
    # entry M - 1 first), so that taking it frees all of its tensors with one op that cuts
    # the list short: emptying each tensor's slot was an op per tensor, ~6,800 a step of
    # gpipe/never at K=4, M=32 (benchmarks/steady_step/README.md).
    def _groups(self) -> list[list[int]]:
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, s in enumerate(self.specs):
            by_dtype.setdefault(s.dtype, []).append(i)
        return list(by_dtype.values())

    def held_arrays(self, size: int) -> list[tf.Tensor]:
        """Empty lists for ``size`` values of this layout (``hold``), one per dtype."""
        return [
            tf.raw_ops.TensorListReserve(
                element_shape=_ANY_SHAPE, num_elements=size * len(g), element_dtype=self.specs[g[0]].dtype
            )
            for g in self._groups()
        ]

    def _slots(self, m: Any, size: int) -> list[tuple[list[int], Any, list[Any]]]:
        """Per dtype group: the group, where entry ``m`` of ``size`` starts in its list, and
        the list positions of its values: one op for all (these run in every iteration),
        the start itself for a group of one."""
        found = []
        for g in self._groups():
            start = (size - 1 - m) * len(g)
            found.append(
                (g, start, [start] if len(g) == 1 else tf.unstack(start + tf.range(len(g)), num=len(g)))
            )
        return found

    def hold(
        self, arrays: list[tf.Tensor], m: Any, size: int, values: Sequence[tf.Tensor]
    ) -> list[tf.Tensor]:
        """``arrays`` (``held_arrays(size)``) with the compressed value ``values`` held as entry ``m``."""
        held = []
        for a, (g, _, slots) in zip(arrays, self._slots(m, size)):
            for i, at in zip(g, slots):
                a = tf.raw_ops.TensorListSetItem(input_handle=a, index=at, item=values[i])
            held.append(a)
        return held

    def take(self, arrays: list[tf.Tensor], m: Any, size: int) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Entry ``m`` of ``hold``'s arrays, as the compressed value it held, and the arrays
        without it. Entries are taken in order, 0 first: taking ``m`` frees it and any
        entry before it still held."""
        values: list[Any] = [None] * len(self.specs)
        released = []
        shape = tf.constant(_ANY_SHAPE)  # one for all the reads (a constant each is a node each)
        for a, (g, start, slots) in zip(arrays, self._slots(m, size)):
            for i, at in zip(g, slots):
                values[i] = tf.raw_ops.TensorListGetItem(
                    input_handle=a, index=at, element_shape=shape, element_dtype=self.specs[i].dtype
                )
                values[i].set_shape(self.specs[i].shape)  # what ``hold`` wrote there
            released.append(tf.raw_ops.TensorListResize(input_handle=a, size=start))
        return values, released

    def read(self, arrays: list[tf.TensorArray], m: Any) -> list[tf.Tensor]:
        return [tf.ensure_shape(a.read(m), s.shape) for a, s in zip(arrays, self.specs)]


def write(arrays: list[tf.TensorArray], m: Any, values: Sequence[tf.Tensor]) -> list[tf.TensorArray]:
    return [a.write(m, v) for a, v in zip(arrays, values)]


def run(
    state: dict, iterations: int, iteration: Callable[[tf.Tensor], None], parallel: int | None = None
) -> None:
    """Run ``iteration(i)`` for ``i`` in ``range(iterations)`` as a ``tf.while_loop`` whose loop
    variables are everything in ``state`` (lists of tensors and TensorArrays), updated
    in place; at most ``parallel`` iterations at once (default: all)."""
    keys = sorted(state, key=repr)
    lengths = [len(state[k]) for k in keys]

    def unpack(values):
        it = iter(values)
        for k, n in zip(keys, lengths):
            state[k] = [next(it) for _ in range(n)]

    def body(i, *values):
        unpack(values)
        iteration(i)
        return (i + 1, *[v for k in keys for v in state[k]])

    start = (tf.constant(0), *[v for k in keys for v in state[k]])
    with independent_stages():
        # Every iteration may run at once: each stage's actions are chained through its own
        # loop variables, so the iterations overlap as far as the stages' order allows.
        _, *values = tf.while_loop(
            lambda i, *_: i < iterations, body, start, parallel_iterations=max(parallel or iterations, 1)
        )
    unpack(values)


class Counters:
    """The iteration's micro-batch index, counted on each device: ``on(device)``. Each device
    counts for itself: one counter would live on one device, and every other device would
    wait for it in every iteration."""

    def __init__(self, devices: Sequence[str], state: dict | None = None, probe: Any = None):
        self.devices = sorted(set(devices))
        self.state, self.probe = state, probe

    def initial(self) -> dict:
        state = {}
        for d in self.devices:
            with tf.device(d):
                state["micro_batch", d] = [tf.constant(0)]
        return state

    def on(self, device: str) -> tf.Tensor:
        if self.probe is not None:
            return self.probe
        assert self.state is not None
        return self.state["micro_batch", device][0]

    def advance(self) -> None:
        assert self.state is not None
        for d in self.devices:
            with tf.device(d):
                self.state["micro_batch", d] = [self.state["micro_batch", d][0] + 1]


def independent_stages() -> contextlib.AbstractContextManager[None]:
    """Build loops whose body has no automatic control dependencies.

    In a ``tf.function`` TensorFlow makes every output of a loop body wait for every
    stateful op of the body (one NoOp on no device, with a control input from each
    stage's call): each iteration would be a barrier of all K stages, and its control
    edges would cross every device twice, which doubles the loop step's host cost at
    K=8, M=32 (benchmarks/compiled_stages/README.md). The stages need no such order:
    each stage's calls are chained through its own data (outputs forward, the running
    gradient sums backward). ``tests/test_loop.py`` checks that the flag still
    takes effect."""
    return tf_compat.no_automatic_control_dependencies()


class Tokens:
    """Each (kind, stage)'s tokens of the last iterations, as loop variables: ``before``
    gives an action what it waits for, in this iteration (``now``) or an earlier one."""

    def __init__(self, waits: list[loop_waits.Wait], cells: Sequence[Cell]):
        self.waits = waits
        self.cells = cells
        self.depth: dict[tuple[str, int], int] = {}
        for w in waits:
            key = (w.on_kind, w.on_stage)
            self.depth[key] = max(self.depth.get(key, 0), w.lag)

    def initial(self, kinds: str) -> dict[Any, list[tf.Tensor]]:
        state = {}
        for (kind, s), depth in self.depth.items():
            if depth and kind in kinds:
                with tf.device(self.cells[s].device):
                    state["token", kind, s] = [tf.constant(True) for _ in range(depth)]
        return state

    def before(self, state: dict, now: dict, kind: str, s: int) -> list[tf.Tensor]:
        found = []
        for w in self.waits:
            if (w.kind, w.stage) == (kind, s):
                found.append(
                    now[w.on_kind, w.on_stage]
                    if w.lag == 0
                    else state["token", w.on_kind, w.on_stage][-w.lag]
                )
        return found

    def advance(self, state: dict, now: dict) -> None:
        for kind, s in now:
            if self.depth.get((kind, s)):
                state["token", kind, s] = state["token", kind, s][1:] + [now[kind, s]]


def token(*structures: Any) -> tf.Tensor:
    with tf.control_dependencies(ordering.done(*structures)):
        return tf.constant(True)


class Emitted:
    """What a loop's iterations emit, per key: ``each`` value into a TensorArray (one entry
    per micro-batch), or ``held`` for a later loop (``Layout.hold``), or a running ``sum``,
    or BatchNormalization moments ``pool``ed.

    ``emit`` takes ``{key: (how, device, structure)}``."""

    def __init__(self, meta: dict, values: dict, M: int):
        self.how = {k: how for k, (how, _) in meta.items()}
        self.device = {k: device for k, (_, device) in meta.items()}
        self.layouts = {k: Layout(value) for k, value in values.items()}
        self.M = M

    def initial(self) -> dict:
        state = {}
        for k, layout in self.layouts.items():
            with tf.device(self.device[k]):
                how = self.how[k]
                if how == "held":
                    state["emitted", k] = layout.held_arrays(self.M)
                else:
                    state["emitted", k] = layout.arrays(self.M) if how == "each" else layout.zeros()
        return state

    def add(self, state: dict, m: Counters, got: dict) -> None:
        for k, (how, device, value) in got.items():
            layout, key = self.layouts[k], ("emitted", k)
            # Named after its key (``grads_1``: stage 1's gradient sums), to be found in a graph.
            with tf.device(device), tf.name_scope("_".join(map(str, k))):
                if how == "held":
                    state[key] = layout.hold(state[key], m.on(device), self.M, layout.compress(value))
                elif how == "each":
                    state[key] = write(state[key], m.on(device), layout.compress(value))
                elif how == "sum":
                    state[key] = [a + b for a, b in zip(state[key], layout.compress(value))]
                elif layout.positions:  # pooled in micro-batch order, as the built-out step pools
                    state[key] = batchnorm.merge(state[key], layout.compress(value))

    def each(self, state: dict, k: Any, stack: bool = True) -> list[Any]:
        """The M values emitted under ``k``, in micro-batch order (``stack`` as ``Layout.entries``)."""
        layout = self.layouts[k]
        with tf.device(self.device[k]):
            return [layout.expand(row) for row in layout.entries(state["emitted", k], self.M, stack)]

    def total(self, state: dict, k: Any) -> Any:
        return self.layouts[k].expand(state["emitted", k])


def emitting(
    M: int,
    devices: Sequence[str],
    state: dict,
    iteration: Callable[[Counters, dict], dict],
    pack: bool = True,
    parallel: int | None = None,
    seen: Callable[[Emitted], None] | None = None,
    rest: tuple[int, Callable[[Counters, dict], None]] | None = None,
) -> tuple[Emitted, dict]:
    """Run ``iteration(m, state)`` for m in range(M) as one ``tf.while_loop``: ``m`` gives
    the micro-batch index on each of ``devices``; the iteration updates ``state`` (loop
    variables: tensors and TensorArrays) and returns what it emits (``Emitted``). Returns
    the emitted values' accumulator and the final state. ``pack``: pass the stage calls'
    variable handles through the loop packed (``tf_gpipe.handles``); a loop that a tape
    differentiates reads the variables through the handles themselves, which is what the
    tape connects to the variables it watches. ``parallel``: as for ``run``. ``seen`` is
    given the accumulator once the probe has made it, before the loop is built: what an
    iteration reads of what earlier ones held (``state["emitted", key]``) has its layouts.

    ``rest = (n, after)``: the loop runs ``n`` iterations more, which skip ``iteration``
    (``loop_guard``), and ``after(m, state)`` at the end of every iteration. What
    ``iteration`` adds to ``state`` (keys it did not have) reaches ``after``, zeros where
    skipped, and leaves the state once ``after`` has run. So an action run ``n`` iterations
    after its micro-batch's (ZB-H1's deferred W) keeps one place in the graph: the loop's
    last iterations run the last ones, not copies of it after the loop."""
    keys = sorted(state, key=repr)
    specs = {k: [tf.type_spec_from_value(v) for v in state[k]] for k in keys}

    meta: dict = {}
    added: dict = {}  # what the iteration adds to the state: its specs

    def probe(m, *flat):
        it = iter(flat)
        local = {k: [next(it) for _ in specs[k]] for k in keys}
        got = iteration(Counters(devices, probe=m), local)
        added.update({k: [_spec(v) for v in local[k]] for k in local if k not in specs})
        meta.update({k: (how, device) for k, (how, device, _) in got.items()})
        return {k: value for k, (_, _, value) in got.items()}

    signature = [tf.TensorSpec([], tf.int32)] + [s for k in keys for s in specs[k]]
    with handles.collected() as captured:
        values = tf_compat.traced_unordered("probe", probe, signature).structured_outputs
    out = Emitted(meta, values, M)
    if seen is not None:
        seen(out)
    # The stage calls' variable handles cross the loop as one stacked tensor per CPU device.
    packed = handles.pack(captured if pack else [])
    state = {**state, **out.initial(), **Counters(devices).initial(), "handles": packed.tensors}
    extra, after = rest if rest is not None else (0, None)

    def body(_: tf.Tensor) -> None:
        m = Counters(devices, state)
        with handles.replaced(handles.unpack(packed, state["handles"])):
            if not extra:
                out.add(state, m, iteration(m, state))
            else:
                changed = [("emitted", k) for k in out.layouts]
                loop_guard.run_below(
                    M, m, state, changed, added, lambda local: out.add(local, m, iteration(m, local))
                )
                assert after is not None
                after(m, state)
                for k in added:
                    del state[k]
        m.advance()

    run(state, M + extra, body, parallel)
    return out, state
