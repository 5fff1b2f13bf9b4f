"""Peak training memory of the GPipe and 1F1B schedules as the number of micro-batches grows.

With re-materialization (remat="always") a stage keeps only its *input* per
micro-batch between its forward and its backward (the "stash"). GPipe runs
every forward before any backward, so each device stashes all M micro-batches;
1F1B starts backwards after K - d warm-up forwards, so device d never holds
more than K - d. With a FIXED micro-batch size (--micro_batch examples) and
batch = M * micro_batch, GPipe's peak memory should grow linearly with M and
1F1B's should flatten once M >= K.

Model (K=4, 8 layers, 2 per stage, real Dense compute): every stage is
``Dense(--bottleneck, relu) -> Dense(--width, relu)`` (the last stage ends in
``Dense(10)`` instead), on a --input_dim-wide input. So the tensors that cross
stages, and are stashed, are ``micro_batch x width`` floats (2 MiB with the
defaults), while the compute per stage stays small (the narrow bottleneck) and
the input data (input_dim wide) does not dominate. Device 0's stash is the
input micro-batch itself (part of the batch, tiny); devices 1..K-1 stash
``micro_batch x width`` each: the model predicts
``sum_{d>=1} peak_stashes(d) * micro_batch * width * 4`` bytes of stashes,
``(K-1) * M`` for GPipe and ``sum_{d>=1} min(K-d, M)`` for 1F1B.

Each (schedule, M, variant) runs in a fresh subprocess (this script with
``--child``) with ``MALLOC_MMAP_THRESHOLD_`` fixed (--mmap_threshold). Two
measurements:

* ``RSS peak - after build``: ``ru_maxrss`` after all steps minus VmRSS right
  after the model is built and compiled (the brief's definition). Includes the
  first step's tf.function trace, whose graph grows with K*M for both schedules.
* ``TF alloc peak``: TensorFlow's CPU allocator high-water mark over the steps
  after the first (``tf.config.experimental.get_memory_info("CPU:0")``, reset
  first) minus its ``current`` bytes before them: exactly the tensors TF
  allocated during a steady-state step, over all K logical CPUs (they share
  one allocator). This is the number to compare with the stash model.

Variants (--variants):

* ``stock``: TensorFlow's default graph optimizations. Grappler's arithmetic
  optimizer rewrites each variable's chain of per-micro-batch gradient sums
  (``total = total + g_m``, built by tf_gpipe's executor) into one ``AddN`` of
  all M gradients, so every micro-batch's *weight* gradient stays alive until
  the last backward of the step: peak memory grows by about one copy of the
  weights per micro-batch, for both schedules, and hides the stash effect.
* ``no_arith_opt``: the same with
  ``tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})``,
  so the sums run as the backwards finish; what remains is the stashes.

Then each stock child records one more step with ``tf_gpipe.timeline.record``
and reports the stashes per device counted by ``timeline.live_stashes`` (and
the schedule's ``peak_in_flight``, which they must equal).

Run (about 8-10 minutes on 2 busy cores with the defaults):

    cd /work/main && PYTHONPATH=. python3 benchmarks/schedule_memory.py

Writes benchmarks/out/schedule_memory.{json,png} and a copy of the plot to
docs/images/schedule_memory.png (--image). Never run by the tests. Not
timing-based, but other processes on the machine do not change this process's RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # also puts the repo root on sys.path
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
flags.DEFINE_string("out", _common.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string(
    "image",
    os.path.join(_common.REPO_ROOT, "docs", "images", "schedule_memory.png"),
    "Also save the plot here (for benchmarks/SCHEDULES.md); empty: only --out.",
)
# child mode
flags.DEFINE_bool("child", False, "Internal: run one configuration and print a RESULT line.")
flags.DEFINE_integer("m", 1, "Internal (child): M.")
flags.DEFINE_string("schedule", "gpipe", "Internal (child): schedule.")

MiB = 2.0**20


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


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
    rss_build = _vm("VmRSS")

    t0 = time.perf_counter()
    losses = [float(model.train_on_batch(x, y))]  # traces
    first_s = time.perf_counter() - t0
    gc.collect()
    rss_before = _vm("VmRSS")
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
    print("RESULT " + json.dumps(result), flush=True)


VARIANTS = {"stock": [], "no_arith_opt": ["arithmetic_optimization"]}


def parent() -> None:
    load_start = _common.loadavg()
    K = FLAGS.stages
    print("# tf_gpipe schedule memory benchmark: GPipe vs 1F1B stashes\n")
    for line in _common.env_lines():
        print(f"- {line}")
    print(f"- {_common.tf_gpipe_line()}")
    print(f"- loadavg at start: {load_start}")
    ours = [
        f.name
        for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])
        if f.name not in ("child", "m", "schedule", "grappler_off")
    ]
    print("- flags: " + " ".join(f"--{k}={FLAGS[k].value}" for k in ours))
    stash = FLAGS.micro_batch * FLAGS.width * 4 / MiB
    print(
        f"- model: K={K} stages of Dense({FLAGS.bottleneck}, relu) -> Dense({FLAGS.width}, relu) "
        f"(last: Dense({FLAGS.bottleneck}, relu) -> Dense(10)), input dim {FLAGS.input_dim}, "
        f"remat={FLAGS.remat}, SGD; micro-batch {FLAGS.micro_batch} examples, batch = M x "
        f"{FLAGS.micro_batch}; one stash (micro_batch x width float32) = {stash:.2f} MiB\n",
        flush=True,
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), _common.REPO_ROOT) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if FLAGS.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(FLAGS.mmap_threshold)
    results, loads = [], [load_start]
    t_all = time.perf_counter()
    for variant in FLAGS.variants:
        off = VARIANTS[variant]
        for M in map(int, FLAGS.micro_batches):
            for name in FLAGS.schedules:
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    f"--m={M}",
                    f"--schedule={name}",
                    f"--stages={K}",
                    f"--micro_batch={FLAGS.micro_batch}",
                    f"--width={FLAGS.width}",
                    f"--bottleneck={FLAGS.bottleneck}",
                    f"--input_dim={FLAGS.input_dim}",
                    f"--remat={FLAGS.remat}",
                    f"--steps={FLAGS.steps}",
                    f"--record={FLAGS.record and variant == 'stock'}",
                    f"--grappler_off={','.join(off)}",
                ]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
                loads.append(_common.loadavg())
                if proc.returncode != 0 or line is None:
                    print(f"M={M} {name} {variant}: child failed (rc={proc.returncode})")
                    print(proc.stderr[-3000:])
                    continue
                r = json.loads(line[len("RESULT ") :])
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
            print(_common.md_table(headers, rows))
    load_end = _common.loadavg()
    print(f"\n- loadavg at end: {load_end}; total wall {time.perf_counter() - t_all:.0f} s")
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "schedule_memory.json"), "w") as fh:
        json.dump(
            dict(
                env=_common.env_lines(),
                tf_gpipe=_common.tf_gpipe_line(),
                load_start=load_start,
                load_end=load_end,
                loads=loads,
                flags={k: FLAGS[k].value for k in ours},
                results=results,
            ),
            fh,
            indent=1,
        )
    _plot(results, os.path.join(FLAGS.out, "schedule_memory.png"))


def _plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=100)
    if FLAGS.image:
        os.makedirs(os.path.dirname(FLAGS.image), exist_ok=True)
        fig.savefig(FLAGS.image, dpi=100)
        print(f"- wrote {FLAGS.image}")
    plt.close(fig)
    print(f"- wrote {path} and {os.path.splitext(path)[0]}.json")


def main(argv):
    del argv
    if FLAGS.child:
        child()
    else:
        parent()


if __name__ == "__main__":
    app.run(main)
