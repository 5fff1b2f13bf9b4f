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

ZB-H1 puts stage s's W(m) after B(m + s): its loop runs that W in iteration m + s
(``weight_lags``), and the waits count iterations, so that the W waits for that B.

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

__all__ = ["Wait", "waits", "weight_lags"]


class Wait(NamedTuple):
    """``(kind, stage)`` of micro-batch ``m`` waits for ``(on_kind, on_stage)`` of ``m - lag``."""

    kind: str
    stage: int
    on_kind: str
    on_stage: int
    lag: int


def _holds(
    positions: dict[Action, tuple[int, int]],
    wait: Wait,
    num_micro_batches: int,
    later: dict[int, int] | None = None,
) -> bool:
    """Whether in every iteration the action comes after its wait's in the device's order.
    Iteration ``i`` runs W of micro-batch ``i - later[stage]`` (``weight_lags``), every other
    action of micro-batch ``i``; an iteration without one of the two holds trivially. The
    loop runs ``max(later)`` iterations more, for the last W's."""
    for i in range(num_micro_batches + max((later or {}).values(), default=0)):
        m = i - _later(wait.kind, wait.stage, later)
        m_on = i - wait.lag - _later(wait.on_kind, wait.on_stage, later)
        if not (0 <= m < num_micro_batches and 0 <= m_on < num_micro_batches):
            continue
        a = positions.get(Action(wait.kind, wait.stage, m))
        p = positions.get(Action(wait.on_kind, wait.on_stage, m_on))
        if a is None or p is None or a[0] != p[0] or p[1] >= a[1]:
            return False
    return True


def _later(kind: str, stage: int, later: dict[int, int] | None) -> int:
    """How many iterations after its micro-batch's a loop runs this action (``weight_lags``)."""
    return (later or {}).get(stage, 0) if kind == "W" else 0


def weight_lags(schedule: Schedule) -> dict[int, int]:
    """For each stage whose W(m) its device runs after B(m + j) (zb-h1: j = the stage's
    position, K - 1 for the last): j, the most over every m. A loop runs that W in
    iteration m + j, after that B, so that it fills the device's wait as the schedule
    places it; what it reads waits in a TensorList until then (``micro_batch_loop``)."""
    found: dict[int, int] = {}
    for order in schedule.orders:
        latest_b: dict[int, int] = {}  # stage -> the latest micro-batch whose B ran so far
        for a in order:
            if a.kind == "B":
                latest_b[a.stage] = max(latest_b.get(a.stage, -1), a.micro_batch)
            elif a.kind == "W" and latest_b.get(a.stage, -1) > a.micro_batch:
                found[a.stage] = max(found.get(a.stage, 0), latest_b[a.stage] - a.micro_batch)
    return found


def waits(schedule: Schedule, later: dict[int, int] | None = None) -> list[Wait]:
    """The waits across micro-batches that ``schedule``'s device orders keep in a loop;
    with ``later`` (``weight_lags``), lags count iterations, W(m) running in iteration
    ``m + later[stage]``.

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

    def iteration(a: Action) -> int:
        return a.micro_batch + _later(a.kind, a.stage, later)

    # Each action after the one before it on its device, where that one runs in the same or
    # an earlier iteration; the smallest lag that holds for every iteration.
    lags: dict[tuple[str, int, str, int], int] = {}
    for order in schedule.orders:
        for before, action in itertools.pairwise(order):
            lag = iteration(action) - iteration(before)
            key = (action.kind, action.stage, before.kind, before.stage)
            if lag >= 0 and key[:2] != key[2:]:
                lags[key] = max(lags.get(key, 0), lag)
    for (kind, s, on_kind, on_s), lag in sorted(lags.items()):
        while lag < M and not _holds(positions, Wait(kind, s, on_kind, on_s, lag), M, later):
            lag += 1
        if lag < M:
            found.append(Wait(kind, s, on_kind, on_s, lag))
    return found
