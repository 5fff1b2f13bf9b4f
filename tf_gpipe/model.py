"""PipelineModel: the public Keras model that pipelines a list of layers across devices."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from tf_gpipe import graph, keras_compat, microbatch, saving, schedules, structure, trainer, update
from tf_gpipe.backend import check_backend
from tf_gpipe.balance import balance_by_cost
from tf_gpipe.cell import Cell
from tf_gpipe.devices import resolve_devices
from tf_gpipe.jit import choose_jit
from tf_gpipe.loop_choice import untaped
from tf_gpipe.partition import cut_into_cells, unpack_layers
from tf_gpipe.pipeline import Pipeline, check_settings

__all__ = ["PipelineModel"]


@keras.saving.register_keras_serializable(package="tf_gpipe")
class PipelineModel(keras.Model):
    """A sequence of Keras layers split into stages on devices, trained with GPipe.

    Drop-in for ``keras.Sequential(layers)`` on Keras' TensorFlow backend (checked):
    ``compile``/``fit``/``evaluate``/``predict``/``save`` work, and the numbers match the
    unsplit model's, but for what depends on the batch or on random draws in training with
    M > 1: dropout and augmentation draw per micro-batch (same distribution, other masks),
    BatchNormalization normalizes per micro-batch, so only a first BatchNormalization (nothing
    random before it) ends with the unsplit moving statistics (docs/concepts.md). Each
    stage's variables are created on its device and its ops run there; only the tensors
    between stages cross devices. Every mini-batch is cut into ``num_micro_batches``
    micro-batches that flow through the stages in the fill-drain order, so stage ``k``
    works on micro-batch ``m`` while stage ``k-1`` works on ``m+1``. With
    re-materialization, each stage keeps only its input per micro-batch and recomputes the
    rest in the backward pass, replaying exactly the same dropout masks and applying
    BatchNormalization updates once. Gradients are summed over micro-batches on each
    stage's device and applied in one optimizer update per mini-batch.

    Args:
        layers: Keras layers applied in order (a list, or a ``keras.Sequential``).
            A leading ``keras.Input``/``InputLayer`` fixes the input shape.
        num_stages: K, the number of stages for an even split by layer count.
            Defaults to ``len(balance)``, else ``len(devices)``, else 1.
        balance: layers per stage, e.g. ``[3, 3, 2, 2]``, instead of an even split;
            or ``"params"``, ``"time"`` or ``"memory"`` to cut where the largest stage's
            cost is smallest (measured per layer on the input spec, so the layers must
            start with a ``keras.Input``; see ``tf_gpipe.balance``).
        num_micro_batches: M, micro-batches per mini-batch. No layer sees an
            empty micro-batch: a batch smaller than M gives fewer micro-batches
            where its size is known while tracing (for ``"interleaved"``, a
            multiple of ``num_stages``); where it is only known at run time (the
            last batch of ``fit``), each missing micro-batch runs on a copy of
            one real example and everything it produces (outputs, loss,
            gradients, variable updates) is discarded. An empty mini-batch
            reaches the layers empty, as in the unsplit model.
        devices: one device string per stage. Default: visible GPUs, else
            logical CPUs, else ``CPU:0``, assigned round-robin (with fewer devices than
            stages, stages share one, with a warning).
        remat: ``"always"`` (re-materialize every stage), ``"except_last"`` (not
            the last stage, whose backward follows its forward at once) or
            ``"never"``.
        schedule: the order each device runs its forwards and backwards in
            ``fit``: ``"gpipe"`` (fill-drain; the loss sees the whole mini-batch),
            ``"1f1b"`` (same bubble, at most K micro-batches in flight),
            ``"interleaved"`` (1F1B over ``virtual_stages`` chunks per device;
            smaller bubble; needs ``num_micro_batches % num_stages == 0``) or
            ``"zb-h1"`` (zero bubble: 1F1B with each backward run as two calls,
            the input gradient first and the weight gradient later, in the
            bubble; at most K micro-batches in flight on every device; a
            re-materialized stage is replayed once, in the first half).
            All but ``"gpipe"`` compute the loss per micro-batch, so it must reduce by
            ``"sum_over_batch_size"`` (Keras' default) or ``"sum"``, and a loss of
            your own must be a mean over examples (each step checks it); a masked
            output's loss is exact, but not together with losses that layers
            add or with other outputs (use ``"gpipe"`` there).
        virtual_stages: v, chunks per device for ``"interleaved"``: layers are cut
            into ``num_stages * v`` cells and cell ``s`` runs on device ``s % K``.
        deferred_batch_norm: BatchNormalization layers normalize each micro-batch
            with its own statistics, but move their running statistics once per
            mini-batch from the statistics of the whole mini-batch, as the
            unsplit model does (GPipe's choice). ``False`` moves them once per
            micro-batch, as Keras alone would.
        side_inputs: names of auxiliary inputs every stage may need (attention
            masks, positions, conditioning). The model is then called with a dict
            holding these keys and the main input; each side input is cut into the
            same micro-batches as the main input, and a layer receives it as a
            keyword argument when its ``call`` has a parameter of that name. Side
            inputs are not differentiated.
        micro_batch_loops: build ``fit``'s step as loops over micro-batches, so the first
            step stops growing with M (docs/api.md): every schedule, any ``remat``; M >= 2,
            dense inputs, no timeline. ``"auto"`` (the default): where they apply, on every
            kind of device, ``evaluate`` and ``predict`` too; ``True``: also ``__call__``
            under a user's tape (docs/api.md); ``False``: never. ``tick_loop=`` is its
            deprecated name.
        plan: a ``tf_gpipe.plan(...)`` result: sets ``num_stages``, ``balance``,
            ``num_micro_batches``, ``remat``, ``schedule``, ``virtual_stages`` and
            ``devices``; any of these also given must agree with it.
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
        layers: Sequence[keras.layers.Layer] | keras.Sequential,
        num_stages: int | None = None,
        balance: Sequence[int] | None = None,
        num_micro_batches: int = 1,
        devices: Sequence[str] | None = None,
        remat: str = "always",
        schedule: str = "gpipe",
        virtual_stages: int = 1,
        deferred_batch_norm: bool = True,
        side_inputs: Sequence[str] = (),
        plan: Any = None,
        micro_batch_loops: bool | str = "auto",
        **kwargs: Any,
    ):
        check_backend()  # again: keras.config.set_backend can switch it after the import
        if "tick_loop" in kwargs:  # the argument's name before the loops ran over micro-batches
            warnings.warn("tf_gpipe: tick_loop= is deprecated, use micro_batch_loops=.", FutureWarning, 2)
            micro_batch_loops = kwargs.pop("tick_loop")
        super().__init__(**kwargs)
        if plan is not None:  # tf_gpipe.plan(...) sets these; any also given here must agree with it
            num_stages, balance, num_micro_batches, devices, remat, schedule, virtual_stages = plan.resolve(
                num_stages=num_stages, balance=balance, num_micro_batches=num_micro_batches,
                devices=devices, remat=remat, schedule=schedule, virtual_stages=virtual_stages,
            )  # fmt: skip
        layer_list, spec = unpack_layers(layers)
        if not layer_list:
            raise ValueError("tf_gpipe: `layers` is empty; a PipelineModel needs at least one layer.")
        check_settings(num_micro_batches, remat, micro_batch_loops, schedule, virtual_stages, num_stages)
        if isinstance(balance, str):  # "params" | "time" | "memory": measured on the input spec
            balance = balance_by_cost(balance, layer_list, spec, num_stages, virtual_stages)
        groups = cut_into_cells(layer_list, num_stages, balance, virtual_stages, devices)
        num_stages = len(groups) // virtual_stages
        # Validates the name, virtual_stages and M against the schedule before anything is built.
        schedules.get(schedule, num_stages, num_micro_batches, virtual_stages)
        self._devices_arg = (
            None if devices is None else list(devices) if not isinstance(devices, str) else devices
        )
        resolved = resolve_devices(devices, num_stages)
        self.num_micro_batches = num_micro_batches
        self.micro_batch_loops = micro_batch_loops
        self.remat = remat
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.balance = [len(g) for g in groups]
        self.stage_layers = layer_list  # tracked in order: weights ordered as keras.Sequential(layers)
        for i, layer in enumerate(layer_list):  # visible to tf.train.Checkpoint too
            keras_compat.track_checkpoint_dependency(self, layer, f"layer_{i}")
        # Stage s runs on device s % K: with virtual stages each device holds every K-th chunk.
        self._pipeline = Pipeline(
            [Cell(s, g, resolved[s % num_stages]) for s, g in enumerate(groups)],
            remat,
            deferred_batch_norm,
        )
        self.deferred_batch_norm = deferred_batch_norm
        if isinstance(side_inputs, str):
            side_inputs = (side_inputs,)
        self.side_inputs = tuple(side_inputs)
        self._num_devices = num_stages
        self._tracer = None
        self._source_model = None  # set by from_model
        # XLA over the whole model would fuse every stage into one cluster on one device:
        # compile(jit_compile=...) compiles stage by stage instead (stage_jit).
        self.supports_jit = False
        self.stage_jit = [False] * len(groups)
        # Like keras.Sequential: inputs reach the first layer in their own dtype (no cast
        # to this model's policy), so float64 or int inputs stay as they are.
        keras_compat.keep_input_dtypes(self)
        keras_compat.overridable(keras.Model, "_maybe_build", "build from the first inputs' dtypes")
        keras_compat.overridable(keras.Model, "_maybe_symbolic_build", "build before the first trace")
        self._jit_compile_arg = "auto"  # compile(jit_compile=...) as given, for get_compile_config
        self._build_spec = None
        if spec is not None:
            self.build_cells(structure.spec_from(spec))

    @classmethod
    def from_model(
        cls,
        model: keras.Model,
        num_stages: int | None = None,
        balance: Sequence[int] | str | None = None,
        virtual_stages: int = 1,
        **kwargs: Any,
    ) -> PipelineModel:
        """Split a functional Keras model (residual/skip connections, several inputs or
        outputs) into consecutive stages.

        The model's nodes are cut, in the order Keras runs them, into ``num_stages *
        virtual_stages`` runs; each tensor a later stage needs (a skip connection) is
        carried from stage to stage until used. The pipeline shares the model's layers and
        variables (moved to their stage devices): the model keeps serving the trained
        weights unsplit, over several devices without XLA (docs/api.md).

        Args:
            model: a functional ``keras.Model`` (or ``keras.Sequential``), built.
            num_stages: K; default ``len(balance) // virtual_stages`` for a list
                ``balance``, else 1.
            balance: nodes per stage (each call of a layer, in the order Keras runs them;
                not the inputs), a list; or ``"params"``, ``"time"`` or ``"memory"`` to cut
                where the largest stage's cost (``graph.node_costs``) is smallest; default an
                even split by node count.
            virtual_stages: as in ``PipelineModel``.
            **kwargs: the other ``PipelineModel`` arguments; ``plan=tf_gpipe.plan(model, ...)``.

        Example:

        ```python
        inp = keras.Input((16,))
        h = keras.layers.Dense(16)(inp)
        out = keras.layers.Dense(3)(keras.layers.Add()([h, keras.layers.Dense(16)(h)]))
        pm = tf_gpipe.PipelineModel.from_model(keras.Model(inp, out), num_stages=2)
        ```
        """
        if kwargs.get("plan") is not None:  # ``tf_gpipe.plan(model, ...)``: a balance of nodes
            num_stages, balance, virtual_stages = kwargs.pop("plan").for_nodes(
                num_stages, balance, virtual_stages, kwargs
            )
        cut = graph.cut_model(model, num_stages, balance, virtual_stages)
        instance = cls(cut.stages, num_stages=cut.num_stages, virtual_stages=virtual_stages, **kwargs)
        instance._source_model = cut.source
        instance.balance = list(cut.node_balance)  # where the model was cut, in nodes per cell
        instance.build_cells(cut.spec)
        graph.serve_split([model, cut.source], instance.devices)
        return instance

    # ------------------------------------------------------------------ properties
    @property
    def num_stages(self) -> int:
        """K, the number of pipeline devices (cells number K * virtual_stages)."""
        return self._num_devices

    @property
    def devices(self) -> list[str]:
        """The device of each of the K pipeline positions, canonical form."""
        return [c.device for c in self._pipeline.cells[: self._num_devices]]

    @property
    def cells(self) -> list[Cell]:
        """The stages: their layers and devices."""
        return list(self._pipeline.cells)

    # What tf_gpipe's other modules use of a PipelineModel, so that none reads its privates.
    @property
    def pipeline(self) -> Pipeline:
        """The cells and how they run (remat, deferred BatchNormalization statistics)."""
        return self._pipeline

    @property
    def tracer(self) -> Any:
        """The timeline recorder the training step marks its actions for, or None."""
        return self._tracer

    @tracer.setter
    def tracer(self, recorder: Any) -> None:
        self._tracer = recorder

    @property
    def build_spec(self) -> Any:
        """The input spec the cells were built for (None before they are)."""
        return self._build_spec

    @property
    def devices_argument(self) -> Any:
        """``devices`` as given (None: the default), for the config."""
        return self._devices_arg

    @property
    def source_model(self) -> keras.Model | None:
        """After ``from_model``: the functional model it was cut from; else None."""
        return self._source_model

    # ------------------------------------------------------------------ building
    def build_cells(self, spec: Any) -> None:
        """Build every cell on its device for inputs like ``spec`` (tensors or KerasTensors)."""
        self._build_spec = spec
        spec, side = self.separate_inputs(spec)
        for cell in self._pipeline.cells:
            spec = cell.build(spec, side)
        self.built = True

    def separate_inputs(self, inputs: Any) -> tuple[Any, dict | None]:
        """Split the model's inputs into the main input and the side inputs (None without)."""
        return structure.separate_side_inputs(inputs, self.side_inputs)

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
        self.build_cells(spec)

    def _maybe_build(self, call_spec):  # a private Keras method: see keras_compat.first_call_argument
        # Keras would build from shapes alone; the real dtypes matter (token ids, masks).
        if not self.built:
            inputs = keras_compat.first_call_argument(call_spec)
            microbatch.check_batched(inputs)
            self.build_cells(structure.spec_from(inputs))
        return super()._maybe_build(call_spec)

    def _build_from_data(self, x: Any) -> None:  # before a step's trace, which would trace twice
        if not self.built and (spec := structure.inputs_spec(x)) is not None:
            self.build_cells(spec)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):  # private Keras: keras_compat.data_spec
        # fit, evaluate, train_on_batch; under a strategy, Keras' symbolic build builds.
        if not self.built and not tf.distribute.has_strategy():
            data = keras_compat.data_spec(iterator, data_batch)
            if data is not None:
                self._build_from_data(keras.utils.unpack_x_y_sample_weight(data)[0])
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def make_train_function(self, force: bool = False) -> Any:
        if force or self.train_function is None:  # the optimizer's slots too, before the trace
            trainer.make_state(self)
        return super().make_train_function(force)

    def get_build_config(self) -> dict:
        return saving.get_build_config(self)

    def build_from_config(self, config: dict) -> None:
        saving.build_from_config(self, config)

    # ------------------------------------------------------------------ running
    def _split(self, inputs: Any, mask: Any):
        main, side = self.separate_inputs(structure.to_tensors(inputs))
        joint = microbatch.split((main, mask, side), self.num_micro_batches)
        return joint.select(0), [c[1] for c in joint.chunks], [c[2] for c in joint.chunks]

    def call(self, inputs: Any, training: bool | None = None, mask: Any = None) -> Any:
        xs, masks, sides = self._split(inputs, mask)
        acts, out_masks, losses = self._pipeline.call(xs, masks, training, sides, self.micro_batch_loops)
        with tf.device(self._pipeline.cells[-1].device):  # beside the outputs, not on the default device
            outputs = xs.merge(acts, out_masks)
        for share, row in zip(trainer.shares(xs.sizes, structure.batch_size(inputs)), losses):
            for loss in row:
                self.add_loss(loss * tf.cast(share, loss.dtype))
        return outputs

    def compile(self, *args: Any, jit_compile: Any = "auto", **kwargs: Any) -> None:
        """As ``keras.Model.compile``, with ``jit_compile`` applied stage by stage.

        ``"auto"`` compiles a stage with XLA where Keras would compile a model (a GPU or TPU
        is visible and every layer of the stage allows it), ``True`` every stage that allows
        it (warning about any that does not), ``False`` none; the choice per stage is in
        ``stage_jit`` (docs/api.md). Each stage is its own XLA cluster on its own device; the
        step around them is not compiled: one cluster would run every stage on one device.
        """
        if jit_compile not in ("auto", True, False):
            raise ValueError(f"tf_gpipe: jit_compile must be 'auto', True or False, got {jit_compile!r}.")
        super().compile(*args, jit_compile=False, **kwargs)
        self._jit_compile_arg = jit_compile
        self.stage_jit = choose_jit(self._pipeline.cells, jit_compile, bool(kwargs.get("run_eagerly")))
        update.place_optimizer(self.optimizer, self.devices[0])
        trainer.make_state(self)

    def get_compile_config(self) -> dict:
        config = super().get_compile_config()
        if config:  # compiled: the jit_compile given, not the False Keras was given
            config["jit_compile"] = self._jit_compile_arg
        return config

    def compile_from_config(self, config: dict) -> None:
        """Re-compile a loaded model (``keras.models.load_model``) as it was saved."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        trainer.make_state(self)

    # As Keras' steps: run as written in a user's tf.function, where AutoGraph would rewrite
    # the library on each trace (600 functions, 14-16 s for a small model's first).
    @tf.autograph.experimental.do_not_convert
    def test_step(self, data: Any) -> dict:
        return trainer.test_step(self, data)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._build_from_data(x)
        return super().predict(x, *args, **kwargs)

    @tf.autograph.experimental.do_not_convert
    def predict_step(self, data: Any) -> Any:
        with untaped():
            return super().predict_step(data)

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data: Any) -> dict:
        """One mini-batch: the schedule's forwards and backwards stage by stage,
        gradients summed per device, one optimizer update, metrics on the whole batch."""
        return trainer.train_step(self, data)

    def get_config(self) -> dict:
        return saving.get_config(self)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> PipelineModel:
        return saving.from_config(cls, config, custom_objects)

    def get_weights(self) -> list[Any]:
        return [v.numpy() for v in saving.listed_weights(self)]

    def set_weights(self, weights: Any) -> None:
        saving.set_weights(self, weights)

    def export(self, filepath: Any, format: str = "tf_saved_model", verbose: Any = None,
               input_signature: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        """Keras' ``export``, its stages and their weights on their devices (load with the
        variable-device policy: docs/saving_and_serving.md); by default for the inputs it was
        built for. To serve on one device, export ``to_sequential()`` or ``to_functional()``."""
        signature = saving.input_signature(self) if input_signature is None else input_signature
        if format != "tf_saved_model":
            return super().export(filepath, format, verbose, signature, **kwargs)
        saving.export_saved_model(self, filepath, verbose, signature, **kwargs)

    def to_sequential(self, name: str | None = None) -> keras.Sequential:
        """An unsplit ``keras.Sequential`` copy of the layers, with the current weights.

        Train pipelined, serve unsplit: the copy has no device placement and no
        micro-batching, and its ``get_weights()`` equals this model's. A model made by
        ``from_model`` exports with ``to_functional()`` instead.
        """
        return saving.to_sequential(self, name)

    def to_functional(self, name: str | None = None) -> keras.Model:
        """After ``from_model``: an unsplit functional copy of the source model (its graph,
        copies of its layers, variables of its own) holding the current weights, which predicts
        what this model predicts and saves as any functional model (docs/api.md)."""
        return saving.to_functional(self, name)
