"""absl flags for the pipeline settings of a training script, turned into PipelineModel arguments.

A script declares the flags at the top, parses them with ``app.run`` and hands
them over::

    from absl import app
    import tf_gpipe.flags as pipeline_flags

    pipeline_flags.define_pipeline_flags(defaults={"num_stages": 4, "virtual_cpus": 4})

    def main(argv):
        pipeline_flags.setup_devices(FLAGS)   # before the first TensorFlow op
        model = tf_gpipe.PipelineModel(layers, **pipeline_flags.pipeline_kwargs(FLAGS))

    app.run(main)

With ``define_plan_flags()`` too, ``pipeline_model(layers, sample, batch)`` builds the
model from ``tf_gpipe.plan`` when ``--plan_memory_budget`` is given, else from the flags.

The flags are checked when absl parses them, so a bad value stops the script
before TensorFlow starts, with a message that names the flag.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from absl import flags

from tf_gpipe.devices import configure_virtual_cpus
from tf_gpipe.flag_parsers import BALANCE_METHODS, BalanceParser, BalanceSerializer, BytesParser, parse_bytes
from tf_gpipe.model import PipelineModel
from tf_gpipe.plan import plan as make_plan

__all__ = [
    "BALANCE_METHODS",
    "FLAG_NAMES",
    "define_pipeline_flags",
    "define_plan_flags",
    "parse_bytes",
    "pipeline_kwargs",
    "pipeline_model",
    "setup_devices",
]

_REMAT_MODES = ("always", "except_last", "never")  # tf_gpipe.pipeline.REMAT_MODES
_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # tf_gpipe.schedules.SCHEDULES
_LOOPS = {"auto": "auto", "true": True, "false": False}  # PipelineModel(micro_batch_loops=...)
# --micro_batch_loops' deprecated name, kept (as a ``defaults`` key too) so that existing
# command lines and scripts keep working.
_LOOPS_ALIAS = "tick_loop"

FLAG_NAMES = (
    "num_stages",
    "num_micro_batches",
    "devices",
    "remat",
    "schedule",
    "virtual_stages",
    "balance",
    "deferred_batch_norm",
    "micro_batch_loops",
    "virtual_cpus",
)


def _given(flag_values: flags.FlagValues, name: str) -> bool:
    """Whether ``--name`` was set on the command line or in code, not left at its default."""
    return not flag_values[name].using_default_value


def _num_stages(values: Mapping[str, Any], flag_values: flags.FlagValues) -> int | None:
    """K as PipelineModel will see it from these flags, or None where it cannot tell yet."""
    balance, devices, v = values["balance"], values["devices"], values["virtual_stages"] or 1
    if isinstance(balance, list) and not _given(flag_values, "num_stages"):
        return len(balance) // v if len(balance) % v == 0 else None
    if devices and not _given(flag_values, "num_stages"):
        return len(devices)
    return values["num_stages"]


def define_pipeline_flags(
    flag_values: flags.FlagValues = flags.FLAGS, defaults: Mapping[str, Any] | None = None
) -> None:
    """Define the flags that configure a ``tf_gpipe.PipelineModel`` (and the demo devices).

    Flags: ``--num_stages``, ``--num_micro_batches``, ``--devices`` (comma list),
    ``--remat``, ``--schedule``, ``--virtual_stages``, ``--balance`` (comma list of
    layers per stage, or ``params``/``time``/``memory``), ``--deferred_batch_norm``,
    ``--micro_batch_loops`` (``auto``/``true``/``false``; ``--tick_loop`` is a deprecated
    alias) and ``--virtual_cpus`` (logical CPUs to make before TensorFlow starts; 0 = the
    real devices). Without ``--num_stages``,
    a ``--balance`` list or ``--devices`` gives the number of stages, as in
    ``PipelineModel``.

    Args:
        flag_values: the ``absl.flags.FlagValues`` to define them in.
        defaults: default values that replace the library's, by flag name, e.g.
            ``{"num_stages": 4, "num_micro_batches": 8, "virtual_cpus": 4}``.
            Lists may be given as Python lists.

    Raises:
        ValueError: for a name in ``defaults`` that is not one of these flags.
        absl.flags.IllegalFlagValueError: at parse time, for a bad value; the
            message names the flag.

    Example:

    ```python
    from absl import flags
    import tf_gpipe.flags as pipeline_flags

    fv = flags.FlagValues()
    pipeline_flags.define_pipeline_flags(fv, defaults={"num_stages": 4})
    fv(["prog", "--num_micro_batches=8", "--balance=3,3,2,2"])
    print(pipeline_flags.pipeline_kwargs(fv))
    ```
    """
    defaults = dict(defaults or {})
    if _LOOPS_ALIAS in defaults:
        defaults.setdefault("micro_batch_loops", defaults.pop(_LOOPS_ALIAS))
    unknown = sorted(set(defaults) - set(FLAG_NAMES))
    if unknown:
        raise ValueError(
            f"tf_gpipe.flags: unknown flag names in defaults: {unknown}; the pipeline flags are "
            f"{list(FLAG_NAMES)}."
        )
    d: dict[str, Any] = {
        "num_stages": None,
        "num_micro_batches": 1,
        "devices": None,
        "remat": "always",
        "schedule": "gpipe",
        "virtual_stages": 1,
        "balance": None,
        "deferred_batch_norm": True,
        "micro_batch_loops": "auto",
        "virtual_cpus": 0,
    }
    d.update(defaults)
    if isinstance(d["micro_batch_loops"], bool):
        d["micro_batch_loops"] = str(d["micro_batch_loops"]).lower()
    if isinstance(d["devices"], (list, tuple)):
        d["devices"] = ",".join(d["devices"])
    fv = flag_values

    flags.DEFINE_integer(
        "num_stages",
        d["num_stages"],
        "K: pipeline stages, the layers split evenly by count. Default: the length of --balance "
        "(divided by --virtual_stages), else of --devices, else 1.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_micro_batches",
        d["num_micro_batches"],
        "M: micro-batches per mini-batch; the bubble (K-1)/(M+K-1) is small once M >= 4K.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_list(
        "devices",
        d["devices"],
        "One device per stage, comma-separated, e.g. /GPU:0,/GPU:1 or "
        "/job:worker/task:0/device:CPU:0,... Empty: visible GPUs, else logical CPUs, round-robin.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "remat",
        d["remat"],
        list(_REMAT_MODES),
        "Re-materialization: recompute each stage's activations in the backward pass "
        "('always'), for all stages but the last ('except_last'), or keep them ('never').",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "schedule",
        d["schedule"],
        list(_SCHEDULES),
        "Pipeline schedule: 'gpipe' (fill-drain), '1f1b' (at most K micro-batches in flight), "
        "'interleaved' (1F1B over --virtual_stages chunks per device) or 'zb-h1' (zero bubble: "
        "each backward split into input and weight gradients). All but 'gpipe' need a "
        "loss with reduction 'sum_over_batch_size' or 'sum'.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "virtual_stages",
        d["virtual_stages"],
        "v: model chunks per device for --schedule=interleaved (K*v cells).",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE(
        BalanceParser(),
        "balance",
        d["balance"],
        "Layers per stage, e.g. 3,3,2,2 (K*v entries with --virtual_stages), or a balancing "
        "method: " + ", ".join(BALANCE_METHODS) + ". Empty: an even split by layer count.",
        flag_values=fv,
        serializer=BalanceSerializer(),
    )
    flags.DEFINE_boolean(
        "deferred_batch_norm",
        d["deferred_batch_norm"],
        "BatchNormalization moves its running statistics once per mini-batch, from the whole "
        "mini-batch's statistics (GPipe); --nodeferred_batch_norm: once per micro-batch.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "micro_batch_loops",
        d["micro_batch_loops"],
        list(_LOOPS),
        "Build fit's step as loops over micro-batches (every schedule and remat mode), so the "
        "first step does not grow with --num_micro_batches: 'auto' on every kind of device, "
        "'true' also for a custom training step's __call__, 'false' never (one call per stage "
        "and micro-batch).",
        flag_values=fv,
    )
    flags.DEFINE_alias(_LOOPS_ALIAS, "micro_batch_loops", flag_values=fv)
    flags.DEFINE_integer(
        "virtual_cpus",
        d["virtual_cpus"],
        "Split the host CPU into this many logical devices before TensorFlow starts, so that "
        "stages sit on different devices of a CPU-only machine. 0: only the real devices.",
        lower_bound=0,
        flag_values=fv,
    )

    def check_virtual_stages(values: dict[str, Any]) -> bool:
        if values["virtual_stages"] and values["virtual_stages"] > 1 and values["schedule"] != "interleaved":
            raise flags.ValidationError(
                f"--virtual_stages={values['virtual_stages']} needs --schedule=interleaved "
                f"(got --schedule={values['schedule']}); the other schedules run one stage per device."
            )
        return True

    def check_stage_counts(values: dict[str, Any]) -> bool:
        balance, devices, v = values["balance"], values["devices"], values["virtual_stages"] or 1
        k = values["num_stages"]
        if isinstance(balance, list):
            if len(balance) % v:
                raise flags.ValidationError(
                    f"--balance has {len(balance)} entries, not a multiple of --virtual_stages={v}; "
                    "give one entry per cell (num_stages * virtual_stages)."
                )
            if _given(fv, "num_stages") and k is not None and len(balance) != k * v:
                raise flags.ValidationError(
                    f"--balance has {len(balance)} entries but --num_stages={k}"
                    + (f" x --virtual_stages={v}" if v > 1 else "")
                    + f" needs {k * v}; pass --num_stages={len(balance) // v} or leave it out."
                )
        if devices:
            stages = _num_stages(values, fv)
            if stages is not None and len(devices) != stages:
                raise flags.ValidationError(
                    f"--devices lists {len(devices)} devices for {stages} stages; give exactly one "
                    "device per stage (or leave --devices empty for the default devices)."
                )
        if isinstance(balance, str) and not (k or devices):
            raise flags.ValidationError(
                f"--balance={balance} balances by measured cost and needs the number of stages: "
                "pass --num_stages (or --devices)."
            )
        return True

    def check_interleaved(values: dict[str, Any]) -> bool:
        if values["schedule"] != "interleaved":
            return True
        k, m = _num_stages(values, fv) or 1, values["num_micro_batches"]
        if m is not None and m % k:
            lower, upper = m - m % k, m - m % k + k
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise flags.ValidationError(
                f"--schedule=interleaved needs --num_micro_batches ({m}) to be a multiple of the "
                f"number of stages ({k}): use --num_micro_batches={hint}, or --schedule=1f1b."
            )
        return True

    names = ["schedule", "virtual_stages"]
    flags.register_multi_flags_validator(names, check_virtual_stages, flag_values=fv)
    names = ["num_stages", "balance", "devices", "virtual_stages"]
    flags.register_multi_flags_validator(names, check_stage_counts, flag_values=fv)
    names = ["schedule", "num_stages", "num_micro_batches", "balance", "devices", "virtual_stages"]
    flags.register_multi_flags_validator(names, check_interleaved, flag_values=fv)


def pipeline_kwargs(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """Keyword arguments for ``tf_gpipe.PipelineModel`` from parsed pipeline flags.

    ``PipelineModel(layers, **pipeline_kwargs(FLAGS))``. An empty ``--devices``
    or ``--balance`` becomes ``None`` (the defaults); a ``--balance`` method name
    is passed on as the string. ``--num_stages`` is left out (``None``) when a
    ``--balance`` list or ``--devices`` sets the number of stages and
    ``--num_stages`` was not given.

    Args:
        flag_values: parsed ``FlagValues`` holding the flags of
            :func:`define_pipeline_flags`.

    Returns:
        A dict with ``num_stages``, ``balance``, ``num_micro_batches``,
        ``devices``, ``remat``, ``schedule``, ``virtual_stages``,
        ``deferred_batch_norm`` and ``micro_batch_loops``.

    Warns (``FutureWarning``) when the deprecated ``--tick_loop`` was given.
    """
    fv = flag_values
    if fv[_LOOPS_ALIAS].present:
        warnings.warn(
            "tf_gpipe.flags: --tick_loop is deprecated, use --micro_batch_loops (the loops run over "
            "micro-batches, not clock ticks).",
            FutureWarning,
            stacklevel=2,
        )
    balance = fv.balance
    devices = list(fv.devices) if fv.devices else None
    num_stages = fv.num_stages
    if (isinstance(balance, list) or devices) and not _given(fv, "num_stages"):
        num_stages = None  # the list sets K, as PipelineModel reads it
    return {
        "num_stages": num_stages,
        "balance": list(balance) if isinstance(balance, list) else balance,
        "num_micro_batches": fv.num_micro_batches,
        "devices": devices,
        "remat": fv.remat,
        "schedule": fv.schedule,
        "virtual_stages": fv.virtual_stages,
        "deferred_batch_norm": fv.deferred_batch_norm,
        "micro_batch_loops": _LOOPS[fv.micro_batch_loops],
    }


def setup_devices(flag_values: flags.FlagValues = flags.FLAGS) -> list[str] | None:
    """Make the ``--virtual_cpus`` logical CPUs; call first thing in ``main``.

    Must run before TensorFlow initializes its devices (before the first op).

    Returns:
        The logical CPU device names when ``--virtual_cpus > 0``, else None
        (nothing changed).
    """
    n = flag_values.virtual_cpus
    if not n:
        return None
    return configure_virtual_cpus(n)


def define_plan_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Define ``--plan_memory_budget``: when set, a script calls ``tf_gpipe.plan`` with it and
    builds its model from the plan (``PipelineModel(layers, plan=p)``), printing ``p.report()``."""
    flags.DEFINE(
        BytesParser(),
        "plan_memory_budget",
        None,
        "Memory budget per device for tf_gpipe.plan (bytes, or e.g. 2GiB). When set, the planner "
        "chooses K, the stage cuts, M, remat and the schedule (the flags for those are ignored) "
        "and prints its report.",
        flag_values=flag_values,
    )


def pipeline_model(
    layers: Any,
    sample_input: Any,
    global_batch: int,
    *,
    optimizer: Any = "adam",
    name: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    flag_values: flags.FlagValues = flags.FLAGS,
) -> tuple[Any, dict[str, Any]]:
    """``(PipelineModel(layers), the settings it was built with)``, as the flags say.

    With ``--plan_memory_budget`` (:func:`define_plan_flags`) ``tf_gpipe.plan`` chooses
    the settings, K up to ``--num_stages``, for ``global_batch`` examples a step and
    ``optimizer`` (its slots and update are counted), and its report is printed; else
    they are ``kwargs`` (default :func:`pipeline_kwargs`).
    """
    fv = flag_values
    if fv.plan_memory_budget:
        plan = make_plan(
            layers,
            sample_input,
            fv.num_stages,
            fv.plan_memory_budget,
            global_batch,
            optimizer=optimizer,
            repeats=2,
        )
        print(plan.report(limit=8))
        return PipelineModel(layers, plan=plan, name=name), plan.settings()
    settings = pipeline_kwargs(fv) if kwargs is None else dict(kwargs)
    return PipelineModel(layers, name=name, **settings), settings
