"""Private TensorFlow APIs tf_gpipe relies on, each behind one small named function.

As ``keras_compat`` does for Keras: a TensorFlow release that moves one fails here,
with a ``TFCompatError`` naming the TensorFlow version and what is gone, and its
test in ``tests/test_tf_compat.py`` fails.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

__all__: list[str] = []


class TFCompatError(RuntimeError):
    """The installed TensorFlow lacks a private API tf_gpipe relies on."""


def _gone(what: str, why: str) -> TFCompatError:
    return TFCompatError(
        f"tf_gpipe: TensorFlow {tf.__version__} no longer provides {what}, which tf_gpipe uses to "
        f"{why}. tf_gpipe is tested with TensorFlow 2.21 (requirements.txt): install "
        "tensorflow==2.21.0, or adapt this hook in tf_gpipe/tf_compat.py (tests/test_tf_compat.py)."
    )


def _private(module: str, name: str, why: str) -> Any:
    """``module.name`` from TensorFlow's private ``tensorflow.python`` tree, or ``_gone``."""
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        found = None
    if found is None:
        raise _gone(f"{module}.{name}", why)
    return found


def function(python_function: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``tf.function(python_function, **options)`` (or, without ``python_function``, its
    decorator), without TensorFlow's warning of frequent retracing.

    TensorFlow counts the traces of every ``tf.function`` made from the same code together
    and, past five in ten calls, warns of a retracing bug. tf_gpipe makes one function per
    stage, per layer it profiles, per optimizer it measures, each traced once per signature:
    six stages called eagerly, or ``balance="time"`` over six layers, trip it with no bug to
    find. Sets ``Function._omit_frequent_tracing_warning``, as TensorFlow does for the
    functions it loads from a SavedModel; a release without it only warns again.
    """
    if python_function is None:
        return lambda f: function(f, **options)
    traced = tf.function(python_function, **options)
    if hasattr(traced, "_omit_frequent_tracing_warning"):
        traced._omit_frequent_tracing_warning = True
    return traced


def captured_source(t: Any) -> Any:
    """The outer value a traced function's placeholder ``t`` captures, or None.

    A traced function (``tf.function``, a ``tf.cond`` branch) reads outer tensors and
    variable handles through placeholders that carry no device; where the value lives
    is the outer one's device. Uses ``FuncGraph.captures`` ((outer, inner) pairs).
    """
    graph = getattr(t, "graph", None)
    if graph is None or t.op.type != "Placeholder":
        return None
    captures = getattr(graph, "captures", None)
    if captures is None:
        if type(graph).__name__ == "FuncGraph":
            raise _gone("FuncGraph.captures", "place the optimizer update beside its inputs")
        return None
    for outer, inner in captures:
        if inner is t:
            return outer
    return None


def is_symbolic(t: Any) -> bool:
    """Whether ``t`` is a graph tensor (not an eager one). Uses ``tf.is_symbolic_tensor``."""
    return bool(tf.is_symbolic_tensor(t))


def call_with_captures(concrete: Any, args: Sequence[Any], captured_inputs: Sequence[Any]) -> Any:
    """``concrete(*args)``, with ``captured_inputs`` fed in place of what it captured.

    A stage function called inside the loops takes its variable handles from the loop's
    packed tensors, not from the handles it captured when traced (``tf_gpipe.handles``).
    Uses ``ConcreteFunction._call_flat``, what ``tf.function`` itself calls with a
    function's captured inputs.
    """
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        raise _gone("ConcreteFunction._call_flat", "pass a stage its variable handles inside the loops")
    flat = concrete.function_type.unpack_inputs(concrete.function_type.bind(*args))
    return call_flat(flat, captured_inputs=list(captured_inputs))


@contextlib.contextmanager
def no_automatic_control_dependencies() -> Iterator[None]:
    """Loops built in this scope have no automatic control dependencies in their body.

    In a ``tf.function`` TensorFlow makes every output of a loop body wait for every
    stateful op of the body; the pipeline loops chain each stage through its own data
    instead, so that no iteration is a barrier of all stages (``tf_gpipe.micro_batch_loop``).
    ``while_v2`` reads the flag from the graph the loop is built in: the private
    ``Graph._add_control_dependencies``, lowered here and restored on exit.
    """
    graph = tf.compat.v1.get_default_graph()
    saved = getattr(graph, "_add_control_dependencies", None)
    if saved is None:
        raise _gone(
            "Graph._add_control_dependencies", "build the pipeline loops without a barrier per iteration"
        )
    graph._add_control_dependencies = False
    try:
        yield
    finally:
        graph._add_control_dependencies = saved


def traced_unordered(name: str, fn: Callable[..., Any], signature: Sequence[Any]) -> Any:
    """``fn`` traced on placeholders of ``signature`` (type specs) into a graph that is never run: the
    ``FuncGraph``, whose ``structured_outputs`` are what ``fn`` returned.

    ``loop_state.emitting`` learns what a loop's iteration emits from such a trace.
    ``tf.function`` would trace it with automatic control dependencies, which a graph that
    never runs needs none of, and the stages' functions and their gradients, first traced
    inside it, then cost about a third more to build (0.45 s against 0.32 s a middle stage's
    gradient, 1F1B with ``remat="never"``; benchmarks/first_step/README.md). Uses
    ``tensorflow.python.framework.func_graph.func_graph_from_py_func`` with
    ``add_control_dependencies=False``, the tracer under ``tf.function``.
    """
    trace = _private(
        "tensorflow.python.framework.func_graph",
        "func_graph_from_py_func",
        "learn what a loop's iteration emits",
    )
    return trace(name, fn, list(signature), {}, add_control_dependencies=False)


def gradient_function(op: tf.Operation) -> Callable[..., Any] | None:
    """The gradient function a graph op carries itself, or None if it has none.

    A function-call op made by ``ConcreteFunction._call_flat`` in a graph carries its
    own gradient, which ``tf_gpipe.cell_pass`` wraps to differentiate the call twice at first
    order. Uses ``Operation._gradient_function``.
    """
    if not hasattr(op, "_gradient_function"):
        raise _gone("Operation._gradient_function", "differentiate a stage call twice (B, then W)")
    return op._gradient_function


def set_gradient_function(op: tf.Operation, function: Callable[..., Any]) -> None:
    """Give the graph op ``op`` the gradient ``function`` (see ``gradient_function``)."""
    if not hasattr(op, "_gradient_function"):
        raise _gone("Operation._gradient_function", "differentiate a stage call twice (B, then W)")
    op._gradient_function = function


def py_function_callable(op: tf.Operation) -> Callable[..., Any]:
    """The Python callable behind an ``EagerPyFunc`` op (a ``tf.py_function``).

    ``tf_gpipe.py_functions`` runs it again under a tape to differentiate a
    ``tf.py_function`` called once per micro-batch. Uses
    ``tensorflow.python.ops.script_ops._py_funcs``, where ``tf.py_function`` registers it
    under the op's token (TensorFlow's own gradient reads it there too), and the
    registered wrapper's ``_func``.
    """
    why = (
        f"differentiate tf.py_function op {op.name!r} in a stage that keeps its activations "
        "(remat='always' replays the stage instead and needs no such hook)"
    )
    registry = _private("tensorflow.python.ops.script_ops", "_py_funcs", why)
    func = getattr(registry.get(op.get_attr("token").decode()), "_func", None)
    if func is None:
        raise _gone("the Python function registered for a tf.py_function op (script_ops._py_funcs)", why)
    return func


def op_determinism_enabled() -> bool:
    """Whether ``tf.config.experimental.enable_op_determinism`` is on.

    With it on, Keras compiles no model with XLA, and neither does ``tf_gpipe.jit`` a
    stage. TensorFlow has a public setter but no public getter: uses
    ``tensorflow.python.framework.config.is_op_determinism_enabled``.
    """
    enabled = _private(
        "tensorflow.python.framework.config", "is_op_determinism_enabled", "decide which stages XLA compiles"
    )
    return bool(enabled())


def server_def() -> Any:
    """The ``ServerDef`` this process joined its cluster with, or None before it joined.

    ``tf_gpipe.cluster`` names this process's own devices by its job and task. Uses
    ``tensorflow.python.eager.context.get_server_def``.
    """
    get = _private(
        "tensorflow.python.eager.context", "get_server_def", "name this process's devices in a cluster"
    )
    return get()


def update_input(op: Any, index: int, tensor: Any) -> None:
    """Make ``op`` read ``tensor`` as its input ``index``, after the op was made.

    A taped stage's gradient loop is made by TensorFlow's gradient code; feeding its
    captured inputs through an identity on the stage's device keeps the lowered loop's
    variables there. Uses ``Operation._update_input``.
    """
    method = getattr(op, "_update_input", None)
    if method is None:
        raise _gone("Operation._update_input", "keep a recurrent stage's gradient loop on its device")
    method(index, tensor)


def add_control_input(op: Any, control: Any) -> None:
    """Make ``op`` wait for ``control`` (an op), after ``op`` was made.

    ``loop_state`` makes the ops of a loop iteration it skips wait for a pivot that is
    dead there, which TensorFlow's dataflow passes on to every op after them. Uses
    ``Operation._add_control_input``.
    """
    method = getattr(op, "_add_control_input", None)
    if method is None:
        raise _gone("Operation._add_control_input", "skip a loop iteration's work past the last micro-batch")
    method(control)


def forward_backward(concrete: Any) -> tuple[Any, Any, int]:
    """A traced function split in two: ``(forward, backward, n)``.

    ``forward`` (called with ``call_forward``) returns the function's ``n`` outputs and,
    after them, the intermediates its gradient reads; ``backward`` (``call_backward``) takes
    the gradients of the first ``n`` outputs that are differentiable and returns those of
    every input, captured ones included. GPipe's loops with ``remat="never"`` keep those
    intermediates between their loop of forwards and their loop of backwards
    (``tf_gpipe.stash``), where no tape can wait. Uses the pair TensorFlow builds to
    differentiate a call in a graph: ``ConcreteFunction._delayed_rewrite_functions``.
    """
    rewrite = getattr(concrete, "_delayed_rewrite_functions", None)
    pair = getattr(rewrite, "forward_backward", None)
    if pair is None:
        raise _gone(
            "ConcreteFunction._delayed_rewrite_functions.forward_backward",
            "keep a taped stage's activations between GPipe's two loops",
        )
    n = len(concrete.function_type.flat_outputs)
    forward, backward = pair(n)
    return forward, backward, n


def part_gradient(
    concrete: Any, signature: Sequence[Any], body: Callable[..., list[Any]]
) -> tuple[Any, Any, list[Any]]:
    """A gradient function of part of a traced function: ``(forward, backward, what body
    returned)``.

    ``body(gradients, *grad_ys)`` (``grad_ys``: placeholders of ``signature``) returns the
    function's results, building them with ``gradients(ys, xs, grad_ys, stops=())``:
    ``tf.gradients`` of tensors of ``concrete``'s graph, ``stops`` held constant (None where
    unconnected). ``backward`` is called with ``call_backward``; what it reads of the
    function's intermediates becomes more outputs of that graph. ``forward`` (called with
    ``call_forward``) returns them after the function's outputs, for this part and every
    part made before it: the last part's forward feeds them all. ZB-H1 splits a stage's
    backward in two such functions (``tf_gpipe.stash``). Uses what TensorFlow builds its
    own gradient of a call with (``gradients_util._GradientsHelper`` over the function's
    graph, ``func_graph_from_py_func``, ``concrete_function._create_forward_backward_with_graph``).
    """
    helper = _private("tensorflow.python.ops.gradients_util", "_GradientsHelper", _SPLIT)
    func_graph = importlib.import_module("tensorflow.python.framework.func_graph")
    graph = concrete.graph
    returned: list[Any] = []

    def gradients(ys, xs, grad_ys, stops=()):
        return helper(list(ys), list(xs), grad_ys=list(grad_ys), stop_gradients=list(stops), src_graph=graph)

    def traced(*grad_ys):
        with tf.device(None):
            returned[:] = body(gradients, *grad_ys)
        return list(returned)

    with graph.as_default():
        backward_graph = func_graph.FuncGraph(f"{graph.name}_part_backward")
        func_graph.func_graph_from_py_func(
            name=backward_graph.name, python_func=traced, args=[], kwargs={},
            signature=list(signature), func_graph=backward_graph,
        )  # fmt: skip
        outputs = {id(t) for t in graph.outputs}
        for c in backward_graph.external_captures:
            if id(getattr(c, "graph", None)) == id(graph) and id(c) not in outputs:
                outputs.add(id(c))
                graph.outputs.append(c)
    make = _private(
        "tensorflow.python.eager.polymorphic_function.concrete_function",
        "_create_forward_backward_with_graph",
        _SPLIT,
    )
    attributes = getattr(getattr(concrete, "_inference_function", None), "attributes", None)
    if attributes is None:
        raise _gone("ConcreteFunction._inference_function.attributes", "split a stage's backward")
    forward, backward = make(attributes, graph, backward_graph)
    return forward, backward, returned


_SPLIT = "split a stage's backward into ZB-H1's input and weight halves"


def call_forward(forward: Any, flat_inputs: Sequence[Any]) -> list[Any]:
    """``forward``'s flat outputs (``forward_backward``) for its flat inputs, captured ones last."""
    return list(forward.call_flat(*flat_inputs))


def call_backward(backward: Any, output_grads: Sequence[Any], captured_inputs: Sequence[Any]) -> list[Any]:
    """``backward``'s gradients (``forward_backward``): one per input of the forward, None
    where unconnected, with the intermediates it reads given as ``captured_inputs``."""
    return list(call_with_flat_captures(backward, output_grads, captured_inputs))


def call_with_flat_captures(concrete: Any, flat_args: Sequence[Any], captured_inputs: Sequence[Any]) -> Any:
    """``concrete`` called with flat tensors ``flat_args`` and ``captured_inputs`` in place of
    what it captured (``ConcreteFunction._call_flat``)."""
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        raise _gone("ConcreteFunction._call_flat", "pass a stage its variable handles inside the loops")
    return call_flat(list(flat_args), captured_inputs=list(captured_inputs))


def flat_arguments(concrete: Any, args: Sequence[Any]) -> list[Any]:
    """The tensors ``concrete(*args)`` passes its graph, in the order of its inputs."""
    return list(concrete.function_type.unpack_inputs(concrete.function_type.bind(*args)))
