"""Simulated bubble, step time and stashes of gpipe, 1f1b and zb-h1 (no TensorFlow).

Pure simulation with ``tf_gpipe.schedules``: each schedule's
``simulate(forward_cost=F, backward_cost=B + W, weight_cost=W)`` on ideal
devices with free transfers, for K in --stages and M in K x --m_factors, under
two cost settings:

* F = B = W = 1: the zero-bubble paper's setting (a matmul layer: the forward,
  the input gradient dY W^T and the weight gradient X^T dY are one matmul each);
* F = 1, B = 1, W = 0.5: stages whose backward is half weight-free work
  (attention scores, activations, norms), so W is the smaller half.

gpipe and 1f1b run each backward as one action of cost B + W; zb-h1 runs B and W
as separate actions. The same costs mean the same work for every schedule: only
the idle time differs. "idle/device" is makespan - busy time (the same on every
device here); "stashes" is ``peak_in_flight()`` per device (device 0 first): the
activations a device holds at once, a stash living until its W under zb-h1.

Run (well under a second):

    python3 benchmarks/schedules/zero_bubble_sim.py

The schedules module is loaded from its file, so TensorFlow is never imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4", "8"], "Values of K (pipeline devices).")
flags.DEFINE_list("m_factors", ["1", "2", "4"], "M = K times each of these.")
flags.DEFINE_list("weight_costs", ["1", "0.5"], "Values of W (with F = B = 1), one table each.")

SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h1")


def _load_schedules():
    # A bare tf_gpipe package (its __init__ imports TensorFlow) holding the real modules.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    package = types.ModuleType("tf_gpipe")
    package.__path__ = [os.path.join(root, "tf_gpipe")]
    sys.modules.setdefault("tf_gpipe", package)
    return importlib.import_module("tf_gpipe.schedules")


def _number(x: float) -> str:
    return f"{x:g}"


def table(schedules, Ks, factors, w: float) -> str:
    headers = ["K", "M"]
    for name in SCHEDULE_NAMES:
        headers += [f"{name} makespan", f"{name} bubble"]
    headers += ["idle/device gpipe, 1f1b, zb-h1", "zb-h1 idle / 1f1b idle"]
    headers += [f"stashes {name}" for name in SCHEDULE_NAMES]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for K in Ks:
        for M in (K * f for f in factors):
            row, idle, stashes = [str(K), str(M)], [], []
            for name in SCHEDULE_NAMES:
                s = schedules.get(name, K, M)
                t = s.simulate(1, 1 + w, weight_cost=w)
                bubble = s.bubble_fraction(1, 1 + w, weight_cost=w)
                row += [_number(t.makespan), f"{bubble:.1%}"]
                idle.append(max(t.makespan - t.busy(d) for d in range(K)))
                stashes.append(" ".join(map(str, s.peak_in_flight())))
            row += [", ".join(map(_number, idle)), f"{idle[2] / idle[1]:.3f}"]
            lines.append("| " + " | ".join(row + stashes) + " |")
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    schedules = _load_schedules()
    Ks = [int(k) for k in FLAGS.stages]
    factors = [int(f) for f in FLAGS.m_factors]
    for w in (float(x) for x in FLAGS.weight_costs):
        print(f"\n### F = 1, B = 1, W = {_number(w)} (backward_cost = {_number(1 + w)})\n")
        print(table(schedules, Ks, factors, w))
    print("\n`tensorflow` imported:", "tensorflow" in sys.modules)


if __name__ == "__main__":
    app.run(main)
