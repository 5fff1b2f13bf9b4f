"""Smoke test of examples/train_classifier.py: a short run in a fresh process.

The script configures its own logical CPUs, so it runs in a subprocess (this
pytest process already has TensorFlow initialized by conftest.py). The three runs
start together: much of each is single-threaded Python (starting TensorFlow, tracing).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env

from tf_gpipe.devices import default_devices  # where the script's stages go by default

# One worker runs every test of this module: its module fixture (child processes) runs once.
pytestmark = pytest.mark.xdist_group("classifier_example")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_classifier.py"


def _start(args):
    env = child_env()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=180):
    """``(returncode, stdout, stderr)`` of a started run."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs, started together: ``(model_dir of the short run, {name: process})``."""
    model_dir = tmp_path_factory.mktemp("classifier")
    # The default pipeline (4 virtual CPUs, K=4, M=8, remat="always") on a small data set.
    short = ["--epochs=3", "--num_examples=800", "--batch_size=32", "--learning_rate=0.01", "--seed=0"]
    short += ["--verbose=2", f"--model_dir={model_dir}"]
    # --plan_memory_budget: one epoch on a small data set (only the wiring is checked).
    planned = [
        "--epochs=1",
        "--num_examples=300",
        "--batch_size=32",
        "--verbose=0",
        "--plan_memory_budget=64MiB",
    ]
    procs = {"short": _start(short), "bad_flags": _start(["--remat=sometimes"]), "plan": _start(planned)}
    yield model_dir, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _summary(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"no SUMMARY line in the output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("SUMMARY ") :])


def test_train_classifier_short_run_learns_and_exports(runs):
    model_dir, procs = runs
    returncode, stdout, stderr = _finish(procs["short"])
    assert returncode == 0, (stdout + stderr)[-5000:]
    summary = _summary(stdout)

    # It learns: the held-out loss and the training loss both fall.
    assert summary["final_loss"] < summary["initial_loss"], summary
    curve = summary["train_loss_per_epoch"]
    assert len(curve) == 3 and curve[-1] < curve[0], summary

    # The stages sit on 4 different devices, and the unsplit export matches.
    assert summary["devices"] == default_devices(4), summary
    assert summary["balance"] == [3, 3, 2, 2], summary
    assert summary["export_max_abs_diff"] < 1e-4, summary
    assert (model_dir / "model.keras").is_file()
    assert (model_dir / "sequential.keras").is_file()


def test_train_classifier_rejects_bad_flags(runs):
    # absl validates the enum flag before any TensorFlow work happens.
    returncode, _, stderr = _finish(runs[1]["bad_flags"], timeout=120)
    assert returncode != 0
    assert "remat" in stderr


def test_train_classifier_builds_from_a_plan(runs):
    # --plan_memory_budget: the planner picks the pipeline and prints its report; the summary
    # shows the plan's balance.
    returncode, stdout, stderr = _finish(runs[1]["plan"])
    assert returncode == 0, (stdout + stderr)[-5000:]
    assert "Plan: K=" in stdout and "Candidates (" in stdout, (stdout + stderr)[-5000:]
    summary = _summary(stdout)
    planned = re.search(r"Plan: K=(\d+) .*balance=(\[[0-9, ]+\])", stdout)
    assert planned and summary["balance"] == json.loads(planned.group(2)), stdout[-3000:]
