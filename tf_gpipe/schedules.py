"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as plain data, free of TensorFlow."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "clock_cycles",
    "bubble_fraction",
    "SCHEDULES",
    "Action",
    "Schedule",
    "Slot",
    "Timeline",
    "get",
    "gpipe",
    "interleaved",
    "one_f_one_b",
]

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: the forward or backward of one micro-batch on one stage.

    ``str`` gives the short label ``"F3"``; ``repr`` adds the stage, ``"F3@s1"``.
    """

    kind: str  # "F" (forward) or "B" (backward)
    stage: int  # 0..num_stages-1 (virtual stages when interleaved)
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"


class Slot(NamedTuple):
    """Where and when one action ran in a simulated timeline."""

    device: int
    start: float
    end: float


@dataclass
class Timeline:
    """Result of :meth:`Schedule.simulate`: each action's slot and the total time."""

    slots: dict[Action, Slot]
    makespan: float

    def busy(self, device: int) -> float:
        """Total time ``device`` spends computing."""
        return sum(s.end - s.start for s in self.slots.values() if s.device == device)


@dataclass
class Schedule:
    """Per-device ordered action lists for one training step.

    Stage ``s`` lives on device ``s % num_devices``: with ``virtual_stages = v``
    device ``d`` holds the model chunks (stages) ``d, d+K, ..., d+(v-1)K``.
    """

    name: str
    num_devices: int
    num_micro_batches: int
    virtual_stages: int
    orders: list[list[Action]]

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages: ``num_devices * virtual_stages``."""
        return self.num_devices * self.virtual_stages

    def device_of(self, stage: int) -> int:
        """The device that runs ``stage``."""
        return stage % self.num_devices

    def dependencies(self, action: Action) -> list[Action]:
        """The actions whose results ``action`` consumes.

        Args:
          action: any action of this schedule.

        Returns:
          ``F(s,m)`` needs ``F(s-1,m)``; ``B(s,m)`` needs its own forward
          (the stashed activations) and, below the last stage, ``B(s+1,m)``
          (the incoming gradient).
        """
        s, m = action.stage, action.micro_batch
        if action.kind == "F":
            return [Action("F", s - 1, m)] if s > 0 else []
        deps = [Action("F", s, m)]
        if s < self.num_stages - 1:
            deps.append(Action("B", s + 1, m))
        return deps

    def _expected(self) -> list[Action]:
        S, M = self.num_stages, self.num_micro_batches
        return [Action(kind, s, m) for kind in "FB" for s in range(S) for m in range(M)]

    def _run(self) -> tuple[list[Action], dict[int, Action]]:
        """Play the orders: each round every device runs its next action if it is ready.

        Returns the global order reached and, on deadlock, each unfinished
        device's blocked action (empty when everything ran).
        """
        done, order = set(), []
        pos = [0] * self.num_devices
        total = sum(len(o) for o in self.orders)
        while len(order) < total:
            progressed = False
            for d, actions in enumerate(self.orders):
                if pos[d] < len(actions):
                    a = actions[pos[d]]
                    if all(dep in done for dep in self.dependencies(a)):
                        done.add(a)
                        order.append(a)
                        pos[d] += 1
                        progressed = True
            if not progressed:
                stuck = {d: o[pos[d]] for d, o in enumerate(self.orders) if pos[d] < len(o)}
                return order, stuck
        return order, {}

    def validate(self) -> None:
        """Check that the schedule is complete, well placed and deadlock-free.

        Raises:
          ValueError: naming the offending actions if an action is unknown,
            missing, duplicated, placed on the wrong device, or if the device
            orders deadlock (with each stuck device's blocked action).
        """
        self._validated_order()

    def _validated_order(self) -> list[Action]:
        if len(self.orders) != self.num_devices:
            raise ValueError(
                f"schedule {self.name!r} has {len(self.orders)} device orders, "
                f"expected num_devices={self.num_devices}"
            )
        expected = set(self._expected())
        seen: dict[Action, int] = {}
        for d, actions in enumerate(self.orders):
            for a in actions:
                if a not in expected:
                    raise ValueError(
                        f"schedule {self.name!r}: device {d} has unknown action {a!r} "
                        f"(kind must be 'F' or 'B', stage < {self.num_stages}, "
                        f"micro-batch < {self.num_micro_batches})"
                    )
                if a in seen:
                    raise ValueError(
                        f"schedule {self.name!r}: action {a!r} is duplicated "
                        f"(on device {seen[a]} and device {d})"
                    )
                seen[a] = d
                if self.device_of(a.stage) != d:
                    raise ValueError(
                        f"schedule {self.name!r}: action {a!r} is on device {d} but "
                        f"stage {a.stage} lives on device {self.device_of(a.stage)}"
                    )
        missing = [a for a in self._expected() if a not in seen]
        if missing:
            shown = ", ".join(repr(a) for a in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"schedule {self.name!r} is missing actions: {shown}{more}")
        order, stuck = self._run()
        if stuck:
            done = set(order)
            details = "; ".join(
                f"device {d} is stuck at {a!r} waiting for "
                + ", ".join(repr(x) for x in self.dependencies(a) if x not in done)
                for d, a in stuck.items()
            )
            raise ValueError(
                f"schedule {self.name!r} deadlocks after {len(order)} of "
                f"{len(self._expected())} actions: {details}"
            )
        return order

    def topological_order(self) -> list[Action]:
        """One global order consistent with every device's order and all dependencies.

        Returns:
          All actions; building ops in this order never needs a result not yet built.

        Raises:
          ValueError: if the schedule is invalid (see :meth:`validate`).
        """
        return self._validated_order()

    def _costs(self, cost: Cost, what: str) -> list[float]:
        if isinstance(cost, numbers.Real):
            return [cost] * self.num_stages
        costs = list(cost)
        if len(costs) != self.num_stages:
            raise ValueError(
                f"{what} has {len(costs)} entries, expected one per stage (num_stages={self.num_stages})"
            )
        return costs

    def simulate(
        self, forward_cost: Cost = 1.0, backward_cost: Cost = 2.0, comm_cost: float = 0.0
    ) -> Timeline:
        """Event-driven timing of the schedule.

        Each device runs its actions in order; an action starts once its device
        is free and each dependency has ended (plus ``comm_cost`` when that
        dependency ran on another device, i.e. its result had to be sent).

        Args:
          forward_cost: time of one forward, a number or one per stage.
          backward_cost: time of one backward, a number or one per stage.
          comm_cost: transfer time between devices.

        Returns:
          A :class:`Timeline` with every action's ``(device, start, end)``.
        """
        fwd = self._costs(forward_cost, "forward_cost")
        bwd = self._costs(backward_cost, "backward_cost")
        free = [0] * self.num_devices
        slots: dict[Action, Slot] = {}
        # Any topological order gives the same times: each start is a max over
        # already-computed ends, so this is a longest-path pass over the DAG.
        for a in self.topological_order():
            d = self.device_of(a.stage)
            start = free[d]
            for dep in self.dependencies(a):
                slot = slots[dep]
                start = max(start, slot.end + (comm_cost if slot.device != d else 0))
            end = start + (fwd if a.kind == "F" else bwd)[a.stage]
            slots[a] = Slot(d, start, end)
            free[d] = end
        return Timeline(slots, max(s.end for s in slots.values()))

    def bubble_fraction(self, forward_cost: Cost = 1.0, backward_cost: Cost = 2.0) -> float:
        """Idle share of the devices: ``1 - busy / (K * makespan)``.

        Args:
          forward_cost: time of one forward, a number or one per stage.
          backward_cost: time of one backward, a number or one per stage.

        Returns:
          The fraction of device time spent waiting, from :meth:`simulate`.
        """
        t = self.simulate(forward_cost, backward_cost)
        total = self.num_devices * t.makespan
        busy = sum(t.busy(d) for d in range(self.num_devices))
        # One division of (exact) integer-valued sums, so that with integer
        # costs the result equals the closed-form fractions bit for bit.
        return (total - busy) / total

    def peak_in_flight(self) -> list[int]:
        """Per device, the most forwards done whose backward is not yet done.

        Returns:
          For each device, walking its own order, the peak number of stashed
          activations (micro-batch, stage) it must hold at once.
        """
        peaks = []
        for actions in self.orders:
            live = peak = 0
            for a in actions:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def draw(self, forward_cost: int = 1, backward_cost: int = 2) -> str:
        """The simulated schedule as a text Gantt chart.

        Args:
          forward_cost: integer time units per forward (a number or one per stage).
          backward_cost: integer time units per backward (a number or one per stage).

        Returns:
          One row per device, ``"dev d: "`` then one column per time unit holding
          the running action's label (``F3``; ``F3@s1`` when interleaved, since a
          device then runs several stages) or ``.`` when idle.
        """
        costs = self._costs(forward_cost, "forward_cost") + self._costs(backward_cost, "backward_cost")
        if any(int(c) != c for c in costs):
            raise ValueError("draw() needs integer costs: one column per time unit")
        t = self.simulate(forward_cost, backward_cost)
        label = str if self.virtual_stages == 1 else repr
        width = max(len(label(a)) for a in t.slots)
        grid = [["."] * int(t.makespan) for _ in range(self.num_devices)]
        for a, slot in t.slots.items():
            for col in range(int(slot.start), int(slot.end)):
                grid[slot.device][col] = label(a)
        rows = [f"dev {d}: " + " ".join(cell.ljust(width) for cell in row) for d, row in enumerate(grid)]
        # Strip the idle padding at line ends so expected pictures survive editors.
        return "\n".join(row.rstrip() for row in rows)


def _check_sizes(num_devices: int, num_micro_batches: int, virtual_stages: int = 1) -> None:
    sizes = {"num_devices": num_devices, "num_micro_batches": num_micro_batches}
    sizes["virtual_stages"] = virtual_stages
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _build(name: str, K: int, M: int, v: int, orders: list[list[Action]]) -> Schedule:
    schedule = Schedule(name, K, M, v, orders)
    # Cheap, and catches a constructor bug here rather than as a hung executor.
    schedule.validate()
    return schedule


def gpipe(num_devices: int, num_micro_batches: int) -> Schedule:
    """GPipe fill-drain: each device runs all forwards, then all backwards.

    Args:
      num_devices: pipeline depth ``K`` (one stage per device).
      num_micro_batches: ``M``.

    Returns:
      The schedule; every device stashes all ``M`` micro-batches' activations.
    """
    _check_sizes(num_devices, num_micro_batches)
    M = num_micro_batches
    orders = [
        [Action("F", d, m) for m in range(M)] + [Action("B", d, m) for m in range(M)]
        for d in range(num_devices)
    ]
    return _build("gpipe", num_devices, M, 1, orders)


def one_f_one_b(num_devices: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush 1F1B: warm-up forwards, alternate one F / one B, cool-down backwards.

    Device ``d`` runs ``K - d - 1`` warm-up forwards (capped at ``M``): just
    enough that the first backward reaches it as the pipe fills, so it never
    holds more than ``K - d`` micro-batches' activations, against ``M`` for GPipe,
    at the same makespan.

    Args:
      num_devices: pipeline depth ``K`` (one stage per device).
      num_micro_batches: ``M``.

    Returns:
      The schedule.
    """
    _check_sizes(num_devices, num_micro_batches)
    K, M = num_devices, num_micro_batches
    orders = []
    for d in range(K):
        warmup = min(K - d - 1, M)
        order = [Action("F", d, m) for m in range(warmup)]
        for i in range(M - warmup):
            order += [Action("F", d, warmup + i), Action("B", d, i)]
        order += [Action("B", d, m) for m in range(M - warmup, M)]
        orders.append(order)
    return _build("1f1b", K, M, 1, orders)


def interleaved(num_devices: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron-LM interleaved 1F1B: ``v`` model chunks per device.

    Device ``d`` holds stages ``d, d+K, ..., d+(v-1)K``. Its work is a sequence
    of ``v*M`` virtual micro-batches taken in groups of ``K`` micro-batches per
    chunk (chunk 0 for micro-batches 0..K-1, chunk 1 for the same, ..., then
    the next K micro-batches); backwards visit the chunks in reverse. Each
    device runs ``2(K-d-1) + (v-1)K`` warm-up forwards (capped at ``v*M``),
    then alternates one forward and one backward, then drains. The bubble
    shrinks to about ``(K-1)/(v*M+K-1)``. With ``v == 1`` the orders are those
    of :func:`one_f_one_b`.

    Args:
      num_devices: ``K``.
      num_micro_batches: ``M``; must be a multiple of ``K``.
      virtual_stages: ``v``, model chunks per device (stages = ``K*v``).

    Returns:
      The schedule.

    Raises:
      ValueError: if ``M`` is not a multiple of ``K``.
    """
    _check_sizes(num_devices, num_micro_batches, virtual_stages)
    K, M, v = num_devices, num_micro_batches, virtual_stages
    if M % K:
        lower, upper = M - M % K, M - M % K + K
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"interleaved schedule needs num_micro_batches ({M}) to be a multiple of "
            f"num_devices ({K}): use {hint} micro-batches, or the '1f1b' schedule"
        )
    total = v * M

    def action(kind: str, d: int, k: int) -> Action:
        # Virtual micro-batch k: groups of K*v, inside a group K per chunk.
        group, offset = divmod(k, K * v)
        chunk = offset // K
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * K + d, group * K + offset % K)

    orders = []
    for d in range(K):
        if v == 1:
            # A single chunk is plain 1F1B; Megatron's formula below would stash
            # twice the activations for nothing.
            warmup = min(K - d - 1, M)
        else:
            # Megatron-LM's count: (v-1)K forwards fill chunks 0..v-2 so that the
            # last chunk's first micro-batch can start; 2(K-d-1) more (not K-d-1)
            # keep the device busy while results and gradients are in transit,
            # which matters once communication costs time. Megatron also runs
            # every forward first when M == K; that only suits its paired
            # send/receive calls: here it would raise memory at no gain in time.
            warmup = min(2 * (K - d - 1) + (v - 1) * K, total)
        order = [action("F", d, k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [action("F", d, warmup + i), action("B", d, i)]
        order += [action("B", d, k) for k in range(total - warmup, total)]
        orders.append(order)
    return _build("interleaved", K, M, v, orders)


def clock_cycles(num_micro_batches: int, num_stages: int) -> list[list[tuple[int, int]]]:
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
    return [[(t - k, k) for k in range(max(0, t - M + 1), min(t, K - 1) + 1)] for t in range(M + K - 1)]


def bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """Idle share of each device under fill-drain: (K-1)/(M+K-1)."""
    M, K = num_micro_batches, num_stages
    return (K - 1) / (M + K - 1)


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def get(name: str, num_devices: int, num_micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name.

    Args:
      name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``.
      num_devices: ``K``.
      num_micro_batches: ``M``.
      virtual_stages: model chunks per device; only ``"interleaved"`` takes more than 1.

    Returns:
      The schedule.

    Raises:
      ValueError: for an unknown name, or ``virtual_stages != 1`` with a
        non-interleaved schedule.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(repr(n) for n in SCHEDULES)}")
    if name == "interleaved":
        return interleaved(num_devices, num_micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device: virtual_stages must be 1, "
            f"got {virtual_stages!r} (use 'interleaved' for virtual stages)"
        )
    build = gpipe if name == "gpipe" else one_f_one_b
    return build(num_devices, num_micro_batches)
