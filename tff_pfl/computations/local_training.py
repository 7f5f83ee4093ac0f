"""Local work on one client's whole-tensor data: SGD training and evaluation.

These are TensorFlow functions meant to run inside a client's
`tff.tensorflow.computation`. Data arrive as a whole-tensor
`client_data.ClientSplit` (see `tff_pfl.data.client_data.read_split`); batches are cut by slicing a seeded
permutation inside a `tf.while_loop`, never through `tf.data`.

Every algorithm reuses `train`: what differs between algorithms is the loss,
which is any `LossFn(model, x_batch, y_batch) -> (mean_loss, logits)`; a
distillation loss closes over a teacher model, a proximal loss over the global
weights.

A model's weights (their TFF type, snapshots, assignment) are handled in
`model_weights`; fine-tuning with the epochs chosen on validation is in
`fine_tuning`.
"""

import collections
import collections.abc
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import losses, settings
from tff_pfl.computations import keras_metrics
from tff_pfl.data import client_data

LossFn = Callable[[tf.keras.Model, tf.Tensor, tf.Tensor], tuple[tf.Tensor, tf.Tensor]]

# Sums over the examples seen; divide by `num_examples` for means. `num_steps`
# counts the SGD steps taken (`sgd_steps`; 0 for evaluation).
Stats = collections.namedtuple('Stats', ['loss_sum', 'num_correct', 'num_examples', 'num_steps'], defaults=(0.0,))


def cross_entropy_sum(logits: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """Summed sparse softmax cross-entropy over the labels that count (TF code).

    Args:
      logits: `[B, C]`, or `[B, L, C]` for one label per position.
      y: int32 labels `[B]`, or `[B, L]` with `client_data.IGNORED_LABEL`
        where a position does not count.

    Returns:
      A float32 scalar.
    """
    if y.shape.rank == 1:
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    counted = tf.cast(tf.not_equal(y, client_data.IGNORED_LABEL), tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.maximum(y, 0), logits=logits)
    return tf.reduce_sum(losses * counted)


def supervised_loss(model: tf.keras.Model, x: tf.Tensor, y: tf.Tensor):
    """Mean sparse softmax cross-entropy of the model's logits; the default loss.

    Args:
      model: the Keras model (called in training mode).
      x: a batch of features `[B, ...]`.
      y: the batch's int32 labels `[B]` (or `[B, L]`, see `losses.hard_cross_entropy`).

    Returns:
      `(loss, logits)`: the scalar mean loss and the `[B, num_classes]`
      (or `[B, L, num_classes]`) logits.
    """
    logits = model(x, training=True)
    return losses.hard_cross_entropy(logits, y), logits


# A user's training loss (the builders' `loss` argument): a Keras loss object, or a function
# `(labels, logits) -> one value per label`.
Loss = tf.keras.losses.Loss | Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def loss_from(loss: Loss | None, spec: client_data.ClientDataSpec | None = None, *, argument: str = 'loss') -> LossFn:
    """The `LossFn` local training minimizes for a builder's `loss` argument.

    None gives `supervised_loss` (sparse softmax cross-entropy on logits, the
    default of every committed result). Otherwise `loss` is called on the
    integer labels and the model's logits and must return one value per label
    (`[B]`, or `[B, L]` for sequences), as a Keras loss's `call` does: a
    `tf.keras.losses.Loss` object is called through `call` (its own reduction
    is not used), a plain function directly. The batch's loss is then the mean
    over the labels that count: positions labelled `client_data.IGNORED_LABEL`
    get label 0 in the call and are weighted out, as in
    `losses.hard_cross_entropy`.

    Args:
      loss: None, a `tf.keras.losses.Loss` or a function `(labels, logits) ->
        values`.
      spec: optional; the data's spec, to try `loss` once on a batch of its
        label and logit shapes when the builder is called.
      argument: the Python argument's name, for the errors.

    Returns:
      A `LossFn` `(model, x, y) -> (mean loss, logits)`.

    Raises:
      TypeError: if `loss` is not callable.
      ValueError: in one line, if `loss` is a Keras loss that reads
        probabilities (`from_logits=False`), or, tried on the spec's shapes,
        fails or does not return one value per label.
    """
    if loss is None:
        return supervised_loss
    if not callable(loss):
        raise TypeError(
            f'{argument} must be a tf.keras.losses.Loss or a function (labels, logits) -> one value per label, '
            f'got {type(loss).__name__}'
        )
    values = _values_per_label(loss, spec, argument)

    def loss_fn(model, x, y):
        logits = model(x, training=True)
        return losses.mean_over_positions(values(y, logits), y), logits

    return loss_fn


def _values_per_label(fn, spec: client_data.ClientDataSpec | None, argument: str):
    """A loss or metric argument -> `values(labels, logits)`, one value per label; checked on the spec's shapes."""
    name = type(fn).__name__ if isinstance(fn, tf.keras.losses.Loss) else getattr(fn, '__name__', repr(fn))
    if isinstance(fn, tf.keras.losses.Loss):
        if fn.get_config().get('from_logits') is False:
            raise ValueError(
                f'{argument}: {name} has from_logits=False and reads probabilities, but the models here output '
                f'logits; pass {name}(from_logits=True)'
            )
        values_fn = fn.call
    else:
        values_fn = fn

    def values(y, logits):
        return tf.cast(values_fn(tf.maximum(y, 0), logits), logits.dtype)

    if spec is not None:
        _try_loss(values, spec, argument, name)
    return values


# A user's extra evaluation metrics (the builders' `metrics` argument): name -> a function
# `(labels, logits) -> one value per label`, a Keras loss on logits, or a Keras metric object.
MetricsArg = collections.abc.Mapping[str, Loss | tf.keras.metrics.Metric]

# What `metrics_from` returns and the evaluations take: (name, values(labels, logits)) pairs, or
# (name, keras_metrics.KerasMetric) for a Keras metric object.
Metrics = tuple[tuple[str, Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | keras_metrics.KerasMetric], ...]

# The names every client evaluation already reports (`template.client_metrics`).
REPORTED = ('loss', 'accuracy', 'num_examples')


def metrics_from(
    metrics: MetricsArg | None, spec: client_data.ClientDataSpec | None = None, *, argument: str = 'metrics'
) -> Metrics:
    """A builder's `metrics` argument -> the extra per-client evaluation metrics.

    Each metric is, like a `loss`, a function `(labels, logits) -> one value
    per label` (e.g. `functools.partial(tf.keras.metrics.sparse_top_k_categorical_accuracy,
    k=3)`) or a `tf.keras.losses.Loss` on logits; a client reports its mean
    over the labels of its test split that count, beside `loss` and
    `accuracy`. Or it is a `tf.keras.metrics.Metric` object
    (`tf.keras.metrics.AUC()`): a client reports the `result()` of a fresh
    copy updated over its test split (`keras_metrics`).

    Args:
      metrics: None (no extra metric), or a mapping name -> metric.
      spec: optional; the data's spec, to try each metric once on its shapes.
      argument: the Python argument's name, for the errors.

    Returns:
      The `Metrics` pairs, in the mapping's order.

    Raises:
      TypeError: if `metrics` is not a mapping of callables or Keras metrics.
      ValueError: in one line, on a name that is not an identifier or is
        already reported, a metric refused as `loss_from` refuses a loss, or a
        Keras metric that takes no labels of the data's shapes.
    """
    if metrics is None:
        return ()
    if not isinstance(metrics, collections.abc.Mapping):
        raise TypeError(
            f'{argument} must be a mapping name -> function (labels, logits) -> one value per label, '
            f'got {type(metrics).__name__}'
        )
    pairs = []
    for name, fn in metrics.items():
        if not (isinstance(name, str) and name.isidentifier()) or name in REPORTED:
            raise ValueError(
                f'{argument}: {name!r} cannot name a metric: use an identifier other than {", ".join(REPORTED)}'
            )
        if keras_metrics.is_keras_metric(fn):
            pairs.append((name, keras_metrics.from_metric(fn, spec, f'{argument}[{name!r}]')))
            continue
        if not callable(fn):
            raise TypeError(
                f'{argument}[{name!r}] must be a function (labels, logits) -> values or a tf.keras.metrics.Metric, '
                f'got {type(fn).__name__}'
            )
        pairs.append((name, _values_per_label(fn, spec, f'{argument}[{name!r}]')))
    return tuple(pairs)


def _try_loss(values, spec: client_data.ClientDataSpec, argument: str, name: str) -> None:
    """Calls a user's loss once on two examples of the spec's shapes; refuses it in one line if it fails."""
    label_shape = [2, *spec.label_shape]
    with tf.Graph().as_default():
        labels = tf.zeros(label_shape, tf.int32)
        logits = tf.zeros([*label_shape, spec.num_classes], tf.float32)
        try:
            result = values(labels, logits)
        except (TypeError, ValueError, tf.errors.OpError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(
                f'{argument}: {name} fails on integer labels {label_shape} and logits '
                f'{[*label_shape, spec.num_classes]}: {first}'
            ) from None
    if result.shape.as_list() != label_shape:
        raise ValueError(
            f'{argument}: {name} must return one value per label (shape {label_shape} for labels {label_shape}), '
            f'got shape {result.shape.as_list()}; a Keras loss is called through its call(), which returns them'
        )


def dense_gradients(tape: tf.GradientTape, loss: tf.Tensor, variables) -> list[tf.Tensor]:
    """`tape.gradient` as dense tensors, for arithmetic on them (TF code).

    An embedding's gradient comes as `tf.IndexedSlices` (the rows of the ids
    seen), which Python numbers cannot multiply; dense tensors pass through.

    Args:
      tape: the tape that recorded `loss`.
      loss: a scalar.
      variables: the variables to differentiate by.

    Returns:
      One dense tensor per variable.
    """
    grads = tape.gradient(loss, variables)
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _correct(logits: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    # An ignored label (-1) never equals an argmax, so it is never correct.
    return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y), tf.float32))


def epoch_permutations(seed: tf.Tensor, epochs, num_examples) -> tf.Tensor:
    """One permutation of range(num_examples) per epoch, from a stateless seed.

    Args:
      seed: int64 tensor of shape [2].
      epochs: number of permutations (int or scalar tensor; at least 1 is drawn).
      num_examples: the number of examples (int or scalar tensor).

    Returns:
      int32 tensor [max(epochs, 1), num_examples]: the example order of each
      epoch (argsort of stateless uniform noise).
    """
    noise = tf.random.stateless_uniform(
        tf.stack([tf.maximum(tf.cast(epochs, tf.int32), 1), tf.cast(num_examples, tf.int32)]),
        seed=seed,
    )
    return tf.argsort(noise, axis=1)


def batch_stream(data: client_data.ClientSplit, *, epochs, batch_size, seed: tf.Tensor):
    """A client's seeded stream of mini-batches, for loops written by hand (TF code).

    Epoch `e` visits the examples in its own permutation (drawn from `seed`);
    batch `i` of the stream is batch `i % batches_per_epoch` of epoch
    `(i // batches_per_epoch) % epochs`; the last batch of an epoch may be
    smaller than `batch_size`.

    Args:
      data: the client's split (its tensors may be a tf.function's inputs).
      epochs: number of distinct epoch permutations.
      batch_size: examples per batch.
      seed: int64 tensor of shape [2].

    Returns:
      `(batches_per_epoch, batch)`: an int32 scalar, and `batch(i) -> (x, y,
      n)`, the features, labels and size of batch `i` (for sequences: the
      number of labels that count, `client_data.count_labels`).
    """
    epochs = tf.maximum(tf.cast(epochs, tf.int32), 1)
    batch_size = tf.cast(batch_size, tf.int32)
    num_examples = data.num_examples
    batches_per_epoch = (num_examples + batch_size - 1) // batch_size
    permutations = epoch_permutations(seed, epochs, num_examples)

    def batch(index):
        epoch = (index // batches_per_epoch) % epochs
        start = (index % batches_per_epoch) * batch_size
        stop = tf.minimum(start + batch_size, num_examples)
        x, y = data.gather(permutations[epoch, start:stop])
        return x, y, client_data.count_labels(y)

    return batches_per_epoch, batch


def sgd_steps(
    data: client_data.ClientSplit,
    step_fn,
    *,
    epochs,
    batch_size,
    seed: tf.Tensor,
    carry=(),
    max_steps=None,
    batches_per_step: int = 1,
    after_epoch=None,
):
    """Runs a hand-written local update over a client's seeded batch stream.

    The number of steps is `epochs * batches_per_epoch // batches_per_step`
    (at least 1 when `epochs > 0`, none when it is 0), capped at `max_steps`; step `s` gets batches
    `s * batches_per_step ...` of `batch_stream`, so that an algorithm that
    needs several independent batches per step (Per-FedAvg's D, D', D'')
    reads fresh ones.

    Args:
      data: the client's whole split.
      step_fn: `(batches, carry) -> (carry, Stats)`, TF code: `batches` is a
        list of `batches_per_step` `(x, y, n)` tuples; it updates model
        variables in place and returns its loop values and the stats of the
        examples it reports on.
      epochs: number of distinct epoch permutations, as in `batch_stream`.
      batch_size: examples per batch, as in `batch_stream`.
      seed: int64 tensor of shape [2], as in `batch_stream`.
      carry: a nest of tensors threaded through the steps.
      max_steps: optional cap on the number of steps.
      batches_per_step: batches each step consumes.
      after_epoch: optional `epoch -> float32 scalar` (TF code), run after the
        last step of every epoch (`epoch`: int32, from 0) on the variables as
        the steps left them, before the next epoch's first step (e.g. a
        distillation between epochs). Needs `batches_per_step` 1 and no
        `max_steps`, so that every epoch ends.

    Returns:
      `(carry, Stats)`: the final loop values and the stats summed over
      steps; with `after_epoch`, `(carry, Stats, the sum of its values)`.

    Raises:
      ValueError: `after_epoch` with `max_steps` or `batches_per_step` > 1.
    """
    if after_epoch is not None and (max_steps is not None or batches_per_step != 1):
        raise ValueError('after_epoch needs whole epochs: no max_steps, one batch per step')
    flat_carry = tf.nest.flatten(carry)

    @tf.function(autograph=False)
    def loop(features, labels, seed, flat_carry):
        split = data.with_tensors(features, labels)
        batches_per_epoch, batch = batch_stream(split, epochs=epochs, batch_size=batch_size, seed=seed)
        epoch_count = tf.cast(epochs, tf.int32)
        total_steps = tf.where(epoch_count > 0, tf.maximum(epoch_count * batches_per_epoch // batches_per_step, 1), 0)
        if max_steps is not None:
            total_steps = tf.minimum(total_steps, tf.cast(max_steps, tf.int32))

        def body(step, loss_sum, num_correct, num_seen, flat_carry, *hook_sum):
            batches = [batch(step * batches_per_step + j) for j in range(batches_per_step)]
            new_carry, stats = step_fn(batches, tf.nest.pack_sequence_as(carry, flat_carry))
            if after_epoch is not None:  # between epochs: after this step if it ends one
                with tf.control_dependencies([t for t in tf.nest.flatten((new_carry, stats)) if tf.is_tensor(t)]):
                    ends_epoch = tf.equal((step + 1) % batches_per_epoch, 0)
                hook_sum = (
                    hook_sum[0]
                    + tf.cond(ends_epoch, lambda: after_epoch(step // batches_per_epoch), lambda: tf.constant(0.0)),
                )
            return (
                step + 1,
                loss_sum + stats.loss_sum,
                num_correct + stats.num_correct,
                num_seen + stats.num_examples,
                tf.nest.flatten(new_carry),
                *hook_sum,
            )

        zero = tf.constant(0.0)
        steps, loss_sum, num_correct, num_seen, flat_carry, *hook_sum = tf.while_loop(
            lambda step, *_: step < total_steps,
            body,
            (tf.constant(0), zero, zero, zero, flat_carry) + (() if after_epoch is None else (zero,)),
        )
        return Stats(loss_sum, num_correct, num_seen, tf.cast(steps, tf.float32)), flat_carry, hook_sum

    stats, flat_carry, hook_sum = loop(data.features, data.labels, seed, flat_carry)
    if after_epoch is None:
        return tf.nest.pack_sequence_as(carry, flat_carry), stats
    return tf.nest.pack_sequence_as(carry, flat_carry), stats, hook_sum[0]


def batch_stats(loss: tf.Tensor, logits: tf.Tensor, y: tf.Tensor, n: tf.Tensor) -> Stats:
    """`Stats` of one batch from its mean loss and logits (TF code).

    Args:
      loss: the batch's scalar mean loss.
      logits: the batch's logits `[B, num_classes]` (or `[B, L, num_classes]`).
      y: the batch's int32 labels `[B]` (or `[B, L]`).
      n: the batch size (for sequences: its labels that count), float32.

    Returns:
      `Stats(loss * n, number of correct predictions, n)`.
    """
    return Stats(loss * n, _correct(logits, y), n)


def sgd_step(model: tf.keras.Model, x, y, n, learning_rate, loss_fn: LossFn = supervised_loss) -> Stats:
    """One SGD step on `model`'s variables for `loss_fn`; the batch's stats before it (TF code).

    Args:
      model: the Keras model; its trainable variables are updated in place.
      x: the batch's features.
      y: the batch's int32 labels.
      n: the batch size, a float32 scalar.
      learning_rate: SGD step size.
      loss_fn: `(model, x_batch, y_batch) -> (mean loss, logits)`.

    Returns:
      The batch's `Stats`, computed with the weights before the step.
    """
    with tf.GradientTape() as tape:
        loss, logits = loss_fn(model, x, y)
    grads = tape.gradient(loss, model.trainable_variables)
    for variable, grad in zip(model.trainable_variables, grads):
        variable.assign_sub(tf.cast(learning_rate, tf.float32) * grad)
    return batch_stats(loss, logits, y, n)


def train(
    model: tf.keras.Model,
    data: client_data.ClientSplit,
    *,
    epochs,
    batch_size,
    learning_rate,
    seed: tf.Tensor,
    loss_fn: LossFn = supervised_loss,
    max_steps=None,
    optimizer: tff.learning.optimizers.Optimizer | None = None,
    after_epoch=None,
):
    """Mini-batch SGD (or `optimizer`) on whole tensors, in place on `model`'s variables.

    Each epoch visits the examples in a fresh permutation drawn from
    `seed` (`batch_stream`); the last batch of an epoch may be smaller than
    `batch_size`.

    Args:
      model: the Keras model to train (its variables are updated).
      data: the client's whole training split.
      epochs: number of passes over the data (int or scalar tensor).
      batch_size: examples per step.
      learning_rate: SGD step size.
      seed: int64 tensor of shape [2], for the stateless permutations.
      loss_fn: `(model, x_batch, y_batch) -> (mean loss, logits)`.
      max_steps: optional cap on the number of SGD steps (None: no cap).
      optimizer: optional; a `tff.learning.optimizers.Optimizer` whose
        `next` takes each step instead of plain SGD (`learning_rate` is then
        unused: the optimizer holds its own). Its state starts fresh
        (`initialize`) at every call: one client's local training.
      after_epoch: optional `epoch -> float32 scalar` run between epochs
        (`sgd_steps`; not with `max_steps`).

    Returns:
      `Stats` summed over every example seen during training (with the
      weights as they were before each step); with `after_epoch`, `(Stats,
      the sum of its values)`.
    """
    hook = {} if after_epoch is None else {'after_epoch': after_epoch}
    if optimizer is None:

        def step(batches, carry):
            x, y, n = batches[0]
            return carry, sgd_step(model, x, y, n, learning_rate, loss_fn)

        _, *result = sgd_steps(data, step, epochs=epochs, batch_size=batch_size, seed=seed, max_steps=max_steps, **hook)
        return result[0] if after_epoch is None else tuple(result)

    variables = model.trainable_variables
    initial_state = optimizer.initialize([tf.TensorSpec(v.shape, v.dtype) for v in variables])

    def optimizer_step(batches, state):
        x, y, n = batches[0]
        with tf.GradientTape() as tape:
            loss, logits = loss_fn(model, x, y)
        grads = tape.gradient(loss, variables)
        stats = batch_stats(loss, logits, y, n)  # before the step, as sgd_step reports them
        with tf.control_dependencies(stats[:3]):
            state, new_weights = optimizer.next(state, [tf.identity(v) for v in variables], grads)
        assigned = [v.assign(w) for v, w in zip(variables, new_weights)]
        with tf.control_dependencies(assigned):
            return tf.nest.map_structure(tf.identity, state), Stats(*(tf.identity(t) for t in stats[:3]))

    _, *result = sgd_steps(
        data,
        optimizer_step,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        max_steps=max_steps,
        carry=initial_state,
        **hook,
    )
    return result[0] if after_epoch is None else tuple(result)


def train_with(
    model: tf.keras.Model,
    data: client_data.ClientSplit,
    config: settings.TrainingConfig,
    *,
    seed: tf.Tensor,
    loss_fn: LossFn = supervised_loss,
    optimizer: tff.learning.optimizers.Optimizer | None = None,
    after_epoch=None,
):
    """`train` with a `TrainingConfig`: its epochs, batch size, learning rate and step cap.

    The one place a config becomes a training loop, so that no caller can drop
    `max_steps` (the local steps a run asked for).

    Args:
      model: the Keras model to train (its variables are updated).
      data: the client's whole training split.
      config: the local training settings.
      seed: int64 tensor of shape [2], for the stateless permutations.
      loss_fn: `(model, x_batch, y_batch) -> (mean loss, logits)`.
      optimizer: optional client optimizer, as for `train` (None: SGD at
        `config.learning_rate`).
      after_epoch: optional, as for `train` (the config must count epochs,
        not steps).

    Returns:
      The training's `Stats` (and the sum of `after_epoch`'s values), as
      `train` returns them.
    """
    return train(
        model,
        data,
        epochs=config.epochs,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        seed=seed,
        loss_fn=loss_fn,
        max_steps=config.max_steps,
        optimizer=optimizer,
        **({} if after_epoch is None else {'after_epoch': after_epoch}),
    )


def metric_sums(
    model: tf.keras.Model, data: client_data.ClientSplit, metrics: Metrics, batch_size: int = 1000
) -> collections.OrderedDict:
    """Each metric's values summed over a split's labels that count, in batches (TF code).

    Args:
      model: the Keras model to evaluate (inference mode).
      data: the split.
      metrics: `metrics_from`'s pairs (not empty).
      batch_size: examples per forward pass (memory bound only).

    Returns:
      name -> float32 sum; divide by `evaluate`'s `num_examples` for means.
      A Keras metric's entry is its `result()` times the labels that count,
      so that the same division gives the result itself.
    """
    keras = {name: fn.fresh() for name, fn in metrics if isinstance(fn, keras_metrics.KerasMetric)}

    @tf.function(autograph=False)
    def loop(features, labels):
        split = data.with_tensors(features, labels)
        num_examples = split.num_examples

        def body(start, sums, counted_sum):
            stop = tf.minimum(start + batch_size, num_examples)
            x, y = split.slice(start, stop)
            logits = model(x, training=False)
            counted = tf.cast(tf.not_equal(y, client_data.IGNORED_LABEL), tf.float32)
            updates = [op for name, fn in metrics if name in keras for op in fn.update(keras[name], y, logits)]
            with tf.control_dependencies(updates):
                new_sums = [
                    s if name in keras else s + tf.reduce_sum(fn(y, logits) * counted)
                    for s, (name, fn) in zip(sums, metrics)
                ]
                return stop, new_sums, counted_sum + tf.reduce_sum(counted)

        zeros = [tf.constant(0.0) for _ in metrics]
        resets = [v.assign(tf.zeros(v.shape, v.dtype)) for metric in keras.values() for v in metric.variables]
        with tf.control_dependencies(resets):  # zeroed here: the copy's variables need no initializer
            num_examples = tf.identity(num_examples)
        _, sums, counted_sum = tf.while_loop(
            lambda start, *_: start < num_examples, body, (tf.constant(0), zeros, tf.constant(0.0))
        )
        with tf.control_dependencies([counted_sum, *sums]):
            return [keras[name].result() * counted_sum if name in keras else s for s, (name, _) in zip(sums, metrics)]

    sums = loop(data.features, data.labels)
    return collections.OrderedDict((name, total) for (name, _), total in zip(metrics, sums))


def evaluate(model: tf.keras.Model, data: client_data.ClientSplit, batch_size: int = 1000) -> Stats:
    """Cross-entropy and accuracy sums of `model` on a whole split, in batches.

    Args:
      model: the Keras model to evaluate (inference mode).
      data: the split.
      batch_size: examples per forward pass (memory bound only).

    Returns:
      `Stats` summed over all examples (for sequences: over the labels that
      count, `num_examples` being their number).
    """

    @tf.function(autograph=False)
    def loop(features, labels):
        split = data.with_tensors(features, labels)
        num_examples = split.num_examples

        def body(start, loss_sum, num_correct):
            stop = tf.minimum(start + batch_size, num_examples)
            x, y = split.slice(start, stop)
            logits = model(x, training=False)
            return stop, loss_sum + cross_entropy_sum(logits, y), num_correct + _correct(logits, y)

        zero = tf.constant(0.0)
        _, loss_sum, num_correct = tf.while_loop(
            lambda start, *_: start < num_examples, body, (tf.constant(0), zero, zero)
        )
        return Stats(loss_sum, num_correct, client_data.count_labels(labels))

    return loop(data.features, data.labels)


def client_seed(base_seed: int, round_num: tf.Tensor, client_id: tf.Tensor, salt: int = 0) -> tf.Tensor:
    """A stateless seed (int64 [2]) unique to (run seed, round, client, salt).

    Deterministic for a given run seed, independent of which other clients
    were sampled or in which order the runtime schedules them.

    Args:
      base_seed: the run seed (a Python int).
      round_num: the round number (scalar tensor).
      client_id: the client's id (tf.string scalar).
      salt: a Python int that tells apart several seeds of one client in
        one round.

    Returns:
      An int64 tensor of shape [2], for stateless random ops.
    """
    client_hash = tf.strings.to_hash_bucket_fast(client_id, np.iinfo(np.int32).max)
    round_part = tf.cast(round_num, tf.int64) * 1009 + salt
    return tf.stack([tf.constant(base_seed, tf.int64) * 1_000_003 + round_part, client_hash])


# The local SGD settings of a client computation (defined beside the settings
# dataclasses that produce them, `tff_pfl.settings.LocalTraining`).
TrainingConfig = settings.TrainingConfig
