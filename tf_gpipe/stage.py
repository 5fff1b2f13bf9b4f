"""A stage as two functions traced once: its forward pass and its re-materializing backward pass.

Building every (stage, micro-batch) pass inline makes the training graph, and
its first trace, grow as K x M x layers. Here each stage is a pair of
``tf.function``s, traced once per input signature (``reduce_retracing`` lets
the smaller micro-batches of an uneven split share one trace after the first
retrace), and the schedule calls them M times: the graph holds O(K) function
bodies and O(K x M) calls. Each function runs on its stage's device, and with
``jit_compile`` it is one XLA cluster there: a cluster never spans two stages.

The forward pass is pure in the sense the replay needs: it returns the value
each variable it wrote had before (seed-generator states, BatchNormalization
statistics), and the backward pass replays the stage with exactly that state,
so it draws the same dropout masks and changes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tf_gpipe import gated, handles, keras_compat, py_functions, replay, scoped, tf_compat
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell, attach_mask
from tf_gpipe.gradient_sums import GradientSums
from tf_gpipe.microbatch import MicroBatch

__all__: list[str] = []

_inline = scoped.Flag()


class Part(NamedTuple):
    """What one backward of a stage computes: the gradients of its inputs, of its weights,
    or both (a split schedule's ``B`` is ``Part(weights=False)``, its ``W``
    ``Part(inputs=False, ...)``).

    ``sums_after``: the token of the stage's previous addition to its gradient sums (or of
    their zeroing). Given, the weight gradients are added to the sums after it
    (``tf_gpipe.gradient_sums``), and a token ready once they are comes back in their
    place; None, they are returned.
    """

    inputs: bool = True
    weights: bool = True
    sums_after: Any = None

    def normalized(self) -> Part:
        """Python bools (a trace's key), and no sums where no weight gradient is made."""
        weights = bool(self.weights)
        return Part(bool(self.inputs), weights, self.sums_after if weights else None)


FULL = Part()  # both gradients, returned


def inlined() -> contextlib.AbstractContextManager[None]:
    """Within this scope the stage functions are called as functions the runtime inlines.

    For a graph that calls each stage function once (the loops over micro-batches,
    ``tf_gpipe.micro_batch_loop``), inlining adds no copies, and each action then runs without a
    function call of its own (less host work per action, benchmarks/compiled_stages/README.md).
    A graph that calls them once per micro-batch keeps the calls
    (``_noinline``, see ``StageFunctions``). Inlined, a body's ops no longer wait for all
    of the call's inputs, nor its outputs for its writes: the forward and backward bodies
    spell out the orders they need when traced in this scope."""
    return _inline.scope()


def is_inlined() -> bool:
    """Whether this is traced inside ``inlined()``."""
    return bool(_inline)


def functions(cell: Cell) -> StageFunctions:
    """The stage functions of ``cell`` for its XLA choice and trainable weights, made on
    first use.

    An XLA program fixes its matmul precision when compiled (TF32 or full float32, by
    ``tf.config.experimental.tensor_float_32_execution_enabled()`` then): an XLA stage
    has its own functions, so its own programs, inside and outside ``exact_float32()``.
    A trace differentiates the weights that were trainable then (and a frozen
    BatchNormalization infers): a layer frozen or unfrozen since gets functions of its own.
    """
    jit = bool(getattr(cell, "jit_compile", False))
    eager = bool(getattr(cell, "run_eagerly", False))
    trainable = tuple(id(v) for v in cell.trainable_variables)
    key = (jit, eager, jit and tf.config.experimental.tensor_float_32_execution_enabled(), trainable)
    made = cell.stage_functions
    if key not in made:
        made[key] = StageFunctions(cell, jit, eager)
    return made[key]


class StageFunctions:
    """The forward and backward functions of one cell.

    Args:
        cell: the stage.
        jit_compile: compile both functions with XLA.
        eager: run the Python bodies directly, not as functions (``run_eagerly``).
    """

    def __init__(self, cell: Cell, jit_compile: bool = False, eager: bool = False):
        self.cell = cell
        self.jit_compile = jit_compile
        self.eager = eager
        # Where fit's backward passes sum the stage's gradients, and the functions that zero,
        # add to and read them.
        self.sums = GradientSums(cell, eager)
        # Per (training, whether it defers): the variables the forward writes, found while tracing.
        self._written: dict[tuple[Any, bool], list[Any]] = {}
        self._deferred_layers: dict[tuple[Any, bool], list[Any]] = {}
        # Keras' own step functions skip autograph too; reduce_retracing lets the smaller
        # micro-batches of an uneven split share one trace.
        # ``_noinline``: Grappler would otherwise inline every call, and the step graph it
        # optimizes would again hold K x M copies of each stage (the first step growing
        # with M). A call is one op that starts when all its inputs are ready.
        options = dict(reduce_retracing=True, autograph=False, experimental_attributes={"_noinline": True})
        self._forward = tf_compat.function(self._forward_body, jit_compile=jit_compile, **options)
        # The forward of a stage that is not re-materialized runs under a tape, and its
        # gradient is TensorFlow's backward of the call (gated inside: ``tf_gpipe.gated``).
        # As one call, that backward would hold every saved activation until it returns,
        # and its outputs (the stage's weight gradients) on top: ~1.25x plain Keras' peak.
        # Inlined, each activation is freed once its gradient is made, as in plain Keras,
        # at the cost of K x M copies of the body in the optimized graph (a slower first
        # step for remat="never").
        # Without XLA where the stage runs a recurrent layer's loop: TensorFlow's gradient of
        # the call reads the stacks of per-step values the loop saves (TensorLists), which
        # cannot leave an XLA function ("TensorList crossing the XLA/TF boundary"), so the
        # first step failed. The stage's other functions keep XLA (a replay differentiates
        # its loop inside the function).
        taped = dict(jit_compile=jit_compile and not runs_loops(cell), reduce_retracing=True, autograph=False)
        self._forward_taped = tf_compat.function(self._forward_taped_body, **taped)
        self._backward = tf_compat.function(self._backward_body, jit_compile=jit_compile, **options)
        # The same three, for ``inlined()`` callers (an XLA function is never inlined): their
        # bodies order themselves (``_run_forward``, ``_backward_body``), so a trace made for
        # one kind of caller is never the other's.
        inline = dict(reduce_retracing=True, autograph=False)
        self._forward_inlined = tf_compat.function(self._forward_body, jit_compile=jit_compile, **inline)
        self._forward_taped_inlined = tf_compat.function(self._forward_taped_body, **taped)
        # A taped forward without the gate, whose graph ``tf_gpipe.stash`` differentiates in
        # two parts (ZB-H1's B and W): the gate's one gradient would make both at once.
        self._forward_split = tf_compat.function(self._forward_split_body, **taped)
        self._forward_split_inlined = tf_compat.function(self._forward_split_body, **taped)
        # The replay as such a function: ZB-H1's B of a re-materialized stage replays the
        # stage once and its W differentiates only the ops that read a weight.
        # Built out, its halves are calls, as the backward they replace (``options``).
        self._replay_split = tf_compat.function(
            self._replay_split_body, **taped, experimental_attributes={"_noinline": True}
        )
        self._replay_split_inlined = tf_compat.function(self._replay_split_body, **taped)
        # Per traced forward (``id``): the functions of its two halves (``tf_gpipe.weight_split``).
        self.split_halves: dict[int, Any] = {}
        self._backward_inlined = tf_compat.function(self._backward_body, jit_compile=jit_compile, **inline)
        # Timeline markers are host callbacks, which XLA cannot compile.
        self._backward_marked = tf_compat.function(self._backward_body, jit_compile=False, **options)
        if eager:  # compile(run_eagerly=True): the layers run op by op, for debugging
            self._forward, self._forward_taped = self._forward_body, self._forward_taped_body
            self._backward = self._backward_marked = self._backward_body
            self._forward_inlined, self._backward_inlined = self._forward, self._backward
            self._forward_taped_inlined = self._forward_taped
            self._forward_split = self._forward_split_inlined = self._forward_split_body
            self._replay_split = self._replay_split_inlined = self._replay_split_body

    # ------------------------------------------------------------------ forward
    def forward(
        self, mb: MicroBatch, deferred: Any, taped: bool = False, input_grads: bool = True
    ) -> tuple[Any, Any, list[tf.Tensor], list[tf.Tensor]]:
        """Run the stage on micro-batch ``mb``, applying its variable updates once.

        ``taped``: the caller differentiates this call with a tape (no re-materialization);
        it then runs as a function the runtime may inline (see ``__init__``), with a gated
        gradient (``tf_gpipe.gated``) that differentiates the float inputs if ``input_grads``.

        Returns ``(outputs, out_mask, layer losses, before)``: ``before`` holds the
        value each written variable had, for the replay. BatchNormalization moments
        go into ``deferred`` (a ``batchnorm.DeferredStats``) when it is given.
        """
        with tf.device(self.cell.device):
            if taped:
                # Inside the loops, with the handles the loop passes (its caller's tape
                # watches them: ``cell_pass._fed_handles``).
                fn, args = self.taped_call(mb, deferred, input_grads)
                result = handles.call(fn, *args)
            else:
                result = handles.call(self._plain_forward(), mb, self._defers(deferred, mb.training))
            outputs, out_mask, losses, before, moments = result
        self.collect_moments(deferred, mb.training, moments)
        if out_mask is not None:
            # A Keras mask does not leave a function on its tensor; a loss or a layer
            # reading the outputs expects it there, as after keras.Sequential's last layer.
            attach_mask(outputs, out_mask)
        return outputs, out_mask, list(losses), list(before)

    def taped_call(self, mb: MicroBatch, deferred: Any, input_grads: Any) -> tuple[Any, tuple]:
        """The taped forward function and its arguments for micro-batch ``mb`` (see ``forward``)."""
        fn = self._forward_taped_inlined if is_inlined() else self._forward_taped
        return fn, (mb, self._defers(deferred, mb.training), bool(input_grads))

    def split_call(self, mb: MicroBatch, deferred: Any) -> tuple[Any, tuple]:
        """The ungated taped forward function and its arguments, whose graph ``tf_gpipe.stash``
        splits into a B and a W (see ``taped_call``)."""
        fn = self._forward_split_inlined if is_inlined() else self._forward_split
        return fn, (mb, self._defers(deferred, mb.training))

    def replay_split_call(self, mb: MicroBatch, pooled: bool, before: list[Any]) -> tuple[Any, tuple]:
        """The replay of micro-batch ``mb``'s forward as a function ``tf_gpipe.stash`` splits
        into a B and a W (``split_call``'s, for a re-materialized stage); ``before`` and
        ``pooled`` as for ``backward``."""
        fn = self._replay_split_inlined if is_inlined() else self._replay_split
        return fn, (mb, self._defers(pooled, mb.training), list(before))

    def collect_moments(self, deferred: Any, training: Any, moments: list[Any]) -> None:
        """Pool a forward's BatchNormalization moments into ``deferred``, where it defers them."""
        if self._defers(deferred, training):
            for bn, sums in zip(self._deferred_layers[(training, True)], moments):
                deferred.add_sums(bn, sums)

    def _plain_forward(self) -> Any:
        """The forward function (not taped) callers in this scope use: inlined or not."""
        return self._forward_inlined if is_inlined() else self._forward

    def _plain_backward(self) -> Any:
        """The backward function (no timeline markers) callers in this scope use: inlined or not."""
        return self._backward_inlined if is_inlined() else self._backward

    def _defers(self, deferred: Any, training: Any) -> bool:
        """Whether a call defers BatchNormalization statistics: ``deferred`` (a forward's
        ``DeferredStats``, or a replay's ``pooled`` flag) is given, the call trains, and the
        stage has some."""
        return bool(deferred) and bool(training) and bool(self.cell.batch_norms)

    def pooled_layers(self, training: Any = True) -> list[Any]:
        """The BatchNormalization layers whose moments a deferring forward returns, in order."""
        return list(self._deferred_layers.get((training, True), []))

    def _forward_body(self, mb, defer):
        return self._run_forward(mb, defer, None)

    def _forward_taped_body(self, mb, defer, input_grads):
        return self._run_forward(mb, defer, input_grads)

    def _forward_split_body(self, mb, defer):
        return self._run_forward(mb, defer, "ungated")

    def _replay_split_body(self, mb, defer, before):
        inputs, mask, side, _, training = mb
        state = list(zip(self._written[(training, defer)], before))
        record = replay.Record(inputs, mask, None, None, [], replay_state=state, side=side)
        scope = tf.name_scope(f"stage{self.cell.index}_replay")
        with tf.device(self.cell.device), scope, py_functions.replayed():
            outputs, losses = replay.run(self.cell, record, training)
        return outputs, None, losses, [], []  # the forward's structure: nothing written, no moments

    def _run_forward(self, mb, defer, taped_inputs):
        """``taped_inputs``: None for the forward a replay follows; True or False (whether
        the float inputs get gradients) for a taped one, whose gradient is gated; "ungated"
        for a taped one differentiated op by op (``split_call``)."""
        inputs, mask, side, nonempty, training = mb
        cell, key = self.cell, (training, defer)
        bns = cell.batch_norms if defer else []
        local = DeferredStats() if bns else None
        # Inlined, the body's ops no longer wait for the call's inputs, nor its outputs for
        # its writes: the reads wait for the inputs, the outputs for the writes, so that the
        # next micro-batch's forward (chained to this one's outputs) reads what this one wrote.
        inputs_ready = [t for t in tf.nest.flatten((inputs, mask, side)) if isinstance(t, tf.Tensor)]
        ordered = tf.control_dependencies(inputs_ready if is_inlined() else [])
        # A name scope of its own: a layer named like "_x" is no valid root scope in a new graph.
        with tf.device(cell.device), tf.name_scope(f"stage{cell.index}_forward"), ordered:
            capture = local.capture(bns, nonempty) if bns else contextlib.nullcontext()
            with keras_compat.RecordingScope() as scope, capture:
                if taped_inputs is None:
                    outputs, out_mask = cell.call(inputs, mask, training, side)
                    losses = list(scope.losses)
                elif taped_inputs == "ungated":
                    with py_functions.replayed():
                        outputs, out_mask = cell.call(inputs, mask, training, side)
                    losses = list(scope.losses)
                else:
                    outputs, out_mask, losses = gated.call(
                        cell, inputs, mask, training, side, scope, taped_inputs
                    )
            skipped = local.skipped_variables(bns) if bns else set()
            written = [v for k, v in scope.written.items() if k not in skipped]
            before = [replay.read_stored(v) for v in written]
            writes = []
            for v, old in zip(written, before):
                new = scope.get_current_value(v)
                if nonempty is not None:  # an empty micro-batch (e.g. NaN batch statistics) changes nothing
                    new = tf.where(nonempty, new, old)
                writes.append(v.assign(new))
            if is_inlined() and writes:
                with tf.control_dependencies(writes):
                    outputs = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), outputs)
            recorded = local.sums() if bns else []
        self._remember(self._written, key, written, "variables it writes")
        self._remember(self._deferred_layers, key, [bn for bn, _ in recorded], "BatchNormalization layers")
        return outputs, out_mask, losses, before, [sums for _, sums in recorded]

    def _remember(self, table: dict, key: Any, found: list, what: str) -> None:
        known = table.get(key)
        if known is not None and [id(v) for v in known] != [id(v) for v in found]:
            raise RuntimeError(
                f"tf_gpipe: stage {self.cell.index} changed the {what} between two traces; its "
                "layers must touch the same variables whatever the micro-batch shape."
            )
        table[key] = found

    # ------------------------------------------------------------------ backward
    def backward(
        self,
        mb: MicroBatch,
        pooled: bool,
        before: list[tf.Tensor],
        output_grads: list[tf.Tensor | None],
        loss_grads: list[tf.Tensor | None],
        part: Part = FULL,
        tracer: Any = None,
    ) -> tuple[list[tf.Tensor | None], Any]:
        """Replay the stage on ``mb`` with the state its forward read (``before``: what its
        writes overwrote; ``pooled``: whether that forward pooled its BatchNormalization
        moments), and differentiate the replay.

        Returns ``(input_grads, variable_grads)``: input grads follow
        ``tf.nest.flatten(mb.inputs)`` (None for non-float inputs), variable grads
        follow ``cell.trainable_variables``; with ``part.sums_after`` they are added to the
        gradient sums instead, and ``(token, rows)`` comes in their place. ``tracer``, a
        ``(Recorder, device, tag)`` triple, marks the end of the recomputation on a timeline.

        ``part`` (``Part``) says which gradients: ZB-H1's W of stage 0, which has no B; and
        each half where the stage's backward is not split (``stash.replay``), each half then
        replaying the stage and making the activation gradients again.
        """
        part = part.normalized()
        defer = self._defers(pooled, mb.training)
        marker, fn = None, self._plain_backward()
        if tracer is not None:
            recorder, device, tag = tracer
            marker, fn = (recorder, device, tf.constant("replayed " + tag)), self._backward_marked
        if part.sums_after is not None:  # made before the trace, which captures them (cheaper than passing)
            self.sums.variables(self.cell.trainable_variables)
        args = (mb, defer, list(before), list(output_grads), list(loss_grads), part, marker)
        with tf.device(self.cell.device):
            in_grads, var_grads = handles.call(fn, *args)
        if part.sums_after is not None:
            token, rows = var_grads
            return list(in_grads), (token, self.sums.rows_in(rows))
        return list(in_grads), list(var_grads)

    def _backward_body(self, mb, defer, before, output_grads, loss_grads, part, marker):
        inputs, mask, side, nonempty, training = mb
        cell = self.cell
        written = self._written[(training, defer)]
        flat_in = tf.nest.flatten(inputs)
        float_pos = replay.float_positions(flat_in)
        arrived = [g for g in [*output_grads, *loss_grads, part.sums_after] if g is not None]
        with tf.device(cell.device), tf.name_scope(f"stage{cell.index}_replay"):
            # The recomputation waits for the incoming gradient: run earlier, it would
            # hold this cell's activations for the whole forward pass and save nothing.
            # A function whose body is inlined may start before all its inputs are ready,
            # so the dependency is spelled out here too.
            # Every input, not only the float ones: a stage fed only integers (token ids)
            # would otherwise replay as soon as its inputs exist.
            with tf.control_dependencies(arrived):
                swapped = [tf.identity(t) if isinstance(t, tf.Tensor) else t for t in flat_in]
            replay_in = [swapped[i] for i in float_pos]
            record = replay.Record(
                inputs=tf.nest.pack_sequence_as(inputs, swapped),
                mask=mask,
                outputs=None,
                out_mask=None,
                losses=[],
                replay_state=list(zip(written, before)),
                side=side,
            )
            # In a function, ``tf.gradients`` gated: each op hands on the gradient of its
            # input only once that of its weights is made too. Ungated, the runtime ran the
            # chain of input gradients ahead, and every layer's activation and incoming
            # gradient waited for its weight gradient: K=2, M=2 peaked 108 MiB (45%) higher
            # (benchmarks/remat_memory/README.md). A tape only when eager (run_eagerly).
            tape = tf.GradientTape() if tf.executing_eagerly() else None
            with tape or contextlib.nullcontext():
                if tape is not None:
                    tape.watch(replay_in)
                outputs, losses = replay.run(cell, record, training)
            if marker is not None:
                recorder, device, label = marker
                done = [t for t in tf.nest.flatten(outputs) + list(losses) if t is not None]
                mark = recorder.marker(label, device, done)
                with tf.control_dependencies([mark]):
                    output_grads = [None if g is None else tf.identity(g) for g in output_grads]
                    loss_grads = [None if g is None else tf.identity(g) for g in loss_grads]
            in_grads, var_grads = replay.tape_gradients(
                tape,
                list(tf.nest.flatten(outputs)) + list(losses),
                list(output_grads) + list(loss_grads),
                flat_in,
                float_pos,
                replay_in,
                cell.trainable_variables if part.weights else [],
                part.inputs,
                nonempty if part.sums_after is None else None,  # the sums skip an empty micro-batch's
                gated=True,
            )
            if part.sums_after is None:
                return in_grads, var_grads
            # After the previous addition, in micro-batch order, whatever each gradient waits
            # for (a bias's needs only the output gradient): inlined, nothing else orders them.
            with tf.control_dependencies([part.sums_after]):
                return in_grads, self.sums.add_in_body(var_grads, nonempty)


def runs_loops(cell: Cell) -> bool:
    """Whether a layer of ``cell`` (nested ones included) is a Keras recurrent layer that
    runs as a loop over time steps (not ``unroll=True``)."""
    return any(
        isinstance(sub, keras.layers.RNN) and not getattr(sub, "unroll", False)
        for layer in cell.layers
        for sub in keras_compat.nested_layers(layer)
    )
