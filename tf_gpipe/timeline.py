"""Record what each device did during a real training step, and draw it.

The engine inserts a host-side marker (a ``tf.py_function`` that reads the
clock) before and after every action, and after each recomputation; the
markers sit in the device's control-dependency chain, so they see the real
order and timing. Markers add a host round trip per action: use them to look
at a schedule, not while measuring peak speed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

__all__ = ["Recorder", "Span", "live_stashes", "record", "save_chrome_trace", "save_gantt"]


@dataclass(frozen=True)
class Span:
    """One busy interval of one device, in seconds since the first marker of the step."""

    device: int
    kind: str  # "F" forward, "R" recomputation, "B" backward (input gradient only when "W" is split off), "W"
    stage: int
    micro_batch: int
    start: float
    end: float


class Recorder:
    """Collects timestamped markers from the training step and turns them into spans."""

    def __init__(self) -> None:
        self._events: list[tuple[float, int, str]] = []
        self._lock = threading.Lock()
        self._tokens: dict[int, tf.Variable] = {}

    def marker(self, label: Any, device: int, deps: Sequence[tf.Tensor]) -> tf.Tensor:
        """A tensor that, when computed (after ``deps``), logs ``label`` with the time."""
        deps = [d for d in deps if d is not None]
        # tf.function orders stateful ops without resource inputs all in one chain, which
        # would serialize the devices; reading a per-device variable confines each marker's
        # ordering to its own device.
        token = self._token(device)
        with tf.control_dependencies(deps):
            if isinstance(label, tf.Tensor):  # one trace of a stage function serves every micro-batch
                return tf.py_function(
                    lambda _, name: self._log(name.numpy().decode(), device),
                    [token.handle, label],
                    Tout=tf.float64,
                    name="timeline_marker",
                )
            return tf.py_function(
                lambda _: self._log(label, device), [token.handle], Tout=tf.float64, name="timeline_marker"
            )

    def _token(self, device: int) -> tf.Variable:
        if device not in self._tokens:
            with tf.init_scope():
                self._tokens[device] = tf.Variable(0, name=f"timeline_device{device}", trainable=False)
        return self._tokens[device]

    def _log(self, label: str, device: int) -> float:
        t = time.perf_counter()
        with self._lock:
            self._events.append((t, device, label))
        return t

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    @property
    def events(self) -> list[tuple[float, int, str]]:
        with self._lock:
            return sorted(self._events)

    def steps(self) -> list[list[Span]]:
        """Spans per recorded training step (a step starts at each F0 of stage 0)."""
        events = self.events
        starts = [i for i, (_, _, label) in enumerate(events) if label == "start F0@s0"]
        bounds = starts + [len(events)]
        return [self._spans(events[a:b]) for a, b in itertools.pairwise(bounds)]

    @staticmethod
    def _spans(events: list[tuple[float, int, str]]) -> list[Span]:
        if not events:
            return []
        t0 = events[0][0]
        open_at: dict[str, tuple[float, int]] = {}
        spans = []
        for t, device, label in events:
            phase, tag = label.split(" ", 1)
            kind, rest = tag[0], tag[1:]
            m_text, s_text = rest.split("@s")
            m, s = int(m_text), int(s_text)
            if phase == "start":
                open_at[tag] = (t - t0, device)
            elif phase == "replayed":
                begin, dev = open_at.pop(tag)
                spans.append(Span(dev, "R", s, m, begin, t - t0))
                open_at[tag] = (t - t0, dev)
            elif phase == "end" and tag in open_at:
                begin, dev = open_at.pop(tag)
                spans.append(Span(dev, kind, s, m, begin, t - t0))
        return sorted(spans, key=lambda sp: (sp.device, sp.start))


def live_stashes(spans: Sequence[Span]) -> dict[int, int]:
    """Peak number of micro-batches per device whose forward ended and last backward pass did not.

    That is the number of stage inputs the device holds for its backward passes:
    a stash is freed by its backward ``B``, or by its ``W`` when the schedule
    splits the weight gradient off (``W`` reads the stash too).
    """
    split = {sp.device for sp in spans if sp.kind == "W"}
    events = []
    for sp in spans:
        if sp.kind == "F":
            events.append((sp.end, 1, sp.device))
        elif sp.kind == ("W" if sp.device in split else "B"):
            events.append((sp.end, -1, sp.device))
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for _, delta, device in sorted(events, key=lambda e: (e[0], e[1])):
        live[device] = live.get(device, 0) + delta
        peak[device] = max(peak.get(device, 0), live[device])
    return peak


@contextlib.contextmanager
def record(model: Any) -> Iterator[Recorder]:
    """Record a timeline of every ``fit``/``train_on_batch`` step run inside the block.

    Example:

    ```python
    with tf_gpipe.timeline.record(model) as rec:
        model.fit(x, y, epochs=1)
    tf_gpipe.timeline.save_chrome_trace(rec.steps()[-1], "trace.json")
    ```
    """
    recorder = Recorder()
    model.tracer = recorder
    model.train_function = None  # retrace with the markers in
    try:
        yield recorder
    finally:
        model.tracer = None
        model.train_function = None


def save_chrome_trace(spans: Sequence[Span], path: str, device_names: Sequence[str] | None = None) -> None:
    """Write spans as Chrome-trace JSON (open in Perfetto or chrome://tracing)."""
    names = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradient"}
    events = []
    for sp in spans:
        events.append(
            {
                "name": f"{sp.kind}{sp.micro_batch}",
                "cat": names[sp.kind],
                "ph": "X",
                "ts": sp.start * 1e6,
                "dur": max(sp.end - sp.start, 0.0) * 1e6,
                "pid": 0,
                "tid": sp.device,
                "args": {"stage": sp.stage, "micro_batch": sp.micro_batch},
            }
        )
    devices = sorted({sp.device for sp in spans})
    for d in devices:
        label = device_names[d] if device_names and d < len(device_names) else f"device {d}"
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": label}})
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def save_gantt(
    spans: Sequence[Span], path: str, title: str = "", device_names: Sequence[str] | None = None
) -> None:
    """Draw spans as a Gantt chart PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4C72B0", "R": "#DD8452", "B": "#55A868", "W": "#8172B3"}
    names = {"F": "forward", "R": "recompute", "B": "backward", "W": "weight gradient"}
    devices = sorted({sp.device for sp in spans})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(devices) + 1.4))
    for sp in spans:
        ax.barh(
            sp.device,
            (sp.end - sp.start) * 1e3,
            left=sp.start * 1e3,
            color=colors[sp.kind],
            edgecolor="black",
            linewidth=0.4,
        )
        width = (sp.end - sp.start) * 1e3
        if width > 0:
            ax.text(
                sp.start * 1e3 + width / 2,
                sp.device,
                f"{sp.kind}{sp.micro_batch}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(devices)
    ax.set_yticklabels([device_names[d] if device_names else f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.margins(x=0.09)  # room for the legend after the last spans
    ax.set_xlabel("time (ms)")
    shown = [k for k in colors if k in {sp.kind for sp in spans}]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in shown]
    ax.legend(handles, [names[k] for k in shown], loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
