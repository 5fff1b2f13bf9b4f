r"""Steady step: the loops over micro-batches against the step built out.

``first_step.py``'s model, data and steps, K=4 on 4 logical CPUs, all variants of a cell in
one process:

* ``loops``: ``micro_batch_loops=True`` (a custom step's loop running K micro-batches at once);
* ``built_out``: ``micro_batch_loops=False``, one stage call per action;
* ``loops_all_at_once`` (``--step=tape`` only): the custom step's loop allowed to run all M
  at once (what TensorFlow's gradient of it then also does).

A cell is (schedule, remat, M). Each variant is traced and run twice, then timed in rounds
of ``--steps`` steps, the order rotating each round, after one round not kept; the table
gives the median over the rounds of the mean step, and loops / built out.

    PYTHONPATH=. python benchmarks/steady_step/steady.py --step=fit \
        --schedules=gpipe,1f1b --remat=always,never --micro_batches=8,32
    PYTHONPATH=. python benchmarks/steady_step/steady.py --batch_known=false \
        --schedules=1f1b --remat=always --micro_batches=32
    PYTHONPATH=. python benchmarks/steady_step/steady.py --step=tape --embedding=false \
        --schedules=gpipe --remat=always --micro_batches=4,16
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "first_step"))
import first_step  # its model, data, steps and flags (also puts harness on sys.path)
import harness
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "Timed rounds (the order of the variants rotates).")
flags.DEFINE_integer("steps", 5, "Steps per variant and round.")
flags.DEFINE_bool(
    "batch_known",
    True,
    "False (--step=fit): the step traced with the batch dimension None, as fit on a dataset "
    "traces it (tf.function(model.train_step)): shapes stay dynamic, micro-batches may be padded.",
)
FLAGS.set_default("micro_batches", ["8", "32"])
FLAGS.set_default("schedules", ["gpipe", "1f1b"])


def _variants() -> tuple[str, ...]:
    return ("loops", "built_out") + (("loops_all_at_once",) if FLAGS.step == "tape" else ())


def _steps(schedule: str, remat: str, m: int, devices: list[str]) -> dict:
    from tf_gpipe import loop_state

    x, y = first_step._data()
    run, steps, variants = loop_state.run, {}, _variants()
    for name in variants:
        FLAGS.micro_batch_loops = "false" if name == "built_out" else "true"
        step = _step(first_step._model(schedule, remat, m, devices), x, y)
        if name == "loops_all_at_once":  # the loop built while run() ignores its bound
            loop_state.run = lambda state, n, iteration, parallel=None: run(state, n, iteration)
        try:
            for _ in range(2):
                _wait(step(x, y))
        finally:
            loop_state.run = run
        steps[name] = step
    times: dict = {n: [] for n in variants}
    # Round 0 is not kept: the first steps after the other variants were built run slower.
    for r in range(FLAGS.rounds + 1):
        k = r % len(variants)
        for name in variants[k:] + variants[:k]:
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                value = steps[name](x, y)
            _wait(value)
            times[name].append((time.perf_counter() - start) / FLAGS.steps * 1000)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


def _step(model, x, y):
    if FLAGS.batch_known or FLAGS.step != "fit":
        return first_step._step(model)
    import tensorflow as tf

    model.optimizer.build(model.trainable_variables)
    spec = tuple(tf.TensorSpec([None, *a.shape[1:]], tf.as_dtype(a.dtype)) for a in (x, y))
    step = tf.function(model.train_step, input_signature=[spec])
    return lambda x, y: step((x, y))["loss"]


def _wait(value) -> None:
    """Block until the step has run (``train_on_batch`` returns NumPy values already)."""
    if hasattr(value, "numpy"):
        value.numpy()


def main(argv):
    del argv
    import tf_gpipe

    devices = tf_gpipe.configure_virtual_cpus(first_step.STAGES)
    harness.header(f"Steady step ({FLAGS.step}): loops against built out")
    variants, rows = _variants(), []
    for schedule in FLAGS.schedules:
        for remat in FLAGS.remat:
            for m in map(int, FLAGS.micro_batches):
                got = _steps(schedule, remat, m, devices)
                base = got["built_out"]
                cells = [f"{got[n]:.1f}" for n in variants]
                rows.append([schedule, remat, m, *cells, f"{got['loops'] / base:.2f}"])
                print(" ".join(map(str, rows[-1])), flush=True)
    headers = ["schedule", "remat", "M", *(f"{n} (ms)" for n in variants), "loops / built_out"]
    harness.print_table(headers, rows)


if __name__ == "__main__":
    app.run(main)
