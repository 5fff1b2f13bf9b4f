r"""Steady step of a custom training step: the loops against the step built out.

``first_step.py``'s model, data and custom training step (``--step=tape``: ``__call__``
under a ``tf.GradientTape``, then ``optimizer.apply``, one ``tf.function``), with a Dense
where the token embedding was (``--embedding=false``), GPipe, ``remat="always"``, K=4 on
4 logical CPUs, all in one process:

* ``loops``: ``micro_batch_loops=True``, the loop running K micro-batches at once;
* ``loops_all_at_once``: the same loop allowed to run all M at once (what TensorFlow's
  gradient of it then also does);
* ``built_out``: ``micro_batch_loops=False``, one stage call per micro-batch.

Each variant is traced and run twice, then timed in rounds of ``--steps`` steps, the order
rotating each round; the table gives the median over the rounds of the mean step.

    PYTHONPATH=. python benchmarks/first_step/tape_steady.py --micro_batches=4,16
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import first_step  # its model, data, custom step and flags (also puts harness on sys.path)
import harness
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "Timed rounds (the order of the variants rotates).")
flags.DEFINE_integer("steps", 5, "Steps per variant and round.")
FLAGS.set_default("micro_batches", ["4", "16"])
FLAGS.set_default("step", "tape")
FLAGS.set_default("embedding", False)

VARIANTS = ("loops", "loops_all_at_once", "built_out")


def _steps(m: int, devices: list[str]) -> dict:
    from tf_gpipe import loop_state

    x, y = first_step._data()
    run, steps = loop_state.run, {}
    for name in VARIANTS:
        FLAGS.micro_batch_loops = "false" if name == "built_out" else "true"
        step = first_step._step(first_step._model("gpipe", "always", m, devices))
        if name == "loops_all_at_once":  # the loop built while run() ignores its bound
            loop_state.run = lambda state, n, iteration, parallel=None: run(state, n, iteration)
        try:
            for _ in range(2):
                step(x, y).numpy()
        finally:
            loop_state.run = run
        steps[name] = step
    times: dict = {n: [] for n in VARIANTS}
    for r in range(FLAGS.rounds):
        for name in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                value = steps[name](x, y)
            value.numpy()
            times[name].append((time.perf_counter() - start) / FLAGS.steps * 1000)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv):
    del argv
    import tf_gpipe

    devices = tf_gpipe.configure_virtual_cpus(first_step.STAGES)
    harness.header("Custom training step: steady step, loops against built out")
    rows = []
    for m in map(int, FLAGS.micro_batches):
        got = _steps(m, devices)
        base = got["built_out"]
        rows.append([m, *(f"{got[n]:.1f}" for n in VARIANTS), f"{got['loops'] / base:.2f}"])
    harness.print_table(["M", *(f"{n} (ms)" for n in VARIANTS), "loops / built_out"], rows)


if __name__ == "__main__":
    app.run(main)
