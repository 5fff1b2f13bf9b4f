"""A schedule as plain data: per-device orders of forward/backward actions, and their analysis.

``Schedule`` checks itself (``validate``), orders its actions for graph building
(``topological_order``), and simulates, measures and draws its timing.
Free of TensorFlow.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tf_gpipe.schedules.timing import Slot, Timeline, simulate_shared

__all__ = ["Action", "Schedule"]

Cost = float | Sequence[float]


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: a forward, backward or weight-gradient pass of one micro-batch on one stage.

    ``kind`` is ``"F"`` (forward) or ``"B"`` (backward); a schedule with
    ``split_backward=True`` splits each backward in two: ``"B"`` is then only
    the gradient w.r.t. the stage input (what the previous stage waits for)
    and ``"W"`` the gradient w.r.t. the stage weights (needed only by the
    optimizer update). ``str`` gives the short label ``"F3"``; ``repr`` adds
    the stage, ``"F3@s1"``.
    """

    kind: str  # "F", "B", or "W" (only with split_backward)
    stage: int  # 0..num_virtual_stages-1
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}@s{self.stage}"


@dataclass
class Schedule:
    """Per-device ordered action lists for one training step.

    Stage ``s`` lives on device ``s % num_devices``: with ``virtual_stages = v``
    device ``d`` holds the model chunks (stages) ``d, d+K, ..., d+(v-1)K``.

    With ``split_backward=False`` (gpipe, 1f1b, interleaved) every (stage,
    micro-batch) has an ``F`` and a ``B``, the full backward (input and weight
    gradients). With ``split_backward=True`` (zb-h1) it has ``F``, ``B`` (input
    gradient only) and ``W`` (weight gradient); ``W`` actions exist only then.
    """

    name: str
    num_devices: int
    num_micro_batches: int
    virtual_stages: int
    orders: list[list[Action]]
    split_backward: bool = False

    @property
    def kinds(self) -> str:
        """The action kinds of this schedule: ``"FB"``, or ``"FBW"`` when the backward is split."""
        return "FBW" if self.split_backward else "FB"

    @property
    def num_virtual_stages(self) -> int:
        """Number of stages over all devices: ``num_devices * virtual_stages`` (a
        ``PipelineModel``'s ``num_stages`` is ``num_devices``)."""
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
          (the incoming gradient); ``W(s,m)`` needs ``B(s,m)`` (the gradient
          w.r.t. the stage output that B received, and the stash through B).
        """
        s, m = action.stage, action.micro_batch
        if action.kind == "F":
            return [Action("F", s - 1, m)] if s > 0 else []
        if action.kind == "W":
            return [Action("B", s, m)]
        deps = [Action("F", s, m)]
        if s < self.num_virtual_stages - 1:
            deps.append(Action("B", s + 1, m))
        return deps

    def _expected(self) -> list[Action]:
        S, M = self.num_virtual_stages, self.num_micro_batches
        return [Action(kind, s, m) for kind in self.kinds for s in range(S) for m in range(M)]

    def _run(self) -> tuple[list[Action], dict[int, Action]]:
        """Play the orders: each round every device runs its next action if it is ready.

        Returns the global order reached and, on deadlock, each unfinished
        device's blocked action (empty when everything ran).
        """
        done: set[Action] = set()
        order: list[Action] = []
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
                    kinds = " or ".join(repr(k) for k in self.kinds)
                    hint = (
                        "; 'W' (weight gradient) only exists with split_backward=True"
                        if a.kind == "W" and not self.split_backward
                        else ""
                    )
                    raise ValueError(
                        f"schedule {self.name!r}: device {d} has unknown action {a!r} "
                        f"(kind must be {kinds}, stage < {self.num_virtual_stages}, "
                        f"micro-batch < {self.num_micro_batches}{hint})"
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
        # The costs stay as given (ints stay ints): errors then quote the user's numbers.
        if isinstance(cost, numbers.Real):
            return [cost] * self.num_virtual_stages  # type: ignore[list-item]
        costs = list(cost)  # type: ignore[arg-type]
        if len(costs) != self.num_virtual_stages:
            raise ValueError(
                f"{what} has {len(costs)} entries, expected one per stage "
                f"(num_virtual_stages={self.num_virtual_stages})"
            )
        return costs

    def durations(
        self, forward_cost: Cost = 1.0, backward_cost: Cost = 2.0, weight_cost: Cost | None = None
    ) -> dict[str, list[float]]:
        """Each action kind's time per stage.

        Args:
          forward_cost: time of one forward, a number or one per stage.
          backward_cost: time of one *full* backward (input and weight
            gradients), a number or one per stage, whatever the schedule, so
            that the same costs describe the same work for every schedule.
          weight_cost: the share of ``backward_cost`` that a split schedule's
            ``W`` takes (its ``B`` takes the rest); ``None``: half, as in the
            zero-bubble paper's F = B = W. Ignored when the backward is not split.

        Returns:
          ``{"F": [...], "B": [...]}``, plus ``"W"`` when the backward is split.

        Raises:
          ValueError: for a cost list of the wrong length, or a ``weight_cost``
            outside ``[0, backward_cost]``.
        """
        fwd = self._costs(forward_cost, "forward_cost")
        bwd = self._costs(backward_cost, "backward_cost")
        wgt = [b / 2 for b in bwd] if weight_cost is None else self._costs(weight_cost, "weight_cost")
        for s, (b, w) in enumerate(zip(bwd, wgt)):
            if not 0 <= w <= b:
                raise ValueError(
                    f"weight_cost ({w}) of stage {s} must lie in [0, backward_cost ({b})]: it is the "
                    "weight-gradient share of the full backward; pass backward_cost = B + W"
                )
        if not self.split_backward:
            return {"F": fwd, "B": bwd}
        return {"F": fwd, "B": [b - w for b, w in zip(bwd, wgt)], "W": wgt}

    def simulate(
        self,
        forward_cost: Cost = 1.0,
        backward_cost: Cost = 2.0,
        comm_cost: float = 0.0,
        *,
        weight_cost: Cost | None = None,
        host_share: Cost | Mapping[str, Sequence[Sequence[tuple[float, float]]]] | None = None,
    ) -> Timeline:
        """Event-driven timing of the schedule.

        Each device runs its actions in order; an action starts once its device
        is free and each dependency has ended (plus ``comm_cost`` when that
        dependency ran on another device, i.e. its result had to be sent).

        ``host_share``: for devices that share one host's processors (logical CPUs of one
        machine), the share of those processors an action keeps busy while it runs alone, in
        ``[0, 1]``: a number, one per stage, or per action kind (``"F"``, ``"B"``, ``"W"``) and
        stage a list of ``(fraction of the action's time, share)`` segments run in order
        (an action's layers: a Transformer block's compute between two waits). ``None``: the
        devices share nothing. The rest of an action's time is device-only work (waiting,
        sleeping, another chip). Processor sharing: while the running segments' shares sum
        to ``D > 1``, each one's processor work runs ``D`` times slower, so a segment of
        share ``f`` progresses at ``1 / (1 - f + f * D)`` of its speed alone.

        Args:
          forward_cost: time of one forward, a number or one per stage.
          backward_cost: time of one full backward (B + W when split), a number
            or one per stage.
          comm_cost: transfer time between devices.
          weight_cost: ``W``'s share of ``backward_cost`` (see :meth:`durations`).

        Returns:
          A :class:`Timeline` with every action's ``(device, start, end)``.
        """
        cost = self.durations(forward_cost, backward_cost, weight_cost)
        if host_share is not None:
            if isinstance(host_share, Mapping):
                segments = {
                    k: [[(float(t), float(f)) for t, f in seg] for seg in host_share[k]] for k in cost
                }
            else:
                shares = [float(f) for f in self._costs(host_share, "host_share")]
                segments = {k: [[(1.0, f)] for f in shares] for k in cost}
            for kind, per_stage in segments.items():
                if len(per_stage) != self.num_virtual_stages or not all(
                    0.0 <= f <= 1.0 and t >= 0.0 for seg in per_stage for t, f in seg
                ):
                    raise ValueError(
                        f"host_share for {kind!r} needs one segment list per stage "
                        f"({self.num_virtual_stages}), each share in [0, 1]"
                    )
            if any(f for per_stage in segments.values() for seg in per_stage for _, f in seg):
                return simulate_shared(self, cost, segments, comm_cost)
        free = [0.0] * self.num_devices
        slots: dict[Action, Slot] = {}
        # Any topological order gives the same times: each start is a max over
        # already-computed ends, so this is a longest-path pass over the DAG.
        for a in self.topological_order():
            d = self.device_of(a.stage)
            start = free[d]
            for dep in self.dependencies(a):
                slot = slots[dep]
                start = max(start, slot.end + (comm_cost if slot.device != d else 0))
            end = start + cost[a.kind][a.stage]
            slots[a] = Slot(d, start, end)
            free[d] = end
        return Timeline(slots, max(s.end for s in slots.values()))

    def bubble_fraction(
        self, forward_cost: Cost = 1.0, backward_cost: Cost = 2.0, *, weight_cost: Cost | None = None
    ) -> float:
        """Idle share of the devices: ``1 - busy / (K * makespan)``.

        Args:
          forward_cost: time of one forward, a number or one per stage.
          backward_cost: time of one full backward, a number or one per stage.
          weight_cost: ``W``'s share of ``backward_cost`` (see :meth:`durations`).

        Returns:
          The fraction of device time spent waiting, from :meth:`simulate`.
        """
        t = self.simulate(forward_cost, backward_cost, weight_cost=weight_cost)
        total = self.num_devices * t.makespan
        busy = sum(t.busy(d) for d in range(self.num_devices))
        # One division of (exact) integer-valued sums, so that with integer
        # costs the result equals the closed-form fractions bit for bit.
        return (total - busy) / total

    def peak_in_flight(self) -> list[int]:
        """Per device, the most micro-batches whose stash is held at once.

        A forward stashes its activations; the last pass that reads them frees
        them: ``B``, or ``W`` when the backward is split (the weight gradient
        needs the stage's inputs as much as the input gradient does).

        Returns:
          For each device, walking its own order, the peak number of stashed
          activations (micro-batch, stage) it must hold at once.
        """
        release = "W" if self.split_backward else "B"
        peaks = []
        for actions in self.orders:
            live = peak = 0
            for a in actions:
                live += 1 if a.kind == "F" else -1 if a.kind == release else 0
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def draw(self, forward_cost: int = 1, backward_cost: int = 2, *, weight_cost: int | None = None) -> str:
        """The simulated schedule as a text Gantt chart.

        Args:
          forward_cost: integer time units per forward (a number or one per stage).
          backward_cost: integer time units per full backward (a number or one per stage).
          weight_cost: integer units of ``backward_cost`` that a ``W`` takes
            when the backward is split; ``None``: half.

        Returns:
          One row per device, ``"dev d: "`` then one column per time unit holding
          the running action's label (``F3``, ``B3``, ``W3``; ``F3@s1`` when
          interleaved, since a device then runs several stages) or ``.`` when idle.
        """
        cost = self.durations(forward_cost, backward_cost, weight_cost)
        if any(int(c) != c for costs in cost.values() for c in costs):
            raise ValueError("draw() needs integer costs: one column per time unit")
        t = self.simulate(forward_cost, backward_cost, weight_cost=weight_cost)
        label = str if self.virtual_stages == 1 else repr
        width = max(len(label(a)) for a in t.slots)
        grid = [["."] * int(t.makespan) for _ in range(self.num_devices)]
        for a, slot in t.slots.items():
            for col in range(int(slot.start), int(slot.end)):
                grid[slot.device][col] = label(a)
        rows = [f"dev {d}: " + " ".join(cell.ljust(width) for cell in row) for d, row in enumerate(grid)]
        # Strip the idle padding at line ends so expected pictures survive editors.
        return "\n".join(row.rstrip() for row in rows)
