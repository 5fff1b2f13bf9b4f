"""tf_gpipe.flags: defining, parsing and validating the pipeline flags, each test on fresh FlagValues."""

import keras
import numpy as np
import pytest
from absl import flags

import tf_gpipe
import tf_gpipe.flags as pipeline_flags


def _parse(args=(), defaults=None):
    fv = flags.FlagValues()
    pipeline_flags.define_pipeline_flags(fv, defaults)
    fv(["prog", *args])
    return fv


def _error(args=(), defaults=None):
    with pytest.raises(flags.IllegalFlagValueError) as info:
        _parse(args, defaults)
    return str(info.value)


def _layers(n=4):
    return [keras.layers.Dense(4, activation="tanh") for _ in range(n - 1)] + [keras.layers.Dense(2)]


# ---------------------------------------------------------------- defaults


def test_defaults_are_pipeline_model_defaults():
    fv = _parse()
    assert pipeline_flags.pipeline_kwargs(fv) == {
        "num_stages": None,
        "balance": None,
        "num_micro_batches": 1,
        "devices": None,
        "remat": "always",
        "schedule": "gpipe",
        "virtual_stages": 1,
        "deferred_batch_norm": True,
        "micro_batch_loops": "auto",
    }
    assert fv.virtual_cpus == 0


def test_script_defaults_replace_the_library_defaults():
    fv = _parse(defaults={"num_stages": 4, "num_micro_batches": 8, "virtual_cpus": 4, "devices": []})
    kwargs = pipeline_flags.pipeline_kwargs(fv)
    assert (kwargs["num_stages"], kwargs["num_micro_batches"], kwargs["devices"]) == (4, 8, None)
    assert fv.virtual_cpus == 4
    # ... and the command line still wins.
    fv = _parse(["--num_micro_batches=16"], defaults={"num_micro_batches": 8})
    assert pipeline_flags.pipeline_kwargs(fv)["num_micro_batches"] == 16


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("true", True), ("false", False)])
def test_micro_batch_loops_flag(value, expected):
    kwargs = pipeline_flags.pipeline_kwargs(_parse([f"--micro_batch_loops={value}"]))
    assert kwargs["micro_batch_loops"] == expected  # PipelineModel's argument
    kwargs = pipeline_flags.pipeline_kwargs(_parse(defaults={"micro_batch_loops": expected}))
    assert kwargs["micro_batch_loops"] == expected
    assert "--micro_batch_loops" in _error(["--micro_batch_loops=maybe"])


def test_tick_loop_is_a_deprecated_alias_of_micro_batch_loops():
    fv = _parse(["--tick_loop=false"])
    assert fv.micro_batch_loops == "false"
    with pytest.warns(FutureWarning, match="--micro_batch_loops"):
        assert pipeline_flags.pipeline_kwargs(fv)["micro_batch_loops"] is False
    # A script's defaults may still use the old name.
    assert _parse(defaults={"tick_loop": True}).micro_batch_loops == "true"
    assert "--micro_batch_loops" in _error(["--tick_loop=maybe"])


def test_the_new_flag_name_does_not_warn(recwarn):
    pipeline_flags.pipeline_kwargs(_parse(["--micro_batch_loops=true"]))
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_defaults_accept_python_lists():
    fv = _parse(defaults={"balance": [2, 2], "devices": ["/CPU:0", "/CPU:1"]})
    kwargs = pipeline_flags.pipeline_kwargs(fv)
    assert kwargs["balance"] == [2, 2] and kwargs["devices"] == ["/CPU:0", "/CPU:1"]


def test_unknown_default_name_is_rejected():
    with pytest.raises(ValueError, match="num_stage"):
        pipeline_flags.define_pipeline_flags(flags.FlagValues(), {"num_stage": 4})


def test_all_flags_are_defined_with_help():
    fv = flags.FlagValues()
    pipeline_flags.define_pipeline_flags(fv)
    for name in pipeline_flags.FLAG_NAMES:
        assert fv[name].help, name


# ---------------------------------------------------------------- --balance


@pytest.mark.parametrize(
    "text, expected",
    [("3,3,2,2", [3, 3, 2, 2]), (" 2, 2 ", [2, 2]), ("5", [5]), ("", None)]
    + [(m, m) for m in pipeline_flags.BALANCE_METHODS],
)
def test_balance_values(text, expected):
    fv = _parse(
        [f"--balance={text}", "--num_stages=2"]
        if text in pipeline_flags.BALANCE_METHODS
        else [f"--balance={text}"]
    )
    assert pipeline_flags.pipeline_kwargs(fv)["balance"] == expected


@pytest.mark.parametrize("text", ["3,x", "3,0", "-1", "3;2", "parameters", "2,,2"])
def test_bad_balance_names_the_flag(text):
    message = _error([f"--balance={text}"])
    assert "--balance" in message


def test_balance_list_sets_the_number_of_stages():
    # A script default for --num_stages gives way to a --balance list ...
    fv = _parse(["--balance=3,1"], defaults={"num_stages": 4})
    assert pipeline_flags.pipeline_kwargs(fv)["num_stages"] is None
    model = tf_gpipe.PipelineModel(_layers(), **pipeline_flags.pipeline_kwargs(fv))
    assert model.balance == [3, 1] and model.num_stages == 2
    # ... but both given on the command line must agree.
    message = _error(["--balance=3,1", "--num_stages=4"])
    assert "--balance" in message and "--num_stages=4" in message and "--num_stages=2" in message
    fv = _parse(["--balance=3,1", "--num_stages=2"])
    assert pipeline_flags.pipeline_kwargs(fv)["num_stages"] == 2


def test_balance_method_is_passed_through_and_needs_stages():
    fv = _parse(["--balance=time", "--num_stages=2"])
    kwargs = pipeline_flags.pipeline_kwargs(fv)
    assert kwargs["balance"] == "time" and kwargs["num_stages"] == 2
    assert "--num_stages" in _error(["--balance=memory"])


def test_balance_serializes_back():
    fv = _parse(["--balance=3,3,2,2"])
    assert "--balance=3,3,2,2" in fv.flags_into_string()


# ---------------------------------------------------------------- --devices


def test_devices_list(cpu_devices):
    fv = _parse([f"--devices={cpu_devices[2]},{cpu_devices[0]}"], defaults={"num_stages": 4})
    kwargs = pipeline_flags.pipeline_kwargs(fv)
    assert kwargs["devices"] == [cpu_devices[2], cpu_devices[0]] and kwargs["num_stages"] is None
    model = tf_gpipe.PipelineModel(_layers(), **kwargs)
    assert model.devices == [cpu_devices[2], cpu_devices[0]]


def test_devices_count_must_match_stages():
    message = _error(["--devices=/CPU:0,/CPU:1", "--num_stages=3"])
    assert "--devices" in message and "3 stages" in message
    message = _error(["--devices=/CPU:0,/CPU:1,/CPU:2", "--balance=2,2"])
    assert "--devices" in message and "2 stages" in message


def test_empty_devices_is_the_default():
    assert pipeline_flags.pipeline_kwargs(_parse(["--devices="]))["devices"] is None


# ---------------------------------------------------------------- schedules


def test_enums_name_the_flag():
    assert "--remat" in _error(["--remat=sometimes"])
    assert "--schedule" in _error(["--schedule=pipedream"])


@pytest.mark.parametrize(
    "args", [["--num_micro_batches=0"], ["--num_stages=0"], ["--virtual_stages=0"], ["--virtual_cpus=-1"]]
)
def test_bounds_name_the_flag(args):
    assert args[0].split("=")[0] in _error(args)


def test_virtual_stages_need_the_interleaved_schedule():
    message = _error(["--virtual_stages=2", "--schedule=1f1b"])
    assert "--virtual_stages=2" in message and "--schedule=interleaved" in message


def test_interleaved_needs_m_multiple_of_k():
    message = _error(["--schedule=interleaved", "--num_stages=4", "--num_micro_batches=6"])
    assert "--num_micro_batches" in message and "4 or 8" in message
    fv = _parse(["--schedule=interleaved", "--virtual_stages=2", "--num_stages=2", "--num_micro_batches=4"])
    model = tf_gpipe.PipelineModel(_layers(), **pipeline_flags.pipeline_kwargs(fv))
    assert (model.schedule, model.virtual_stages, len(model.cells)) == ("interleaved", 2, 4)


def test_balance_entries_must_cover_virtual_stages():
    message = _error(["--schedule=interleaved", "--virtual_stages=2", "--balance=2,1,1"])
    assert "--balance" in message and "--virtual_stages=2" in message


def test_flags_build_a_model_that_trains():
    fv = _parse(
        [
            "--num_stages=2",
            "--num_micro_batches=3",
            "--remat=except_last",
            "--schedule=1f1b",
            "--nodeferred_batch_norm",
            "--micro_batch_loops=false",
        ]
    )
    model = tf_gpipe.PipelineModel(_layers(), **pipeline_flags.pipeline_kwargs(fv))
    assert model.micro_batch_loops is False
    settings = (model.num_stages, model.num_micro_batches, model.remat, model.schedule)
    assert settings == (2, 3, "except_last", "1f1b")
    assert model.deferred_batch_norm is False
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    history = model.fit(rng.randn(12, 3).astype("float32"), rng.randint(0, 2, 12), batch_size=6, verbose=0)
    assert np.isfinite(history.history["loss"][0])


# ---------------------------------------------------------------- --virtual_cpus


def test_setup_devices(cpu_devices):
    assert pipeline_flags.setup_devices(_parse()) is None  # 0: nothing to do
    # conftest.py already made 4 logical CPUs: asking for the same number again is harmless ...
    assert pipeline_flags.setup_devices(_parse(["--virtual_cpus=4"])) == cpu_devices
    # ... asking for more once TensorFlow is running says what to do.
    with pytest.raises(RuntimeError, match="before any TensorFlow op"):
        pipeline_flags.setup_devices(_parse(["--virtual_cpus=8"]))


# ---------------------------------------------------------------- --plan_memory_budget


@pytest.mark.parametrize(
    "text, expected", [("1048576", 2**20), ("2GiB", 2 * 2**30), ("1.5 MiB", 3 * 2**19), ("3GB", 3 * 10**9)]
)
def test_plan_memory_budget_parses_bytes_and_units(text, expected):
    fv = flags.FlagValues()
    pipeline_flags.define_plan_flags(fv)
    fv(["prog", f"--plan_memory_budget={text}"])
    assert fv.plan_memory_budget == expected


def test_plan_memory_budget_is_off_by_default_and_names_a_bad_unit():
    fv = flags.FlagValues()
    pipeline_flags.define_plan_flags(fv)
    fv(["prog"])
    assert fv.plan_memory_budget is None
    with pytest.raises(flags.IllegalFlagValueError, match="512MiB or 2GiB"):
        fv(["prog", "--plan_memory_budget=2 parsecs"])


def test_every_schedule_is_a_flag_value():
    from tf_gpipe import schedules

    for name in schedules.SCHEDULES:
        args = [f"--schedule={name}", "--num_stages=2", "--num_micro_batches=4"]
        assert _parse(args).schedule == name
    assert "zb-h1" in _error(["--schedule=zb"])
