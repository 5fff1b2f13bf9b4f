"""Record real training steps with tf_gpipe.timeline and draw them: GPipe, 1F1B, interleaved.

K=4 logical CPUs, M=8, each schedule twice: ``SerialWork`` stages (benchmarks/serial_device.py,
remat="never": the schedule itself, in regular boxes) saved as docs/images/timeline_<schedule>.png,
and real Dense compute (remat="always", recomputations shown as "R") saved as
docs/images/timeline_dense_<schedule>.png. Of --steps recorded steps, the one with the median
makespan is drawn (``timeline.save_gantt``) and written as a Chrome trace to
--out/timeline_<name>.json. --per_device_markers re-applies, as a patch, the per-device marker
tokens the library now has (the old workaround; redundant). Command and results:
benchmarks/schedules/README.md, section 3. Never run by the tests.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 4, "K.")
flags.DEFINE_integer("micro_batches", 8, "M.")
flags.DEFINE_integer("virtual_stages", 2, "v for the interleaved schedule.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "Schedules to record.")
flags.DEFINE_float("forward_ms", 20.0, "SerialWork forward cost per stage action.")
flags.DEFINE_float("backward_ms", 40.0, "SerialWork backward cost per stage action.")
flags.DEFINE_integer("width", 2048, "Dense width for the real-compute version.")
flags.DEFINE_integer("micro_batch", 64, "Examples per micro-batch for the real-compute version.")
flags.DEFINE_integer(
    "steps",
    5,
    "Recorded train_on_batch calls; of those after the first (tracing) one, the one "
    "with the median recorded makespan is drawn (a single step can catch a stall on a busy machine).",
)
flags.DEFINE_bool("dense", True, "Also record the real-compute (Dense) version.")
flags.DEFINE_bool(
    "per_device_markers", False, "Work around the serializing timeline markers (see docstring)."
)
flags.DEFINE_bool(
    "stock_demo",
    True,
    "Also save the stock-marker GPipe recording (docs/images/timeline_gpipe_stock_markers.png).",
)
flags.DEFINE_string("images", os.path.join(harness.REPO_ROOT, "docs", "images"), "Directory for the PNGs.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the Chrome traces and JSON.")


@contextlib.contextmanager
def per_device_markers():
    """Temporarily give each timeline marker a per-device dummy resource input (see docstring)."""
    import tensorflow as tf

    from tf_gpipe import timeline

    resources = {}

    def marker(self, label, device, deps):
        deps = [d for d in deps if d is not None]
        if device not in resources:
            with tf.init_scope():
                resources[device] = tf.Variable(0.0, trainable=False, name=f"timeline_device{device}")
        with tf.control_dependencies(deps):
            return tf.py_function(
                lambda *_: self._log(label, device),
                [resources[device].handle],
                Tout=tf.float64,
                name="timeline_marker",
            )

    stock = timeline.Recorder.marker
    timeline.Recorder.marker = marker
    try:
        yield
    finally:
        timeline.Recorder.marker = stock


def main(argv):
    del argv
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K, M = FLAGS.stages, FLAGS.micro_batches
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_gpipe import timeline

    tf.get_logger().setLevel("ERROR")
    os.makedirs(FLAGS.images, exist_ok=True)
    os.makedirs(FLAGS.out, exist_ok=True)
    f, b = FLAGS.forward_ms, FLAGS.backward_ms
    harness.header(
        "tf_gpipe timeline demo", extra=[f"per-device markers workaround: {FLAGS.per_device_markers}"]
    )
    print(flush=True)

    def serial_model(name, v, mode="stateless"):
        layers = [keras.layers.InputLayer(shape=(4,))] + [
            sd.SerialWork(s % K, f / v, b / v, mode=mode, name=f"serial_s{s}") for s in range(K * v)
        ]
        model = tf_gpipe.PipelineModel(
            layers, num_stages=K, num_micro_batches=M, remat="never", schedule=name, virtual_stages=v
        )
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((M, 4), dtype=np.float32))
        return model, x, x

    def dense_model(name, v):
        # 2K layers whatever the schedule (the same work): 2 per stage, 1 per virtual stage when v=2
        layers = [keras.layers.InputLayer(shape=(FLAGS.width,))]
        layers += [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(2 * K - 1)]
        layers.append(keras.layers.Dense(10))
        model = tf_gpipe.PipelineModel(
            layers, num_stages=K, num_micro_batches=M, remat="always", schedule=name, virtual_stages=v
        )
        model.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        rng = np.random.default_rng(0)
        n = M * FLAGS.micro_batch
        x = tf.constant(rng.standard_normal((n, FLAGS.width), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, n), dtype=tf.int32)
        return model, x, y

    def record(model, x, y, fixed):
        ctx = per_device_markers() if fixed else contextlib.nullcontext()
        with ctx, timeline.record(model) as rec:
            times = []
            for _ in range(FLAGS.steps):
                t0 = time.perf_counter()
                model.train_on_batch(x, y)
                times.append(time.perf_counter() - t0)
        steps = rec.steps()
        assert len(steps) == FLAGS.steps, (len(steps), FLAGS.steps)
        later = sorted(steps[1:] or steps, key=lambda sp: max(s.end for s in sp))
        return later[len(later) // 2], times

    summary = []

    def one(kind, name, fixed=FLAGS.per_device_markers, png=None, tag=None):
        v = FLAGS.virtual_stages if name == "interleaved" else 1
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        model, x, y = serial_model(name, v) if kind == "serial" else dense_model(name, v)
        spans, times = record(model, x, y, fixed)
        plan = tf_gpipe.schedules.get(name, K, M, v)
        makespan = max(s.end for s in spans) - min(s.start for s in spans)
        live = timeline.live_stashes(spans)
        stashes = [live.get(d, 0) for d in range(K)]
        sched = name + (f" v={v}" if v > 1 else "")
        chunks = f"; {v} chunks per device, so labels repeat" if v > 1 else ""
        if kind == "serial":
            theory = plan.simulate(f / v, b / v).makespan
            what = f"SerialWork f={f:g} ms, b={b:g} ms per stage, remat=never"
            extra = f"; simulated {theory:.0f} ms"
        else:
            theory = None
            what = f"{2 * K} x Dense({FLAGS.width}), micro-batch {FLAGS.micro_batch}, remat=always"
            extra = ""
        tag = tag or (name if kind == "serial" else f"dense_{name}")
        title = (
            f"{sched}, K={K}, M={M}: {what}\nrecorded step {makespan * 1e3:.0f} ms{extra}; "
            f"stashes per device {stashes}{chunks}"
            + ("" if fixed else "  [stock markers: devices serialized]")
        )
        png = png or os.path.join(FLAGS.images, f"timeline_{tag}.png")
        # save_gantt puts its legend in the upper right, over the last spans of device 0: a
        # margin on the time axis leaves it room.
        import matplotlib

        with matplotlib.rc_context({"axes.xmargin": 0.09}):
            timeline.save_gantt(spans, png, title=title, device_names=[f"CPU:{d}" for d in range(K)])
        trace = os.path.join(FLAGS.out, f"timeline_{tag}.json")
        timeline.save_chrome_trace(spans, trace, device_names=[f"CPU:{d}" for d in range(K)])
        row = dict(
            name=tag,
            schedule=sched,
            kind=kind,
            per_device_markers=fixed,
            recorded_ms=makespan * 1e3,
            simulated_ms=theory,
            step_ms=[t * 1e3 for t in times],
            live_stashes=stashes,
            peak_in_flight=plan.peak_in_flight(),
            png=os.path.relpath(png, harness.REPO_ROOT),
            trace=os.path.relpath(trace, harness.REPO_ROOT),
            spans=len(spans),
        )
        summary.append(row)
        print(
            f"{tag:24s} recorded {row['recorded_ms']:7.1f} ms"
            + (f" (simulated {theory:.0f} ms)" if theory else "")
            + f"  stashes {stashes} (peak_in_flight {row['peak_in_flight']})"
            + f"  -> {row['png']}, {row['trace']}",
            flush=True,
        )
        if kind == "serial" and name == "gpipe" and fixed:
            print("\nsimulated (Schedule.draw, 1 column = one forward):\n" + plan.draw(1, 2) + "\n")

    for name in FLAGS.schedules:
        one("serial", name)
    if FLAGS.dense:
        for name in FLAGS.schedules:
            one("dense", name)
    if FLAGS.stock_demo and FLAGS.per_device_markers and "gpipe" in FLAGS.schedules:
        one(
            "serial",
            "gpipe",
            fixed=False,
            png=os.path.join(FLAGS.images, "timeline_gpipe_stock_markers.png"),
            tag="gpipe_stock_markers",
        )
    harness.save_json(
        os.path.join(FLAGS.out, "timeline_demo.json"),
        dict(
            env=harness.env_lines(),
            tf_gpipe=harness.tf_gpipe_line(),
            loadavg=harness.loadavg(),
            results=summary,
        ),
    )
    print(f"\n- loadavg at end: {harness.loadavg()}")


if __name__ == "__main__":
    app.run(main)
