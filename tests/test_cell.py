"""tf_gpipe.cell: each stage's variables live on its device, and its ops run there during model.fit."""

import json
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import child_env, record_slots, same_device

from tf_gpipe import PipelineModel

REPO_ROOT = Path(__file__).resolve().parents[1]
IN_DIM = 5
# Not the identity order, so that "everything on the default device" cannot pass by chance.
PERMUTED = ["/device:CPU:3", "/device:CPU:1", "/device:CPU:2"]


def _layers(dropout=False):
    layers = [
        keras.layers.Dense(8, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(8, activation="relu"),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(0.5))
    layers.append(keras.layers.Dense(3))
    return layers


def _model(dropout=False, devices=PERMUTED, **kwargs):
    kwargs.setdefault("num_micro_batches", 2)
    return PipelineModel(_layers(dropout), num_stages=3, devices=devices, **kwargs)


def _data(n=16, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, IN_DIM).astype("float32"), rng.randn(n, 3).astype("float32")


def _misplaced_stage_variables(model, include_seed_state=False):
    """(variable path, its device, its stage's device) for each misplaced variable."""
    wrong, checked = [], 0
    for cell in model.cells:
        for layer in cell.layers:
            variables = layer.variables if include_seed_state else layer.weights
            for v in variables:
                checked += 1
                if not same_device(v.value.device, cell.device):
                    wrong.append((v.path, v.value.device, cell.device))
    assert checked > 0, "no variables to check: the model is not built"
    return wrong


def _assert_stage_variables_placed(model, include_seed_state=False):
    assert model.built
    assert _misplaced_stage_variables(model, include_seed_state) == []


# ---------------------------------------------------------------- variables


def test_variables_on_stage_devices_after_build():
    model = _model()
    model.build((None, IN_DIM))
    assert model.devices == PERMUTED
    assert [len(c.layers) for c in model.cells] == [2, 1, 1]
    _assert_stage_variables_placed(model)
    # BatchNormalization's non-trainable statistics too.
    bn = model.cells[0].layers[1]
    assert same_device(bn.moving_mean.value.device, PERMUTED[0])


def test_variables_on_stage_devices_when_built_by_fit():
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    assert not model.built
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    _assert_stage_variables_placed(model)


def test_variables_on_stage_devices_when_built_inside_tf_function():
    model = _model()

    @tf.function
    def step(x):
        return model(x, training=True)

    x, _ = _data(8)
    out = step(tf.constant(x))
    assert out.shape == (8, 3)
    _assert_stage_variables_placed(model)


def test_variables_on_stage_devices_when_built_symbolically():
    # Inside a functional model, Keras first calls the PipelineModel on KerasTensors.
    model = _model()
    inputs = keras.Input((IN_DIM,))
    outer = keras.Model(inputs, keras.layers.Activation("softmax")(model(inputs)))
    _assert_stage_variables_placed(model)
    x, _ = _data(4)
    assert outer(tf.constant(x)).shape == (4, 3)


def test_dropout_seed_state_on_stage_device():
    model = _model(dropout=True)
    model.build((None, IN_DIM))
    dropout = model.cells[1].layers[1]  # balance [2, 2, 1]
    assert isinstance(dropout, keras.layers.Dropout)
    assert dropout.seed_generator.state in dropout.variables
    _assert_stage_variables_placed(model, include_seed_state=True)


def test_optimizer_slots_on_stage_devices():
    model = _model()
    opt = keras.optimizers.Adam()
    slots = record_slots(opt)
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    device = {id(v): cell.device for cell in model.cells for v in cell.trainable_variables}
    assert len(slots) == 2 * len(device)  # a momentum and a velocity per variable
    wrong = [
        (slot.path, slot.value.device, device[id(v)])
        for v, slot in slots
        if not same_device(slot.value.device, device[id(v)])
    ]
    assert wrong == []


def test_variables_on_stage_devices_from_built_sequential():
    seq = keras.Sequential([keras.Input((IN_DIM,))] + _layers())
    model = PipelineModel(seq, num_stages=3, devices=PERMUTED)
    _assert_stage_variables_placed(model)


@pytest.mark.parametrize("how", ["from_config", "load_model"])
def test_variables_on_stage_devices_after_loading(tmp_path, how):
    model = _model()
    model.build((None, IN_DIM))
    _assert_stage_variables_placed(model)
    if how == "from_config":
        clone = PipelineModel.from_config(model.get_config())
        clone.build((None, IN_DIM))
    else:
        model.save(tmp_path / "m.keras")
        clone = keras.models.load_model(tmp_path / "m.keras")
    assert clone.devices == PERMUTED
    _assert_stage_variables_placed(clone)


# ---------------------------------------------------------------- XLA stage by stage


def test_jit_compile_true_compiles_each_stage_not_the_step():
    model = _model()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    # The step around the stages stays uncompiled: one XLA cluster would span every device.
    assert model.jit_compile is False
    assert model.stage_jit == [True, True, True]
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    _assert_stage_variables_placed(model)


def test_jit_compile_auto_is_off_on_cpu():
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    assert model.jit_compile is False
    assert model.supports_jit is False
    assert model.stage_jit == [False, False, False]  # "auto": XLA only with a GPU or TPU


def test_outer_functional_model_does_not_support_jit():
    inputs = keras.Input((IN_DIM,))
    hidden = keras.layers.Dense(4)(inputs)
    inner = PipelineModel([keras.layers.Dense(8), keras.layers.Dense(3)], num_stages=2)
    outer = keras.Model(inputs, inner(hidden))
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        outer.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert outer.jit_compile is False
    # The counterpart without the pipeline does compile with XLA: the check above is not vacuous.
    plain = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert plain.jit_compile is True


# ---------------------------------------------------------------- ops during model.fit

# Runs in a fresh interpreter: placement logging must be on before TensorFlow's runtime
# starts (turning it on later has no effect), and the tests' own process is long started.
_FIT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # the placement log is INFO
    import tensorflow as tf
    tf.debugging.set_log_device_placement(True)
    import tf_gpipe
    tf_gpipe.configure_virtual_cpus(4)
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(16, 6).astype("float32")
    y = rng.randn(16, 3).astype("float32")
    result = {}
    for tag, jit, devices, remat, micro_batch_loops in [
        ("auto", "auto", ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"], "always", False),
        ("jit", True, ["/device:CPU:2", "/device:CPU:0", "/device:CPU:3"], "except_last", False),
        ("loop", "auto", ["/device:CPU:1", "/device:CPU:3", "/device:CPU:0"], "always", "auto"),
    ]:
        sys.stderr.write("@@BEGIN " + tag + "@@\\n"); sys.stderr.flush()
        layers = [
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
        ]
        model = tf_gpipe.PipelineModel(
            layers, num_stages=3, num_micro_batches=2, devices=devices, remat=remat,
            micro_batch_loops=micro_batch_loops,
        )
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        sys.stderr.write("@@END " + tag + "@@\\n"); sys.stderr.flush()
        result[tag] = {
            "devices": model.devices,
            "jit_compile": model.jit_compile,
            "stage_jit": model.stage_jit,
            "iterations": int(model.optimizer.iterations.numpy()),
        }
    print("RESULT " + json.dumps(result), flush=True)
    """
)

# A placement line (one line in the log):
# I0000 00:00:... 123 placer.cc:162] StatefulPartitionedCall/stage1_mb0/dense_1/MatMul: (MatMul): \
#     /job:localhost/replica:0/task:0/device:CPU:1
_PLACEMENT = re.compile(r"placer\.cc:\d+\] (\S+): \((\w+)\): (/\S+)\s*$")
_STAGE_SCOPE = re.compile(r"(?:^|/)stage(\d+)_mb(\d+)(_backward)?/")
# Inside a stage function's body (one body per stage, called for every micro-batch):
# "stage1_forward/dense_1/MatMul", "gradient_tape/stage1_replay/dense_1/MatMul/MatMul".
_STAGE_BODY = re.compile(r"(?:^|/)stage(\d+)_(forward|replay)/")


def _parse_sections(log: str):
    """{tag: [(node, op, device)]} for the placement lines between the script's markers."""
    sections, current = {}, None
    for line in log.splitlines():
        marker = re.match(r"@@(BEGIN|END) (\w+)@@", line.strip())
        if marker:
            current = marker.group(2) if marker.group(1) == "BEGIN" else None
            if current:
                sections[current] = []
            continue
        found = _PLACEMENT.search(line)
        if found and current:
            sections[current].append(found.groups())
    return sections


@pytest.fixture(scope="module")
def fit_placement_log(tmp_path_factory):
    script = tmp_path_factory.mktemp("placement") / "fit_with_placement_log.py"
    script.write_text(_FIT_SCRIPT)
    env = child_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=str(REPO_ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result_lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result_lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(result_lines[-1][len("RESULT ") :])
    return result, _parse_sections(proc.stderr)


_FIT_CONFIGS = pytest.mark.parametrize(
    "tag, expected_devices",
    [
        ("auto", ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]),
        ("jit", ["/device:CPU:2", "/device:CPU:0", "/device:CPU:3"]),
    ],
)


def _stage_ops(fit_placement_log, tag, expected_devices):
    """[(stage, micro-batch, is_backward, node, op, device)] of one fit, after sanity checks."""
    result, sections = fit_placement_log
    info = result[tag]
    assert info["devices"] == expected_devices
    assert info["jit_compile"] is False  # never the whole step: that cluster would span devices
    assert info["stage_jit"] == [tag == "jit"] * 3
    assert info["iterations"] == 2  # fit really ran its two steps
    placements = sections.get(tag)
    assert placements, f"no placement log for {tag!r}; sections: {list(sections)}"
    out = []
    for node, op, device in placements:
        scope = _STAGE_SCOPE.search(node)
        if not scope:
            body = _STAGE_BODY.search(node)
            if body:  # micro-batch None: the body every micro-batch's call runs
                backward = body.group(2) == "replay" or "gradient" in node
                out.append((int(body.group(1)), None, backward, node, op, device))
            continue
        k, m = int(scope.group(1)), int(scope.group(2))
        # A re-materialized stage replays under "stage{k}_mb{m}_backward"; a stage kept on a
        # tape (remat="except_last") has its gradient ops under "gradient_tape/stage{k}_mb{m}".
        backward = bool(scope.group(3)) or "gradient_tape/" in node
        out.append((k, m, backward, node, op, device))
    return out


@pytest.mark.xdist_group("placement_log")  # its module fixture runs once, on one worker
@_FIT_CONFIGS
def test_compute_ops_run_on_stage_devices_during_fit(fit_placement_log, tag, expected_devices):
    ops = _stage_ops(fit_placement_log, tag, expected_devices)
    compute = [o for o in ops if o[4] not in ("Identity", "NoOp")]
    misplaced = [
        (node, op, device, expected_devices[k])
        for k, m, backward, node, op, device in compute
        if not same_device(device, expected_devices[k])
    ]
    assert misplaced == [], misplaced[:20]
    expected = {(k, m, b) for k in range(3) for m in range(2) for b in (False, True)}
    # Each stage runs as a function: the placer sees one call per stage, micro-batch and
    # direction, on the stage's device (under XLA its ops are XLA's, not the placer's).
    calls = {(k, m, b) for k, m, b, _, op, _ in compute if op.endswith("PartitionedCall") and m is not None}
    if tag == "jit":
        assert expected <= calls, sorted(expected - calls)
        return
    assert {(k, m, False) for k in range(3) for m in range(2)} <= calls
    # The function bodies (one per stage and direction) ran their matmuls on the stage's
    # device; remat="always" replays every stage, so each has a replay body too.
    seen_matmul = {(k, b) for k, m, b, _, op, _ in compute if m is None and op in ("MatMul", "_MklMatMul")}
    assert {(k, b) for k in range(3) for b in (False, True)} <= seen_matmul, seen_matmul
    seen_ops = {op for *_, op, _ in compute}
    assert {"BiasAdd", "BiasAddGrad", "Relu", "ReluGrad", "ReadVariableOp"} <= seen_ops


@pytest.mark.xdist_group("placement_log")  # its module fixture runs once, on one worker
@_FIT_CONFIGS
def test_all_stage_scope_ops_run_on_stage_devices_during_fit(fit_placement_log, tag, expected_devices):
    ops = _stage_ops(fit_placement_log, tag, expected_devices)
    assert len(ops) >= 3 * 2 * 2 * (1 if tag == "jit" else 3)
    misplaced = [
        (node, op, device, expected_devices[k])
        for k, m, backward, node, op, device in ops
        if not same_device(device, expected_devices[k])
    ]
    assert misplaced == [], misplaced[:20]


# The loops over micro-batches (tf_gpipe.micro_batch_loop, the default on CPUs):
# ".../while/stage1_forward/..." around each stage's call, and the function bodies' own
# "stage1_forward/..." and "stage1_replay/..." scopes.
_LOOP_SCOPE = re.compile(r"(?:^|/)stage(\d+)_(forward|backward|replay)/")
_INLINED_ARGUMENT = re.compile(r"/input/_\d+$")


@pytest.mark.xdist_group("placement_log")  # its module fixture runs once, on one worker
def test_the_loops_run_each_stage_on_its_device_during_fit(fit_placement_log):
    """Every op in a stage's scope of the loops (its cond, its inlined function bodies) is
    placed on the stage's device, and the bodies are inlined: no stage-function call is left."""
    result, sections = fit_placement_log
    expected_devices = result["loop"]["devices"]
    assert expected_devices == ["/device:CPU:1", "/device:CPU:3", "/device:CPU:0"]
    assert result["loop"]["iterations"] == 2
    ops = []
    for node, op, device in sections["loop"]:
        scope = _LOOP_SCOPE.search(node)
        # An inlined call's argument (an Identity named after the tensor it passes) stays
        # where that tensor is made: another stage's, for the output or gradient it hands on.
        if scope and not (node.startswith("Func/") and _INLINED_ARGUMENT.search(node)):
            ops.append((int(scope.group(1)), scope.group(2), node, op, device))
    misplaced = [
        (node, op, device) for k, _, node, op, device in ops if not same_device(device, expected_devices[k])
    ]
    assert misplaced == [], misplaced[:20]
    # The loops call each stage's functions once, and inline them (``stage.inlined``):
    # their bodies run in the stage's scope of the loops, with no call op of their own.
    calls = sorted((k, d) for k, d, node, op, _ in ops if op.endswith("PartitionedCall"))
    assert calls == [], calls
    matmuls = {
        (k, "replay" if f"stage{k}_replay/" in node else d)
        for k, d, node, op, _ in ops
        if op in ("MatMul", "_MklMatMul")
    }
    assert {(k, d) for k in range(3) for d in ("forward", "replay")} <= matmuls, matmuls
