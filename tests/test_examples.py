"""Smoke test of examples/train_classifier.py: a short run in a fresh process.

The script configures its own logical CPUs, so it runs in a subprocess (this
pytest process already has TensorFlow initialized by conftest.py).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tf_gpipe.devices import default_devices  # where the script's stages go by default

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_classifier.py"


def _run(args, timeout=180):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _summary(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"no SUMMARY line in the output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("SUMMARY ") :])


def test_train_classifier_short_run_learns_and_exports(tmp_path):
    # The default pipeline (4 virtual CPUs, K=4, M=8, remat="always") on a small data set.
    proc = _run(
        [
            "--epochs=3",
            "--num_examples=800",
            "--batch_size=32",
            "--learning_rate=0.01",
            "--seed=0",
            "--verbose=2",
            f"--model_dir={tmp_path}",
        ]
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    summary = _summary(proc.stdout)

    # It learns: the held-out loss and the training loss both fall.
    assert summary["final_loss"] < summary["initial_loss"], summary
    curve = summary["train_loss_per_epoch"]
    assert len(curve) == 3 and curve[-1] < curve[0], summary

    # The stages sit on 4 different devices, and the unsplit export matches.
    assert summary["devices"] == default_devices(4), summary
    assert summary["balance"] == [3, 3, 2, 2], summary
    assert summary["export_max_abs_diff"] < 1e-4, summary
    assert (tmp_path / "model.keras").is_file()
    assert (tmp_path / "sequential.keras").is_file()


def test_train_classifier_rejects_bad_flags():
    # absl validates the enum flag before any TensorFlow work happens.
    proc = _run(["--remat=sometimes"], timeout=120)
    assert proc.returncode != 0
    assert "remat" in proc.stderr


def test_train_classifier_builds_from_a_plan():
    # --plan_memory_budget: the planner picks the pipeline and prints its report; the summary
    # shows the plan's balance (one epoch on a small data set: only the wiring is checked here).
    proc = _run(
        ["--epochs=1", "--num_examples=300", "--batch_size=32", "--verbose=0", "--plan_memory_budget=64MiB"]
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "Plan: K=" in proc.stdout and "Candidates (" in proc.stdout, output[-5000:]
    summary = _summary(proc.stdout)
    planned = re.search(r"Plan: K=(\d+) .*balance=(\[[0-9, ]+\])", proc.stdout)
    assert planned and summary["balance"] == json.loads(planned.group(2)), proc.stdout[-3000:]
