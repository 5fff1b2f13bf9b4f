"""A stage's variable handles as one loop variable per device (``tf_gpipe.micro_batch_loop``).

A stage function captures a resource handle for every variable it reads or writes (its
weights, seed-generator states, BatchNormalization statistics; built out, gradient sums). Called
inside the loops, it needs each of them in the ``tf.while_loop``: one input each, traced at
every level (a placeholder per handle per nested graph) and, once TensorFlow lowers the loop
to its frame ops, seven graph nodes each. With ~130 variables that would be ~40% of the loop
step's graph and most of what its first step costs over the built-out step's with one
micro-batch (benchmarks/compiled_stages/README.md).

``pack`` stacks the handles of each device into one tensor there, before the loop; inside
the loop body, ``unpack`` splits it again and ``replaced`` makes the stage-function calls in its
scope (``call``) take those tensors in place of the captured handles. A taped stage's call
too: its tape watches the tensors the call is fed, and its weight gradients are taken
w.r.t. them (``cell_pass._fed_handles``). Only CPU devices have
a ``Pack`` kernel for resource handles, so handles on other devices (GPUs) stay as they
are: one input each, as before.

``call`` feeds a function other captured inputs than its own through
``tf_compat.call_with_captures`` (a private TensorFlow API).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import tf_compat

__all__: list[str] = []

_local = threading.local()  # replicas trace in threads of their own


def _replacements() -> dict[int, tf.Tensor]:
    if not hasattr(_local, "by_id"):
        _local.by_id = {}
    return _local.by_id


def _resources(tensors: Sequence[Any]) -> list[tf.Tensor]:
    return [t for t in tensors if getattr(t, "dtype", None) == tf.resource]


def captured(concrete: Any) -> list[tf.Tensor]:
    """The resource handles a traced function (a ``ConcreteFunction``) captures."""
    return _resources(concrete.captured_inputs)


class Packed:
    """Handles grouped by device: ``groups[i]`` travels as the tensor ``tensors[i]``."""

    def __init__(self, groups: list[list[tf.Tensor]], tensors: list[tf.Tensor]):
        self.groups = groups
        self.tensors = tensors


def _packable(device: str) -> bool:
    return bool(device) and tf.DeviceSpec.from_string(device).device_type == "CPU"


def pack(handles: Sequence[tf.Tensor]) -> Packed:
    """The handles of each CPU device holding two or more, stacked there into one tensor."""
    by_device: dict[str, list[tf.Tensor]] = {}
    for h in handles:
        if _packable(h.device):
            by_device.setdefault(h.device, []).append(h)
    groups = [g for g in by_device.values() if len(g) > 1]
    tensors = []
    for g in groups:
        with tf.device(g[0].device):
            tensors.append(tf.stack(g))
    return Packed(groups, tensors)


def unpack(packed: Packed, tensors: Sequence[tf.Tensor]) -> dict[int, tf.Tensor]:
    """``{id(handle): its tensor}`` from ``tensors`` (``packed.tensors`` as the loop passed them)."""
    found: dict[int, tf.Tensor] = {}
    for group, t in zip(packed.groups, tensors):
        with tf.device(group[0].device):
            found.update(zip(map(id, group), tf.unstack(t, num=len(group))))
    return found


@contextlib.contextmanager
def replaced(by_id: dict[int, tf.Tensor]) -> Iterator[None]:
    """Within this scope ``call`` passes ``by_id[id(h)]`` for each captured handle ``h`` it holds."""
    table = _replacements()
    saved = dict(table)
    table.update(by_id)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


@contextlib.contextmanager
def collected() -> Iterator[list[tf.Tensor]]:
    """Within this scope ``call`` adds the handles each call captures to the list it yields."""
    saved = getattr(_local, "found", None)
    found: list[tf.Tensor] = []
    _local.found = found
    try:
        yield found
    finally:
        _local.found = saved


def fed(inputs: Sequence[Any]) -> list[Any]:
    """A call's captured ``inputs`` as this scope passes them: each handle ``replaced`` names
    in its place; while ``collected``, each handle added to the list."""
    found = getattr(_local, "found", None)
    if found is not None:
        known = {id(h) for h in found}
        found.extend(h for h in _resources(inputs) if id(h) not in known)
    table = _replacements()
    return [table.get(id(t), t) for t in inputs]


def call(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` (``fn`` a ``tf.function``), with the captured handles ``replaced`` names."""
    table = _replacements()
    found = getattr(_local, "found", None)
    if (not table and found is None) or not hasattr(fn, "get_concrete_function"):
        return fn(*args)
    concrete = fn.get_concrete_function(*args)
    inputs = fed(concrete.captured_inputs)
    if not table:
        return fn(*args)
    return tf_compat.call_with_captures(concrete, args, inputs)
