r"""The whole accelerator check in one call: suite, examples, XLA parity, first step,
4 logical devices and where the optimizer update runs.

A machine with a GPU is lent for a short time and only now and then: this script runs
every check that needs one, each in its own process (logical devices must be set up
before TensorFlow starts), and prints one table. On a machine without a GPU it runs
the same checks on logical CPUs, which tests the script, not the GPU.

    python benchmarks/gpu_check.py                  # everything
    python benchmarks/gpu_check.py --skip=example,xla,logical4,first_step,overlap --timeout=400
    python benchmarks/gpu_check.py --skip=suite     # the rest

On an H200 host (16 cores, at 6cc949c) TensorFlow's unpacking took 30 s, the suite 252 s
(743 tests), the example 37 s, xla 17 s, logical4 24 s, first_step 112 s for one schedule
with ``--first_step_micro_batches=1,32 --first_step_repeats=2``: run the suite in a call of
its own, the rest in another.

Checks, in this order (the suite first: it says most, and a lease may end mid-way):
- ``suite``: the README's tests (``pytest -n`` with the cores there are), counts and
  the names of any that failed; the whole ``-v`` log goes to ``$OUT/gpu_suite.log``
  (``benchmarks/out/`` without ``$OUT``) as it runs, so a cut-off run keeps its names;
- ``example``: ``examples/train_classifier.py`` for 2 epochs on the real devices, with its
  unsplit-export comparison (inside ``tf_gpipe.exact_float32()``);
- ``xla``: a 4-stage ``PipelineModel`` compiled with ``jit_compile=True`` (XLA stage by
  stage) against ``keras.Sequential`` compiled with XLA, same weights, 3 Adam steps,
  inside ``tf_gpipe.exact_float32()``: largest weight difference (ok below 1e-4);
- ``logical4``: device 0 split into 4 logical devices, stages 0-3 on them, Adam: the
  step's partition graphs must hold no optimizer op outside the stages' devices, and
  an update (an assign) on each of devices 1-3; the median step time; then ``export``,
  loaded with its variable devices, must serve ``predict``'s outputs (and what a plain
  ``tf.saved_model.load`` does is reported); and two zb-h1 steps as loops (their last
  W's in iterations that skip the rest) must give the built-out step's weights (1e-4);
- ``first_step``: trace + compile + first run of a K=4 Transformer-block stack (layers
  without an ``Input``: built by the data) for M in ``--first_step_micro_batches`` (1, 8,
  32) per schedule (``--first_step_schedules``), and ``keras.Sequential``'s (XLA where
  Keras would use it); ok when the largest M takes at most 1.3x the smallest and 1.5x
  ``keras.Sequential``; ``--first_step_repeats=2`` times each twice in the process, the second
  with every kernel compiled (telling a GPU's PTX compilation from tracing and optimizing).
  ``--child=first_step`` runs it alone, in this process;
- ``overlap``: ``benchmarks/overlap/overlap.py`` (K=2 on two logical CPUs against plain
  Keras with the same micro-batches), short, with the GPU hidden: the host CPU's figures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("skip", [], "Checks to leave out: example, xla, logical4, first_step, overlap, suite.")
flags.DEFINE_string("child", "", "Internal: run this one check in this process and print its JSON.")
flags.DEFINE_integer("timeout", 300, "Seconds each check may take (a device call runs 600 s at most).")
flags.DEFINE_list("first_step_schedules", ["gpipe", "1f1b"], "Schedules the first_step check times.")
flags.DEFINE_list("first_step_micro_batches", ["1", "8", "32"], "M values the first_step check times.")
flags.DEFINE_integer(
    "first_step_repeats",
    1,
    "Fresh models per (schedule, M), one after the other in the first_step process: the later "
    "ones find every kernel the first compiled (on a GPU without its native kernels, from PTX); "
    "the ratios use the last.",
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ("suite", "example", "xla", "logical4", "first_step", "overlap")


# ---------------------------------------------------------------------------- in a child process
def _kind_and_devices(split: int = 0):
    """('GPU' or 'CPU', device names); ``split`` > 0 first cuts device 0 into that many."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    physical = gpus[0] if gpus else tf.config.list_physical_devices("CPU")[0]
    if split:
        memory = {"memory_limit": 4096} if gpus else {}
        tf.config.set_logical_device_configuration(
            physical, [tf.config.LogicalDeviceConfiguration(**memory) for _ in range(split)]
        )
    elif not gpus:
        tf.config.set_logical_device_configuration(
            physical, [tf.config.LogicalDeviceConfiguration() for _ in range(4)]
        )
    return kind, [d.name for d in tf.config.list_logical_devices(kind)]


def _mlp(seed=0, width=256, depth=7):
    import keras

    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(width, activation="relu") for _ in range(depth)] + [keras.layers.Dense(10)]


def _xla() -> dict:
    import keras
    import numpy as np

    import tf_gpipe

    kind, devices = _kind_and_devices()
    x = np.random.RandomState(0).randn(96, 64).astype("float32")
    y = np.random.RandomState(1).randint(0, 10, 96)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf_gpipe.exact_float32():
        seq = keras.Sequential([keras.Input((64,)), *_mlp()])
        pm = tf_gpipe.PipelineModel(_mlp(), devices=devices[:4], num_micro_batches=4)
        pm.build((None, 64))
        pm.set_weights(seq.get_weights())
        seq.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=True)
        pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=True)
        for _ in range(3):
            seq.train_on_batch(x, y)
            pm.train_on_batch(x, y)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(pm.get_weights(), seq.get_weights()))
    return {
        "kind": kind,
        "stage_jit": list(map(str, pm.stage_jit)),
        "max_weight_diff": diff,
        "ok": diff < 1e-4,
    }


def _first_step() -> dict:
    import keras
    import numpy as np

    import tf_gpipe

    kind, devices = _kind_and_devices()
    x = np.random.RandomState(0).randint(0, 500, (64, 32)).astype("int32")
    y = np.random.RandomState(1).randint(0, 500, (64, 32))

    def layers():
        keras.utils.set_random_seed(0)
        return (
            [keras.layers.Embedding(500, 64)]
            + [harness.transformer_block(64) for _ in range(4)]
            + [keras.layers.Dense(500)]
        )

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    times = {}
    ms = [int(m) for m in FLAGS.first_step_micro_batches]
    repeats = range(FLAGS.first_step_repeats)
    runs = [("gpipe", 1)] + [(name, m) for name in FLAGS.first_step_schedules for m in ms for _ in repeats]
    for i, (name, m) in enumerate(runs):  # the first run pays the process' one-time costs: not kept
        extra = {"virtual_stages": 2} if name == "interleaved" else {}
        model = tf_gpipe.PipelineModel(
            layers(), devices=devices[:4], num_micro_batches=m, schedule=name, **extra
        )
        model.compile(optimizer="adam", loss=loss)
        start = time.perf_counter()
        model.train_on_batch(x, y)
        if i:
            times[f"{name} M={m}"] = round(time.perf_counter() - start, 2)  # the last repeat's
            print(f"first_step {name} M={m}: {times[f'{name} M={m}']} s", flush=True)
    seq = keras.Sequential([keras.Input((32,), dtype="int32"), *layers()])
    seq.compile(optimizer="adam", loss=loss)  # jit_compile="auto", as a user would
    start = time.perf_counter()
    seq.train_on_batch(x, y)
    times["keras.Sequential"] = round(time.perf_counter() - start, 2)
    top, base = f"M={max(ms)}", f"M={min(ms)}"
    flat = {n: round(times[f"{n} {top}"] / times[f"{n} {base}"], 2) for n in FLAGS.first_step_schedules}
    to_seq = {
        n: round(times[f"{n} {top}"] / times["keras.Sequential"], 2) for n in FLAGS.first_step_schedules
    }
    return {
        "kind": kind,
        "seconds": times,
        f"{top}_over_{base}": flat,
        f"{top}_over_sequential": to_seq,
        "ok": all(r <= 1.3 for r in flat.values()) and all(r <= 1.5 for r in to_seq.values()),
    }


def _short(device: str) -> str:
    """``GPU:1`` for any spelling of a device name."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


def _logical4() -> dict:
    import collections

    import keras
    import numpy as np
    from tensorflow.python.eager import context

    import tf_gpipe

    kind, devices = _kind_and_devices(split=4)
    pm = tf_gpipe.PipelineModel(_mlp(width=512), devices=devices[:4], num_micro_batches=4)
    pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(True))
    x = np.random.RandomState(0).randn(256, 64).astype("float32")
    y = np.random.RandomState(1).randint(0, 10, 256)
    context.enable_run_metadata()
    pm.train_on_batch(x, y)
    metadata = context.export_run_metadata()
    context.disable_run_metadata()
    ops = collections.defaultdict(list)
    for graph in metadata.function_graphs:
        for partition in graph.partition_graphs:
            for node in partition.node:
                if pm.optimizer.name in node.name.split("/"):
                    ops[node.device].append(node.op)
    stage_devices = [_short(d) for d in devices[:4]]
    outside = {d: len(o) for d, o in ops.items() if _short(d) not in stage_devices}
    updated = [
        d
        for d in stage_devices[1:]
        if any(_short(k) == d and any(op.startswith("Assign") for op in o) for k, o in ops.items())
    ]
    steps = []
    for _ in range(7):
        start = time.perf_counter()
        pm.train_on_batch(x, y)
        steps.append(time.perf_counter() - start)
    served = _served(pm, x[:37])
    # remat="never" runs each stage's B and W as two functions of its forward (tf_gpipe/stash.py).
    zb_h1 = {f"zb_h1_{r}_loops_vs_built_out": _zb_h1_loops(devices[:4], x, y, r) for r in ("always", "never")}
    return {
        "kind": kind,
        "devices": devices[:4],
        **zb_h1,
        "optimizer_ops_per_device": {d: len(o) for d, o in sorted(ops.items())},
        "outside_stage_devices": outside,
        "devices_1_3_with_an_update": updated,
        **served,
        "median_step_ms": round(1000 * sorted(steps)[3], 2),
        "ok": not outside
        and len(updated) == 3
        and served["export_served_diff"] < 1e-5
        and max(zb_h1.values()) < 1e-4,
    }


def _zb_h1_loops(devices, x, y, remat: str) -> float:
    """Two zb-h1 steps (M=6) as loops and built out, from the same weights: the loops run the
    last W's in iterations that skip the rest, a Switch and a Merge per list and handle on
    each stage's device (``tf_gpipe/loop_guard.py``). The largest weight difference."""
    import keras
    import numpy as np

    import tf_gpipe

    weights: dict = {}
    start = None
    for loops in (True, False):
        pm = tf_gpipe.PipelineModel(
            _mlp(width=512), devices=devices, num_micro_batches=6, schedule="zb-h1", remat=remat,
            micro_batch_loops=loops,
        )  # fmt: skip
        pm.build((None, x.shape[1]))
        if start is None:
            start = pm.get_weights()
        pm.set_weights(start)
        loss = keras.losses.SparseCategoricalCrossentropy(True)
        pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        for _ in range(2):
            pm.train_on_batch(x[:250], y[:250])  # uneven micro-batches: 42 x 4, 41 x 2
        weights[loops] = pm.get_weights()
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights[True], weights[False]))


def _served(pm, x) -> dict:
    """``pm.export``, loaded as docs/saving_and_serving.md says (the variables on the devices
    it records): its largest difference from ``predict``, and what a plain load does."""
    import tempfile

    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    path = os.path.join(tempfile.mkdtemp(), "served")
    policy = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
    with tf_gpipe.exact_float32():  # predict and serve may pick different TF32 kernels
        pm.export(path, verbose=False)
        expected = pm.predict(x, verbose=0)
        loaded = tf.saved_model.load(
            path, options=tf.saved_model.LoadOptions(experimental_variable_policy=policy)
        )
        placed = sorted({_short(v.device) for v in loaded.variables})
        diff = float(np.abs(loaded.serve(x).numpy() - expected).max())
        plain_loaded = tf.saved_model.load(path)  # held: its variables live as long as it does
        try:
            plain = f"{float(np.abs(plain_loaded.serve(x).numpy() - expected).max()):.1e}"
        except tf.errors.InvalidArgumentError as e:
            plain = "fails: " + str(e.message).strip().splitlines()[0][:120]
    return {"export_variable_devices": placed, "export_served_diff": diff, "export_plain_load": plain}


# ---------------------------------------------------------------------------- the parent
def _run(cmd: list[str], env: dict[str, str] | None = None, log: str = "") -> tuple[int, str, float]:
    """Run ``cmd``: its exit status, output and seconds. ``log``: the output goes to that
    file as it comes (and is read back from it), so a run cut off by the timeout keeps it."""
    start = time.perf_counter()
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    kwargs: dict = dict(cwd=ROOT, text=True, timeout=FLAGS.timeout, env=env)
    out = ""
    try:
        if log:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs).returncode
        else:
            done = subprocess.run(cmd, capture_output=True, **kwargs)
            rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {FLAGS.timeout} s: {e}\n"
    if log:
        with open(log) as f:
            out = f.read() + out
    return rc, out, time.perf_counter() - start


def _check(name: str) -> dict:
    if name == "suite":
        workers = str(max(2, min(14, (os.cpu_count() or 2) - 2)))
        log = os.path.join(os.environ.get("OUT") or harness.OUT_DIR, "gpu_suite.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        # Each worker would take all of the GPU's memory at its first op, and the others abort.
        grow = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-n", workers, "tests"]
        rc, out, s = _run(cmd, env=grow, log=log)
        summary = [line for line in out.splitlines() if line.startswith("=") and " passed" in line]
        counts = re.findall(r"(\d+) (passed|failed|errors?)\b", summary[-1] if summary else "")
        # "[gw3] [ 40%] FAILED tests/...": each failure's name, as it happens.
        failed = sorted(set(re.findall(r"\] (?:FAILED|ERROR) (\S+)", out)))
        result = " ".join(f"{n} {w}" for n, w in counts) or out[-300:]
        return {"ok": rc == 0, "result": "; ".join([result, *failed]), "seconds": s}
    if name == "example":
        script = os.path.join("examples", "train_classifier.py")
        rc, out, s = _run([sys.executable, script, "--virtual_cpus=0", "--epochs=2", "--verbose=0"])
        summary = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
        export = [line for line in out.splitlines() if line.startswith("Unsplit export")]
        return {
            "ok": rc == 0 and bool(summary),
            "result": "; ".join(export + ([summary[-1][8:]] if summary else [out[-600:]])),
            "seconds": s,
        }
    if name == "overlap":
        # A CPU benchmark: the GPU hidden, so plain Keras runs on the same cores as the stages.
        script = os.path.join("benchmarks", "overlap", "overlap.py")
        args = ["--settings=0-0-1,2-1-1", "--rounds=3", "--steps=5", "--warmup=2", "--trace=False"]
        args += ["--variants=plain_mb,pipe_k2_gpipe,pipe_k2_1f1b", "--out=" + harness.OUT_DIR]
        rc, out, s = _run([sys.executable, script, *args], env={"CUDA_VISIBLE_DEVICES": ""})
        table = [line for line in out.splitlines() if line.startswith("|")]
        return {"ok": rc == 0, "result": "\n".join(table) or out[-600:], "seconds": s}
    schedules = "--first_step_schedules=" + ",".join(FLAGS.first_step_schedules)
    ms = "--first_step_micro_batches=" + ",".join(FLAGS.first_step_micro_batches)
    repeats = f"--first_step_repeats={FLAGS.first_step_repeats}"
    rc, out, s = _run([sys.executable, os.path.abspath(__file__), f"--child={name}", schedules, ms, repeats])
    found = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if rc or not found:
        return {"ok": False, "result": out[-600:], "seconds": s}
    result = json.loads(found[-1][len("RESULT ") :])
    return {"ok": result.pop("ok"), "result": json.dumps(result), "seconds": s}


def main(argv):
    del argv
    if FLAGS.child:
        result = {"xla": _xla, "first_step": _first_step, "logical4": _logical4}[FLAGS.child]()
        print("RESULT " + json.dumps(result), flush=True)
        return
    harness.header("tf_gpipe accelerator check")
    rows = []
    for name in CHECKS:
        if name in FLAGS.skip:
            continue
        got = _check(name)
        rows.append([name, "ok" if got["ok"] else "FAILED", f"{got['seconds']:.0f}", got["result"]])
        print(f"{name}: {rows[-1][1]} ({rows[-1][2]} s) {got['result']}", flush=True)
    harness.print_table(["check", "status", "seconds", "result"], rows)
    sys.exit(0 if all(r[1] == "ok" for r in rows) else 1)


if __name__ == "__main__":
    app.run(main)
