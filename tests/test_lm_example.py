"""examples/train_transformer_lm.py: a short run, a killed run that resumes exactly, and
a run that follows tf_gpipe.plan.

The script configures its own logical CPUs, so it runs in subprocesses (this
pytest process already has TensorFlow initialized by conftest.py). Run A trains
12 steps without interruption; run B is "killed" after step 6
(``--stop_after_steps``, between the checkpoints at steps 4 and 8), then started
again with the same flags: it must resume from step 4 and reproduce A's losses
for steps 5..12 exactly (same batches, same dropout masks, same Adam state).
The runs that do not wait for each other run side by side: much of each is
single-threaded Python (starting TensorFlow, tracing).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import child_env

# One worker runs every test of this module: its module fixture (child processes) runs once.
pytestmark = pytest.mark.xdist_group("lm_example")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_transformer_lm.py"

# A tiny model on the default pipeline (4 logical CPUs, K=4, M=4, remat="always"), dropout on.
TINY = [
    "--steps=12",
    "--checkpoint_every=4",
    "--num_layers=2",
    "--d_model=32",
    "--num_heads=2",
    "--mlp_dim=64",
    "--batch_size=8",
    "--seq_len=32",
    "--corpus_kb=40",
    "--dropout=0.1",
    "--sample_length=20",
    "--verbose=2",
    "--print_step_losses",
]


# The planner's run: a smaller model, two steps (only the wiring is checked).
PLANNED = ["--steps=2", "--checkpoint_every=2", "--num_layers=2", "--d_model=16", "--num_heads=2"]
PLANNED += ["--mlp_dim=32", "--batch_size=8", "--seq_len=16", "--corpus_kb=20", "--sample_length=4"]
PLANNED += ["--verbose=0", "--plan_memory_budget=64MiB"]


def _start(args, flags=TINY):
    # A resumed run must repeat the full run's losses to 1e-6: the CPU computes the same
    # bits in every process, where a GPU's autotuned kernels may not.
    env = child_env(CUDA_VISIBLE_DEVICES="")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *flags, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, (out + err)[-5000:]
    return out


def _step_losses(stdout):
    losses = {}
    for line in stdout.splitlines():
        if line.startswith("STEP_LOSS "):
            _, step, value = line.split()
            losses[int(step)] = float(value)
    return losses


def _summary(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"no SUMMARY line in the output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("SUMMARY ") :])


def _event_tags(log_dir):
    tags = set()
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(value.tag for value in event.summary.value)
    return tags


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A (12 steps), run B (killed after step 6) and the planned run side by side,
    then B again."""
    dir_a, dir_b = tmp_path_factory.mktemp("run_a"), tmp_path_factory.mktemp("run_b")
    proc_a = _start([f"--model_dir={dir_a}"])
    proc_b = _start([f"--model_dir={dir_b}", "--stop_after_steps=6"])
    proc_plan = _start([f"--model_dir={tmp_path_factory.mktemp('run_plan')}"], flags=PLANNED)
    try:
        out_b1 = _finish(proc_b)
        out_b2 = _finish(_start([f"--model_dir={dir_b}"]))
        out_a = _finish(proc_a)
    except BaseException:
        for proc in (proc_a, proc_b, proc_plan):
            proc.kill()
        raise
    # The planned run is awaited (and its failure reported) by its own test.
    return {"dir_a": dir_a, "a": out_a, "b1": out_b1, "b2": out_b2, "plan": proc_plan}


def test_short_run_trains_logs_checkpoints_exports_and_samples(runs):
    out, model_dir = runs["a"], runs["dir_a"]
    summary = _summary(out)
    assert summary["start_step"] == 0
    # The script's default: its 4 logical CPUs (the runs hide any GPU).
    assert summary["devices"] == [f"/device:CPU:{k}" for k in range(4)], summary
    assert len(summary["train_loss_per_epoch"]) == 3
    assert summary["final_val_loss"] < summary["initial_val_loss"], summary
    assert summary["export_max_abs_diff"] < 1e-4, summary

    # Checkpoints after every epoch of --checkpoint_every steps.
    assert tf.train.latest_checkpoint(str(model_dir / "checkpoints")).endswith("ckpt-12")
    # The unsplit export, and a sample generated from it.
    assert (model_dir / "lm.keras").is_file()
    assert "Sample from the exported model" in out
    assert summary["sample"].startswith("def ") and len(summary["sample"]) == 4 + 20

    # TensorBoard: the loss and throughput per epoch, and the pipeline settings as text.
    tags = _event_tags(model_dir / "logs")
    assert {"epoch_loss", "epoch_examples_per_sec", "epoch_tokens_per_sec", "pipeline_settings"} <= tags, tags


def test_killed_run_resumes_on_the_same_loss_trajectory(runs):
    full = _step_losses(runs["a"])
    first, second = _step_losses(runs["b1"]), _step_losses(runs["b2"])
    assert sorted(full) == list(range(1, 13))
    assert "SIMULATED KILL after step 6" in runs["b1"]
    assert sorted(first) == list(range(1, 7))
    # The restart resumes from the checkpoint at step 4 and redoes steps 5 and 6.
    assert "Resuming from" in runs["b2"] and "(step 4 of 12)" in runs["b2"]
    assert sorted(second) == list(range(5, 13))

    np.testing.assert_allclose([first[s] for s in range(1, 7)], [full[s] for s in range(1, 7)], rtol=1e-6)
    np.testing.assert_allclose(
        [second[s] for s in range(5, 13)], [full[s] for s in range(5, 13)], rtol=1e-6, atol=0
    )
    final_a, final_b = _summary(runs["a"])["final_val_loss"], _summary(runs["b2"])["final_val_loss"]
    assert final_b == pytest.approx(final_a, rel=1e-6)


def test_builds_from_a_plan(runs):
    # --plan_memory_budget: the planner profiles on integer token ids (the embedding takes
    # no floats) and the model follows the plan it prints.
    out = _finish(runs["plan"])
    planned = re.search(r"Plan: K=(\d+) M=(\d+) .*balance=(\[[0-9, ]+\])", out)
    assert planned and "Candidates (" in out, out[-5000:]
    summary = _summary(out)
    assert summary["balance"] == json.loads(planned.group(3)), out[-3000:]
    assert len(summary["devices"]) == int(planned.group(1)), out[-3000:]
