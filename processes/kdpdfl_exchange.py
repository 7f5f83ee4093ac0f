"""KD-PDFL's star-node arithmetic (Eqs. 2-4), as plain TF functions.

E. Jeong, M. Kountouris, "Personalized Decentralized Federated Learning with
Knowledge Distillation" (ICC 2023). `processes.kdpdfl` builds the exchange
from these; each is tested against numpy in tests/test_kdpdfl.py.
"""

import tensorflow as tf


def output_distances(own: tf.Tensor, neighbours: tf.Tensor) -> tf.Tensor:
    """Eq. 3: (1/n) sum_x sum_l (p_i(x)_l - p_j(x)_l)^2 per neighbour.

    Args:
      own: `[n, L]` the star's outputs on its batch.
      neighbours: `[K, n, L]` each neighbour model's outputs on the same batch.

    Returns:
      `[K]` distances.
    """
    return tf.reduce_mean(tf.reduce_sum(tf.square(neighbours - own[tf.newaxis]), axis=-1), axis=-1)


def collaboration_gradient(row: tf.Tensor) -> tf.Tensor:
    """grad g_i for g_i(w_i) = 1/2 (1 - sum_j w_ij)^2: -(1 - sum_j w_ij) for every j.

    g is 0 when the client's collaboration weights sum to 1 and 1/2 when
    they are all zero, i.e. when it would train only locally.

    Args:
      row: `[M]` the star's connectivity vector w_i.

    Returns:
      `[M]`, the gradient (the same value in every entry).
    """
    return -(1.0 - tf.reduce_sum(row)) * tf.ones_like(row)


def connectivity_update(row, neighbour_ids, present, distances, *, mu1, mu2):
    """Eq. 2 on the star's row w_i, for its neighbours only.

    grad h_ij = mu_1 d_W(i, j) + mu_2 grad g_ij; eta = 1 / ||grad h_i|| (the
    norm over the neighbours' entries); w_ij <- max(0, w_ij - eta grad h_ij).
    Entries of clients that are not neighbours this time are left alone
    (their distances are unknown). A zero gradient leaves the row unchanged
    (mu_1 = mu_2 = 0 keeps W at its initial value).

    Args:
      row: `[M]` the star's connectivity vector (w_ii = 0).
      neighbour_ids: `[K]` int32 client indices (any value where not present).
      present: `[K]` 1.0 for a filled slot, else 0.0.
      distances: `[K]` d_W(i, j) per slot.
      mu1: weight of the distances.
      mu2: weight of the collaboration regulariser.

    Returns:
      The new `[M]` row.
    """
    ids = tf.where(present > 0, neighbour_ids, 0)
    current = tf.gather(row, ids)
    grad = (mu1 * distances + mu2 * tf.gather(collaboration_gradient(row), ids)) * present
    norm = tf.norm(grad)
    step = tf.where(norm > 0, grad / tf.maximum(norm, 1e-12), tf.zeros_like(grad))
    updated = tf.maximum(0.0, current - step)
    delta = (updated - current) * present
    return row + tf.math.unsorted_segment_sum(delta, ids, tf.shape(row)[0])


def confidence(num_train, num_neighbours, c_base):
    """Eq. 4: c_i = min(|X_i| / c_base, 1 / (|N_i| + 1)).

    Args:
      num_train: |X_i|, the star's number of training examples.
      num_neighbours: |N_i|, the number of neighbours that sent a model.
      c_base: the example count at which |X_i| / c_base reaches 1.

    Returns:
      c_i, a float32 scalar.
    """
    return tf.minimum(tf.cast(num_train, tf.float32) / c_base, 1.0 / (tf.cast(num_neighbours, tf.float32) + 1.0))


def star_mix(own, neighbour_models, weights, own_share):
    """c theta_i + (1 - c) sum_k (w_k / sum w) theta_k, per weight tensor.

    Args:
      own: the star's weights (list of tensors).
      neighbour_models: the same list with a leading slot dimension K.
      weights: `[K]` non-negative mixing weights (0 for empty slots).
      own_share: c, the star's own share.

    Returns:
      The mixed weights; the star's own if every weight is zero.
    """
    total = tf.reduce_sum(weights)
    normalised = weights / tf.maximum(total, 1e-12)
    share = tf.where(total > 0, own_share, 1.0)
    mixed = []
    for mine, theirs in zip(own, neighbour_models):
        average = tf.tensordot(normalised, theirs, axes=1)
        mixed.append(share * mine + (1.0 - share) * average)
    return mixed
