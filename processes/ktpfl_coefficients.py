"""The KT-pFL family's knowledge-coefficient matrix c: its settings and its math.

Both variants (`processes.ktpfl`, `processes.ktpfl_homo`) learn c the same
way: the help lines and checks of its three settings (eta_3, rho, lambda);
the mixing weights (rows of c normalised, restricted to the round's
clients); the objective's shape (Eq. 4's, Eq. 11's) with its regulariser;
and the clipped gradient step on the block of the round's clients. The
round that uses them is `processes.ktpfl_rounds`.
"""

import tensorflow as tf

# Fields of both KT-pFL variants (one name, one meaning).
COEFFICIENT_LR_HELP = 'eta_3, the learning rate of the knowledge-coefficient update (Eq. 7; Eq. 11 for ktpfl_homo).'


RHO_HELP = 'rho, the weight of ||c - 1/N||^2 in the objective (Eq. 4; Eq. 11 for ktpfl_homo).'


IMITATION_HELP = 'lambda, the weight of the knowledge-transfer term in the c update (Eq. 2 and 7; Eq. 11).'


def coefficient_checks(settings) -> list[tuple[bool, str]]:
    """The checks of the coefficient matrix's settings, shared by both variants' settings.

    Args:
      settings: settings with `kt_coefficient_learning_rate`, `kt_rho` and `kt_imitation`.

    Returns:
      `(ok, one-line problem)` pairs, as `Settings._checks` returns them.
    """
    return [
        (
            settings.kt_coefficient_learning_rate >= 0,
            f'kt_coefficient_learning_rate must be >= 0, got {settings.kt_coefficient_learning_rate}',
        ),
        (settings.kt_rho >= 0, f'kt_rho must be >= 0, got {settings.kt_rho}'),
        (settings.kt_imitation > 0, f'kt_imitation must be > 0, got {settings.kt_imitation}'),
    ]


def mixing_weights(coefficients: tf.Tensor, present: tf.Tensor | None = None) -> tf.Tensor:
    """Rows of c normalised to sum to 1 (c itself is kept non-negative).

    A row that has fallen to all zeros gives the client its own weight only
    (the identity row): a client that trusts nobody keeps its own knowledge.

    Args:
      coefficients: c, `[N, N]`, non-negative.
      present: optional `[N]`, 1 for the clients of this round and 0 for
        the others: the columns of absent clients are zeroed before the rows
        are normalised, so each row mixes this round's clients only. None:
        every client (the same numbers as a vector of ones).

    Returns:
      `[N, N]`, the row-normalised c.
    """
    # The mask goes on the row sums and on the weights, not on c once for both: c then feeds the
    # same three ops as without a mask (sum, divide, the regulariser), so its gradient is summed in
    # the same order and every client present gives the unmasked numbers bit for bit.
    columns = coefficients if present is None else coefficients * present[tf.newaxis, :]
    totals = tf.reduce_sum(columns, axis=1, keepdims=True)
    weights = coefficients / tf.maximum(totals, 1e-12)
    if present is not None:
        weights = weights * present[tf.newaxis, :]
    own = tf.eye(tf.shape(coefficients)[0], dtype=coefficients.dtype)
    return tf.where(totals > 0, weights, own)


def _block(present):
    """`[N, N]`: 1 where both the row's and the column's client are present, else 0."""
    return present[:, tf.newaxis] * present[tf.newaxis, :]


def regularised(coefficients, per_client, weights, rho, imitation, present=None):
    """Eq. 4's (and Eq. 11's) shape: lambda sum_n (D_n/D) per_client_n + rho ||c - 1/N||^2.

    With `present`, the regulariser sums over the block of present clients
    (its target stays 1/N, N every client: c_0's value, the scale of the
    entries left out of the block).

    Args:
      coefficients: c, `[N, N]`.
      per_client: `[N]`, each client's transfer term.
      weights: `[N]`, D_n.
      rho: the regulariser's weight.
      imitation: lambda, the transfer term's weight.
      present: optional `[N]` presence of the round's clients.

    Returns:
      The objective, a scalar (TF code).
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    share = weights / tf.reduce_sum(weights)
    squares = tf.square(coefficients - 1.0 / num_clients)
    if present is not None:
        squares = squares * _block(present)
    return imitation * tf.reduce_sum(share * per_client) + rho * tf.reduce_sum(squares)


def within_block(new, coefficients, present):
    """`new` on the block of present clients, `coefficients` (untouched) elsewhere; `new` if `present` is None.

    Args:
      new: `[N, N]`, the stepped (or recomputed) coefficients.
      coefficients: `[N, N]`, c before the round.
      present: `[N]` presence of the round's clients, or None (every client).

    Returns:
      The round's c (TF code).
    """
    if present is None:
        return new
    return tf.where(_block(present) > 0, new, coefficients)


def clipped_step(objective, coefficients, learning_rate, present=None):
    """One gradient-descent step of `objective` (a function of c) from `coefficients`, clipped at 0.

    With `present`, only the block of present clients takes the step.

    Args:
      objective: `c -> scalar`.
      coefficients: c, `[N, N]`.
      learning_rate: the step size (eta_3).
      present: optional `[N]` presence of the round's clients.

    Returns:
      The new c (TF code).
    """
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        loss = objective(coefficients)
    stepped = tf.maximum(coefficients - learning_rate * tape.gradient(loss, coefficients), 0.0)
    return within_block(stepped, coefficients, present)
