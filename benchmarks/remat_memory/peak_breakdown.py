"""What is alive at the allocator's peak of one training step, by the op that allocated it.

``remat_memory.py`` gives one number per configuration; this says what makes it up. One
configuration, one process: a first step (traces), then a second step under TensorFlow's
profiler at host tracer level 2, where the BFC allocator logs every allocation and free
(its ``MemoryAllocation`` / ``MemoryDeallocation`` events: address, size, the op, the
bytes in use after it). Replaying those events gives the blocks alive when the bytes in
use peak; they are printed grouped by the op's first name scope and whether it made a
gradient (``stage1_replay``, ``stage1_replay gradients``, ...) and, with ``--blocks``, one
by one. Blocks allocated
before the profiled step (weights, gradient sums, the batch) are in the baseline; those
of them freed before the peak are counted apart. It showed a replay's input gradients
running ahead of its weight gradients, which the gated backward (``gate_gradients=True``) stops.

    TF_CPU_ALLOCATOR_USE_BFC=true python3 benchmarks/remat_memory/peak_breakdown.py \\
        --stages=2 --micro_batches=4 --remat=always

A ``tf_gpipe`` on ``PYTHONPATH`` (a frozen snapshot of another commit) is measured
instead of this checkout's. ``--stages=0`` measures plain ``keras.Sequential``. Needs
TensorFlow's private ``tensorflow.tsl.profiler.protobuf.xplane_pb2`` to read the trace.
"""

from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the allocator that logs its events
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("depth", 32, "Hidden Dense(width, relu) layers (remat_memory.py's model).")
flags.DEFINE_integer("width", 1024, "Units per hidden layer (and input features).")
flags.DEFINE_integer("batch", 4096, "Mini-batch size.")
flags.DEFINE_integer("stages", 2, "K (0: plain keras.Sequential).")
flags.DEFINE_integer("micro_batches", 4, "M.")
flags.DEFINE_string("remat", "always", "remat mode.")
flags.DEFINE_bool("blocks", False, "Also list every live block of 1 MiB or more.")
MiB = harness.MiB


def memory_events(logdir: str) -> list[tuple[int, str, dict]]:
    """The allocator's events in the profile under ``logdir``: ``(time_ns, name, stats)``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names, stat_names = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for ev in line.events:
                name = names[ev.metadata_id].name
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for st in ev.stats:
                    kind = st.WhichOneof("value")
                    value = getattr(st, kind)
                    if kind == "ref_value":  # a string stat: an index into the names
                        value = stat_names[value].name
                    stats[stat_names[st.metadata_id].name] = value
                events.append((line.timestamp_ns + ev.offset_ps // 1000, name, stats))
    return sorted(events, key=lambda e: e[0])


def at_peak(events: list[tuple[int, str, dict]]) -> tuple[int, dict, int]:
    """``(bytes in use at the peak, {address: (bytes, op, shape)} alive then, bytes of blocks
    from before the profile freed by then)``."""
    live: dict = {}
    best: tuple[int, dict, int] = (-1, {}, 0)
    freed_early = 0
    for _, name, st in events:
        addr = st.get("addr")
        if name == "MemoryAllocation":
            live[addr] = (st.get("allocation_bytes", 0), st.get("tf_op") or "?", st.get("shape", ""))
        elif addr in live:
            del live[addr]
        else:
            freed_early += st.get("allocation_bytes", 0)
        if st.get("bytes_allocated", 0) > best[0]:
            best = (st["bytes_allocated"], dict(live), freed_early)
    return best


def group(op: str) -> str:
    """A block's group: the op's first name scope (a stage's forward or replay), and whether
    it is a gradient (``tf.gradients``' ``gradients`` scope, or a tape's) or a gradient sum."""
    parts = [p for p in op.split("/") if p]
    if any(p.startswith("AssignAdd") for p in parts):
        return "gradient sums (AssignAdd)"
    if parts and parts[0] == "gradient_tape":
        return "/".join(parts[1:2]) + " gradients"
    if any(p == "gradients" or p.startswith("gradients_") for p in parts):
        return parts[0] + " gradients"
    return parts[0] if parts else "?"


def main(argv) -> None:
    del argv
    import tf_gpipe

    K, M = FLAGS.stages, FLAGS.micro_batches
    if K > 0:
        tf_gpipe.configure_virtual_cpus(K)  # before any TF op
    import tensorflow as tf

    harness.header(f"Live at the peak: K={K} M={M} remat={FLAGS.remat}")
    model, x, y = harness.dense_stack(K, M, FLAGS.remat, FLAGS.depth, FLAGS.width, FLAGS.batch)
    model.train_on_batch(x, y)  # traces
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0)
    with tempfile.TemporaryDirectory(prefix="peak_breakdown_") as logdir:
        tf.profiler.experimental.start(logdir, options=options)
        model.train_on_batch(x, y)
        tf.profiler.experimental.stop()
        events = memory_events(logdir)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]

    in_use, live, freed_early = at_peak(events)
    groups: collections.Counter = collections.Counter()
    for size, op, _ in live.values():
        groups[group(op)] += size
    print(
        f"\nbaseline (weights, sums, batch: before the step) {base / MiB:.1f} MiB; allocator peak "
        f"{peak / MiB:.1f} MiB ({(peak - base) / MiB:.1f} above the baseline); peak in the events "
        f"{in_use / MiB:.1f} MiB; of the baseline freed by then {freed_early / MiB:.1f} MiB\n"
    )
    rows = [[name, f"{size / MiB:.1f}"] for name, size in groups.most_common() if size >= MiB / 10]
    total = sum(groups.values())
    rows.append(["all blocks allocated in the step and alive at the peak", f"{total / MiB:.1f}"])
    harness.print_table(["allocated by", "MiB alive at the peak"], rows)
    if FLAGS.blocks:
        blocks = sorted(live.values(), key=lambda b: b[1])
        rows = [[op, shape, f"{size / MiB:.1f}"] for size, op, shape in blocks if size >= MiB]
        harness.print_table(["op", "shape", "MiB"], rows, title="\nEvery live block of 1 MiB or more")


if __name__ == "__main__":
    app.run(main)
