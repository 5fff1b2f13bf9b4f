"""Where the first training step's time goes: Python tracing against TensorFlow's first run.

Each configuration runs in a fresh process, ``--repeats`` times, configurations alternated
(forward order, then reversed), and the table gives medians. A child times its first
``train_on_batch`` (K=``--stages``, the model of ``compiled_stages.py``, ``remat="always"``)
and splits it into

* trace: time inside the outermost ``func_graph_from_py_func`` calls (Python building the
  step's graph and every function in it), and
* rest: the remainder (TensorFlow optimizing, partitioning and instantiating the graph,
  then running the step once),

with the process CPU time of the first step and the time of a second step beside them.
One process per cell swings by 20-30% on the 2-core machine of
benchmarks/compiled_stages/README.md even when nothing else runs, hence the repeats.

    python benchmarks/compiled_stages/first_split.py --configs=built_out:1,loop:2,loop:32 --repeats=4

(``--repeats`` and ``--stages`` are ``compiled_stages.py``'s flags.)

``--gc_off`` switches Python's garbage collector off for the first step (a probe, not a
library setting). Results: benchmarks/compiled_stages/README.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compiled_stages as cs  # its flags too: --stages, the model's size
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "configs",
    ["built_out:1", "loop:2", "loop:32"],
    "builder:M pairs (builder: built_out, loop, or loop_unpacked: the loop without tf_gpipe.handles).",
)
flags.DEFINE_bool("gc_off", False, "Python's garbage collector off during the first step.")
flags.DEFINE_string("child_config", "", "Internal: run one configuration and print JSON.")


def _child(config: str) -> None:
    import gc

    builder, m = config.split(":")
    FLAGS.jit = "auto"
    traced = cs.harness.trace_clock()
    devices = cs._setup_devices(FLAGS.stages)
    if builder == "loop_unpacked":  # the loop as before tf_gpipe.handles: one loop variable per handle
        from tf_gpipe import handles

        handles.pack = lambda found: handles.Packed([], [])
    looped = builder in ("loop", "loop_unpacked")
    model = cs._model("pipe", FLAGS.stages, int(m), devices, remat="always", micro_batch_loops=looped)
    x, y = cs._data()
    if FLAGS.gc_off:
        gc.disable()
    cpu, start = time.process_time(), time.perf_counter()
    model.train_on_batch(x, y)
    first, cpu = time.perf_counter() - start, time.process_time() - cpu
    gc.enable()
    start = time.perf_counter()
    model.train_on_batch(x, y)
    second = time.perf_counter() - start
    print(json.dumps(dict(first=first, trace=traced[0], rest=first - traced[0], cpu=cpu, second=second)))


def main(argv):
    del argv
    if FLAGS.child_config:
        return _child(FLAGS.child_config)
    runs: dict[str, list[dict]] = {c: [] for c in FLAGS.configs}
    for r in range(FLAGS.repeats):
        for config in FLAGS.configs if r % 2 == 0 else list(reversed(FLAGS.configs)):
            args = [sys.executable, __file__, f"--child_config={config}", f"--stages={FLAGS.stages}"]
            args += ["--gc_off"] if FLAGS.gc_off else []
            out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
            runs[config].append(json.loads(out.strip().splitlines()[-1]))
            print(config, runs[config][-1], flush=True)
    base = statistics.median(r["first"] for r in runs[FLAGS.configs[0]])
    load = os.getloadavg()[0]
    print(f"\nK={FLAGS.stages}, remat always, jit auto, {FLAGS.repeats} processes each, medians;", end="")
    print(f" load {load:.1f}")
    print("| builder:M | first step (s) | vs first row | trace (s) | rest (s) | CPU (s) ", end="")
    print("| second step (ms) | first steps (s) |\n|---|---|---|---|---|---|---|---|")
    for config, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        each = " ".join(f"{r['first']:.1f}" for r in rs)
        row = [f"{med[k]:.2f}" for k in ("first",)] + [f"{med['first'] / base:.2f}"]
        row += [f"{med[k]:.2f}" for k in ("trace", "rest", "cpu")] + [f"{1e3 * med['second']:.0f}", each]
        print(f"| {config} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    app.run(main)
