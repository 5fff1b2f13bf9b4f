"""Partition solvers: layers per stage from one cost per layer."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import numpy as np

from tf_gpipe.partition import even_balance, split_by_balance

__all__ = ["solve_min_variance", "solve_minmax", "stage_costs"]


def _checked(costs: Sequence[float], num_stages: int) -> list[float]:
    if isinstance(num_stages, bool) or not hasattr(num_stages, "__index__"):
        raise ValueError(f"tf_gpipe: num_stages must be an integer >= 1, got {num_stages!r}.")
    values = [float(c) for c in costs]
    if not values:
        raise ValueError("tf_gpipe: costs is empty; give one cost per layer.")
    bad = [i for i, c in enumerate(values) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise ValueError(f"tf_gpipe: costs[{bad[0]}] = {values[bad[0]]!r}; costs must be finite and >= 0.")
    even_balance(len(values), operator.index(num_stages))  # raises unless 1 <= num_stages <= layers
    return values


def solve_minmax(costs: Sequence[float], num_stages: int) -> list[int]:
    """The contiguous partition whose most expensive stage is as cheap as possible (optimal).

    Under fill-drain the slowest stage sets the pace, so the step time follows
    the largest stage cost. Exact dynamic program, O(K n^2). Of the optimal
    partitions, the one with the least sum of squared stage costs; on exact ties,
    larger early stages (as :func:`~tf_gpipe.partition.even_balance`).

    Args:
        costs: one cost per layer, finite and >= 0.
        num_stages: K, 1 <= K <= len(costs); every stage gets at least one layer.

    Returns:
        Layers per stage, e.g. ``[3, 3, 2, 2]``.

    Example:
        >>> solve_minmax([1, 1, 1, 1, 4], 2)
        [4, 1]
    """
    c, k_all = _checked(costs, num_stages), operator.index(num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    bound, _ = _sweep(prefix, k_all, np.maximum)
    if bound == 0:  # nothing costs anything
        return even_balance(len(c), k_all)
    # Same sums again (the bound holds exactly): least sum of squares, scaled by an exact power of two.
    e = math.frexp(bound)[1]
    _, lengths = _sweep(prefix, k_all, lambda p, s: np.where(s <= bound, p + np.ldexp(s, -e) ** 2, np.inf))
    return lengths


def _sweep(prefix: np.ndarray, k_all: int, combine: Callable) -> tuple[float, list[int]]:
    """``table[k, i]``: the best score of the first i layers in k stages; ``combine(table[k-1, j],
    cost of layers j..i-1)`` scores each last cut j. The least wins, on ties the last one."""
    n = len(prefix) - 1
    table = np.full((k_all + 1, n + 1), np.inf)
    table[0, 0] = 0.0
    start = np.zeros((k_all + 1, n + 1), dtype=int)
    for k in range(1, k_all + 1):
        for i in range(k, n - (k_all - k) + 1):
            j = np.arange(k - 1, i)
            total = combine(table[k - 1, j], prefix[i] - prefix[j])
            a = len(total) - 1 - int(np.argmin(total[::-1]))
            table[k, i], start[k, i] = total[a], j[a]
    ends = [n]
    for k in range(k_all, 1, -1):
        ends.insert(0, int(start[k, ends[0]]))
    return float(table[k_all, n]), [b - a for a, b in zip([0] + ends[:-1], ends)]


def _block_partition(costs: list[float], k: int, closest: bool) -> list[int] | None:
    """Bárány et al.'s block partition, step for step as torchgpipe; None where that would fail."""
    n, seen = len(costs), set()
    low, span = min(costs), max(costs) - min(costs)
    unit = [0.0] * n if span == 0 else [(x - low) / span for x in costs]  # costs rescaled to [0, 1]
    ends = [n // k * (i + 1) for i in range(k - 1)] + [n]  # n // k layers a stage, the remainder last
    while True:
        sizes = [sum(unit[(ends[i - 1] if i else 0) : ends[i]]) for i in range(k)]
        largest = max(sizes)
        p = max(i for i, s in enumerate(sizes) if s == largest)  # torchgpipe's max((size, i))
        while True:
            sizes = [sum(unit[(ends[i - 1] if i else 0) : ends[i]]) for i in range(k)]
            if largest <= min(sizes) + 1:
                return [b - a for a, b in zip([0] + ends[:-1], ends)]
            ties = [i for i, s in enumerate(sizes) if s == min(sizes)]
            # torchgpipe takes the first cheapest stage; the paper the one closest to p.
            q = min(ties, key=lambda i: abs(i - p)) if closest else ties[0]
            h = q - 1 if p < q else q + 1
            state = (tuple(ends), p, largest)
            if ends[h] == (ends[h - 1] if h else 0) or state in seen:
                return None  # a layer from an empty stage, or a cycle: torchgpipe would go wrong
            seen.add(state)
            if p < q:
                ends[h] -= 1  # the last layer of stage h moves to stage q
            else:
                ends[q] += 1  # the first layer of stage h moves to stage q
            if p == h:
                break


def solve_min_variance(costs: Sequence[float], num_stages: int) -> list[int]:
    """torchgpipe's heuristic (Bárány et al., "Block partitions of sequences"): even, not optimal.

    Costs are rescaled to [0, 1]; from ``n // K`` layers a stage, a layer moves
    from a neighbour into the cheapest stage until the dearest exceeds it by at
    most one rescaled layer. The result is torchgpipe's, except where torchgpipe
    would take a layer from an empty stage (it then returns an empty stage or
    never stops): there the cheapest stage closest to the dearest is taken, as
    the paper says. :func:`solve_minmax` is optimal; this is for parity.

    Args:
        costs: one cost per layer, finite and >= 0.
        num_stages: K, 1 <= K <= len(costs).

    Returns:
        Layers per stage, every entry >= 1.

    Example:
        >>> solve_min_variance([1, 2, 3, 4, 5, 6], 2)  # as torchgpipe
        [4, 2]
    """
    c = _checked(costs, num_stages)
    for closest in (False, True):
        lengths = _block_partition(c, operator.index(num_stages), closest)
        if lengths is not None and min(lengths) > 0:
            return lengths
    return solve_minmax(c, num_stages)  # never seen; keeps every stage non-empty


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage of ``balance`` (layers per stage)."""
    return [sum(group) for group in split_by_balance([float(c) for c in costs], None, balance)]
