"""The GPipe fill-drain schedule as plain data (no TensorFlow)."""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["clock_cycles", "bubble_fraction", "draw"]


def clock_cycles(num_micro_batches: int, num_stages: int) -> List[List[Tuple[int, int]]]:
    """Forward tasks ``(micro_batch, stage)`` grouped by clock tick, fill then drain.

    At tick ``t`` stage ``k`` works on micro-batch ``t - k``; so while stage 1
    runs micro-batch 0, stage 0 already runs micro-batch 1::

        # t  (m,k) (m,k) (m,k)          M=3, K=3
        # 0  (0,0)
        # 1  (1,0) (0,1)
        # 2  (2,0) (1,1) (0,2)
        # 3        (2,1) (1,2)
        # 4              (2,2)

    The backward pass runs the same ticks in reverse order.
    """
    M, K = num_micro_batches, num_stages
    return [
        [(t - k, k) for k in range(max(0, t - M + 1), min(t, K - 1) + 1)]
        for t in range(M + K - 1)
    ]


def bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """Idle share of each device under fill-drain: (K-1)/(M+K-1)."""
    M, K = num_micro_batches, num_stages
    return (K - 1) / (M + K - 1)


def draw(num_micro_batches: int, num_stages: int) -> str:
    """The forward schedule as text: one row per stage, one column per tick."""
    ticks = clock_cycles(num_micro_batches, num_stages)
    width = len(str(num_micro_batches - 1))
    rows = []
    for k in range(num_stages):
        cells = []
        for tick in ticks:
            ms = [m for m, kk in tick if kk == k]
            cells.append(f"F{ms[0]:<{width}}" if ms else "." + " " * width)
        rows.append(f"stage {k}: " + " ".join(cells))
    return "\n".join(rows)
