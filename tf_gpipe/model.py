"""PipelineModel: the public Keras model that pipelines a list of layers across devices."""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence, Union

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as _loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from tf_gpipe import microbatch
from tf_gpipe.cell import Cell
from tf_gpipe.devices import resolve_devices
from tf_gpipe.partition import split_by_balance
from tf_gpipe.pipeline import REMAT_MODES, Pipeline

__all__ = ["PipelineModel"]


def _unpack_layers(layers: Any):
    """A flat list of layers, plus the input spec if the user gave one (keras.Input / Sequential)."""
    spec = None
    if isinstance(layers, keras.Sequential):
        if layers.built and getattr(layers, "_functional", None) is not None:
            spec = layers._functional.inputs
            spec = spec[0] if isinstance(spec, list) and len(spec) == 1 else spec
        layers = layers.layers
    elif isinstance(layers, keras.layers.Layer):
        raise TypeError(
            "tf_gpipe: `layers` must be a list of Keras layers or a keras.Sequential, got the "
            f"single layer {layers.name!r}; pass [layer]."
        )
    try:
        layers = list(layers)
    except TypeError:
        raise TypeError(
            f"tf_gpipe: `layers` must be a list of Keras layers or a keras.Sequential, got {type(layers).__name__}."
        ) from None
    if layers and isinstance(layers[0], keras.layers.InputLayer):
        first = layers.pop(0)
        spec = first.output
    for i, layer in enumerate(layers):
        if isinstance(layer, keras.layers.InputLayer):
            raise ValueError(
                f"tf_gpipe: layers[{i}] is an InputLayer; only the first layer may be one."
            )
        if not isinstance(layer, keras.layers.Layer):
            hint = ""
            if type(layer).__module__.startswith(("tf_keras", "tensorflow.python.keras")):
                hint = " It is a tf.keras (Keras 2) layer; build it with `import keras` (Keras 3)."
            raise TypeError(
                f"tf_gpipe: layers[{i}] is {type(layer).__name__}, not a Keras layer.{hint}"
            )
    return layers, spec


def _spec_from(structure: Any) -> Any:
    def one(t):
        if t is None:
            return None
        dtype = getattr(t, "dtype", "float32")
        dtype = dtype.name if isinstance(dtype, tf.DType) else str(dtype)
        return keras.KerasTensor(tuple(t.shape), dtype=dtype)

    return tf.nest.map_structure(one, structure)


@keras.saving.register_keras_serializable(package="tf_gpipe")
class PipelineModel(keras.Model):
    """A sequence of Keras layers split into stages on devices, trained with GPipe.

    Drop-in for ``keras.Sequential(layers)``: ``compile``/``fit``/``evaluate``/
    ``predict``/``save`` work, and the numbers match the unsplit model. Each
    stage's variables are created on its device and its ops run there; only the
    tensors between stages cross devices. Every mini-batch is cut into
    ``num_micro_batches`` micro-batches that flow through the stages in the
    fill-drain order, so stage ``k`` works on micro-batch ``m`` while stage
    ``k-1`` works on ``m+1``. With re-materialization, each stage keeps only its
    input per micro-batch and recomputes the rest in the backward pass, replaying
    exactly the same dropout masks and applying BatchNormalization updates once.
    Gradients are summed over micro-batches on each stage's device and applied
    in one optimizer update per mini-batch.

    Args:
        layers: Keras layers applied in order (a list, or a ``keras.Sequential``).
            A leading ``keras.Input``/``InputLayer`` fixes the input shape.
        num_stages: K, the number of stages for an even split by layer count.
            Defaults to ``len(balance)``, else ``len(devices)``, else 1.
        balance: layers per stage, e.g. ``[3, 3, 2, 2]``, instead of an even split.
        num_micro_batches: M, micro-batches per mini-batch. A batch smaller
            than M gives fewer (never empty) micro-batches where its size is known
            while tracing; elsewhere empty micro-batches are harmless.
        devices: one device string per stage. Default: visible GPUs, else
            logical CPUs, else ``CPU:0``, assigned round-robin.
        remat: ``"always"`` (re-materialize every stage), ``"except_last"`` (not
            the last stage, whose backward follows its forward at once) or
            ``"never"``.
        **kwargs: ``name``, ``trainable``, ``dtype`` as for any Keras model.

    Call arguments:
        inputs: a tensor or nested structure (tuple/dict) of tensors whose first
            axis is the batch.
        training: as for any Keras layer.
        mask: optional Keras mask for the inputs.

    Returns:
        The last stage's outputs for the whole mini-batch, micro-batches merged in order.

    Example:

    ```python
    import keras, numpy as np, tf_gpipe
    tf_gpipe.configure_virtual_cpus(2)          # demo devices on a CPU-only machine
    model = tf_gpipe.PipelineModel(
        [keras.layers.Dense(64, activation="relu"), keras.layers.Dropout(0.1),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)],
        num_stages=2, num_micro_batches=4)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(np.random.rand(256, 32), np.random.randint(0, 10, 256), epochs=1)
    ```
    """

    def __init__(
        self,
        layers: Union[Sequence[keras.layers.Layer], keras.Sequential],
        num_stages: Optional[int] = None,
        balance: Optional[Sequence[int]] = None,
        num_micro_batches: int = 1,
        devices: Optional[Sequence[str]] = None,
        remat: str = "always",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        layer_list, spec = _unpack_layers(layers)
        if not layer_list:
            raise ValueError(
                "tf_gpipe: `layers` is empty; a PipelineModel needs at least one layer."
            )
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(
                f"tf_gpipe: num_micro_batches must be an integer >= 1, got {num_micro_batches!r}; "
                "GPipe's bubble is small once num_micro_batches >= 4 * num_stages."
            )
        if remat not in REMAT_MODES:
            raise ValueError(
                f"tf_gpipe: unknown remat mode {remat!r}; use one of {list(REMAT_MODES)}."
            )
        if num_stages is None and balance is None:
            num_stages = len(devices) if devices is not None and not isinstance(devices, str) else 1
        groups = split_by_balance(layer_list, num_stages, balance)
        self._devices_arg = None if devices is None else list(devices) if not isinstance(devices, str) else devices
        resolved = resolve_devices(devices, len(groups))
        self.num_micro_batches = num_micro_batches
        self.remat = remat
        self.balance = [len(g) for g in groups]
        self.stage_layers = layer_list  # tracked in order: weights ordered as keras.Sequential(layers)
        self._pipeline = Pipeline(
            [Cell(k, g, d) for k, (g, d) in enumerate(zip(groups, resolved))], remat
        )
        # XLA would fuse every stage into one cluster on one device: keep it off.
        self.supports_jit = False
        # Like keras.Sequential: inputs reach the first layer in their own dtype (no cast
        # to this model's policy), so float64 or int inputs stay as they are.
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self._build_spec = None
        if spec is not None:
            self._build_cells(_spec_from(spec))

    # ------------------------------------------------------------------ properties
    @property
    def num_stages(self) -> int:
        return len(self._pipeline.cells)

    @property
    def devices(self) -> List[str]:
        """The device of each stage, canonical form."""
        return [c.device for c in self._pipeline.cells]

    @property
    def cells(self) -> List[Cell]:
        """The stages: their layers and devices."""
        return list(self._pipeline.cells)

    # ------------------------------------------------------------------ building
    def _build_cells(self, spec: Any) -> None:
        self._build_spec = spec
        for cell in self._pipeline.cells:
            spec = cell.build(spec)
        self.built = True

    def build(self, input_shape: Any = None) -> None:
        """Build every stage on its device for inputs of ``input_shape`` (float32)."""
        if self.built:
            return
        if input_shape is None:
            raise ValueError(
                "tf_gpipe: PipelineModel.build needs an input shape, e.g. model.build((None, 32)), "
                "or call the model on data."
            )
        spec = tree.map_shape_structure(
            lambda s: keras.KerasTensor(tuple(s), dtype=self.input_dtype), input_shape
        )
        self._build_cells(spec)

    def _maybe_build(self, call_spec):
        # Keras would build from shapes alone; the real dtypes matter (token ids, masks).
        if not self.built:
            self._build_cells(_spec_from(call_spec.first_arg))
        return super()._maybe_build(call_spec)

    def get_build_config(self) -> dict:
        if self._build_spec is None:
            return {}
        return {
            "input_spec": tf.nest.map_structure(
                lambda t: None if t is None else {"shape": list(t.shape), "dtype": t.dtype},
                self._build_spec,
            )
        }

    def build_from_config(self, config: dict) -> None:
        if "input_spec" in config and not self.built:

            def one(d):
                return keras.KerasTensor(tuple(d["shape"]), dtype=d["dtype"])

            spec = tree.traverse(
                lambda d: one(d) if isinstance(d, dict) and set(d) == {"shape", "dtype"} else None,
                config["input_spec"],
                top_down=True,
            )
            self._build_cells(spec)

    # ------------------------------------------------------------------ running
    def _split(self, inputs: Any, mask: Any):
        inputs = tf.nest.map_structure(
            lambda t: t if t is None or tf.is_tensor(t) else tf.convert_to_tensor(t), inputs
        )
        joint = microbatch.split((inputs, mask), self.num_micro_batches)
        xs = microbatch.Split([c[0] for c in joint.chunks], joint.sizes, joint.static)
        return xs, [c[1] for c in joint.chunks]

    def call(self, inputs: Any, training: Optional[bool] = None, mask: Any = None) -> Any:
        xs, masks = self._split(inputs, mask)
        acts, out_masks, losses = self._pipeline.call(xs, masks, training)
        outputs = microbatch.merge(acts)
        if out_masks[0] is not None:
            merged_mask = microbatch.merge(out_masks)
            for t, m in zip(tf.nest.flatten(outputs), tf.nest.flatten(merged_mask)):
                if m is not None:
                    keras.src.backend.set_keras_mask(t, m)
        for loss in losses:
            self.add_loss(loss)
        return outputs

    def compile(self, *args: Any, jit_compile: Any = "auto", **kwargs: Any) -> None:
        """As ``keras.Model.compile``; XLA stays off because it ignores stage placement."""
        if jit_compile is True:
            warnings.warn(
                "tf_gpipe: jit_compile=True would let XLA fuse all stages onto one device; "
                "PipelineModel compiles with jit_compile=False. Use jit_compile inside a layer "
                "(e.g. a tf.function(jit_compile=True) in its call) to compile one stage.",
                stacklevel=2,
            )
        super().compile(*args, jit_compile=False, **kwargs)

    def train_step(self, data: Any) -> dict:
        """One mini-batch: fill-drain forward, loss on the merged batch, explicit
        backward stage by stage, gradients summed per device, one optimizer update."""
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if not self.built:
            self._build_cells(_spec_from(x))
        xs, masks = self._split(x, None)
        pipe = self._pipeline
        K = self.num_stages
        records = pipe.forward(xs, masks, training=True)
        outs = [records[m][K - 1].outputs for m in range(len(xs))]
        flat_outs = [tf.nest.flatten(o) for o in outs]
        cell_losses = [
            ((m, k), i, loss)
            for m, row in enumerate(records)
            for k, rec in enumerate(row)
            for i, loss in enumerate(rec.losses)
        ]
        trainable = self.trainable_weights
        with tf.GradientTape() as tape:
            watched = [t for f in flat_outs for t in f if t is not None and t.dtype.is_floating]
            tape.watch(watched + [c[2] for c in cell_losses])
            y_pred = microbatch.merge(outs)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            if cell_losses:
                loss = loss + tf.add_n([tf.cast(c[2], loss.dtype) for c in cell_losses])
            self._loss_tracker.update_state(
                _loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
            )
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        sources = [t for f in flat_outs for t in f] + [c[2] for c in cell_losses] + list(trainable)
        usable = [i for i, t in enumerate(sources) if t is not None and tf.as_dtype(t.dtype).is_floating]
        got = tape.gradient(
            loss, [sources[i] for i in usable], unconnected_gradients=tf.UnconnectedGradients.NONE
        )
        grads: List[Optional[tf.Tensor]] = [None] * len(sources)
        for i, g in zip(usable, got):
            grads[i] = g
        pos = 0
        output_grads = []
        for f in flat_outs:
            output_grads.append(grads[pos : pos + len(f)])
            pos += len(f)
        loss_grads: dict = {}
        for c in cell_losses:
            loss_grads.setdefault(c[0], []).append(grads[pos])
            pos += 1
        direct = grads[pos:]  # from regularizers and other terms that read weights directly
        if trainable:
            totals = pipe.backward(records, output_grads, loss_grads, training=True)
            final = []
            for v, g in zip(trainable, direct):
                total = totals.get(id(v))
                if g is not None:
                    with tf.device(v.value.device):
                        total = g if total is None else total + g
                final.append(total)
            self.optimizer.apply_gradients(zip(final, trainable))
        else:
            warnings.warn("The model does not have any trainable weights.")
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------ saving
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "layers": [keras.saving.serialize_keras_object(layer) for layer in self.stage_layers],
            "balance": list(self.balance),
            "num_micro_batches": self.num_micro_batches,
            "devices": self._devices_arg,
            "remat": self.remat,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "PipelineModel":
        config = dict(config)
        layers = [
            keras.saving.deserialize_keras_object(c, custom_objects=custom_objects)
            for c in config.pop("layers")
        ]
        devices = config.get("devices")
        if devices is not None:
            try:
                resolve_devices(devices, len(devices))
            except ValueError as e:
                warnings.warn(
                    f"tf_gpipe: the saved devices are not all available here ({e}); "
                    "loading with the default devices instead.",
                    stacklevel=2,
                )
                config["devices"] = None
        return cls(layers=layers, **config)

    def to_sequential(self, name: Optional[str] = None) -> keras.Sequential:
        """An unsplit ``keras.Sequential`` copy of the layers, with the current weights.

        Train pipelined, serve unsplit: the copy has no device placement and no
        micro-batching, and its ``get_weights()`` equals this model's.
        """
        if not self.built:
            raise ValueError("tf_gpipe: build or call the model before to_sequential().")
        clones = [layer.__class__.from_config(layer.get_config()) for layer in self.stage_layers]
        seq = keras.Sequential(clones, name=name or f"{self.name}_sequential")
        spec = self._build_spec
        if isinstance(spec, keras.KerasTensor):
            seq.build(spec.shape)
        else:
            seq(spec)
        seq.set_weights(self.get_weights())
        return seq
