"""Distillation losses on logits (TF code).

Shapes: student logits `[..., B, C]` (leading candidate dimensions allowed,
e.g. a grid of models trained together), teacher logits `[B, C]`, labels
`[B]`; `temperature` and `imitation` broadcast against the leading dimensions
`[...]`. Every function returns the mean over the batch, shape `[...]`.

Sequences (next-character prediction) carry one label per position: logits
`[..., B, L, C]`, labels `[B, L]`. Then the mean is over the positions whose
label counts (not `client_data.IGNORED_LABEL`), for the soft terms too: the
student imitates the teacher where it is scored.
"""

import tensorflow as tf

from tff_pfl.data import client_data

SOFT_LOSSES = ('kl', 'ce', 'kl_elements', 'ce_elements')
# 'kl' and 'ce' sum the soft term over the C classes of each position, then take the mean over the
# positions; the '_elements' forms also divide by C (the mean over every logit, what PyTorch's
# `KLDivLoss()` does under its default reduction 'mean'): the same gradient direction, C times smaller.
ELEMENTS_SUFFIX = '_elements'


def _expand(value, logits, labels):
    """[...] -> [..., 1, 1] (or [..., 1, 1, 1] for sequences) so it broadcasts against the logits."""
    value = tf.convert_to_tensor(value, logits.dtype)
    trailing = [1] * (labels.shape.rank + 1)
    return tf.reshape(value, tf.concat([tf.shape(value), trailing], axis=0))


def mean_over_positions(values, labels):
    """The mean of per-position values over the positions whose label counts.

    Args:
      values: `[..., B]` (or `[..., B, L]`), one value per label.
      labels: the batch's int labels `[B]` (or `[B, L]`, ignored positions
        `client_data.IGNORED_LABEL`).

    Returns:
      The mean, `[...]` (over all of `B` for class labels; over the counted
      positions for sequences, at least one).
    """
    if labels.shape.rank == 1:
        return tf.reduce_mean(values, axis=-1)
    counted = tf.cast(tf.not_equal(labels, client_data.IGNORED_LABEL), values.dtype)
    total = tf.maximum(client_data.count_labels(labels), 1.0)
    return tf.reduce_sum(values * counted, axis=list(range(-labels.shape.rank, 0))) / total


def hard_cross_entropy(student_logits, labels):
    """Mean cross-entropy of the student's softmax with integer labels.

    Args:
      student_logits: `[..., B, C]` (or `[..., B, L, C]`).
      labels: int labels `[B]` (or `[B, L]`, ignored positions -1).

    Returns:
      The mean loss over the (counted) positions, `[...]`.
    """
    safe = tf.maximum(labels, 0)  # ignored positions get a valid index; they are weighted out
    safe = tf.broadcast_to(safe, tf.shape(student_logits)[:-1])
    values = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=safe, logits=student_logits)
    return mean_over_positions(values, labels)


def soft_kl(teacher_logits, student_logits, temperature, labels):
    """Mean KL(softmax(teacher / T) || softmax(student / T)), without the T^2 factor.

    Args:
      teacher_logits: `[B, C]` (or `[B, L, C]`).
      student_logits: `[..., B, C]` (or `[..., B, L, C]`).
      temperature: T, broadcast to `[...]`.
      labels: the batch's labels `[B]` (or `[B, L]`): which positions count.

    Returns:
      The mean divergence over the (counted) positions, `[...]`.
    """
    t = _expand(temperature, student_logits, labels)
    teacher_log_p = tf.nn.log_softmax(teacher_logits / t, axis=-1)
    student_log_p = tf.nn.log_softmax(student_logits / t, axis=-1)
    values = tf.reduce_sum(tf.exp(teacher_log_p) * (teacher_log_p - student_log_p), axis=-1)
    return mean_over_positions(values, labels)


def soft_cross_entropy(teacher_logits, student_logits, temperature, labels):
    """Mean cross-entropy -sum softmax(teacher / T) log softmax(student / T).

    Equals `soft_kl` plus the teacher's entropy, which does not depend on the
    student: the two have the same gradient with respect to the student.

    Args:
      teacher_logits: `[B, C]` (or `[B, L, C]`).
      student_logits: `[..., B, C]` (or `[..., B, L, C]`).
      temperature: T, broadcast to `[...]`.
      labels: the batch's labels `[B]` (or `[B, L]`): which positions count.

    Returns:
      The mean loss over the (counted) positions, `[...]`.
    """
    t = _expand(temperature, student_logits, labels)
    teacher_p = tf.nn.softmax(teacher_logits / t, axis=-1)
    student_log_p = tf.nn.log_softmax(student_logits / t, axis=-1)
    return mean_over_positions(-tf.reduce_sum(teacher_p * student_log_p, axis=-1), labels)


def persfl_loss(student_logits, teacher_logits, labels, temperature, imitation, soft: str = 'kl'):
    """PersFL's objective (Eq. 3; Eq. 7 with soft='ce' for PersFL-GD).

    (1 - lambda) * CE(y, softmax(A(x))) + lambda * T^2 * soft(O(x), A(x); T)

    Args:
      student_logits: A_k(x), `[..., B, C]` (or `[..., B, L, C]`).
      teacher_logits: O_k(x), `[B, C]` (or `[B, L, C]`).
      labels: int labels `[B]` (or `[B, L]`).
      temperature: T, broadcast to `[...]`.
      imitation: lambda, broadcast to `[...]`.
      soft: 'kl' (PersFL) or 'ce' (PersFL-GD); 'kl_elements' / 'ce_elements'
        divide the soft term by the number of classes C (`SOFT_LOSSES`).

    Returns:
      The mean loss over the (counted) positions, `[...]`.
    """
    if soft not in SOFT_LOSSES:
        raise ValueError(f'soft loss must be one of {SOFT_LOSSES}, got {soft!r}')
    soft_fn = soft_kl if soft.startswith('kl') else soft_cross_entropy
    imitation = tf.convert_to_tensor(imitation, student_logits.dtype)
    temperature = tf.convert_to_tensor(temperature, student_logits.dtype)
    soft_term = soft_fn(teacher_logits, student_logits, temperature, labels)
    if soft.endswith(ELEMENTS_SUFFIX):
        soft_term = soft_term / tf.cast(tf.shape(student_logits)[-1], soft_term.dtype)
    return (1.0 - imitation) * hard_cross_entropy(student_logits, labels) + imitation * tf.square(
        temperature
    ) * soft_term
