"""Balance a pipeline: estimate each layer's cost, then cut the layers into stages of even cost.

Estimators (``tf_gpipe.balance.profile``) give one cost per layer, solvers
(``tf_gpipe.balance.solvers``) cut the layers where the stages' costs are even, and
``report`` (``tf_gpipe.balance.report``) shows a partition with its predicted bubble.
``balance_by`` runs an estimator and a solver in one call.
"""

from __future__ import annotations

from typing import Any

from tf_gpipe.balance.profile import Layers, by_memory, by_params, by_time, listed_layers
from tf_gpipe.balance.report import report
from tf_gpipe.balance.solvers import solve_min_variance, solve_minmax, stage_costs
from tf_gpipe.partition import cuts_keeping, keeps, tied, within

__all__ = [
    "METHODS",
    "SOLVERS",
    "balance_by",
    "by_memory",
    "by_params",
    "by_time",
    "report",
    "solve_min_variance",
    "solve_minmax",
    "stage_costs",
]

METHODS = ("params", "time", "memory")
SOLVERS = ("minmax", "min_variance")


def balance_by(
    method: str, layers: Layers, num_stages: int, sample: Any = None, solver: str = "minmax", **kwargs: Any
) -> list[int]:
    """Layers per stage that even out one cost: ``"params"``, ``"time"`` or ``"memory"``.

    Args:
        method: the estimate to balance: :func:`by_params`, :func:`by_time` or :func:`by_memory`.
        layers, sample: as for :func:`by_params`.
        num_stages: K, the number of stages.
        solver: ``"minmax"`` (optimal largest stage) or ``"min_variance"`` (torchgpipe's).
        **kwargs: for the estimator (``repeats=``, ``optimizer_slots=``, ``batch_size=``...).

    Returns:
        The ``balance`` argument of :class:`~tf_gpipe.PipelineModel`: where ``num_stages``
        allows it, no cut falls between two uses of a shared layer or variable
        (``solve_minmax`` with ``cuts`` where the solver's split would).

    Example:
        >>> layers = [keras.layers.Dense(64) for _ in range(7)] + [keras.layers.Dense(10_000)]
        >>> balance_by("params", layers, 2, (32, 64))  # for PipelineModel(layers, balance=...)
        [7, 1]
    """
    estimators = {"params": by_params, "time": by_time, "memory": by_memory}
    solvers = {"minmax": solve_minmax, "min_variance": solve_min_variance}
    if method not in estimators:
        raise ValueError(f"tf_gpipe: unknown balance method {method!r}; use one of {list(METHODS)}.")
    if solver not in solvers:
        raise ValueError(f"tf_gpipe: unknown solver {solver!r}; use one of {list(SOLVERS)}.")
    layer_list, spec = listed_layers(layers)
    solve_minmax([0.0] * len(layer_list), num_stages)  # fail before profiling, as the solver would
    costs = estimators[method](layer_list, spec if sample is None else sample, **kwargs)
    found = solvers[solver](costs, num_stages)
    spans = tied(layer_list)
    cuts = within(cuts_keeping(len(layer_list), spans), num_stages)
    if cuts is None or keeps(found, spans):
        return found
    return solve_minmax(costs, num_stages, cuts)


def balance_by_cost(method: str, layers: list, spec: Any, num_stages: int | None, v: int) -> list[int]:
    """``PipelineModel(balance="params" | "time" | "memory")``: the balance ``method`` gives
    ``num_stages * v`` cells, measured on ``spec``, or an error that says what to pass."""
    if num_stages is None:
        raise ValueError(f"tf_gpipe: balance={method!r} needs num_stages (how many stages to balance).")
    if spec is None:
        raise ValueError(
            f"tf_gpipe: balance={method!r} measures each layer on a sample input, so the input "
            "shape must be known: start the layers with keras.Input(shape=...), or compute it with "
            f"tf_gpipe.balance.balance_by({method!r}, layers, num_stages, sample) and pass the list."
        )
    return balance_by(method, layers, num_stages * v, spec)
