"""Peak training memory of the GPipe and 1F1B schedules as the number of micro-batches grows.

With remat="always" a device stashes one stage input per micro-batch between its forward
and backward: GPipe holds all M, 1F1B at most K - d on device d. At a fixed micro-batch
size GPipe's peak should grow with M and 1F1B's flatten once M >= K. One fresh child process
per (variant, M, schedule) reports TensorFlow's allocator peak during a steady step, the RSS
peak above the built model and, recorded with ``tf_gpipe.timeline``, the stashes per device.
Variants: ``stock``, and ``no_arith_opt`` (Grappler's arithmetic optimizer off). Method,
command and results: benchmarks/schedules/README.md, section 2. Writes
--out/schedule_memory.{json,png} and --image. Never run by the tests.
"""

from __future__ import annotations

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
flags.DEFINE_bool("record", True, "Record one more step with tf_gpipe.timeline and count stashes.")
flags.DEFINE_integer(
    "mmap_threshold",
    256 * 1024,
    "MALLOC_MMAP_THRESHOLD_ for the children, bytes (0: leave glibc's dynamic default).",
)
flags.DEFINE_list("variants", ["stock", "no_arith_opt"], "Variants to run (see the docstring).")
flags.DEFINE_list(
    "grappler_off",
    [],
    "Grappler optimizers to switch off in the children, e.g. arithmetic_optimization "
    "(tf.config.optimizer.set_experimental_options({name: False})).",
)
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string(
    "image",
    os.path.join(harness.REPO_ROOT, "docs", "images", "schedule_memory.png"),
    "Also save the plot here (for benchmarks/schedules/README.md); empty: only --out.",
)
# child mode
flags.DEFINE_bool("child", False, "Internal: run one configuration and print a RESULT line.")
flags.DEFINE_integer("m", 1, "Internal (child): M.")
flags.DEFINE_string("schedule", "gpipe", "Internal (child): schedule.")

MiB = harness.MiB


def make_layers(keras, K: int):
    layers = [keras.layers.InputLayer(shape=(FLAGS.input_dim,))]
    for s in range(K):
        layers.append(keras.layers.Dense(FLAGS.bottleneck, activation="relu", name=f"narrow{s}"))
        if s < K - 1:
            layers.append(keras.layers.Dense(FLAGS.width, activation="relu", name=f"wide{s}"))
        else:
            layers.append(keras.layers.Dense(10, name="head"))
    return layers


def stash_model_mib(peaks, K: int) -> float:
    """Stashed bytes predicted from per-device peak stash counts (device 0 stashes input rows)."""
    per = FLAGS.micro_batch * 4 / MiB
    return sum(p * per * (FLAGS.input_dim if d == 0 else FLAGS.width) for d, p in enumerate(peaks))


def child() -> None:
    import gc
    import resource

    import tf_gpipe

    K, M = FLAGS.stages, FLAGS.m
    tf_gpipe.configure_virtual_cpus(K)  # before any TF op
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if FLAGS.grappler_off:
        tf.config.optimizer.set_experimental_options({name: False for name in FLAGS.grappler_off})
    keras.utils.set_random_seed(0)
    model = tf_gpipe.PipelineModel(
        make_layers(keras, K),
        num_stages=K,
        num_micro_batches=M,
        remat=FLAGS.remat,
        schedule=FLAGS.schedule,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    n = M * FLAGS.micro_batch
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x = tf.constant(rng.standard_normal((n, FLAGS.input_dim), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, n), dtype=tf.int32)
    weights_mib = sum(int(np.prod(v.shape)) * 4 for v in model.weights) / MiB
    gc.collect()
    rss_build = harness.vm("VmRSS")

    t0 = time.perf_counter()
    losses = [float(model.train_on_batch(x, y))]  # traces
    first_s = time.perf_counter() - t0
    gc.collect()
    rss_before = harness.vm("VmRSS")
    tf_base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    step_times = []
    for _ in range(max(FLAGS.steps - 1, 1)):
        t0 = time.perf_counter()
        losses.append(float(model.train_on_batch(x, y)))
        step_times.append(time.perf_counter() - t0)
    tf_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    plan = tf_gpipe.schedules.get(FLAGS.schedule, K, M)
    result = dict(
        K=K,
        M=M,
        schedule=FLAGS.schedule,
        remat=FLAGS.remat,
        batch=n,
        grappler_off=list(FLAGS.grappler_off),
        rss_total_MiB=(ru_maxrss - rss_build) / MiB,
        tf_peak_MiB=(tf_peak - tf_base) / MiB,
        rss_build_MiB=rss_build / MiB,
        rss_before_MiB=rss_before / MiB,
        tf_base_MiB=tf_base / MiB,
        weights_MiB=weights_mib,
        peak_in_flight=plan.peak_in_flight(),
        stash_model_MiB=stash_model_mib(plan.peak_in_flight(), K),
        first_step_s=first_s,
        step_s=min(step_times),
        losses=losses,
    )
    if FLAGS.record:
        with tf_gpipe.timeline.record(model) as rec:
            model.train_on_batch(x, y)
        spans = rec.steps()[-1]
        live = tf_gpipe.timeline.live_stashes(spans)
        result["live_stashes"] = [live.get(d, 0) for d in range(K)]
    harness.emit(result)


VARIANTS = {"stock": [], "no_arith_opt": ["arithmetic_optimization"]}


def parent() -> None:
    K = FLAGS.stages
    skip = ("child", "m", "schedule", "grappler_off")
    load_start = harness.header("tf_gpipe schedule memory benchmark: GPipe vs 1F1B stashes", __name__, skip)
    stash = FLAGS.micro_batch * FLAGS.width * 4 / MiB
    print(
        f"- model: K={K} stages of Dense({FLAGS.bottleneck}, relu) -> Dense({FLAGS.width}, relu) "
        f"(last: Dense({FLAGS.bottleneck}, relu) -> Dense(10)), input dim {FLAGS.input_dim}, "
        f"remat={FLAGS.remat}, SGD; micro-batch {FLAGS.micro_batch} examples, batch = M x "
        f"{FLAGS.micro_batch}; one stash (micro_batch x width float32) = {stash:.2f} MiB\n",
        flush=True,
    )
    env = harness.child_env(FLAGS.mmap_threshold)
    results, loads = [], [load_start]
    t_all = time.perf_counter()
    for variant in FLAGS.variants:
        off = VARIANTS[variant]
        for M in map(int, FLAGS.micro_batches):
            for name in FLAGS.schedules:
                args = [
                    "--child",
                    f"--m={M}",
                    f"--schedule={name}",
                    *harness.flag_args(("stages", "micro_batch", "width", "bottleneck", "input_dim")),
                    *harness.flag_args(("remat", "steps")),
                    f"--record={FLAGS.record and variant == 'stock'}",
                    f"--grappler_off={','.join(off)}",
                ]
                t0 = time.perf_counter()
                proc, lines = harness.run_child(__file__, args, env)
                loads.append(harness.loadavg())
                if proc.returncode != 0 or not lines:
                    print(f"M={M} {name} {variant}: child failed (rc={proc.returncode})")
                    print(proc.stderr[-3000:])
                    continue
                r = lines[0]
                r["variant"] = variant
                r["wall_s"] = time.perf_counter() - t0
                results.append(r)
                print(
                    f"{variant:12s} M={M:2d} {name:6s} RSS-after-build={r['rss_total_MiB']:7.1f} MiB "
                    f"TF-alloc={r['tf_peak_MiB']:7.1f} MiB stash model={r['stash_model_MiB']:6.1f} MiB "
                    f"live_stashes={r.get('live_stashes')} step={r['step_s']:.2f}s wall={r['wall_s']:.0f}s",
                    flush=True,
                )

    headers = [
        "M",
        "batch",
        "schedule",
        "RSS peak - after build MiB",
        "TF alloc peak MiB",
        "stash model MiB",
        "TF alloc - stash model MiB",
        "live_stashes per device (timeline)",
        "peak_in_flight per device",
        "step s",
    ]
    for variant in FLAGS.variants:
        rows = []
        for r in results:
            if r["variant"] != variant:
                continue
            rows.append(
                [
                    r["M"],
                    r["batch"],
                    r["schedule"],
                    f"{r['rss_total_MiB']:.0f}",
                    f"{r['tf_peak_MiB']:.0f}",
                    f"{r['stash_model_MiB']:.0f}",
                    f"{r['tf_peak_MiB'] - r['stash_model_MiB']:.0f}",
                    " ".join(map(str, r.get("live_stashes", []))) or "-",
                    " ".join(map(str, r["peak_in_flight"])),
                    f"{r['step_s']:.2f}",
                ]
            )
        if rows:
            print(f"\n## variant {variant} (Grappler options off: {VARIANTS[variant] or 'none'})\n")
            print(harness.md_table(headers, rows))
    load_end = harness.loadavg()
    print(f"\n- loadavg at end: {load_end}; total wall {time.perf_counter() - t_all:.0f} s")
    harness.save_json(
        os.path.join(FLAGS.out, "schedule_memory.json"),
        dict(env=harness.env_lines(), tf_gpipe=harness.tf_gpipe_line(), load_start=load_start,
             load_end=load_end, loads=loads, flags=harness.flag_values(__name__, skip), results=results),
    )  # fmt: skip
    _plot(results, os.path.join(FLAGS.out, "schedule_memory.png"))


def _plot(results, path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    panels = (
        ("tf_peak_MiB", "TF CPU allocator peak during a step - before it"),
        ("rss_total_MiB", "ru_maxrss - RSS after build (includes the trace)"),
    )
    colors = {"gpipe": "tab:blue", "1f1b": "tab:orange"}
    styles = {"stock": "-", "no_arith_opt": "--"}
    for ax, (key, title) in zip(axes, panels):
        for name, color in colors.items():
            for variant, style in styles.items():
                pts = sorted(
                    (r["M"], r[key]) for r in results if r["schedule"] == name and r["variant"] == variant
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        marker="o",
                        color=color,
                        label=f"{name}, {variant}",
                    )
            model = sorted({(r["M"], r["stash_model_MiB"]) for r in results if r["schedule"] == name})
            if model and key == "tf_peak_MiB":
                ax.plot(
                    [p[0] for p in model],
                    [p[1] for p in model],
                    ":",
                    color=color,
                    lw=2,
                    label=f"{name}, stash model",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (micro-batches of a fixed size; batch = M x micro_batch)")
        ax.set_ylabel("MiB")
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
        child()
    else:
        parent()


if __name__ == "__main__":
    app.run(main)
