"""Distillation losses on logits (TF code).

Shapes: student logits `[..., B, C]` (leading candidate dimensions allowed,
e.g. a grid of models trained together), teacher logits `[B, C]`, labels
`[B]`; `temperature` and `imitation` broadcast against the leading dimensions
`[...]`. Every function returns the mean over the batch, shape `[...]`.
"""

import tensorflow as tf

SOFT_LOSSES = ('kl', 'ce')


def _expand(value, logits):
    """[...] -> [..., 1, 1] so it broadcasts against [..., B, C]."""
    value = tf.convert_to_tensor(value, logits.dtype)
    return tf.reshape(value, tf.concat([tf.shape(value), [1, 1]], axis=0))


def hard_cross_entropy(student_logits, labels):
    """Mean cross-entropy of the student's softmax with integer labels.

    Args:
      student_logits: `[..., B, C]`.
      labels: int labels `[B]`.

    Returns:
      The batch-mean loss, `[...]`.
    """
    labels = tf.broadcast_to(labels, tf.shape(student_logits)[:-1])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=student_logits), axis=-1)


def soft_kl(teacher_logits, student_logits, temperature):
    """Mean KL(softmax(teacher / T) || softmax(student / T)), without the T^2 factor.

    Args:
      teacher_logits: `[B, C]`.
      student_logits: `[..., B, C]`.
      temperature: T, broadcast to `[...]`.

    Returns:
      The batch-mean divergence, `[...]`.
    """
    t = _expand(temperature, student_logits)
    teacher_log_p = tf.nn.log_softmax(teacher_logits / t, axis=-1)
    student_log_p = tf.nn.log_softmax(student_logits / t, axis=-1)
    return tf.reduce_mean(tf.reduce_sum(tf.exp(teacher_log_p) * (teacher_log_p - student_log_p), axis=-1), axis=-1)


def soft_cross_entropy(teacher_logits, student_logits, temperature):
    """Mean cross-entropy -sum softmax(teacher / T) log softmax(student / T).

    Equals `soft_kl` plus the teacher's entropy, which does not depend on the
    student: the two have the same gradient with respect to the student.

    Args:
      teacher_logits: `[B, C]`.
      student_logits: `[..., B, C]`.
      temperature: T, broadcast to `[...]`.

    Returns:
      The batch-mean loss, `[...]`.
    """
    t = _expand(temperature, student_logits)
    teacher_p = tf.nn.softmax(teacher_logits / t, axis=-1)
    student_log_p = tf.nn.log_softmax(student_logits / t, axis=-1)
    return tf.reduce_mean(-tf.reduce_sum(teacher_p * student_log_p, axis=-1), axis=-1)


def persfl_loss(student_logits, teacher_logits, labels, temperature, imitation, soft: str = 'kl'):
    """PersFL's objective (Eq. 3; Eq. 7 with soft='ce' for PersFL-GD).

    (1 - lambda) * CE(y, softmax(A(x))) + lambda * T^2 * soft(O(x), A(x); T)

    Args:
      student_logits: A_k(x), `[..., B, C]`.
      teacher_logits: O_k(x), `[B, C]`.
      labels: int labels `[B]`.
      temperature: T, broadcast to `[...]`.
      imitation: lambda, broadcast to `[...]`.
      soft: 'kl' (PersFL) or 'ce' (PersFL-GD).

    Returns:
      The batch-mean loss, `[...]`.
    """
    if soft not in SOFT_LOSSES:
        raise ValueError(f'soft loss must be one of {SOFT_LOSSES}, got {soft!r}')
    soft_fn = soft_kl if soft == 'kl' else soft_cross_entropy
    imitation = tf.convert_to_tensor(imitation, student_logits.dtype)
    temperature = tf.convert_to_tensor(temperature, student_logits.dtype)
    return (1.0 - imitation) * hard_cross_entropy(student_logits, labels) + imitation * tf.square(
        temperature
    ) * soft_fn(teacher_logits, student_logits, temperature)
