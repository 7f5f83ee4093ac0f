"""Loss and metrics of TFF's own processes as benchmark peers (`bench_peers`).

They count the scored positions only (`losses.hard_cross_entropy`; for text:
characters, docs/data.md "Text"), and read the labels of test rows that are
marked inside a client's dataset (`mark_test`), so that TFF's split and
personalization functions tell them from training or validation rows and the
collected metrics name their client.
"""

import numpy as np
import tensorflow as tf

from tff_pfl import losses

# Test rows are marked inside a client's dataset: each label y (>= -1) of client k's test rows is
# stored as y - (k + 1) * TEST_MARK, so that TFF's dataset split function of FedRecon's evaluation
# and the personalization functions tell them from training or validation rows (every label of a
# marked row is < -1; an unmarked row has a label >= 0), and the collected metrics name their
# client. Losses and metrics read (y + 1) mod TEST_MARK - 1, the label itself.
# Marked labels must survive float32: TFF's FedRecon evaluation (and training) report the loss
# through a Keras `MeanMetricWrapper`, which casts the labels to float32 before our loss reads them,
# and float32 holds integers exactly up to 2^24 only. A mark of 2^20 lost the labels of clients
# past the 16th (Shakespeare's 613 roles: labels rounded to multiples of 32). With 2^10: up to
# 1,023 classes and `MAX_MARKED_CLIENTS` clients.
TEST_MARK = 1 << 10
MAX_MARKED_CLIENTS = (1 << 24) // TEST_MARK - 1


# ----------------------------------------------------------------------------
# Loss and metrics over the scored positions.


def label(y):
    """The label of a possibly marked label (TF code)."""
    return tf.math.floormod(tf.cast(y, tf.int32) + 1, TEST_MARK) - 1


def client_tag(y):
    """k + 1 for the marked labels of client k, 0 for unmarked ones (TF code)."""
    return -tf.math.floordiv(tf.cast(y, tf.int32) + 1, TEST_MARK)


def mark_test(y: np.ndarray, index: int) -> np.ndarray:
    """Client `index`'s test labels, marked (`TEST_MARK`).

    Args:
      y: int32 labels (>= -1).
      index: the client's position in the partition.

    Returns:
      `y - (index + 1) * TEST_MARK`.
    """
    return (y - (index + 1) * TEST_MARK).astype(np.int32)


class ScoredCrossEntropy(tf.keras.losses.Loss):
    """Mean cross-entropy from logits over the scored labels (`losses.hard_cross_entropy`).

    Labels -1 (text padding and end of snippet) count nowhere.
    """

    def __init__(self, name: str = 'scored_cross_entropy'):
        super().__init__(name=name)

    def __call__(self, y_true, y_pred, sample_weight=None):
        del sample_weight
        return losses.hard_cross_entropy(y_pred, label(y_true))

    def call(self, y_true, y_pred):
        """The batch's mean loss over its scored labels.

        Args:
          y_true: int labels `[B]` or `[B, L]` (possibly marked, `mark_test`).
          y_pred: logits `[B, C]` or `[B, L, C]`.

        Returns:
          A scalar.
        """
        return self(y_true, y_pred)


class ScoredAccuracy(tf.keras.metrics.Mean):
    """Accuracy over the scored labels: its count is the number of scored labels."""

    def __init__(self, name: str = 'accuracy', dtype=None):
        super().__init__(name=name, dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        """Adds a batch's correct predictions of scored labels.

        Args:
          y_true: int labels (possibly marked, `mark_test`).
          y_pred: logits.
          sample_weight: ignored (the scored labels weigh 1, the others 0).

        Returns:
          The update op.
        """
        del sample_weight
        y_true = label(y_true)
        correct = tf.equal(tf.argmax(y_pred, axis=-1, output_type=tf.int32), y_true)
        return super().update_state(tf.cast(correct, self.dtype), sample_weight=tf.cast(y_true >= 0, self.dtype))


class ScoredCount(tf.keras.metrics.Sum):
    """The number of scored labels (for text: characters)."""

    def __init__(self, name: str = 'scored', dtype=None):
        super().__init__(name=name, dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        """Adds a batch's number of scored labels.

        Args:
          y_true: int labels (possibly marked, `mark_test`).
          y_pred: ignored.
          sample_weight: ignored.

        Returns:
          The update op.
        """
        del y_pred, sample_weight
        return super().update_state(tf.reduce_sum(tf.cast(label(y_true) >= 0, self.dtype)))


class ClientTag(tf.keras.metrics.Metric):
    """k + 1 for the marked test rows of client k (`mark_test`): whose metrics these are."""

    def __init__(self, name: str = 'client', dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.tag = self.add_weight(name='tag', initializer='zeros')

    def update_state(self, y_true, y_pred, sample_weight=None):
        """Keeps the largest client tag of the batch's labels.

        Args:
          y_true: int labels (possibly marked, `mark_test`).
          y_pred: ignored.
          sample_weight: ignored.

        Returns:
          The update op.
        """
        del y_pred, sample_weight
        tag = tf.cast(tf.reduce_max(client_tag(y_true)), self.dtype)
        return self.tag.assign(tf.maximum(self.tag, tag))

    def result(self):
        """The client's tag, k + 1 (0: no marked label seen).

        Returns:
          A float32 scalar.
        """
        return tf.identity(self.tag)


def metrics() -> list:
    return [ScoredAccuracy(), ScoredCount()]


def eval_metrics() -> list:
    return [ScoredAccuracy(), ScoredCount(), ClientTag()]


def scored_counts(logits, y):
    """`(correct, scored)` of a batch, float32 (TF code)."""
    y = label(y)
    scored = tf.cast(y >= 0, tf.float32)
    correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), y), tf.float32) * scored
    return tf.reduce_sum(correct), tf.reduce_sum(scored)


def is_test_row(x, y):
    del x
    return tf.reduce_max(y) < -1


def is_train_row(x, y):
    return tf.logical_not(is_test_row(x, y))
