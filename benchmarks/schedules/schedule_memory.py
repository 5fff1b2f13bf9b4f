"""Peak training memory of the GPipe and 1F1B schedules as the number of micro-batches grows.

With remat="always" a device stashes one stage input per micro-batch between its forward
and backward: GPipe holds all M, 1F1B at most K - d on device d. At a fixed micro-batch
size GPipe's peak should grow with M and 1F1B's flatten once M >= K. One fresh child process
per (variant, M, schedule) reports TensorFlow's allocator peak during a steady step, the RSS
peak above the built model and, recorded with ``tf_gpipe.timeline``, the stashes per device.
Variants: ``stock``, and ``no_arith_opt`` (Grappler's arithmetic optimizer off). Method,
command and results: benchmarks/schedules/README.md.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 4, "K: pipeline devices (logical CPUs).")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16", "32"], "Values of M.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Schedules to compare.")
flags.DEFINE_integer("micro_batch", 64, "Examples per micro-batch (fixed; batch = M * this).")
flags.DEFINE_integer("width", 8192, "Width of the activations that cross stages (the stashes).")
flags.DEFINE_integer("bottleneck", 128, "Width of the narrow Dense inside each stage.")
flags.DEFINE_integer("input_dim", 32, "Input features.")
flags.DEFINE_string("remat", "always", "remat mode.")
flags.DEFINE_integer("steps", 3, "train_on_batch calls (the first traces and is not sampled).")
flags.DEFINE_bool("record", True, "Record one more step (stock variant) with tf_gpipe.timeline.")
flags.DEFINE_integer("mmap_threshold", 256 * 1024, "MALLOC_MMAP_THRESHOLD_ of the children (0: glibc's).")
flags.DEFINE_list("variants", ["stock", "no_arith_opt"], "Variants to run (see the docstring).")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
IMAGE = os.path.join(harness.REPO_ROOT, "docs", "images", "schedule_memory.png")
flags.DEFINE_string("image", IMAGE, "Also save the plot here (for the README); empty: only --out.")
flags.DEFINE_bool("child", False, "Internal: measure the one (variant, M, schedule) given.")
VARIANTS = {"stock": [], "no_arith_opt": ["arithmetic_optimization"]}  # Grappler optimizers off
MiB = harness.MiB


def child() -> None:
    import gc
    import resource

    import tf_gpipe

    K, M, schedule, variant = FLAGS.stages, int(FLAGS.micro_batches[0]), FLAGS.schedules[0], FLAGS.variants[0]
    tf_gpipe.configure_virtual_cpus(K)  # before any TF op
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if VARIANTS[variant]:
        tf.config.optimizer.set_experimental_options({name: False for name in VARIANTS[variant]})
    keras.utils.set_random_seed(0)
    layers = [keras.layers.InputLayer(shape=(FLAGS.input_dim,))]
    for s in range(K):
        layers.append(keras.layers.Dense(FLAGS.bottleneck, activation="relu", name=f"narrow{s}"))
        layers.append(keras.layers.Dense(10) if s == K - 1 else keras.layers.Dense(FLAGS.width, "relu"))
    model = tf_gpipe.PipelineModel(layers, K, num_micro_batches=M, remat=FLAGS.remat, schedule=schedule)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss)
    n = M * FLAGS.micro_batch
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x = tf.constant(rng.standard_normal((n, FLAGS.input_dim), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, n), dtype=tf.int32)
    gc.collect()
    rss_build = harness.vm("VmRSS")
    losses = [float(model.train_on_batch(x, y))]  # traces
    gc.collect()
    tf_base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    step_times = []
    for _ in range(max(FLAGS.steps - 1, 1)):
        t0 = time.perf_counter()
        losses.append(float(model.train_on_batch(x, y)))
        step_times.append(time.perf_counter() - t0)
    tf_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peaks = tf_gpipe.schedules.get(schedule, K, M).peak_in_flight()
    # Stashed bytes from the peak stash counts (device 0 stashes input rows, the others `width`).
    row_mib = FLAGS.micro_batch * 4 / MiB
    stash = sum(p * row_mib * (FLAGS.width if d else FLAGS.input_dim) for d, p in enumerate(peaks))
    result = dict(K=K, M=M, schedule=schedule, variant=variant, batch=n, peak_in_flight=peaks, losses=losses)
    result.update(rss_total_MiB=(ru_maxrss - rss_build) / MiB, tf_peak_MiB=(tf_peak - tf_base) / MiB)
    result.update(stash_model_MiB=stash, step_s=min(step_times))
    if FLAGS.record and variant == "stock":
        with tf_gpipe.timeline.record(model) as rec:
            model.train_on_batch(x, y)
        live = tf_gpipe.timeline.live_stashes(rec.steps()[-1])
        result["live_stashes"] = [live.get(d, 0) for d in range(K)]
    harness.emit(result)


def plot(results, path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    panels = (("tf_peak_MiB", "TF CPU allocator peak during a step - before it"),
              ("rss_total_MiB", "ru_maxrss - RSS after build (includes the trace)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels):
        for name, color in {"gpipe": "tab:blue", "1f1b": "tab:orange"}.items():
            for variant, style in {"stock": "-", "no_arith_opt": "--"}.items():
                pts = [(r["M"], r[key]) for r in results if r["schedule"] + r["variant"] == name + variant]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{name}, {variant}")
            model = sorted({(r["M"], r["stash_model_MiB"]) for r in results if r["schedule"] == name})
            if model and key == "tf_peak_MiB":
                ax.plot(*zip(*model), ":", color=color, lw=2, label=f"{name}, stash model")
        ax.set(xlabel="M (micro-batches of a fixed size; batch = M x micro_batch)", ylabel="MiB")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"K={FLAGS.stages}, remat={FLAGS.remat}, micro-batch {FLAGS.micro_batch}, stash "
        f"{FLAGS.micro_batch}x{FLAGS.width} float32: peak training memory, GPipe vs 1F1B "
        "(stock TF vs Grappler arithmetic optimization off)",
        fontsize=10,
    )
    fig.tight_layout()
    harness.save_figure(fig, path, FLAGS.image)


def main(argv):
    del argv
    if FLAGS.child:
        return child()
    stash = FLAGS.micro_batch * FLAGS.width * 4 / MiB
    model = (
        f"model: K={FLAGS.stages} stages of Dense({FLAGS.bottleneck}, relu) -> Dense({FLAGS.width}, relu) "
        f"(last: Dense({FLAGS.bottleneck}, relu) -> Dense(10)), input dim {FLAGS.input_dim}, "
        f"remat={FLAGS.remat}, SGD; micro-batch {FLAGS.micro_batch} examples, batch = M x "
        f"{FLAGS.micro_batch}; one stash (micro_batch x width float32) = {stash:.2f} MiB"
    )
    harness.header("tf_gpipe schedule memory benchmark: GPipe vs 1F1B stashes", extra=[model])
    env = harness.child_env(FLAGS.mmap_threshold)
    results = []
    for variant, M, name in itertools.product(FLAGS.variants, FLAGS.micro_batches, FLAGS.schedules):
        results += harness.child(env, micro_batches=[M], schedules=[name], variants=[variant])
    headers = (
        "M|batch|schedule|RSS peak - after build MiB|TF alloc peak MiB|stash model MiB|TF alloc - stash "
        "model MiB|live_stashes per device (timeline)|peak_in_flight per device|step s"
    )
    for variant in FLAGS.variants:
        rows = [
            [r["M"], r["batch"], r["schedule"], f"{r['rss_total_MiB']:.0f}", f"{r['tf_peak_MiB']:.0f}",
             f"{r['stash_model_MiB']:.0f}", f"{r['tf_peak_MiB'] - r['stash_model_MiB']:.0f}",
             " ".join(map(str, r.get("live_stashes", []))) or "-", " ".join(map(str, r["peak_in_flight"])),
             f"{r['step_s']:.2f}"]
            for r in results if r["variant"] == variant
        ]  # fmt: skip
        title = f"## variant {variant} (Grappler options off: {VARIANTS[variant] or 'none'})"
        harness.print_table(headers, rows, title)
    harness.finish("schedule_memory", results=results)
    plot(results, os.path.join(FLAGS.out, "schedule_memory.png"))


if __name__ == "__main__":
    app.run(main)
