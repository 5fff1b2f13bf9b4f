"""Record real training steps with tf_gpipe.timeline and draw them: GPipe, 1F1B, interleaved.

K=4 logical CPUs, M=8, each schedule twice: ``SerialWork`` stages (benchmarks/serial_device.py,
remat="never": the schedule itself, in regular boxes) saved as docs/images/timeline_<schedule>.png,
and real Dense compute (remat="always", recomputations shown as "R") saved as
docs/images/timeline_dense_<schedule>.png. Of --steps recorded steps, the one with the median
makespan is drawn (``timeline.save_gantt``) and written as a Chrome trace to
--out/timeline_<name>.json. Command and results: benchmarks/schedules/README.md.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 4, "K.")
flags.DEFINE_integer("micro_batches", 8, "M.")
flags.DEFINE_integer("virtual_stages", 2, "v for the interleaved schedule.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved", "zb-h1"], "Schedules to record.")
flags.DEFINE_float("forward_ms", 20.0, "SerialWork forward cost per stage action.")
flags.DEFINE_float("backward_ms", 40.0, "SerialWork backward cost per stage action.")
flags.DEFINE_integer("width", 2048, "Dense width for the real-compute version.")
flags.DEFINE_integer("micro_batch", 64, "Examples per micro-batch for the real-compute version.")
flags.DEFINE_integer(
    "steps", 5, "Recorded train_on_batch calls; of those after the first, the median is drawn."
)
flags.DEFINE_bool("dense", True, "Also record the real-compute (Dense) version.")
flags.DEFINE_string("images", os.path.join(harness.REPO_ROOT, "docs", "images"), "Directory for the PNGs.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the Chrome traces and JSON.")


def main(argv):
    del argv
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K, M, f, b = FLAGS.stages, FLAGS.micro_batches, FLAGS.forward_ms, FLAGS.backward_ms
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import matplotlib
    import numpy as np
    import tensorflow as tf

    from tf_gpipe import timeline

    tf.get_logger().setLevel("ERROR")
    harness.header("tf_gpipe timeline demo")
    rng = np.random.default_rng(0)
    summary, names = [], [f"CPU:{d}" for d in range(K)]
    for kind, name in [("serial", s) for s in FLAGS.schedules] + [("dense", s) for s in FLAGS.schedules]:
        if kind == "dense" and not FLAGS.dense:
            continue
        v = FLAGS.virtual_stages if name == "interleaved" else 1
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        if kind == "serial":
            if name == "zb-h1":  # its backward in two host calls: B, then W (half of b each)
                from split_serial_work import SplitSerialWork

                layers = [SplitSerialWork(s, f, b, weight_ms=b / 2, name=f"serial_s{s}") for s in range(K)]
            else:
                layers = [sd.SerialWork(s % K, f / v, b / v, name=f"serial_s{s}") for s in range(K * v)]
            layers, remat, loss = [keras.layers.InputLayer(shape=(4,)), *layers], "never", "mse"
            x = y = tf.constant(rng.standard_normal((M, 4), dtype=np.float32))
        else:  # 2K layers whatever the schedule (the same work): 2 per stage, 1 per virtual stage when v=2
            layers = [keras.layers.InputLayer(shape=(FLAGS.width,))]
            layers += [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(2 * K - 1)]
            layers, remat = [*layers, keras.layers.Dense(10)], "always"
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            x = tf.constant(rng.standard_normal((M * FLAGS.micro_batch, FLAGS.width), dtype=np.float32))
            y = tf.constant(rng.integers(0, 10, M * FLAGS.micro_batch), dtype=tf.int32)
        model = tf_gpipe.PipelineModel(
            layers, K, num_micro_batches=M, remat=remat, schedule=name, virtual_stages=v
        )
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss)
        with timeline.record(model) as rec:
            for _ in range(FLAGS.steps):
                model.train_on_batch(x, y)
        steps = rec.steps()
        assert len(steps) == FLAGS.steps, (len(steps), FLAGS.steps)
        later = sorted(steps[1:] or steps, key=lambda sp: max(s.end for s in sp))
        spans = later[len(later) // 2]

        plan = tf_gpipe.schedules.get(name, K, M, v)
        makespan = (max(s.end for s in spans) - min(s.start for s in spans)) * 1e3
        live = timeline.live_stashes(spans)
        stashes = [live.get(d, 0) for d in range(K)]
        sched = name + (f" v={v}" if v > 1 else "")
        split = {"weight_cost": b / 2} if plan.split_backward else {}
        theory = plan.simulate(f / v, b / v, **split).makespan if kind == "serial" else None
        tag, sim = (name, f"; simulated {theory:.0f} ms") if kind == "serial" else (f"dense_{name}", "")
        what = f"SerialWork f={f:g} ms, b={b:g} ms per stage" + (" (B, W: b/2 each)" if split else "")
        what += ", remat=never"
        if kind == "dense":
            what = f"{2 * K} x Dense({FLAGS.width}), micro-batch {FLAGS.micro_batch}, remat=always"
        title = f"{sched}, K={K}, M={M}: {what}\nrecorded step {makespan:.0f} ms{sim}"
        title += f"; stashes per device {stashes}"
        title += f"; {v} chunks per device, so labels repeat" if v > 1 else ""
        png = os.path.join(FLAGS.images, f"timeline_{tag}.png")
        trace = os.path.join(FLAGS.out, f"timeline_{tag}.json")
        # save_gantt puts its legend in the upper right, over the last spans of device 0: a margin on
        # the time axis leaves it room.
        for d in (FLAGS.images, FLAGS.out):
            os.makedirs(d, exist_ok=True)
        with matplotlib.rc_context({"axes.xmargin": 0.09}):
            timeline.save_gantt(spans, png, title=title, device_names=names)
        timeline.save_chrome_trace(spans, trace, device_names=names)
        png, trace = (f"`{os.path.relpath(p, harness.REPO_ROOT)}`" for p in (png, trace))
        simulated = "-" if theory is None else f"{theory:.0f}"
        summary.append([png, sched, f"{makespan:.0f}", simulated, stashes, plan.peak_in_flight(), trace])
        print(*summary[-1], flush=True)
    headers = "picture|schedule|recorded step ms|simulated ms|live_stashes|peak_in_flight|Chrome trace"
    harness.print_table(headers, summary)
    harness.finish("timeline_demo", results=summary)


if __name__ == "__main__":
    app.run(main)
