"""Models as TFF users write them, turned into the Keras model functions the builders run.

Every builder trains a Keras model made fresh inside its computations: its
trainable variables are the weights that are broadcast, averaged and kept
per client. `keras_model_fn` accepts, besides such a no-argument Keras model
function,

* a `tff.learning.models.FunctionalModel` (e.g. from
  `tff.learning.models.functional_model_from_keras`): a Keras model whose
  variables start at the functional model's `initial_weights` and whose
  output is its `predict_on_batch`;
* a no-argument function returning a `tff.learning.models.VariableModel`
  (e.g. `tff.learning.models.from_keras_model(...)`): a Keras model over the
  variable model's own trainable variables, whose output is its
  `predict_on_batch`.

Either way the output must be logits, as for a Keras model (checked on the
model's traced output op, `model_weights.check_logits`). The model's own
loss is never silently replaced: the builders train with their `loss=`
(cross-entropy on logits when None), and `check_own_loss` refuses, in one
line, a model whose own loss is not that cross-entropy when no `loss=` is
given (a zero loss, `from_logits=False` on logits, another objective). The
model's own metrics are not used: pass them as `metrics=` (docs/models.md).
Models with non-trainable weights are refused (a Keras model's BatchNormalization
is taken, `model_weights.check_non_trainable`). PersFL's
distillation grid needs a Sequential Keras model (it stacks the grid's
candidates layer by layer) and refuses these in one line.
"""

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def _features_spec(input_spec) -> tf.TensorSpec | None:
    """The features' `tf.TensorSpec` of a TFF model's `input_spec` ((x, y) or {'x': ..., 'y': ...})."""
    if isinstance(input_spec, Mapping):
        spec = input_spec.get('x')
    elif isinstance(input_spec, Sequence) and len(input_spec) == 2:
        spec = input_spec[0]
    else:
        spec = None
    return spec if isinstance(spec, tf.TensorSpec) else None


class _FunctionalKerasModel(tf.keras.Model):
    """A Keras model over a `FunctionalModel`'s weights (variables made from its initial weights)."""

    def __init__(self, functional: tff.learning.models.FunctionalModel):
        super().__init__(name='functional_model')
        self._functional = functional
        trainable, non_trainable = functional.initial_weights
        if len(non_trainable):
            raise ValueError(
                f'model: the FunctionalModel has {len(non_trainable)} non-trainable weights, which are not supported'
            )
        self.weights_list = [tf.Variable(w, trainable=True, name=f'weight_{i}') for i, w in enumerate(trainable)]
        self.probe_spec = _features_spec(functional.input_spec)  # model_weights.check_logits traces it

    def call(self, inputs, training=False):
        return self._functional.predict_on_batch((list(self.weights_list), []), inputs, training)


class _VariableKerasModel(tf.keras.Model):
    """A Keras model over a `VariableModel`'s trainable variables."""

    def __init__(self, variable_model: tff.learning.models.VariableModel):
        super().__init__(name='variable_model')
        self._variable_model = variable_model
        if list(variable_model.non_trainable_variables):
            raise ValueError(
                f'model: the VariableModel has {len(variable_model.non_trainable_variables)} non-trainable '
                'variables, which are not supported'
            )
        self.weights_list = list(variable_model.trainable_variables)
        self.probe_spec = _features_spec(variable_model.input_spec)  # model_weights.check_logits traces it

    def call(self, inputs, training=False):
        return self._variable_model.predict_on_batch(inputs, training=training)


def keras_model_fn(model, *, argument: str = 'model_fn') -> Callable[[], tf.keras.Model]:
    """A builder's model argument as a no-argument Keras model function.

    Args:
      model: a no-argument function returning a `tf.keras.Model` (returned
        as it is, checked when first called) or a
        `tff.learning.models.VariableModel`; or a
        `tff.learning.models.FunctionalModel`.
      argument: the argument's name, for errors.

    Returns:
      A no-argument function returning a fresh `tf.keras.Model`.

    Raises:
      TypeError: `model` is none of these (one line naming `argument`).
    """
    if isinstance(model, tff.learning.models.FunctionalModel):
        return lambda: _FunctionalKerasModel(model)
    if isinstance(model, (tf.keras.Model, tff.learning.models.VariableModel)):
        raise TypeError(
            f'{argument} must be a function that builds a new model on each call (TFF makes variables inside '
            f'its computations), got a {type(model).__name__} instance; pass e.g. lambda: build_model()'
        )
    if not callable(model):
        raise TypeError(
            f'{argument} must be a no-argument function returning a tf.keras.Model or a '
            f'tff.learning.models.VariableModel, or a tff.learning.models.FunctionalModel; got {type(model).__name__}'
        )

    def model_fn():
        built = model()
        if isinstance(built, tf.keras.Model):
            return built
        if isinstance(built, tff.learning.models.VariableModel):
            return _VariableKerasModel(built)
        raise TypeError(
            f'{argument} must return a tf.keras.Model or a tff.learning.models.VariableModel, '
            f'got {type(built).__name__}'
        )

    if getattr(model, '_tff_pfl_keras_model_fn', False):
        return model
    model_fn._tff_pfl_keras_model_fn = True
    return model_fn


def _probe(spec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A batch of 8 seeded random features and labels of the spec's shapes."""
    shape = (8, *spec.feature_shape)
    if spec.feature_encoding == 'int32':
        x = rng.integers(0, 2, size=shape).astype(np.int32)
    else:
        x = rng.normal(size=shape).astype(np.float32)
    return x, rng.integers(0, spec.num_classes, size=(8, *spec.label_shape)).astype(np.int32)


def _own_loss(model, spec) -> tuple[str, float, float] | None:
    """(kind, own loss, cross-entropy) of a TFF model on a probe batch; None for a Keras model function."""
    rng = np.random.default_rng(0)
    x, y = _probe(spec, rng)
    if isinstance(model, tff.learning.models.FunctionalModel):
        logits = tf.constant(rng.normal(size=(*y.shape, spec.num_classes)).astype(np.float32))
        own = model.loss(output=logits, label=tf.constant(y))
        kind = 'FunctionalModel'
    elif callable(model) and not isinstance(model, tf.keras.Model):
        built = model()
        if not isinstance(built, tff.learning.models.VariableModel):
            return None
        batch = {'x': x, 'y': y} if isinstance(built.input_spec, Mapping) else (x, y)
        output = built.forward_pass(batch, training=False)
        own, logits, kind = output.loss, output.predictions, 'VariableModel'
    else:
        return None
    reference = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return kind, float(own), float(reference)


def check_own_loss(model, spec, *, argument: str = 'model_fn') -> None:
    """Refuses a TFF model whose own loss the builders would drop: one that is not cross-entropy on logits.

    Called by a builder given no `loss=`: it trains with cross-entropy, so a
    `FunctionalModel` or `VariableModel` whose own loss differs on a seeded
    probe batch (relative 1e-4) would train on another objective than its
    author wrote. Keras model functions have no own loss and pass.

    Args:
      model: the builder's model argument, as the user gave it.
      spec: the data's spec (the probe's shapes and classes).
      argument: the argument's name, for the error.

    Raises:
      ValueError: in one line, with the two values and the fix.
    """
    found = _own_loss(model, spec)
    if found is None:
        return
    kind, own, reference = found
    if not np.isclose(own, reference, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"{argument}: the {kind}'s own loss gives {own:.4g} where cross-entropy on its logits gives "
            f'{reference:.4g} (a probe batch); the builders train with loss= (cross-entropy when None), so pass '
            'loss=(labels, logits) -> one value per label, or give the model '
            'SparseCategoricalCrossentropy(from_logits=True)'
        )
