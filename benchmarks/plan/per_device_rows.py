"""Per-device memory of every row of a ``plan_validation.py`` run, each device on its own allocator.

``plan_validation.py`` compares the planner's prediction with one allocator shared by all
logical CPUs: the process's peak against ``predict.process_peak``, the per-device prediction
summed at each instant of the simulated timeline. The planner itself fits *per-device*
peaks to the budget. This script reads the rows of a validation run's output (model,
schedule, M, v, remat, cut) and runs ``per_device_memory.py`` on each. There every stage
runs in a worker process of its own, whose allocator is that device's. It prints one table:
predicted and measured MiB per device, and their ratios.

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/plan/per_device_rows.py results/full_X.txt

The profile is ``per_device_memory.py``'s own (``probe.py``'s cache), taken again on this
machine, so its predictions may differ a little from the validation run's. Never run by
the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = re.compile(
    r"^(mlp|transformer|cnn): K=(\d+) M=(\d+) (\S+)(?: v=(\d+))? remat=(\S+) balance=\[([\d, ]+)\]: step"
)


def main(path: str) -> None:
    with open(path) as f:
        rows = [m.groups() for line in f if (m := ROW.match(line))]
    print("| model | plan | per device: predicted -> measured MiB (measured / predicted) | worst |")
    print("|---|---|---|---|")
    for model, K, M, schedule, v, remat, balance in rows:
        cmd = [sys.executable, os.path.join(HERE, "per_device_memory.py"), f"--model={model}",
               f"--schedule={schedule}", f"--micro_batches={M}", f"--virtual_stages={v or 1}",
               f"--remat={remat}", f"--balance={balance.replace(' ', '')}", "--steps=3"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
        cells = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, flags=re.M)
        if len(cells) != int(K):
            print(f"| {model} | {schedule} M={M} {remat} | failed: {out[-300:]!r} | |")
            continue
        shown = " / ".join(f"{p} -> {m} ({r})" for _, p, m, r in cells)
        worst = max((float(r) for *_, r in cells), key=lambda r: abs(r - 1.0))
        label = f"K={K} M={M} {schedule}{f' v={v}' if v else ''} {remat} [{balance}]"
        print(f"| {model} | {label} | {shown} | {worst:.3f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
