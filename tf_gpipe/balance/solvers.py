"""Partition solvers: layers per stage from one cost per layer."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from tf_gpipe.partition import even_balance, minmax_cut, split_by_balance

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


def solve_minmax(costs: Sequence[float], num_stages: int, cuts: Sequence[int] | None = None) -> list[int]:
    """The contiguous partition whose most expensive stage is as cheap as possible (optimal).

    Under fill-drain the slowest stage sets the pace, so the step time follows
    the largest stage cost. Exact dynamic program, O(K n^2). Of the optimal
    partitions, the one with the least sum of squared stage costs; on exact ties,
    larger early stages (as :func:`~tf_gpipe.partition.even_balance`).

    Args:
        costs: one cost per layer, finite and >= 0.
        num_stages: K, 1 <= K <= len(costs); every stage gets at least one layer.
        cuts: where a stage may begin (``c``: before layer ``c``, 0 < c < len(costs));
            default anywhere. Shared layers' uses are kept in one stage this way.

    Returns:
        Layers per stage, e.g. ``[3, 3, 2, 2]``.

    Example:
        >>> solve_minmax([1, 1, 1, 1, 4], 2)
        [4, 1]
        >>> solve_minmax([1, 1, 1, 1, 4], 2, cuts=[1, 2, 3])
        [3, 2]
    """
    c, k = _checked(costs, num_stages), operator.index(num_stages)
    lengths = minmax_cut(c, k, cuts)
    if lengths is None:
        raise ValueError(
            f"tf_gpipe: no split of {len(c)} layers into {k} stages begins stages only at "
            f"cuts={sorted(cuts or [])}; use at most {len(set(cuts or [])) + 1} stages."
        )
    return lengths


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
