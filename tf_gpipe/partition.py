"""Partition the layers a user gives (a list, a keras.Sequential) into consecutive cells (pipeline stages)."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import keras
import numpy as np

from tf_gpipe import keras_compat

__all__: list[str] = []

T = TypeVar("T")


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage for an even split by layer count; earlier stages take the remainder.

    Example: ``even_balance(10, 4) == [3, 3, 2, 2]``.
    """
    if num_layers < 1:
        raise ValueError("tf_gpipe: `layers` is empty; a PipelineModel needs at least one layer.")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"tf_gpipe: num_stages must be an integer >= 1, got {num_stages!r}.")
    if num_stages > num_layers:
        raise ValueError(
            f"tf_gpipe: num_stages={num_stages} is greater than the number of layers "
            f"({num_layers}); every stage needs at least one layer. "
            f"Use num_stages<={num_layers}, or split your layers more finely."
        )
    base, rem = divmod(num_layers, num_stages)
    return [base + (1 if k < rem else 0) for k in range(num_stages)]


def split_by_balance(
    items: Sequence[T], num_stages: int | None, balance: Sequence[int] | None
) -> list[list[T]]:
    """Cut ``items`` into consecutive groups: ``balance`` sizes if given, else an even split."""
    n = len(items)
    if balance is None:
        if num_stages is None:
            raise ValueError("tf_gpipe: pass num_stages (an even split) or balance (layers per stage).")
        balance = even_balance(n, num_stages)
    else:
        balance = [
            int(b) if isinstance(b, numbers.Integral) and not isinstance(b, bool) else b for b in balance
        ]
        if n < 1:
            even_balance(n, 1)  # raises the empty-layers error
        if not balance or any((not isinstance(b, int)) or b < 1 for b in balance):
            raise ValueError(
                f"tf_gpipe: balance={balance} must be a list of positive integers (layers per stage)."
            )
        if num_stages is not None and len(balance) != num_stages:
            raise ValueError(
                f"tf_gpipe: balance has {len(balance)} stages but num_stages={num_stages}; "
                f"pass num_stages={len(balance)} or drop one of the two."
            )
        if sum(balance) != n:
            suggestion = even_balance(n, len(balance)) if len(balance) <= n else None
            hint = f" For example balance={suggestion}." if suggestion else ""
            raise ValueError(
                f"tf_gpipe: balance={balance} sums to {sum(balance)} but there are {n} layers; "
                f"the entries must add up to the number of layers.{hint}"
            )
    groups, start = [], 0
    for size in balance:
        groups.append(list(items[start : start + size]))
        start += size
    return groups


class Tied(NamedTuple):
    """A layer or variable that several items (layers, graph nodes) use: every cut between
    its ``first`` and ``last`` use would put it in two stages."""

    first: int
    last: int
    kind: str  # "layer" | "variable"
    name: str


def _uses(items: Sequence[Any]) -> dict[int, tuple[str, Any, dict[int, Any]]]:
    """Every layer and variable ``items`` use, directly or nested inside them (sublayers,
    nested models): ``{id: (kind, it, {position of an item using it: that item})}``. A
    built nested layer without variables may be shared, so it is left out."""
    found: dict[int, tuple[str, Any, dict[int, Any]]] = {}
    for i, item in enumerate(items):
        for sub in _nested(item):
            if sub is not item and getattr(sub, "built", False) and not getattr(sub, "variables", ()):
                continue
            found.setdefault(id(sub), ("layer", sub, {}))[2].setdefault(i, item)
        for v in getattr(item, "variables", ()):
            found.setdefault(id(v), ("variable", v, {}))[2].setdefault(i, item)
    return found


def _name(kind: str, obj: Any) -> str:
    name = (getattr(obj, "path", None) if kind == "variable" else None) or getattr(obj, "name", None)
    return str(name or type(obj).__name__)


def tied(items: Sequence[Any]) -> list[Tied]:
    """The layers and variables that more than one of ``items`` use, directly or nested
    inside them (the sharing ``check_tied_layers`` refuses across stages)."""
    return [
        Tied(min(at), max(at), kind, _name(kind, obj))
        for kind, obj, at in _uses(items).values()
        if len(at) > 1
    ]


def shared_weights(items: Sequence[Any]) -> list[tuple[Any, tuple[int, ...]]]:
    """Each trainable variable that more than one of ``items`` use, with the positions of
    the items using it: what a step keeps once (on the last stage using it), however
    many layers or stages read it."""
    return [
        (obj, tuple(sorted(at)))
        for kind, obj, at in _uses(items).values()
        if kind == "variable" and len(at) > 1 and getattr(obj, "trainable", False)
    ]


def cuts_keeping(n: int, spans: Sequence[Tied]) -> list[int]:
    """The positions ``c`` (a cut before item ``c``, 0 < c < n) that split none of ``spans``."""
    return [c for c in range(1, n) if not any(t.first < c <= t.last for t in spans)]


def within(cuts: Sequence[int] | None, k: int) -> Sequence[int] | None:
    """``cuts`` (``cuts_keeping``'s) where ``k`` stages can all begin at one of them, else
    None (anywhere): no split into ``k`` stages then keeps every shared layer's uses in one
    stage, and a stage trains on a copy (``warn_shared``)."""
    return cuts if cuts is not None and k <= len(cuts) + 1 else None


def keeps(balance: Sequence[int], spans: Sequence[Tied]) -> bool:
    """Whether ``balance`` cuts none of ``spans``."""
    ends = np.cumsum(list(balance))[:-1]
    return not any(t.first < c <= t.last for c in ends for t in spans)


def minmax_cut(costs: Sequence[float], k: int, cuts: Sequence[int] | None = None) -> list[int] | None:
    """The contiguous split of ``costs`` into ``k`` non-empty groups whose largest sum is
    least, cutting only at ``cuts`` (positions as ``cuts_keeping``'s; any if None); of those
    the least sum of squares, then larger early groups. None if no split cuts only there.
    ``balance.solve_minmax`` is this with its checks."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum([float(c) for c in costs])])
    allowed = np.ones(n + 1, dtype=bool)
    if cuts is not None:
        allowed[1:] = False
        allowed[list(cuts)] = True
    bound, lengths = _sweep(prefix, k, np.maximum, allowed)
    if not np.isfinite(bound):
        return None
    if bound == 0:  # nothing costs anything: even by count
        return minmax_cut([1.0] * n, k, cuts)
    # Same sums again (the bound holds exactly): least sum of squares, scaled by an exact power of two.
    e = math.frexp(bound)[1]
    squares = lambda p, s: np.where(s <= bound, p + np.ldexp(s, -e) ** 2, np.inf)  # noqa: E731
    _, lengths = _sweep(prefix, k, squares, allowed)
    return lengths


def _sweep(prefix: np.ndarray, k_all: int, combine: Callable, allowed: np.ndarray) -> tuple[float, list[int]]:
    """``table[k, i]``: the best score of the first i items in k groups; ``combine(table[k-1, j],
    cost of items j..i-1)`` scores each last cut j (one ``allowed``). The least wins, on ties
    the last one."""
    n = len(prefix) - 1
    table = np.full((k_all + 1, n + 1), np.inf)
    table[0, 0] = 0.0
    start = np.zeros((k_all + 1, n + 1), dtype=int)
    for k in range(1, k_all + 1):
        for i in range(k, n - (k_all - k) + 1):
            j = np.arange(k - 1, i)
            total = np.where(allowed[j], combine(table[k - 1, j], prefix[i] - prefix[j]), np.inf)
            a = len(total) - 1 - int(np.argmin(total[::-1]))
            table[k, i], start[k, i] = total[a], j[a]
    ends = [n]
    for k in range(k_all, 1, -1):
        ends.insert(0, int(start[k, ends[0]]))
    return float(table[k_all, n]), [b - a for a, b in zip([0] + ends[:-1], ends)]


def default_balance(items: Sequence[Any], cells: int) -> list[int]:
    """Items per cell when the user gives no ``balance``: an even split by count, with no cut
    between two uses of a shared layer or variable where a split into ``cells`` allows it
    (then the fewest items in the largest cell); else the even split (``warn_shared``)."""
    balance = even_balance(len(items), cells)
    spans = tied(items)
    if keeps(balance, spans):
        return balance
    return minmax_cut([1.0] * len(items), cells, cuts_keeping(len(items), spans)) or balance


def _nested(item: Any) -> list[Any]:
    """``item`` and every layer inside it (sublayers, nested models), ``item`` first."""
    return keras_compat.nested_layers(item)


def _through(item: Any, kind: str, shared: Any) -> Any:
    """The layer of ``item`` that uses ``shared`` (a tied head, a sub-model holding a shared
    layer, a layer handed a variable): the deepest that holds it itself, else ``item``."""
    found = item
    for layer in _nested(item):
        if layer is shared:
            continue
        held = keras_compat.nested_layers(layer, recursive=False)[1:] if kind == "layer" else layer.variables
        if any(h is shared for h in held):
            found = layer
    return found


def _shared_note(kind: str, name: str, shared: Any, uses: dict) -> str:
    stages = sorted(uses)
    holders = {s: _through(uses[s], kind, shared) for s in stages}
    through = [f"{holders[s].name!r} in stage {s}" for s in stages if holders[s] is not shared]
    via = f" (through {' and '.join(through)})" if through else ""
    return (
        f"tf_gpipe: {kind} {name!r} is used in stages {stages}{via}. Its weights live on the "
        f"device of stage {stages[-1]}, the last that uses it: stages {stages[:-1]} train on a "
        "copy made on their devices once a step, and send their gradients there, where they "
        "are summed before its one update. A balance that keeps all its uses in one stage "
        "saves the copies, their memory and their traffic."
    )


def check_stages(groups: Sequence[Sequence[Any]]) -> None:
    """Refuse what no split into these groups of layers (one per cell) can run: a stateful
    recurrent layer."""
    refuse_stateful_rnns(groups)


def warn_shared(groups: Sequence[Sequence[Any]]) -> list[str]:
    """Warn of each layer, or variable outside such a layer, that two stages use (a tied
    embedding read by the first stage and by an output head in the last, a block called in
    two): it lives on the last one's device (each cell builds its layers on its own, in
    order), the others train on a copy (``Cell.copied``). A layer counts wherever it
    appears, directly or nested; a built nested layer without variables is shared freely.
    Returns the texts."""
    # A functional model's stage (``graph.GraphStage``) names the layers its nodes call.
    groups = [[op for item in group for op in getattr(item, "stage_ops", [item])] for group in groups]
    items = [item for group in groups for item in group]
    stage_of = [s for s, group in enumerate(groups) for _ in group]
    notes: list[str] = []
    covered: set[int] = set()
    used = _uses(items).values()
    for kind in ("layer", "variable"):
        for found_kind, obj, at in used:
            uses: dict[int, Any] = {}
            for i in sorted(at):
                uses.setdefault(stage_of[i], at[i])
            if found_kind != kind or len(uses) < 2 or id(obj) in covered:
                continue
            notes.append(_shared_note(kind, _name(kind, obj), obj, uses))
            covered.update(id(v) for v in getattr(obj, "variables", ()))
    for note in notes:
        warnings.warn(note, stacklevel=4)
    return notes


def refuse_stateful_rnns(groups: Sequence[Sequence[Any]]) -> None:
    """Refuse a recurrent layer with ``stateful=True``: its state carries over from one
    batch to the next row by row, and between micro-batches it would pass one micro-batch's
    state to the next (and Keras builds it only for a fixed batch size)."""
    for s, group in enumerate(groups):
        for item in group:
            for sub in _nested(item):
                if isinstance(sub, keras.layers.RNN) and getattr(sub, "stateful", False):
                    raise ValueError(
                        f"tf_gpipe: layer {sub.name!r} (stage {s}) is a recurrent layer with "
                        "stateful=True: its state carries over between batches row by row, which "
                        "micro-batches would break. Use stateful=False (the state then starts "
                        "anew each batch)."
                    )


def unpack_layers(layers: Any):
    """A flat list of layers, plus the input spec if the user gave one (keras.Input / Sequential)."""
    spec = None
    if isinstance(layers, keras.Sequential):
        functional = keras_compat.sequential_functional(layers) if layers.built else None
        if functional is not None:
            spec = functional.inputs
            spec = spec[0] if isinstance(spec, list) and len(spec) == 1 else spec
        layers = layers.layers
    elif isinstance(layers, keras.Model):
        raise TypeError(
            f"tf_gpipe: PipelineModel takes a list of layers or a keras.Sequential, got the model "
            f"{layers.name!r} ({type(layers).__name__}). To split a functional model (branches, "
            "skip connections, several inputs or outputs) into stages, use "
            "tf_gpipe.PipelineModel.from_model(model, num_stages=...)."
        )
    elif isinstance(layers, keras.layers.Layer):
        raise TypeError(
            "tf_gpipe: `layers` must be a list of Keras layers or a keras.Sequential, got the "
            f"single layer {layers.name!r}; pass [layer]."
        )
    try:
        layers = list(layers)
    except TypeError:
        raise TypeError(
            "tf_gpipe: `layers` must be a list of Keras layers or a keras.Sequential, "
            f"got {type(layers).__name__}."
        ) from None
    if layers and isinstance(layers[0], keras.KerasTensor):  # keras.Input(...)
        spec = layers.pop(0)
    elif layers and isinstance(layers[0], keras.layers.InputLayer):
        spec = layers.pop(0).output
    for i, layer in enumerate(layers):
        if isinstance(layer, keras.layers.InputLayer):
            raise ValueError(f"tf_gpipe: layers[{i}] is an InputLayer; only the first layer may be one.")
        if not isinstance(layer, keras.layers.Layer):
            hint = ""
            if type(layer).__module__.startswith(("tf_keras", "tensorflow.python.keras")):
                hint = " It is a tf.keras (Keras 2) layer; build it with `import keras` (Keras 3)."
            raise TypeError(f"tf_gpipe: layers[{i}] is {type(layer).__name__}, not a Keras layer.{hint}")
    return layers, spec


def cut_into_cells(
    layers: list[Any],
    num_stages: int | None,
    balance: Sequence[int] | None,
    virtual_stages: int,
    devices: Any,
) -> list[list[Any]]:
    """``PipelineModel``'s layers in ``num_stages * virtual_stages`` consecutive groups, one
    per cell: as ``balance`` gives (one entry per cell), else an even split into
    ``num_stages`` (default: one per device given, else 1) times ``virtual_stages`` that
    keeps each shared layer in one group where it can. Warns of a layer two groups share
    (``warn_shared``)."""
    if balance is not None:
        groups = split_by_balance(
            layers, None if num_stages is None else num_stages * virtual_stages, balance
        )
        if len(groups) % virtual_stages:
            raise ValueError(
                f"tf_gpipe: balance has {len(groups)} entries, not a multiple of "
                f"virtual_stages={virtual_stages}; give num_stages * virtual_stages entries."
            )
    else:
        if num_stages is None:
            num_stages = len(devices) if devices is not None and not isinstance(devices, str) else 1
        cells = num_stages * virtual_stages
        groups = split_by_balance(layers, None, default_balance(layers, cells))
    check_stages(groups)
    warn_shared(groups)
    return groups
