"""KD-PDFL's star-node arithmetic (Eqs. 2-4, §IV step 5), as plain TF functions.

E. Jeong, M. Kountouris, "Personalized Decentralized Federated Learning with
Knowledge Distillation" (ICC 2023). `processes.kdpdfl` builds the exchange
from these; each is tested against numpy in tests/test_kdpdfl.py.
"""

import tensorflow as tf

# Readings of Eq. 2's step eta = 1./|grad h_i| (`KDPDFLSettings.kd_step`).
STEPS = ('norm', 'elementwise')


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


def connectivity_update(row, neighbour_ids, present, distances, *, mu1, mu2, step):
    """Eq. 2 on the star's row w_i, for its neighbours only.

    grad h_ij = mu_1 d_W(i, j) + mu_2 grad g_ij and w_ij <- max(0, w_ij -
    eta grad h_ij), with eta by `step`: 'norm', eta = 1 / ||grad h_i|| (the
    Euclidean norm over the neighbours' entries: a unit-length step);
    'elementwise', eta_ij = 1 / |grad h_ij|, i.e. w_ij <- max(0, w_ij -
    sign(grad h_ij)). Entries of clients that are not neighbours this time
    are left alone (their distances are unknown), and so is an entry whose
    gradient is zero ('norm': the whole row when the gradient is zero, so
    mu_1 = mu_2 = 0 keeps W at its initial value under either step).

    Args:
      row: `[M]` the star's connectivity vector (w_ii = 0).
      neighbour_ids: `[K]` int32 client indices (any value where not present).
      present: `[K]` 1.0 for a filled slot, else 0.0.
      distances: `[K]` d_W(i, j) per slot.
      mu1: weight of the distances.
      mu2: weight of the collaboration regulariser.
      step: 'norm' or 'elementwise' (`STEPS`).

    Returns:
      The new `[M]` row.

    Raises:
      ValueError: a step not in `STEPS`.
    """
    if step not in STEPS:
        raise ValueError(f'step must be one of {", ".join(STEPS)}, got {step!r}')
    ids = tf.where(present > 0, neighbour_ids, 0)
    current = tf.gather(row, ids)
    grad = (mu1 * distances + mu2 * tf.gather(collaboration_gradient(row), ids)) * present
    if step == 'norm':
        norm = tf.norm(grad)
        change = tf.where(norm > 0, grad / tf.maximum(norm, 1e-12), tf.zeros_like(grad))
    else:  # grad / |grad| entry by entry: its sign, 0 where the gradient is 0
        change = tf.sign(grad)
    updated = tf.maximum(0.0, current - change)
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
      neighbour_models: the same list with a leading dimension (the slots of
        an exchange, or the M footprints).
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


def keep_footprints(footprints, held, slot_models, neighbour_ids, present):
    """§IV step 5's footprints: this exchange's received models overwrite their clients' entries.

    Args:
      footprints: the star's latest model of every client, a list of `[M,
        ...]` tensors.
      held: `[M]` 1.0 where the star holds a footprint of that client.
      slot_models: this exchange's received models, a list of `[K, ...]`
        tensors.
      neighbour_ids: `[K]` int32 client indices (any value where not present).
      present: `[K]` 1.0 for a filled slot, else 0.0.

    Returns:
      `(footprints, held)` after this exchange; the other entries unchanged.
    """
    num_clients = tf.shape(held)[0]
    ids = tf.where(present > 0, neighbour_ids, 0)
    received = tf.math.unsorted_segment_sum(present, ids, num_clients)  # 0/1: invited indices are distinct
    kept = []
    for old, new in zip(footprints, slot_models):
        shape = [-1] + [1] * (len(new.shape) - 1)
        arrived = tf.math.unsorted_segment_sum(new * tf.reshape(present, shape), ids, num_clients)
        kept.append(tf.where(tf.reshape(received, shape) > 0, arrived, old))
    return kept, tf.maximum(held, received)
