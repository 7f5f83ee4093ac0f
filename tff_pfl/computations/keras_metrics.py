"""Keras metric objects (`tf.keras.metrics.AUC()`, ...) as a builder's extra evaluation metrics.

A builder's `metrics=` takes, beside per-label functions, `tf.keras.metrics.Metric`
objects. A Keras metric is stateful and need not be a mean (an AUC is not), so
each client evaluation builds a fresh copy of it (`from_config`), updates it over
the client's test batches and reports its `result()`: the client's own AUC, say,
never a mean of per-batch values.

What the metric reads is fixed once, when the builder is called, by trying it on
the data's shapes:

* predictions: the logits if the metric was built with `from_logits=True`, else
  the softmax probabilities (Keras metrics read probabilities by default);
* labels: the class indices for Keras's `Sparse...` metrics
  (`SparseCategoricalAccuracy`, `SparseTopKCategoricalAccuracy`), else one-hot
  rows of the model's width (`AUC`, `Precision`, `CategoricalAccuracy`, a
  metric of the user's): Keras's own naming rule, since a metric given the
  other kind often runs and returns a wrong number (`CategoricalAccuracy` on
  class indices broadcasts them);
* sequence labels are flattened to one row per position, and positions labelled
  `client_data.IGNORED_LABEL` get sample weight 0.
"""

import collections

import tensorflow as tf

from tff_pfl.data import client_data


class KerasMetric(collections.namedtuple('KerasMetric', ['metric', 'one_hot', 'from_logits'])):
    """A user's Keras metric object and the inputs it was found to take.

    Attributes:
      metric: the user's `tf.keras.metrics.Metric` (never updated itself: each
        evaluation updates a copy).
      one_hot: whether its labels are one-hot rows (else class indices).
      from_logits: whether it reads logits (else softmax probabilities).
    """

    def fresh(self) -> tf.keras.metrics.Metric:
        """A new metric of the same class and config (TF code: creates its variables).

        Returns:
          The copy; `metric_sums` zeroes its variables before updating them.
        """
        return type(self.metric).from_config(self.metric.get_config())

    def update(self, metric: tf.keras.metrics.Metric, labels: tf.Tensor, logits: tf.Tensor) -> list:
        """The update ops of one batch: flattened positions, ignored labels weighted out (TF code).

        Args:
          metric: the copy to update (`fresh`).
          labels: integer labels `[B]` or `[B, L]`.
          logits: the model's logits `[*labels.shape, width]`.

        Returns:
          The update ops (empty in eager mode).
        """
        width = logits.shape[-1]
        flat_labels = tf.reshape(labels, [-1])
        flat_logits = tf.reshape(logits, [-1, width])
        weights = tf.cast(tf.not_equal(flat_labels, client_data.IGNORED_LABEL), tf.float32)
        classes = tf.maximum(flat_labels, 0)
        y_true = tf.one_hot(classes, width) if self.one_hot else classes
        y_pred = flat_logits if self.from_logits else tf.nn.softmax(flat_logits)
        update = metric.update_state(y_true, y_pred, sample_weight=weights)
        return [update] if update is not None else []


def is_keras_metric(value) -> bool:
    """Whether a `metrics=` entry is a Keras metric object.

    Args:
      value: one value of the `metrics` mapping.

    Returns:
      True for a `tf.keras.metrics.Metric`.
    """
    return isinstance(value, tf.keras.metrics.Metric)


def _first_line(error: BaseException) -> str:
    """The error's first line; for an error autograph wrapped (`in user code: ...`), the original's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[-1] if lines[0] == 'in user code:' else lines[0]


def _takes(metric: tf.keras.metrics.Metric, one_hot: bool, from_logits: bool, spec, num_classes: int) -> str | None:
    """None if a fresh copy of `metric` takes a batch of the spec's shapes so, else the first line of its error."""
    trial = KerasMetric(metric, one_hot, from_logits)
    with tf.Graph().as_default():
        labels = tf.zeros([2, *spec.label_shape], tf.int32)
        logits = tf.zeros([2, *spec.label_shape, num_classes], tf.float32)
        try:
            copy = trial.fresh()
            with tf.control_dependencies(trial.update(copy, labels, logits)):
                result = copy.result()
        except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as error:
            return _first_line(error)
    if result.shape.rank != 0:
        return f'its result() has shape {result.shape.as_list()}, not one number'
    return None


def from_metric(metric: tf.keras.metrics.Metric, spec, argument: str) -> KerasMetric:
    """A user's Keras metric, with the inputs it takes on the spec's shapes.

    Args:
      metric: a `tf.keras.metrics.Metric` object.
      spec: the data's spec (None: labels as class indices, untried).
      argument: the Python argument, for the errors (`metrics['auc']`).

    Returns:
      The `KerasMetric`.

    Raises:
      ValueError: in one line, if it fails on the labels and predictions
        chosen for it, or its result is not one number.
    """
    from_logits = bool(metric.get_config().get('from_logits', False))
    one_hot = not type(metric).__name__.startswith('Sparse')
    chosen = KerasMetric(metric, one_hot, from_logits)
    if spec is None:
        return chosen
    refusal = _takes(metric, one_hot, from_logits, spec, spec.num_classes)
    if refusal is not None:
        labels = 'one-hot labels' if one_hot else 'class indices'
        predictions = 'logits' if from_logits else 'probabilities'
        raise ValueError(
            f'{argument}: {type(metric).__name__} fails on {labels} and {spec.num_classes} {predictions} per label '
            f'({refusal}); a Keras Sparse... metric gets class indices, any other one-hot labels'
        )
    return chosen
