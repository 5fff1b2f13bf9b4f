"""A schedule's device orders as waits across micro-batches, for a loop over micro-batches.

A step built as one loop over micro-batches (``tf_gpipe.micro_batch_loop``) runs in
iteration ``m`` every action of micro-batch ``m``: its forwards stage after stage, its
loss, its backwards. Dataflow orders the actions of one iteration; across iterations a
loop carries values forward only, so an action can wait for actions of its own or an
earlier micro-batch, never a later one. ``waits`` turns each device's order into such
waits::

    1F1B, K=2, device 0:  F0 F1 B0 F2 B1 F3 B2 B3
        F(m) waits for F(m-1)   each stage's forwards in micro-batch order
        B(m) waits for B(m-1)   and its backwards
        F(m) waits for B(m-2)   at most two micro-batches in flight

A wait holds for every micro-batch (the loop runs one body for all of them), so it is
kept only where the order has it for every ``m``; a wait on a later micro-batch
("B0 after F1") is left to dataflow. What is kept is the part of the order that bounds
what a device holds (forwards wait for backwards) and what makes the step exact (each
stage's actions of one kind in micro-batch order: its random draws and statistics). The
schedule's order satisfies every wait kept, so the loop cannot deadlock.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from tf_gpipe.schedules.schedule import Action, Schedule

__all__ = ["Wait", "defers_weights", "waits"]


class Wait(NamedTuple):
    """``(kind, stage)`` of micro-batch ``m`` waits for ``(on_kind, on_stage)`` of ``m - lag``."""

    kind: str
    stage: int
    on_kind: str
    on_stage: int
    lag: int


def _holds(positions: dict[Action, tuple[int, int]], wait: Wait, num_micro_batches: int) -> bool:
    """Whether every micro-batch's action comes after its wait's in the device's order."""
    for m in range(wait.lag, num_micro_batches):
        a = positions.get(Action(wait.kind, wait.stage, m))
        p = positions.get(Action(wait.on_kind, wait.on_stage, m - wait.lag))
        if a is None or p is None or a[0] != p[0] or p[1] >= a[1]:
            return False
    return True


def waits(schedule: Schedule) -> list[Wait]:
    """The waits across micro-batches that ``schedule``'s device orders keep in a loop.

    Raises:
      ValueError: when a stage's actions of one kind are not in micro-batch order (no
        loop over micro-batches runs such a schedule exactly).
    """
    M = schedule.num_micro_batches
    positions = {a: (d, i) for d, order in enumerate(schedule.orders) for i, a in enumerate(order)}
    found: list[Wait] = []
    for kind in schedule.kinds:
        for s in range(schedule.num_virtual_stages):
            chain = Wait(kind, s, kind, s, 1)
            if M > 1 and not _holds(positions, chain, M):
                raise ValueError(
                    f"tf_gpipe: schedule {schedule.name!r} runs stage {s}'s {kind} actions out of "
                    "micro-batch order; a loop over micro-batches cannot run it."
                )
            found.append(chain)
    # Each action after the one before it on its device, where that one is of the same or
    # an earlier micro-batch; the smallest lag that holds for every micro-batch.
    lags: dict[tuple[str, int, str, int], int] = {}
    for order in schedule.orders:
        for before, action in itertools.pairwise(order):
            lag = action.micro_batch - before.micro_batch
            key = (action.kind, action.stage, before.kind, before.stage)
            if lag >= 0 and key[:2] != key[2:]:
                lags[key] = max(lags.get(key, 0), lag)
    for (kind, s, on_kind, on_s), lag in sorted(lags.items()):
        while lag < M and not _holds(positions, Wait(kind, s, on_kind, on_s, lag), M):
            lag += 1
        if lag < M:
            found.append(Wait(kind, s, on_kind, on_s, lag))
    return found


def defers_weights(schedule: Schedule) -> bool:
    """Whether a device runs a weight half W(m) after an action of a later micro-batch
    (zb-h1: W(m) after B(m + 1)). A loop iteration holds W(m) to nothing later than its own
    micro-batch, so in a loop W(m) may take the device while the schedule's next action
    waits: what the deferral of W was for (benchmarks/plan/README.md)."""
    for order in schedule.orders:
        latest = -1
        for a in order:
            if a.kind == "W" and latest > a.micro_batch:
                return True
            latest = max(latest, a.micro_batch)
    return False
