"""examples/fit_image_classifier.py: a short run with ModelCheckpoint, EarlyStopping and TensorBoard.

The script configures its own logical CPUs, so it runs in a subprocess (this
pytest process already has TensorFlow initialized by conftest.py).
"""

import json
import subprocess
import sys
from pathlib import Path

from helpers import child_env

from tf_gpipe.devices import default_devices  # where the script's stages go by default

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fit_image_classifier.py"


def test_short_fit_with_keras_callbacks(tmp_path):
    env = child_env()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The default pipeline (4 logical CPUs, K=4, M=4) on the drawn shapes, which need
    # no optional package; 2 epochs of 10 steps.
    args = ["--dataset=shapes", "--num_examples=800", "--epochs=2", "--verbose=2", f"--model_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, proc.stdout[-3000:]
    summary = json.loads(lines[-1][len("SUMMARY ") :])

    assert summary["epochs_run"] == 2
    assert summary["devices"] == default_devices(4), summary
    assert summary["train_loss_per_epoch"][-1] < summary["train_loss_per_epoch"][0], summary
    # ModelCheckpoint wrote a loadable PipelineModel; TensorBoard wrote train and validation logs.
    assert (tmp_path / "best.keras").is_file()
    assert summary["reloaded_test_accuracy"] > 0.0
    for run in ("train", "validation"):
        assert list((tmp_path / "logs" / run).glob("events.out.tfevents.*")), run
