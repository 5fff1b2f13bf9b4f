"""One configuration of plan_validation's models, measured closely (a diagnostic, not a validation).

Profiles the model once (the profile and the optimizer update's cost are kept in
``--cache_dir`` and reused), takes the candidate the planner weighed for
``--schedule --micro_batches --virtual_stages --remat`` on 4 devices (or prices the
cut ``--balance`` if given), builds it, runs ``--steps`` steps and prints: the
prediction (process and per device, each stage's bytes), the allocator's peak, the
largest allocator ``current`` read at the start or end of any ``Work`` host call (what
the devices hold, without the momentary buffers between calls), the ``Work`` host
calls per step by device and kind (F forward, R replay, B input gradient, W weight
gradient), and the process's CPU seconds and wall seconds per step.

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/plan/probe.py --model=cnn \\
        --schedule=interleaved --micro_batches=4 --virtual_stages=2 --remat=except_last

Method and findings: benchmarks/plan/README.md. Never run by the tests.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_validation as pv  # after the path: defines the model flags and Work
from absl import app, flags

FLAGS = flags.FLAGS
pv.define_candidate_flags()
flags.DEFINE_string("cache_dir", "/tmp/tf_gpipe_plan_probe", "Where the profile is kept.")
MiB = 2**20


def main(argv):
    del argv
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)
    log = []
    hold = sd._hold

    def logged_hold(device, ms, kind=""):
        import tensorflow as tf_

        before = tf_.config.experimental.get_memory_info("CPU:0")["current"]
        t0 = time.perf_counter()
        hold(device, ms, kind)
        after = tf_.config.experimental.get_memory_info("CPU:0")["current"]
        log.append((t0, time.perf_counter(), device, kind, before, after))

    sd._hold = logged_hold
    import tf_gpipe

    K = 4
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    Work = pv._work_layer()
    keras.utils.set_random_seed(0)
    layers = pv._layers(FLAGS.model, Work)
    devices = [f"/device:CPU:{i}" for i in range(K)]
    os.makedirs(FLAGS.cache_dir, exist_ok=True)
    cache = os.path.join(FLAGS.cache_dir, f"{FLAGS.model}_{FLAGS.batch}_{FLAGS.max_micro_batches}.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            prof, update = pickle.load(f)
    else:
        p = tf_gpipe.plan(layers, None, devices, FLAGS.budget_mib * MiB, FLAGS.batch, optimizer="adam",
                          max_micro_batches=FLAGS.max_micro_batches, repeats=FLAGS.repeats)  # fmt: skip
        prof, update = p.profile, p.update
        with open(cache, "wb") as f:
            pickle.dump((prof, update), f)
    M, v = FLAGS.micro_batches, FLAGS.virtual_stages
    p, c, schedule, _, process = pv.candidate(
        prof, update, devices, FLAGS.schedule, M, v, FLAGS.remat, FLAGS.balance
    )
    print(f"{c.label()} balance={c.balance}: predicted {c.step_s * 1e3:.1f} ms, {process / MiB:.2f} MiB "
          f"(per device {' / '.join(f'{b / MiB:.2f}' for b in c.peak_bytes)})")  # fmt: skip
    for i, s in enumerate(c.stages):
        print(f"  stage {i} device {schedule.device_of(i)}: input {s.input_bytes / MiB:.2f} stash "
              f"{s.activation_bytes / MiB:.2f} backward {s.backward_bytes / MiB:.2f} MiB")  # fmt: skip
    shape = pv.input_shape(layers)
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x, y = pv.batch(rng, shape)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model = pv.build(pv._layers(FLAGS.model, Work), p)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)  # fmt: skip
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    log.clear()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(FLAGS.steps):
        model.train_on_batch(x, y)
    cpu, wall = (time.process_time() - cpu) / FLAGS.steps, (time.perf_counter() - wall) / FLAGS.steps
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    held = max(max(r[4], r[5]) for r in log) - base
    calls = collections.Counter((r[2], r[3]) for r in log)
    load = os.getloadavg()[0]
    print(
        f"measured: peak {peak / MiB:.2f} MiB; at Work calls at most {held / MiB:.2f} MiB; "
        f"{wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU a step, load {load:.2f}"
    )
    print("Work host calls a step (device, kind):", {k: n / FLAGS.steps for k, n in sorted(calls.items())})
    holds = collections.Counter()
    for t0, t1, d, _, _, _ in log:
        holds[d] += t1 - t0
    flags_ = pv.remat_flags_of(c, schedule)
    from tf_gpipe.plan import predict

    timeline = predict.step_time(schedule, c.stages, flags_, p.shared_host)[2]
    busy = [timeline.busy(d) for d in range(K)]
    measured = " / ".join(f"{1e3 * holds[d] / FLAGS.steps:.1f}" for d in range(K))
    print("per device, ms a step: Work holds measured", measured,
          "| simulated busy", " / ".join(f"{1e3 * b:.1f}" for b in busy))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
