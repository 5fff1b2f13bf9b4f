"""Every private Keras API tf_gpipe relies on, each behind one small named function.

Keras' public API covers most of what tf_gpipe does (``keras.tree``,
``keras.StatelessScope``, ``keras.utils.unpack_x_y_sample_weight``, ...). What it
cannot do without Keras internals lives in this package, one hook per function, each saying what
it uses and why. A Keras release that moves one of them fails in one place:
the hook raises ``KerasCompatError`` naming the Keras version and what is gone, and
its test in ``tests/test_keras_compat.py`` fails, rather than some equivalence test
far away, or worse, a silent wrong answer (a mask no longer passed, a variable left
on the wrong device). ``KerasCompatError`` is a ``RuntimeError``, never an
``AttributeError`` or ``ImportError``, so no ``except`` meant for user code can
swallow it.

Tested with Keras 3.15 and the 3.16 nightlies (``.ci/keras_nightly.sh``).
"""

from __future__ import annotations

# The hooks, by what they touch; callers use them as ``keras_compat.<hook>``.
from tf_gpipe.keras_compat.errors import KerasCompatError
from tf_gpipe.keras_compat.layers import (
    RecordingScope,
    batch_norm_reduction_axes,
    call_takes_mask,
    call_takes_training,
    current_stateless_scope,
    first_call_argument,
    get_keras_mask,
    keep_input_dtypes,
    nested_layers,
    observe_batch_norm_moments,
    overridable,
    set_keras_mask,
    suspend_stateless_scope,
    track_checkpoint_dependency,
)
from tf_gpipe.keras_compat.models import (
    aggregate_additional_loss,
    clear_losses,
    compiled_loss,
    compiled_loss_metrics,
    data_spec,
    flat_compiled_losses,
    functional_nodes,
    inputs_structure,
    loss_code,
    loss_tracker,
    losses_listed,
    model_compute_loss,
    node_arguments,
    operation_caller,
    outputs_structure,
    recorded_metric_updates,
    sequential_functional,
    set_initial_epoch,
    standardize_inputs,
    unscale_loss_for_distribution,
)
from tf_gpipe.keras_compat.optimizers import (
    backing_variable,
    colocate_optimizer_slots,
    factored_slots,
    optimizer_own_variables,
    set_backing_variable,
    skip_default_all_reduce,
    update_on_variable_device,
    variable_device,
)

__all__: list[str] = []
