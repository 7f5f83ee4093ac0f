"""What every `build_*_process` checks of its Python arguments before it builds anything.

A builder decorated with `checked` refuses, in one line naming the argument
and the fix, the mistakes a user's own code makes that would otherwise only
show inside a round (a gRPC error from the TFF worker, or a silently wrong
loss):

* `spec` that is not a `ClientDataSpec` (a `ClientData` passed as it is);
* `seed` that is not a non-negative integer (None, a float);
* `model_fn` whose model cannot take the data's features, or whose outputs
  do not have one logit per class (per position for sequence labels): fewer
  logits than `spec.num_classes`, one vector per example where the labels
  are per position, or the other way round;
* a `FunctionalModel` / `VariableModel` whose own loss is not cross-entropy
  on logits, with no `loss=` given (it would be dropped).

It also tells the process its partition's ids, so that
`process.initial_client_states` takes the user's own ids
(`spec.source_ids`) as well as the positional ones and refuses unknown ones.
"""

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tff_pfl.computations import template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The largest seed: TF's stateless ops take seeds as int32 pairs, and the clients' seeds are derived
# from the run seed in int32 arithmetic.
MAX_SEED = 2**31 - 1


def check_spec(spec, argument: str = 'spec') -> None:
    """Refuses a `spec` that is not a `client_data.ClientDataSpec`.

    Args:
      spec: the builder's data argument.
      argument: its name, for the error.

    Raises:
      TypeError: in one line, naming what makes a spec.
    """
    if not isinstance(spec, client_data.ClientDataSpec):
        raise TypeError(
            f'{argument} must be a ClientDataSpec, got {type(spec).__name__}; make one from your ClientData, '
            f'dict of tf.data datasets or arrays with tff_pfl.data.federated.from_federated_data(...)'
        )


def check_seed(seed, argument: str = 'seed') -> None:
    """Refuses a seed that is not an integer in [0, `MAX_SEED`].

    Args:
      seed: the builder's seed argument.
      argument: its name, for the error.

    Raises:
      TypeError: not an integer (None included: a run here is always seeded).
      ValueError: out of range.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f'{argument} must be an int (it fixes the initial model and every batch order), got {seed!r}; '
            f'pass e.g. {argument}=0'
        )
    if not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f'{argument} must be in [0, 2**31 - 1], got {seed}')


def _features(spec: client_data.ClientDataSpec) -> tf.Tensor:
    """One example's features as the computations feed them to a model (a batch of one, zeros)."""
    dtype = tf.int32 if spec.feature_encoding == client_data.INT32 else tf.float32
    return tf.zeros((1, *spec.feature_shape), dtype)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def check_model_outputs(spec: client_data.ClientDataSpec, model: tf.keras.Model, argument: str = 'model_fn') -> None:
    """Refuses a model whose outputs do not fit the partition's features and labels.

    Calls the model (in graph mode: shapes only) on a batch of one example's
    features, as the computations read them (float32, or int32 token ids),
    and compares the output's shape per example with the labels':
    `label_shape + (width,)` with `width >= spec.num_classes`. A wider model
    is taken (its extra logits are never a label).

    Args:
      spec: the partition.
      model: a fresh model of the builder's model function.
      argument: the model function's argument name, for the error.

    Raises:
      ValueError: in one line, naming the model, the shapes and the fix.
    """
    features = _features(spec)
    try:
        outputs = model(features, training=False)
    except Exception as error:  # any failure here is the model not taking these features
        raise ValueError(
            f"{argument}: model {model.name!r} cannot take the data's features (shape "
            f'{tuple(spec.feature_shape)} per example, {features.dtype.name}): {_first_line(error)}'
        ) from None
    if not isinstance(outputs, tf.Tensor):
        raise ValueError(
            f'{argument}: model {model.name!r} returns a {type(outputs).__name__}; it must return one tensor of logits'
        )
    label_shape = tuple(spec.label_shape)
    per_example = tuple(outputs.shape[1:])
    wanted = label_shape + (spec.num_classes,)
    what = 'one logit per class' + (f' at each of the {label_shape} label positions' if label_shape else '')
    if len(per_example) != len(wanted) or any(
        got is not None and got != want for got, want in zip(per_example[:-1], label_shape)
    ):
        raise ValueError(
            f'{argument}: model {model.name!r} gives outputs of shape {per_example} per example; the labels '
            f'(shape {label_shape} per example, {spec.num_classes} classes) need {wanted}: {what}'
        )
    width = per_example[-1]
    if width is not None and width < spec.num_classes:
        raise ValueError(
            f'{argument}: model {model.name!r} has {width} logits, but the labels go up to {spec.num_classes - 1} '
            f'(spec.num_classes = {spec.num_classes}); build its last layer with spec.num_classes outputs'
        )


# (model function, what of the spec it was checked against): a builder is often called with the same
# model function and partition many times (a tuning grid, tests), and the check builds a model.
_CHECKED = weakref.WeakKeyDictionary()


def _spec_key(spec: client_data.ClientDataSpec) -> tuple:
    return (tuple(spec.feature_shape), spec.feature_encoding, tuple(spec.label_shape), spec.num_classes)


def checked_model_fn(spec: client_data.ClientDataSpec, model_fn, argument: str = 'model_fn') -> Callable:
    """`adapters.keras_model_fn(model_fn)`, with its model checked against `spec` once.

    Args:
      spec: the partition.
      model_fn: the builder's model argument (a Keras model function, a TFF
        `VariableModel` function or a `FunctionalModel`).
      argument: its name, for errors.

    Returns:
      The no-argument Keras model function the builder goes on with.

    Raises:
      TypeError: `model_fn` is not a model function (`adapters.keras_model_fn`).
      ValueError: its model does not fit the data (`check_model_outputs`).
    """
    keras_fn = adapters.keras_model_fn(model_fn, argument=argument)
    key = _spec_key(spec)
    try:
        if key in _CHECKED.get(model_fn, ()):
            return keras_fn
    except TypeError:  # not weakly referenceable: checked each time
        pass
    with tf.Graph().as_default():
        check_model_outputs(spec, keras_fn(), argument)
    with contextlib.suppress(TypeError):  # not weakly referenceable: checked again next time
        _CHECKED.setdefault(model_fn, set()).add(key)
    return keras_fn


def checked(builder: Callable) -> Callable:
    """Decorates a `build_*_process(spec, [model_fn,] settings, ..., seed=...)` with the checks above.

    Before the builder runs: `check_spec(spec)`, `check_seed(seed)` when it
    takes one (a numpy integer passed on as an int), a TFF model's own loss
    checked when no `loss` is given (`adapters.check_own_loss`), and
    `model_fn` replaced by `checked_model_fn(spec, model_fn)`.
    After: a `template.PersonalizedProcess` it returns is told the
    partition's ids (`bind_client_ids`).

    Args:
      builder: the builder function.

    Returns:
      The checked builder, with the builder's signature and docstring.
    """
    signature = inspect.signature(builder)

    @functools.wraps(builder)
    def build(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        spec = arguments.get('spec')
        check_spec(spec)
        if 'seed' in arguments:
            check_seed(arguments['seed'])
            arguments['seed'] = int(arguments['seed'])  # a numpy integer as Python's (Keras takes only int)
        if 'model_fn' in arguments:
            if arguments.get('loss') is None:
                adapters.check_own_loss(arguments['model_fn'], spec)
            arguments['model_fn'] = checked_model_fn(spec, arguments['model_fn'])
        process = builder(*bound.args, **bound.kwargs)
        if isinstance(process, template.PersonalizedProcess):
            process.bind_client_ids(spec.client_ids, spec.source_ids)
        return process

    return build
