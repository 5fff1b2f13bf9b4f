"""The chosen plan, its report, and the message when nothing fits the memory budget."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tf_gpipe import schedules
from tf_gpipe.model import PipelineModel
from tf_gpipe.plan.predict import UpdateCost, split_seconds, static_bytes
from tf_gpipe.plan.profile import ModelProfile
from tf_gpipe.plan.search import Candidate, remat_flags

__all__ = ["Plan", "PlanError"]

MiB = 2.0**20


def _mib(b: float) -> str:
    return f"{b / MiB:,.2f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return [lines[0], "-" * len(lines[0])] + lines[1:]


class PlanError(ValueError):
    """Nothing fits the memory budget; ``candidates`` holds every configuration weighed."""

    def __init__(self, message: str, candidates: Sequence[Candidate]):
        super().__init__(message)
        self.candidates = list(candidates)


SETTINGS = ("num_stages", "balance", "num_micro_batches", "devices", "remat", "schedule", "virtual_stages")


@dataclass
class Plan:
    """What ``tf_gpipe.plan`` chose: pass it as ``PipelineModel(layers, plan=p)``.

    Attributes:
        num_stages, balance, num_micro_batches, remat, schedule, virtual_stages,
            devices: the ``PipelineModel`` arguments it sets (``devices`` is None
            when ``plan`` was given a device count).
        predicted_step_s: simulated seconds per training step.
        predicted_peak_bytes: predicted peak bytes of each device.
        candidates: every configuration weighed, fastest first (``Candidate``).
        memory_budget_bytes, global_batch, optimizer_slots, update: the inputs it planned for.
    """

    chosen: Candidate
    candidates: list[Candidate]
    device_list: list[str] | None  # as given to plan (the chosen K use the first K)
    memory_budget_bytes: float
    global_batch: int
    optimizer_slots: int
    profile: ModelProfile  # the measurements it planned from (for plan_from_profile)
    update: UpdateCost | None = None  # the optimizer update's temporaries it planned with
    shared_host: bool = False  # whether the simulation shared one host's processors among the devices

    num_stages = property(lambda self: self.chosen.num_stages)
    balance = property(lambda self: list(self.chosen.balance))
    num_micro_batches = property(lambda self: self.chosen.num_micro_batches)
    remat = property(lambda self: self.chosen.remat)
    schedule = property(lambda self: self.chosen.schedule)
    virtual_stages = property(lambda self: self.chosen.virtual_stages)
    predicted_step_s = property(lambda self: self.chosen.step_s)
    predicted_peak_bytes = property(lambda self: list(self.chosen.peak_bytes))

    @property
    def devices(self) -> list[str] | None:
        return None if self.device_list is None else self.device_list[: self.chosen.num_stages]

    def _update_note(self) -> str:
        if self.update is None:
            return ""
        u = self.update
        more = f"{u.from_sums:.1f} (M > 1) or {u.from_fresh:.1f} (M = 1)"
        return f"; its update takes {more} weights' worth more"

    def settings(self) -> dict[str, Any]:
        """The ``PipelineModel`` keyword arguments this plan sets."""
        return {name: getattr(self, name) for name in SETTINGS}

    def resolve(self, nodes: bool = False, **given: Any) -> tuple[Any, ...]:
        """``PipelineModel``'s arguments with this plan's settings, in the order of ``SETTINGS``.

        An argument left at ``PipelineModel``'s default takes the plan's value; any
        other must equal it (``devices`` too, unless the plan was made for a count).
        ``nodes``: for ``PipelineModel.from_model``, whose balance counts nodes.
        """
        if self.profile.of_graph and not nodes:
            raise ValueError(
                "tf_gpipe: this plan cuts a functional model's nodes (its balance counts nodes, "
                "not layers); build the model with PipelineModel.from_model(model, plan=p)."
            )
        defaults = {k: p.default for k, p in inspect.signature(PipelineModel.__init__).parameters.items()}
        out = self.settings()
        for name, value in given.items():
            planned = out[name]
            if value is None or value == defaults[name] or (name == "devices" and planned is None):
                continue
            listed = name in ("balance", "devices") and not isinstance(value, str)
            if (list(value) if listed else value) != planned:
                raise ValueError(
                    f"tf_gpipe: {name}={value!r} disagrees with the plan's {name}={planned!r}; "
                    f"drop the argument to use the plan, or drop plan= to choose {name} yourself."
                )
        if out["devices"] is None:
            out["devices"] = given.get("devices")
        return tuple(out[name] for name in SETTINGS)

    def for_nodes(
        self, num_stages: Any, balance: Any, virtual_stages: Any, kwargs: dict
    ) -> tuple[Any, Any, Any]:
        """``PipelineModel.from_model``'s ``(num_stages, balance, virtual_stages)`` with this
        plan's settings (its balance counts the model's nodes); the others it sets go into
        ``kwargs``, the rest of ``from_model``'s arguments."""
        others = [k for k in SETTINGS if k not in ("num_stages", "balance", "virtual_stages")]
        given = {k: kwargs.pop(k) for k in others if k in kwargs}
        found = self.resolve(
            True, num_stages=num_stages, balance=balance, virtual_stages=virtual_stages, **given
        )
        out = dict(zip(SETTINGS, found))
        kwargs.update({k: out[k] for k in others})
        return out["num_stages"], out["balance"], out["virtual_stages"]

    def __repr__(self) -> str:
        return (
            f"Plan({self.chosen.label()}, balance={self.balance}, step {self.predicted_step_s * 1e3:.2f} ms, "
            f"peak {_mib(max(self.predicted_peak_bytes))} MiB/device)"
        )

    def report(self, limit: int | None = 20) -> str:
        """A text table of the candidates weighed, and why the chosen one won.

        Args:
            limit: candidates listed (fastest first, the chosen one always); None: all.

        Returns:
            The report: the choice and the reason, the chosen configuration's stages
            (time, activations and peak memory per device), then the candidates with
            their step time, bubble and largest per-device peak.
        """
        c, budget = self.chosen, self.memory_budget_bytes
        fitting = [x for x in self.candidates if x.fits]
        fastest = self.candidates[0]
        lines = [
            f"Plan: {c.label()}, balance={c.balance}, micro-batches of {c.micro_batch_size} "
            f"(global batch {self.global_batch})",
            f"Predicted: step {c.step_s * 1e3:.2f} ms, bubble {c.bubble:.1%}, peak "
            f"{_mib(c.max_peak)} MiB on the fullest device (budget {_mib(budget)} MiB, "
            f"{self.optimizer_slots} optimizer slot(s) per weight{self._update_note()})",
        ]
        if self.shared_host:
            lines.append(
                "Timed as devices sharing this host's processors (logical CPUs): stages that run at once "
                "share the processors their layers were measured to use"
            )
        why = (
            f"Why: the fastest of the {len(fitting)} of {len(self.candidates)} candidates that fit the budget"
        )
        if fastest is not c:
            why += (
                f"; faster ones do not fit, e.g. {fastest.label()} at {fastest.step_s * 1e3:.2f} ms needs "
                f"{_mib(fastest.max_peak)} MiB"
            )
        rest = [x for x in fitting if x is not c]
        if rest:
            r = rest[0]
            gain = r.step_s / c.step_s - 1 if c.step_s > 0 else 0.0
            why += f"; the next that fits, {r.label()}, is {gain:.1%} slower"
            if r.step_s == c.step_s and r.max_peak != c.max_peak:
                why += f" (a tie: the chosen one needs less memory, {_mib(c.max_peak)} vs "
                why += f"{_mib(r.max_peak)} MiB)"
        lines += [why + ".", "", "Stages of the chosen plan:"]
        flags = remat_flags(c.remat, len(c.balance))
        split = schedules.get(c.schedule, c.num_stages, c.num_micro_batches, c.virtual_stages).split_backward
        rows = [
            ["stage", "device", "layers", "fwd ms", "B+W ms" if split else "bwd ms", "stash MiB/mb",
             "weights+state MiB", "peak MiB"]
        ]  # fmt: skip
        start = 0
        halves = split_seconds(c.stages, flags)
        for s, (size, st) in enumerate(zip(c.balance, c.stages)):
            d = s % c.num_stages
            names = [p.name for p in self.profile.layers[start : start + size]]
            start += size
            shown = names[0] if size == 1 else f"{names[0]}..{names[-1]} ({size})"
            stash = st.input_bytes if flags[s] else st.activation_bytes
            device = self.devices[d] if self.devices else str(d)
            replay = st.forward_s if flags[s] else 0.0
            bwd = f"{(st.backward_s + replay) * 1e3:.3f}"
            if split:
                bwd = f"{halves[0][s] * 1e3:.3f}+{halves[1][s] * 1e3:.3f}"
            rows.append(
                [str(s), device, shown, f"{st.forward_s * 1e3:.3f}", bwd, _mib(stash),
                 _mib(static_bytes(st, self.optimizer_slots, c.num_micro_batches)), _mib(c.peak_bytes[d])]
            )  # fmt: skip
        lines += _table(rows)
        lines += ["", f"Candidates ({len(self.candidates)} weighed, fastest first; * chosen):"]
        shown_c = self.candidates if limit is None else self.candidates[:limit]
        if c not in shown_c:
            shown_c = shown_c + [c]
        rows = [["", "K", "M", "schedule", "remat", "balance", "step ms", "bubble", "peak MiB", "fits"]]
        for x in shown_c:
            sched = x.schedule + (f" v={x.virtual_stages}" if x.virtual_stages > 1 else "")
            rows.append(
                ["*" if x is c else "", str(x.num_stages), str(x.num_micro_batches), sched, x.remat,
                 str(x.balance), f"{x.step_s * 1e3:.2f}", f"{x.bubble:.1%}", _mib(x.max_peak),
                 "yes" if x.fits else "no"]
            )  # fmt: skip
        lines += _table(rows)
        if limit is not None and len(self.candidates) > limit:
            lines.append(f"... {len(self.candidates) - limit} more (report(limit=None) lists all)")
        return "\n".join(lines)


def nothing_fits(
    candidates: Sequence[Candidate],
    budget: float,
    num_devices: int,
    optimizer_slots: int,
    alternatives: Callable[..., list[Candidate]],
    global_batch: int,
    max_devices: int,
) -> PlanError:
    """The error naming what would fit, each option priced by ``alternatives(**changes)``."""
    least = min(candidates, key=lambda x: x.max_peak)
    heaviest = max(range(len(least.peak_bytes)), key=lambda d: least.peak_bytes[d])
    static = sum(
        static_bytes(st, optimizer_slots, least.num_micro_batches)
        for s, st in enumerate(least.stages)
        if s % least.num_stages == heaviest
    )
    lines = [
        f"tf_gpipe: nothing fits memory_budget_bytes={budget:,.0f} ({_mib(budget)} MiB) per device on "
        f"{num_devices} device(s): of {len(candidates)} configurations, the least memory is "
        f"{_mib(least.max_peak)} MiB ({least.label()}, balance={least.balance}), of which weights, gradient "
        f"sums and {optimizer_slots} optimizer slot(s) take {_mib(static)} MiB. What would fit:"
    ]
    found = False
    for k in range(num_devices + 1, max_devices + 1):
        fit = [x for x in alternatives(num_devices=[k]) if x.fits]
        if fit:
            lines.append(f"  - more devices: {k}, e.g. {fit[0].label()} at {_mib(fit[0].max_peak)} MiB")
            found = True
            break
    for changes, what in (
        ({"remats": ("always",)}, "re-materialization"),
        ({"max_micro_batches": global_batch}, "more micro-batches (smaller ones)"),
    ):
        fit = [x for x in alternatives(**changes) if x.fits]
        if fit:
            lines.append(f"  - {what}: {fit[0].label()} at {_mib(fit[0].max_peak)} MiB")
            found = True
    batch = global_batch // 2
    while batch >= 1:
        fit = [x for x in alternatives(global_batch=batch) if x.fits]
        if fit:
            lines.append(
                f"  - a smaller global batch: {batch}, e.g. {fit[0].label()} at {_mib(fit[0].max_peak)} MiB"
            )
            found = True
            break
        batch //= 2
    if not found:
        lines.append(
            f"  - nothing tried here: up to {max_devices} devices, remat='always', one example per "
            "micro-batch; use an optimizer with fewer slots (SGD: 0), or mixed precision"
        )
    return PlanError("\n".join(lines), candidates)
