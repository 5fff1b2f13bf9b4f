"""A schedule's timing: the ``Timeline`` that ``Schedule.simulate`` returns, and the
simulation of devices that share one host's processors (``simulate(host_share=...)``).
Free of TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["Slot", "Timeline"]


class Slot(NamedTuple):
    """Where and when one action ran in a simulated timeline."""

    device: int
    start: float
    end: float


@dataclass
class Timeline:
    """Result of :meth:`Schedule.simulate`: each action's slot and the total time."""

    slots: dict[Any, Slot]  # Action -> where and when it ran
    makespan: float

    def busy(self, device: int) -> float:
        """Total time ``device`` spends computing."""
        return sum(s.end - s.start for s in self.slots.values() if s.device == device)


def simulate_shared(
    schedule: Any,
    cost: dict[str, list[float]],
    segments: dict[str, list[list[tuple[float, float]]]],
    comm_cost: float,
) -> Timeline:
    """``schedule.simulate`` (a ``Schedule``) with the devices sharing one host's processors
    (``host_share``, turned into ``segments``: per kind and stage, ``(fraction of the
    action's time, share)`` pairs)."""
    schedule.validate()  # every action exists once, and the orders do not deadlock
    position = [0] * schedule.num_devices
    running: dict[int, list] = {}  # device -> [action, start, [[seconds alone left, share], ...]]
    slots: dict[Any, Slot] = {}
    now = 0.0

    def ready_at(a: Any, d: int) -> float | None:
        times = []
        for dep in schedule.dependencies(a):
            if dep not in slots:
                return None
            times.append(slots[dep].end + (comm_cost if slots[dep].device != d else 0.0))
        return max(times, default=0.0)

    while True:
        waits = []
        for d in range(schedule.num_devices):
            if d in running or position[d] == len(schedule.orders[d]):
                continue
            a = schedule.orders[d][position[d]]
            at = ready_at(a, d)
            if at is not None and at <= now:
                seconds = float(cost[a.kind][a.stage])
                parts = segments[a.kind][a.stage]
                total = sum(t for t, _ in parts) or 1.0
                left = [[seconds * t / total, f] for t, f in parts if t > 0] or [[seconds, 0.0]]
                running[d] = [a, now, left]
                position[d] += 1
            elif at is not None:
                waits.append(at)
        if not running:
            if not waits:
                break
            now = min(waits)
            continue
        demand = max(1.0, sum(r[2][0][1] for r in running.values()))
        rate = {d: 1.0 / (1.0 - r[2][0][1] + r[2][0][1] * demand) for d, r in running.items()}
        step = min(r[2][0][0] / rate[d] for d, r in running.items())
        step = min([step] + [w - now for w in waits])
        now += step
        for d in list(running):
            r = running[d]
            r[2][0][0] -= rate[d] * step
            if r[2][0][0] <= 1e-12 * max(1.0, now):
                r[2].pop(0)
            if not r[2]:
                slots[r[0]] = Slot(d, r[1], now)
                del running[d]
    return Timeline(slots, max(s.end for s in slots.values()))
