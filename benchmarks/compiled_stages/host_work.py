"""Host work of one GPipe training step whose actions cost next to nothing.

Every stage is one ``SerialWork`` layer (benchmarks/serial_device.py) holding its device
for ``--forward_ms`` (backward: twice that), so a step's time is the machinery's. One
step runs under TensorFlow's profiler; the table counts its events by name: ``Process``
(one per executor node batch), ``_Send`` (a tensor or a loop's predicate crossing
devices), ``PartitionedCallOp`` (a function call), and the time inside the step function.
Then ``--steps`` unprofiled steps give the median step time. ``--root`` picks the
checkout whose ``tf_gpipe`` is measured (an older snapshot: ``git archive``), so two
engines can be compared on one machine:

    python benchmarks/compiled_stages/host_work.py --stages=8 --micro_batches=8
    python benchmarks/compiled_stages/host_work.py --root=/tmp/snapshot_of_93f9809

Results: benchmarks/compiled_stages/README.md. Never run by the tests.
"""

from __future__ import annotations

import collections
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: serial_device

FLAGS = flags.FLAGS
flags.DEFINE_string("root", os.path.dirname(os.path.dirname(HERE)), "Checkout whose tf_gpipe is measured.")
flags.DEFINE_integer("stages", 8, "K.")
flags.DEFINE_integer("micro_batches", 8, "M.")
flags.DEFINE_float("forward_ms", 0.05, "Cost of one stage's forward action; backward: twice that.")
flags.DEFINE_string("micro_batch_loops", "auto", "PipelineModel(micro_batch_loops=...): auto, true or false.")
flags.DEFINE_integer("steps", 7, "Unprofiled steps timed after the profiled one (median reported).")
flags.DEFINE_integer("top", 12, "Event names listed.")


def main(_):
    sys.path.insert(0, FLAGS.root)
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K, M = FLAGS.stages, FLAGS.micro_batches
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    work = [sd.SerialWork(s, FLAGS.forward_ms, 2 * FLAGS.forward_ms, name=f"serial_s{s}") for s in range(K)]
    kwargs = {}
    if FLAGS.micro_batch_loops != "auto":  # an engine older than the option takes none
        kwargs["micro_batch_loops"] = FLAGS.micro_batch_loops == "true"
    model = tf_gpipe.PipelineModel(
        [keras.layers.InputLayer(shape=(4,))] + work,
        num_stages=K,
        num_micro_batches=M,
        remat="always",
        **kwargs,
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    x = tf.constant(np.random.default_rng(0).standard_normal((M, 4), dtype=np.float32))
    model.train_on_batch(x, x)
    model.train_on_batch(x, x)
    logdir = tempfile.mkdtemp(prefix="host_work_")
    tf.profiler.experimental.start(logdir)
    model.train_on_batch(x, x)
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0], "rb") as f:
        space.ParseFromString(f.read())
    shutil.rmtree(logdir, ignore_errors=True)
    count, ms = collections.Counter(), collections.Counter()
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "?").split(":")[-1]
                count[name] += 1
                ms[name] += event.duration_ps / 1e9
    times = []
    for _ in range(FLAGS.steps):
        t0 = time.perf_counter()
        model.train_on_batch(x, x)
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"# host work, K={K} M={M}, tf_gpipe from {FLAGS.root}, loops={FLAGS.micro_batch_loops}")
    print(f"median step (unprofiled, {FLAGS.steps} steps): {statistics.median(times):.1f} ms")
    print("| event | count | ms (profiled step) |\n|---|---|---|")
    for name in ["Process", "_Send", "PartitionedCallOp", "one_step_on_data"]:
        print(f"| {name} | {count[name]} | {ms[name]:.1f} |")
    print(f"(all events: {sum(count.values())}; most frequent: {count.most_common(FLAGS.top)})")


if __name__ == "__main__":
    app.run(main)
