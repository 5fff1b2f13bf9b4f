"""Does tf_gpipe.plan predict what it chose? Predicted vs measured step time and peak memory.

For an MLP, a Transformer stack and a CNN from keras.applications (MobileNet, alpha 0.25),
each in a fresh child process: plan on K logical CPUs, build ``PipelineModel(layers,
plan=p)``, train a few steps, and compare the measured median step time with
``p.predicted_step_s`` and the CPU allocator's peak with the predicted peak. After every
real layer sits a ``Work`` layer that makes its device a serial resource busy for a known
time per example (benchmarks/serial_device.py's locks), so the logical CPUs behave like
independent devices although they share the cores; the planner profiles those layers
like any other. All logical CPUs share one allocator, so the measured peak is compared
with the predicted peak of the whole process on the simulated timeline
(``predict.process_peak``), not the per-device one; beside it, as a diagnostic, the most the
allocator held at the start or end of any ``Work`` host call. Method and results:
benchmarks/plan/README.md. Never run by the tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator keeps statistics only then

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "models", ["mlp", "transformer", "cnn"], "Models to plan and measure (also: lm, tied_lm, skip_mlp)."
)
flags.DEFINE_integer("devices", 4, "K: logical CPUs offered to the planner.")
flags.DEFINE_integer(
    "batch", 128, "Global batch (small: the Work sleeps, not real compute, should dominate)."
)
flags.DEFINE_float("budget_mib", 1024.0, "Memory budget per device, MiB.")
flags.DEFINE_float("work_ms_per_example", 0.1, "Serial work per example per real layer, forward (ms).")
flags.DEFINE_float("work_fixed_ms", 3.0, "Serial work per call per real layer, forward (ms).")
flags.DEFINE_integer("max_micro_batches", 16, "The largest M the planner tries.")
flags.DEFINE_bool("also_remat", True, "Also measure the fastest fitting candidate of each other remat mode.")
flags.DEFINE_list("schedules", [], "Schedules the planner weighs (default: every one it can run).")
flags.DEFINE_list(
    "also_schedules", [], "Also measure the fastest fitting candidate of each of these schedules."
)
flags.DEFINE_integer("steps", 5, "Timed steps (median), after two untimed ones.")
flags.DEFINE_string("optimizer", "adam", "Optimizer (the planner counts its slots and measures its update).")
flags.DEFINE_integer("repeats", 3, "Timed calls per layer and batch size when profiling.")
flags.DEFINE_float("time_tolerance", 0.15, "PASS when measured/predicted step time is within this.")
flags.DEFINE_float("memory_tolerance", 0.20, "PASS when measured/predicted peak memory is within this.")
flags.DEFINE_bool("child", False, "Internal: run one model, print RESULT lines.")
flags.DEFINE_string("model", "mlp", "Internal (child): the model.")

MiB = harness.MiB
# The language models' vocabulary: a 16384 x 128 table (8 MiB), the largest weight, which the
# tied one's first and last layers share (the untied one has a head of its own).
TIED_VOCAB = 16384
# The most the allocator held at the start or end of any Work host call: what the devices hold
# between layers, without the momentary buffers (a convolution's gradient) that the peak adds
# when they happen to meet across devices (README, "Reading it").
HELD = {"max": 0}


def _work_layer():
    """``Work``: identity whose forward and backward hold their device's lock for a known time."""
    import keras
    import numpy as np
    import serial_device as sd
    import tensorflow as tf

    from tf_gpipe import is_recomputing

    class Work(keras.layers.Layer):
        """``y = x * w``; forward sleeps ``fixed_ms + per_example_ms * n`` on the device it runs
        on, the backward twice that, in two host calls (as benchmarks/schedules/
        split_serial_work.py): one feeding only the input gradient, one only the weight
        gradient, so a split schedule's B pays the first and its W the second, and a full
        backward both. Only scalars pass through the host: the big tensors stay TensorFlow's,
        so the allocator sees them."""

        def __init__(self, fixed_ms: float, per_example_ms: float, **kwargs):
            super().__init__(**kwargs)
            self.fixed_ms, self.per_example_ms = fixed_ms, per_example_ms

        def build(self, input_shape):
            self.w = self.add_weight(shape=(), initializer="ones", name="w")

        def call(self, x):
            probe = tf.zeros(())
            name = probe.device.rsplit(":", 1)
            device = int(name[1]) if len(name) == 2 and name[1].isdigit() else 0
            fixed, per = self.fixed_ms, self.per_example_ms
            forward_kind = "R" if is_recomputing() else "F"

            def host(kind):
                def work(n, *_):
                    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
                    sd._hold(device, fixed + per * int(n), kind)
                    after = tf.config.experimental.get_memory_info("CPU:0")["current"]
                    HELD["max"] = max(HELD["max"], before, after)
                    return np.float32(0.0)

                return work

            def hold(kind, *probe):
                # A data input (one element of each): constant inputs would let Grappler fold the call away.
                t = tf.numpy_function(host(kind), list(probe), Tout=tf.float32, stateful=False)
                t.set_shape(())
                return t

            @tf.custom_gradient
            def run(x, w):
                n, one = tf.shape(x)[0], tf.reshape(x, [-1])[:1]
                y = x * (w + hold(forward_kind, n, one))

                def grad(dy):
                    # Each half reads the forward's output, as SplitSerialWork: a replayed forward
                    # is not pruned from either.
                    probe = (n, tf.reshape(y, [-1])[:1], tf.reshape(dy, [-1])[:1])
                    dx = dy * (w + hold("B", *probe))
                    dw = tf.reduce_sum(dy * x) + hold("W", *probe)
                    return dx, dw

                return y, grad

            return run(x, tf.identity(keras.ops.convert_to_tensor(self.w)))

        def compute_output_shape(self, input_shape):
            return input_shape

    return Work


def define_candidate_flags() -> None:
    """The flags naming one candidate (``probe.py``, ``per_device_memory.py``)."""
    flags.DEFINE_string("schedule", "interleaved", "Schedule of the candidate.")
    flags.DEFINE_integer("micro_batches", 4, "M of the candidate.")
    flags.DEFINE_integer("virtual_stages", 2, "v of the candidate (1 unless interleaved).")
    flags.DEFINE_string("remat", "except_last", "Remat mode of the candidate.")
    flags.DEFINE_list("balance", [], "A cut to price and measure instead of the planner's.")


def candidate(prof, update, devices, schedule: str, M: int, v: int, remat: str, balance=()):
    """``(plan, its candidate for (schedule, M, v, remat) on these devices, the schedule,
    the remat flags, the predicted process peak)``: the plan from a kept profile (``probe.py``,
    ``per_device_memory.py``), the candidate priced on ``balance`` instead when given."""
    import dataclasses

    import tf_gpipe
    from tf_gpipe.plan import plan_from_profile, predict
    from tf_gpipe.plan.search import remat_flags

    K = len(devices)
    p = plan_from_profile(prof, devices, FLAGS.budget_mib * 2**20, FLAGS.batch, optimizer_slots=2,
                          update=update, max_micro_batches=FLAGS.max_micro_batches)  # fmt: skip
    wanted = (schedule, M, v, remat, K)
    matching = [
        c
        for c in p.candidates
        if (c.schedule, c.num_micro_batches, c.virtual_stages, c.remat, c.num_stages) == wanted
    ]
    if not matching:
        raise SystemExit("no such candidate: see the plan's report for what it weighed")
    c = matching[0]
    steps = tf_gpipe.schedules.get(c.schedule, K, M, v)
    flags_ = remat_flags(c.remat, K * v)
    if balance:
        cut = [int(b) for b in balance]
        stages = predict.stage_costs(prof, cut, c.micro_batch_size)
        step, bubble, _ = predict.step_time(steps, stages, flags_, p.shared_host)
        peaks = predict.device_memory(steps, stages, flags_, 2, update)
        c = dataclasses.replace(c, balance=cut, stages=stages, step_s=step, bubble=bubble, peak_bytes=peaks)
    process = predict.process_peak(steps, c.stages, flags_, 2, update=update)
    p.chosen = c
    return p, c, steps, flags_, process


def remat_flags_of(c, schedule):
    from tf_gpipe.plan.search import remat_flags

    return remat_flags(c.remat, schedule.num_virtual_stages)


def _layers(name: str, Work):
    import keras

    work = dict(fixed_ms=FLAGS.work_fixed_ms, per_example_ms=FLAGS.work_ms_per_example)
    if name == "mlp":
        body = [keras.layers.Dense(256, activation="relu") for _ in range(6)] + [keras.layers.Dense(10)]
        spec = keras.Input((128,))
    elif name == "transformer":

        class Block(keras.layers.Layer):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.attn = keras.layers.MultiHeadAttention(4, 16)
                self.ff1, self.ff2 = keras.layers.Dense(256, activation="gelu"), keras.layers.Dense(64)
                self.n1, self.n2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()

            def call(self, x):
                x = self.n1(x + self.attn(x, x))
                return self.n2(x + self.ff2(self.ff1(x)))

        body = [keras.layers.Dense(64)] + [Block() for _ in range(4)]
        body += [keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)]
        spec = keras.Input((32, 48))
    elif name == "cnn":
        net = keras.applications.MobileNet(
            input_shape=(32, 32, 3), alpha=0.25, weights=None, classes=10, include_top=True
        )
        body = net.layers[1:]  # MobileNet (v1) is a chain: no skip connections
        spec = keras.Input((32, 32, 3))
    elif name in ("tied_lm", "lm"):  # tied as GPT-2's: the head's matrix is the token embedding's
        embedding = keras.layers.Embedding(TIED_VOCAB, 128)
        body = [embedding] + [keras.layers.Dense(128, activation="gelu") for _ in range(3)]
        head = (
            harness.tied_head(embedding)
            if name == "tied_lm"
            else keras.layers.Dense(TIED_VOCAB, use_bias=False)
        )
        body += [keras.layers.GlobalAveragePooling1D(), head]
        spec = keras.Input((32,), dtype="int32")
    elif name == "skip_mlp":  # functional: planned node by node (each residual add a node)
        inp = h = keras.Input((128,))
        h = Work(name="work_in", **work)(keras.layers.Dense(256)(h))
        for i in range(3):
            inner = Work(name=f"work_{i}", **work)(keras.layers.Dense(256, activation="relu")(h))
            h = keras.layers.Add()([h, inner])  # h skips the block
        return keras.Model(inp, Work(name="work_out", **work)(keras.layers.Dense(10)(h)))
    else:
        raise ValueError(f"unknown model {name!r}")
    layers = [spec]
    for i, layer in enumerate(body):
        layers += [layer, Work(name=f"work_{i}", **work)]
    return layers


def input_shape(layers) -> tuple:
    """The example shape of ``_layers``' list (its ``keras.Input``) or functional model."""
    import keras

    return tuple((layers.inputs[0] if isinstance(layers, keras.Model) else layers[0]).shape[1:])


def build(layers, p):
    """The pipeline of plan ``p``: ``from_model`` for a functional model (a plan of nodes)."""
    import keras

    import tf_gpipe

    if isinstance(layers, keras.Model):
        return tf_gpipe.PipelineModel.from_model(layers, plan=p)
    return tf_gpipe.PipelineModel(layers, plan=p)


def batch(rng, shape):
    """A batch for ``FLAGS.model``: tokens and next-token labels for the language models."""
    import numpy as np
    import tensorflow as tf

    if FLAGS.model in ("tied_lm", "lm"):
        x = tf.constant(rng.integers(0, TIED_VOCAB, (FLAGS.batch,) + shape), dtype=tf.int32)
        return x, tf.constant(rng.integers(0, TIED_VOCAB, FLAGS.batch), dtype=tf.int32)
    x = tf.constant(rng.standard_normal((FLAGS.batch,) + shape, dtype=np.float32))
    return x, tf.constant(rng.integers(0, 10, FLAGS.batch), dtype=tf.int32)


def child() -> None:
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K = FLAGS.devices
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_gpipe.plan import predict
    from tf_gpipe.plan.search import remat_flags

    tf.get_logger().setLevel("ERROR")
    Work = _work_layer()
    keras.utils.set_random_seed(0)
    layers = _layers(FLAGS.model, Work)
    devices = [f"/device:CPU:{i}" for i in range(K)]
    t0 = time.perf_counter()
    p = tf_gpipe.plan(
        layers, None, devices, FLAGS.budget_mib * MiB, FLAGS.batch,
        optimizer=FLAGS.optimizer, max_micro_batches=FLAGS.max_micro_batches, repeats=FLAGS.repeats,
        schedules=FLAGS.schedules or None,
    )  # fmt: skip
    plan_s = time.perf_counter() - t0
    chosen = [p.chosen]
    if FLAGS.also_remat:
        for mode in ("never", "except_last", "always"):
            other = next((c for c in p.candidates if c.fits and c.remat == mode), None)
            if other is not None and other.remat != p.chosen.remat:
                chosen.append(other)
    for name in FLAGS.also_schedules:
        other = next((c for c in p.candidates if c.fits and c.schedule == name), None)
        if other is not None and other not in chosen:
            chosen.append(other)
    shape = input_shape(layers)
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x, y = batch(rng, shape)
    for c in chosen:
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        fresh = _layers(FLAGS.model, Work)
        p.chosen = c  # measure this candidate as if chosen
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model = build(fresh, p)
        model.compile(
            optimizer=FLAGS.optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        model.train_on_batch(x, y)  # traces
        model.train_on_batch(x, y)
        tf.config.experimental.reset_memory_stats("CPU:0")
        HELD["max"] = 0
        times = []
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - t0)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
        flags_ = remat_flags(c.remat, len(c.balance))
        schedule = tf_gpipe.schedules.get(c.schedule, c.num_stages, c.num_micro_batches, c.virtual_stages)
        process = predict.process_peak(schedule, c.stages, flags_, p.optimizer_slots, update=p.update)
        harness.emit(
            dict(
                model=FLAGS.model,
                plan=c.label() + f" balance={c.balance}",
                chosen=c is chosen[0],
                predicted_ms=c.step_s * 1e3,
                measured_ms=statistics.median(times) * 1e3,
                times_ms=[t * 1e3 for t in times],
                predicted_process_MiB=process / MiB,
                predicted_device_MiB=[b / MiB for b in c.peak_bytes],
                measured_MiB=peak / MiB,
                held_MiB=(HELD["max"] - base) / MiB,
                plan_s=plan_s,
                report=p.report(limit=8) if c is chosen[0] else "",
                loadavg=harness.loadavg(),
            )
        )


def parent() -> None:
    harness.header("tf_gpipe.plan: predicted vs measured", __name__, skip=("child", "model"))
    env = harness.child_env()
    passthrough = harness.flag_args(
        ("devices", "batch", "budget_mib", "work_ms_per_example", "work_fixed_ms", "max_micro_batches")
        + ("also_remat", "schedules", "also_schedules", "steps", "optimizer", "repeats")
    )
    results = []
    for name in FLAGS.models:
        for r in harness.stream_child(__file__, ["--child", f"--model={name}", *passthrough], env):
            results.append(r)
            if r["report"]:
                print(r["report"] + "\n")
            print(
                f"{r['model']}: {r['plan']}: step {r['measured_ms']:.1f} ms measured, "
                f"{r['predicted_ms']:.1f} predicted; peak {r['measured_MiB']:.2f} MiB measured, "
                f"{r['predicted_process_MiB']:.2f} predicted (plan took {r['plan_s']:.1f} s)",
                flush=True,
            )

    def verdict(ratio: float, tolerance: float) -> str:
        return "PASS" if abs(ratio - 1.0) <= tolerance else "FAIL"

    rows = []
    for r in results:
        t = r["measured_ms"] / r["predicted_ms"]
        m = r["measured_MiB"] / r["predicted_process_MiB"]
        rows.append(
            [
                r["model"] + (" *" if r["chosen"] else ""),
                r["plan"],
                f"{r['predicted_ms']:.1f}",
                f"{r['measured_ms']:.1f}",
                f"{t:.3f} {verdict(t, FLAGS.time_tolerance)}",
                f"{r['predicted_process_MiB']:.2f}",
                f"{r['measured_MiB']:.2f}",
                f"{m:.3f} {verdict(m, FLAGS.memory_tolerance)}",
                f"{r['held_MiB']:.2f} ({r['held_MiB'] / r['predicted_process_MiB']:.2f})",
                " / ".join(f"{b:.2f}" for b in r["predicted_device_MiB"]),
            ]
        )
    headers = ["model (* chosen)", "plan", "pred. ms", "meas. ms", "time ratio", "pred. MiB", "meas. MiB"]
    headers += ["memory ratio", "at Work calls MiB (ratio)"]
    print()
    print(harness.md_table(headers + ["pred. MiB per device"], rows))
    print(f"\n- loadavg at end: {harness.loadavg()}")


def main(argv):
    del argv
    if FLAGS.child:
        child()
    else:
        parent()


if __name__ == "__main__":
    app.run(main)
