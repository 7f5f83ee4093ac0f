"""KT-pFL: parameterized knowledge transfer across heterogeneous client models.

J. Zhang, S. Guo, X. Ma, H. Wang, W. Xu, F. Wu, "Parameterized Knowledge
Transfer for Personalized Federated Learning" (NeurIPS 2021), Algorithm 1.

Every client n keeps its own model w_n, of its own architecture, in its
state (packed, see `computations.heterogeneous`). One round:

1. local training on private data, E epochs or exactly `local_steps` SGD
   steps (Eq. 5);
2. soft predictions s(w_n, x) = softmax(z / T) on this round's public batch
   (the same batch for everyone, drawn from the public data by round);
3. the server forms each client's personalized soft target
   sum_m c[n, m] s(w_m, x) with the knowledge-coefficient matrix c;
4. each client distils towards its target with KL for R passes over the
   public batch (Eq. 6);
5. the server updates c by gradient descent on Eq. 4's objective (Eq. 7):
   lambda * sum_n (D_n / D) KL(sum_m c[n, m] s_m || s_n) + rho ||c - 1/N||^2.

Indexing: row n of c is client n's mixing vector (the paper's c_mn, the
contribution of client m to client n, is c[n, m] here).

Only soft predictions cross from the clients to the server: each client sends
its [P, C] predictions with its index, and the server keeps the round's K
clients' predictions as K rows (`_gather`, K = the round's most clients);
each client's example count and a 1 go into its own slot of two [N] sums.
Weights never leave a client.

Partial participation (the paper's Table 2, client sampling rate 0.1: "only
partial of elements in the knowledge coefficient matrix c will be updated in
each communication round"): a round takes the states of any subset S of the
clients (the run loop samples them, as for every algorithm). Each client of
S also marks its slot of a presence vector; the server mixes only S's
predictions (row n of c restricted to the columns of S, renormalised), forms
targets for S only, and takes Eq. 7's step on the S x S block of c, with Eq.
4's objective restricted to S. Every entry of c outside that block, and every
client outside S, is left exactly as it was. With S = every client this is
the full-participation round, bit for bit.

Settings: `KTpFLSettings` (Algorithm 1 and its Table 1 baselines) and
`KTpFLHomoSettings` (Appendix C); their defaults are the paper's Appendix B.2
(docs/algorithms/ktpfl.md, "Settings").
"""

import collections
import dataclasses
import os
import typing

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, reports
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    building_blocks,
    device_state,
    distillation,
    heterogeneous,
    local_training,
    privacy,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

C_UPDATES = ('paper', 'released', 'fedmd', 'similarity', 'topk')
# Baselines of the paper's Table 1 that differ from KT-pFL only in c:
#   fedmd: every client's target is the plain average of all soft predictions;
#   similarity (Sim-pFL): c[n, m] = cosine similarity of the soft predictions;
#   topk (TopK-pFL): the same, kept for the K most similar clients only.
FIXED_OR_SIMILARITY = ('fedmd', 'similarity', 'topk')

_setting = settings_lib.setting
# Inherited local-training fields whose defaults the paper restates keep their help line.
_LOCAL_HELP = {f.name: settings_lib.help_of(f) for f in dataclasses.fields(settings_lib.LocalTraining)}
# Fields of both KT-pFL variants (one name, one meaning).
_COEFFICIENT_LR_HELP = 'eta_3, the learning rate of the knowledge-coefficient update (Eq. 7; Eq. 11 for ktpfl_homo).'
_RHO_HELP = 'rho, the weight of ||c - 1/N||^2 in the objective (Eq. 4; Eq. 11 for ktpfl_homo).'
_IMITATION_HELP = 'lambda, the weight of the knowledge-transfer term in the c update (Eq. 2 and 7; Eq. 11).'


def _coefficient_checks(settings) -> list[tuple[bool, str]]:
    return [
        (
            settings.kt_coefficient_learning_rate >= 0,
            f'kt_coefficient_learning_rate must be >= 0, got {settings.kt_coefficient_learning_rate}',
        ),
        (settings.kt_rho >= 0, f'kt_rho must be >= 0, got {settings.kt_rho}'),
        (settings.kt_imitation > 0, f'kt_imitation must be > 0, got {settings.kt_imitation}'),
    ]


@dataclasses.dataclass(frozen=True)
class KTpFLSettings(settings_lib.LocalTraining, heterogeneous.PublicKnowledge):
    """KT-pFL (Algorithm 1) and the baselines that differ only in c (`kt_c_update`).

    Defaults: the paper's Appendix B.2, heterogeneous models, EMNIST /
    Fashion-MNIST (private batch 128, E = 20, R = 1, eta_1 = eta_2 = eta_3 =
    0.01, rho = 0.6, T = 10, lambda = 1, public batch 256, 3000 public
    examples per round) and footnote 4 (K = 5).
    """

    batch_size: int = _setting(128, _LOCAL_HELP['batch_size'])
    client_learning_rate: float = _setting(0.01, _LOCAL_HELP['client_learning_rate'])
    local_epochs: int = _setting(20, _LOCAL_HELP['local_epochs'])
    kt_distill_epochs: int = _setting(
        1, "R, each client's distillation passes over the round's public batch (Eq. 6; 0: no distillation)."
    )
    kt_coefficient_learning_rate: float = _setting(0.01, _COEFFICIENT_LR_HELP)
    kt_rho: float = _setting(0.6, _RHO_HELP)
    kt_imitation: float = _setting(1.0, _IMITATION_HELP)
    kt_c_update: str = _setting(
        'paper',
        "How c is set: paper (Eq. 7), released (the authors' code), or a Table 1 baseline: fedmd (uniform), "
        'similarity (Sim-pFL), topk (TopK-pFL).',
    )
    kt_top_k: int = _setting(5, 'K of TopK-pFL (kt_c_update=topk): each client mixes its K most similar clients.')

    def _checks(self):
        return (
            super()._checks()
            + [
                (self.kt_distill_epochs >= 0, f'kt_distill_epochs must be >= 0, got {self.kt_distill_epochs}'),
                (
                    self.kt_c_update in C_UPDATES,
                    f'kt_c_update must be one of {", ".join(C_UPDATES)}, got {self.kt_c_update!r}',
                ),
                (self.kt_top_k >= 1, f'kt_top_k must be >= 1, got {self.kt_top_k}'),
            ]
            + _coefficient_checks(self)
        )


@dataclasses.dataclass(frozen=True)
class KTpFLHomoSettings(settings_lib.LocalTraining):
    """Homogeneous KT-pFL (Appendix C, Algorithm 2): parameters mixed by c.

    Defaults: the paper's Appendix B.2, homogeneous models, EMNIST /
    Fashion-MNIST (private batch 32, E = 20, R = 1, eta_1 = eta_2 = 0.01,
    eta_3 = 0.005, lambda = 1); rho, not stated for this setting, is the
    heterogeneous setting's 0.6.
    """

    batch_size: int = _setting(32, _LOCAL_HELP['batch_size'])
    client_learning_rate: float = _setting(0.01, _LOCAL_HELP['client_learning_rate'])
    local_epochs: int = _setting(20, _LOCAL_HELP['local_epochs'])
    kt_transfer_steps: int = _setting(
        1, 'R, gradient steps of each client towards its personalized model u_n (Eq. 10; 0: no transfer).'
    )
    kt_transfer_learning_rate: float = _setting(
        0.01, 'eta_2, the step size of the transfer towards u_n (Eq. 10; 1 with R = 1: adopt u_n).'
    )
    kt_coefficient_learning_rate: float = _setting(0.005, _COEFFICIENT_LR_HELP)
    kt_rho: float = _setting(0.6, _RHO_HELP)
    kt_imitation: float = _setting(1.0, _IMITATION_HELP)

    def _checks(self):
        return (
            super()._checks()
            + [
                (self.kt_transfer_steps >= 0, f'kt_transfer_steps must be >= 0, got {self.kt_transfer_steps}'),
                (
                    self.kt_transfer_learning_rate >= 0,
                    f'kt_transfer_learning_rate must be >= 0, got {self.kt_transfer_learning_rate}',
                ),
            ]
            + _coefficient_checks(self)
        )


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


def mix(coefficients: tf.Tensor, predictions: tf.Tensor, present: tf.Tensor | None = None) -> tf.Tensor:
    """Personalized soft targets: [N, N] x [N, P, C] -> [N, P, C] (row n: client n's).

    Rows of c are normalised by `mixing_weights`, so that every target is a
    probability distribution.

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions s_m on the public batch,
        `[N, P, C]`.
      present: optional `[N]` presence vector (see `mixing_weights`): the
        targets mix this round's clients only, and the rows of absent
        clients are zero (no target is formed for them).

    Returns:
      `[N, P, C]`, row n being client n's target sum_m c[n, m] s_m.
    """
    targets = tf.einsum('nm,mpc->npc', mixing_weights(coefficients, present), predictions)
    if present is not None:
        targets = targets * present[:, tf.newaxis, tf.newaxis]
    return targets


def paper_objective(coefficients, predictions, weights, rho, imitation, present=None):
    """Eq. 4 as a function of c (models fixed): lambda sum_n (D_n/D) KL + rho ||c - 1/N||^2.

    KL(mix_n || s_n) with the row-normalised mixture of `mix`, averaged over
    the public batch; probabilities are clipped at 1e-8 inside the logarithm.
    With `present`, the objective of this round's clients S only: the sum
    runs over n in S with D = sum of D_n over S, each mixture over m in S
    (`mix`), and the regulariser over the S x S block of c.

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions, `[N, P, C]` (rows of
        absent clients are ignored).
      weights: D_n, `[N]` (0 for absent clients).
      rho: the regulariser's weight.
      imitation: lambda.
      present: optional `[N]` presence vector (None: every client).

    Returns:
      The objective, a float32 scalar.
    """
    targets = mix(coefficients, predictions, present)
    log_ratio = tf.math.log(tf.maximum(targets, 1e-8)) - tf.math.log(tf.maximum(predictions, 1e-8))
    kl = tf.reduce_mean(tf.reduce_sum(targets * log_ratio, axis=-1), axis=-1)  # [N]
    return _regularised(coefficients, kl, weights, rho, imitation, present)


def paper_update(coefficients, predictions, weights, *, learning_rate, rho, imitation, present=None):
    """One gradient step of Eq. 7, then c is clipped at 0 (see `mix`).

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions, `[N, P, C]`.
      weights: D_n, `[N]`.
      learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda.
      present: optional `[N]` presence vector: the step of `paper_objective`
        restricted to this round's clients S, taken on the S x S block of c
        only; every other entry is returned unchanged. None: every client.

    Returns:
      The new c, `[N, N]`.
    """
    return _clipped_step(
        lambda c: paper_objective(c, predictions, weights, rho, imitation, present),
        coefficients,
        learning_rate,
        present,
    )


def _block(present):
    """`[N, N]`: 1 where both the row's and the column's client are present, else 0."""
    return present[:, tf.newaxis] * present[tf.newaxis, :]


def _regularised(coefficients, per_client, weights, rho, imitation, present=None):
    """Eq. 4's (and Eq. 11's) shape: lambda sum_n (D_n/D) per_client_n + rho ||c - 1/N||^2.

    With `present`, the regulariser sums over the block of present clients
    (its target stays 1/N, N every client: c_0's value, the scale of the
    entries left out of the block).
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    share = weights / tf.reduce_sum(weights)
    squares = tf.square(coefficients - 1.0 / num_clients)
    if present is not None:
        squares = squares * _block(present)
    return imitation * tf.reduce_sum(share * per_client) + rho * tf.reduce_sum(squares)


def _within_block(new, coefficients, present):
    """`new` on the block of present clients, `coefficients` (untouched) elsewhere; `new` if `present` is None."""
    if present is None:
        return new
    return tf.where(_block(present) > 0, new, coefficients)


def _clipped_step(objective, coefficients, learning_rate, present=None):
    """One gradient-descent step of `objective` (a function of c) from `coefficients`, clipped at 0.

    With `present`, only the block of present clients takes the step.
    """
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        loss = objective(coefficients)
    stepped = tf.maximum(coefficients - learning_rate * tape.gradient(loss, coefficients), 0.0)
    return _within_block(stepped, coefficients, present)


def released_update(coefficients, predictions, *, learning_rate, penalty=0.7, sharpness=5.0):
    """The authors' released-code variant of the c step.

    Per row n: the objective MSE(s_n, sum_m c[n, m] s_m) + penalty MSE(c[n],
    1/N), one gradient step, then the row is renormalised as softmax(sharpness
    * c[n]).

    Args:
      coefficients: c, `[N, N]`; mixed with as is (not through
        `mixing_weights`).
      predictions: the clients' soft predictions, `[N, P, C]`.
      learning_rate: the step size.
      penalty: the weight of the pull towards 1/N.
      sharpness: the softmax's scale.

    Returns:
      The new c, `[N, N]`, each row summing to 1.
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        # Rows are softmax-normalised already: the released code mixes with c as is.
        targets = tf.einsum('nm,mpc->npc', coefficients, predictions)
        mse = tf.reduce_mean(tf.square(predictions - targets), axis=[1, 2])
        loss = tf.reduce_sum(mse + penalty * tf.reduce_mean(tf.square(coefficients - 1.0 / num_clients), axis=1))
    stepped = coefficients - learning_rate * tape.gradient(loss, coefficients)
    return tf.nn.softmax(sharpness * stepped, axis=1)


def noised_to_distributions(predictions: tf.Tensor, present: tf.Tensor) -> tf.Tensor:
    """Noised soft predictions made distributions again: negatives to 0, rows renormalised (TF code).

    A row whose entries are all <= 0 becomes uniform; absent clients' rows
    stay 0.

    Args:
      predictions: `[N, P, C]`, the clients' noised soft predictions.
      present: `[N]` presence vector.

    Returns:
      `[N, P, C]`.
    """
    positive = tf.maximum(predictions, 0.0)
    total = tf.reduce_sum(positive, axis=-1, keepdims=True)
    num_classes = tf.cast(tf.shape(predictions)[-1], tf.float32)
    rows = tf.where(total > 0.0, positive / tf.where(total > 0.0, total, 1.0), 1.0 / num_classes)
    return rows * present[:, tf.newaxis, tf.newaxis]


def similarity_coefficients(predictions: tf.Tensor, top_k=None) -> tf.Tensor:
    """Sim-pFL's / TopK-pFL's c from this round's soft predictions.

    c[n, m] = cosine similarity of clients n's and m's predictions on the
    public batch (non-negative for probabilities). With `top_k`, each row
    keeps its K largest entries (the client itself, similarity 1, is always
    among them) and zeroes the rest. Rows are normalised by `mix`.

    Args:
      predictions: the clients' soft predictions, `[N, P, C]`.
      top_k: optional K (None keeps every entry).

    Returns:
      c, `[N, N]`, non-negative.
    """
    num_clients = tf.shape(predictions)[0]
    flat = tf.math.l2_normalize(tf.reshape(predictions, [num_clients, -1]), axis=1)
    similarity = tf.maximum(tf.matmul(flat, flat, transpose_b=True), 0.0)
    if top_k is None:
        return similarity
    k = tf.minimum(top_k, num_clients)
    threshold = tf.math.top_k(similarity, k=k).values[:, -1:]
    return tf.where(similarity >= threshold, similarity, 0.0)


def build_ktpfl_process(
    spec: client_data.ClientDataSpec,
    settings: KTpFLSettings = KTpFLSettings(),
    *,
    dp: privacy.DPConfig | None = None,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
    max_clients_per_round: int | None = None,
) -> template.PersonalizedProcess:
    """Builds KT-pFL over clients with heterogeneous models.

    Args:
      spec: the partition on disk; it must hold public data.
      settings: the `KTpFLSettings`: local training (E epochs or exactly
        `local_steps` SGD steps, batch size, eta_1), the architectures
        (assigned to clients in turn; empty: chosen from the data), P, T, R,
        the distillation batch size and eta_2, eta_3, rho, lambda, and how c
        is set (`kt_c_update`: 'paper' (Eq. 7), 'released' (the authors'
        code), or a baseline: 'fedmd' (uniform c, never updated),
        'similarity' (Sim-pFL), 'topk' (TopK-pFL, with `kt_top_k`)).
      dp: local DP of the soft predictions (fixed clip; `_local_output`);
        None: none.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): KT-pFL's server learns its knowledge-
        coefficient matrix by its own gradient step (Zhang et al., 2021, Eq. 7, kt_coefficient_learning_rate).
      model_aggregator: not taken (ValueError if given): KT-pFL mixes the clients' uploads per
        client by the coefficient matrix, not into one mean; pass dp= for its local DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy). Only the private
        training: the distillation towards the soft targets is KL.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.
      max_clients_per_round: K, the most clients a round takes (None: N);
        a round with more clients fails at an assertion.

    Returns:
      A `template.PersonalizedProcess` declaring each client's architecture
      (`architectures`) and the bytes it exchanges (`communication`);
      server state `<coefficients, round_num>`, client state `<client_id,
      num_participations, last_round, client_index, architecture, params>`.
      `next` takes the states of this round's clients, every client (the
      paper's Algorithm 1) or a sample of them (its Table 2; see the module
      docstring), in any order. With a sample, 'released' is not defined
      (its softmax renormalises rows over every client) and the round fails
      at its assertion; the program refuses it before training.

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `KTpFLSettings`.
      ValueError: one line, if an architecture cannot take the data or the
        partition has too little public data, or `dp` clips adaptively.
    """
    if not isinstance(settings, KTpFLSettings):
        raise TypeError(f'build_ktpfl_process takes KTpFLSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_ktpfl_process',
        _UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    _check_local_dp(dp)
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    num_clients = spec.num_clients
    public_batch = heterogeneous.public_batch_for(settings, spec)
    architectures = heterogeneous.client_architectures(settings.architectures, spec)
    temperature = settings.public_temperature
    c_update, top_k = settings.kt_c_update, settings.kt_top_k
    archs, arch_ids = heterogeneous.for_clients(architectures, spec)
    num_classes = spec.num_classes
    capacity = _capacity(max_clients_per_round, num_clients)
    predictions_type = tff.TensorType(np.float32, (num_clients, public_batch, num_classes))
    # What the server receives: row k is client ids[k]'s predictions (`_gather`).
    rows_type = _rows_type(tff.TensorType(np.float32, (public_batch, num_classes)), capacity)

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        architecture = tf.gather(tf.constant(arch_ids, tf.int32), index)
        return building_blocks.participation_state(
            client_id,
            client_index=index,
            architecture=architecture,
            params=tf.gather(archs.initial_packed(seed), architecture),
        )

    client_state_type = initial_client_state.type_signature.result

    def public_batch_of(round_num):
        return client_data.read_public_batch(spec, public_batch, seed, round_num)

    def soft(model, x):
        return tf.nn.softmax(model(x, training=False) / temperature, axis=-1)

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        private = client_data.read_split(spec, state['client_id'], 'train')
        x_public = public_batch_of(round_num)
        params, predictions, stats = heterogeneous.train_packed(
            archs,
            state['architecture'],
            state['params'],
            private,
            training,
            seed=local_training.client_seed(seed, round_num, state['client_id']),
            outputs=lambda model: soft(model, x_public),
            optimizer=client_optimizer,
            loss_fn=loss_fn,
        )
        return _local_output(state, num_clients, params, stats, private.num_examples, dp=dp, predictions=predictions)

    @tff.tensorflow.computation(predictions_type, np.int32, client_state_type)
    def distill_stage(targets, round_num, state):
        x_public = public_batch_of(round_num)
        target = targets[state['client_index']]

        def work(model):
            distill_loss = distillation.distill_towards(
                model,
                x_public,
                target,
                temperature=temperature,
                epochs=settings.kt_distill_epochs,
                batch_size=settings.public_distill_batch_size,
                learning_rate=settings.public_distill_learning_rate,
                seed=local_training.client_seed(seed, round_num, state['client_id'], salt=2),
            )
            with tf.control_dependencies([distill_loss]):
                return archs.pack(model.trainable_weights), tf.identity(distill_loss)

        params, distill_loss = archs.dispatch(state['architecture'], state['params'], work)
        return building_blocks.participated(state, round_num, params=params), distill_loss

    server_init = _build_server_init(num_clients)
    server_state_type = server_init.type_signature.result

    def coefficients_for(state, predictions):
        # Absent clients' predictions are zero: their similarity to everyone is 0.
        if c_update == 'similarity':
            return similarity_coefficients(predictions)
        if c_update == 'topk':
            return similarity_coefficients(predictions, top_k=top_k)
        return state['coefficients']

    vector_type = tff.TensorType(np.float32, (num_clients,))

    def received(rows, present):
        # Every client's row of [N, P, C] (zero for the clients not in this round).
        predictions = rows_by_client(rows['ids'], rows['values'], num_clients)
        # Under local DP the noised rows are no distributions: the server projects them back (post-processing).
        return predictions if dp is None else noised_to_distributions(predictions, present)

    @tff.tensorflow.computation(server_state_type, rows_type, vector_type)
    def targets_for(state, rows, present):
        predictions = received(rows, present)
        return mix(coefficients_for(state, predictions), predictions, present)

    @tff.tensorflow.computation(server_state_type, rows_type, vector_type, vector_type)
    def update_coefficients(state, rows, sizes, present):
        predictions = received(rows, present)
        if c_update == 'paper':
            # Eq. 4's distillation term carries the same T^2 as Eq. 6's step (`distill_towards`).
            coefficients = paper_update(
                state['coefficients'],
                predictions,
                sizes,
                learning_rate=settings.kt_coefficient_learning_rate,
                rho=settings.kt_rho,
                imitation=settings.kt_imitation * temperature**2,
                present=present,
            )
        elif c_update == 'released':
            every_client = tf.debugging.Assert(
                tf.reduce_all(present > 0), ['kt_c_update=released needs every client in every round']
            )
            with tf.control_dependencies([every_client]):
                coefficients = released_update(
                    state['coefficients'], predictions, learning_rate=settings.kt_coefficient_learning_rate
                )
        else:  # the baselines' c is not learned; keep this round's block for reports
            coefficients = _within_block(coefficients_for(state, predictions), state['coefficients'], present)
        return collections.OrderedDict(coefficients=coefficients, round_num=state['round_num'] + 1)

    stages = _Stages(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='predictions',
        mix=targets_for,
        second_stage=distill_stage,
        update_coefficients=update_coefficients,
        metric='distill_kl',
        evaluate_client=heterogeneous.build_personalized_evaluation(
            spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
        ),
    )
    return _personalized_process(
        stages,
        capacity,
        extras={
            'architectures': tuple(architectures),
            'communication': collections.OrderedDict(
                soft_prediction_bytes_up_per_client=public_batch * num_classes * 4,
                soft_target_bytes_down_per_client=public_batch * num_classes * 4,
                parameter_bytes_per_client_mean=float(np.mean([archs.sizes[i] for i in arch_ids])) * 4,
            ),
        },
    )


def parameter_distance(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Appendix C's L_dis on parameter vectors: 1/2 ||a - b||^2 over the last axis.

    Args:
      a: parameter vectors, `[..., D]`.
      b: parameter vectors, broadcastable against `a`.

    Returns:
      The distances, `[...]`.
    """
    return 0.5 * tf.reduce_sum(tf.square(a - b), axis=-1)


def presence(ids: tf.Tensor, num_clients: int) -> tf.Tensor:
    """`[N]`: 1 for the clients in `ids` and 0 for the others (-1 in `ids`: an empty row, ignored).

    Args:
      ids: client indices, `int32[K]`, each in `[0, N)` or -1.
      num_clients: N.

    Returns:
      The presence vector, float32 `[N]`.
    """
    valid = ids >= 0
    rows = tf.boolean_mask(ids, valid)[:, tf.newaxis]
    return tf.scatter_nd(rows, tf.ones_like(rows[:, 0], tf.float32), [num_clients])


def rows_by_client(ids: tf.Tensor, values: tf.Tensor, num_clients: int) -> tf.Tensor:
    """`[K, ...]` rows of the clients `ids` -> `[N, ...]`, row n client n's (zero for clients not in `ids`).

    Args:
      ids: client indices, `int32[K]`, each in `[0, N)` or -1 (an empty row,
        dropped); no index twice.
      values: `[K, ...]`, row k client `ids[k]`'s.
      num_clients: N.

    Returns:
      `[N, ...]`.
    """
    valid = ids >= 0
    shape = tf.concat([[num_clients], tf.shape(values)[1:]], axis=0)
    return tf.scatter_nd(tf.boolean_mask(ids, valid)[:, tf.newaxis], tf.boolean_mask(values, valid), shape)


def compact(present: tf.Tensor, values: tf.Tensor, capacity: int) -> tuple[tf.Tensor, tf.Tensor]:
    """`[N, ...]` rows and presence -> the present clients' ids `[K]` and rows `[K, ...]` (`rows_by_client`'s inverse).

    Args:
      present: `[N]`, 1 for the present clients.
      values: `[N, ...]`, row n client n's.
      capacity: K, at least the number of present clients.

    Returns:
      `(ids, rows)`: the present clients' indices in increasing order, -1
      after them, and their rows, zero after them.
    """
    ids = tf.cast(tf.where(present > 0)[:, 0], tf.int32)
    count = tf.shape(ids)[0]
    fits = tf.debugging.assert_less_equal(count, capacity, message='more clients in the round than its capacity')
    with tf.control_dependencies([fits]):
        padding = capacity - count
    ids = tf.concat([ids, tf.fill([padding], -1)], axis=0)
    rows = tf.gather(values, tf.maximum(ids, 0)) * tf.reshape(
        tf.cast(ids >= 0, values.dtype), [-1] + [1] * (values.shape.rank - 1)
    )
    return tf.ensure_shape(ids, [capacity]), tf.ensure_shape(rows, [capacity, *values.shape[1:]])


def personalized_parameters(coefficients: tf.Tensor, params: tf.Tensor, ids: tf.Tensor | None = None) -> tf.Tensor:
    """Appendix C's personalized models u_n = sum_m c[n, m] w_m, rows of c normalised.

    With `ids`, the round's clients S only: u_n for n in S mixes the models
    of S (row n of c restricted to S's columns, renormalised: `mixing_weights`
    with S's presence). The models come as S's rows, `[K, D]`, so nothing
    of size N x D is formed: the server of a sampled round holds K models.

    Args:
      coefficients: c, `[N, N]`.
      params: the models, `[K, D]`: row k client `ids[k]`'s (None: `[N, D]`,
        every client in order).
      ids: the clients of the rows, `int32[K]` (-1: an empty row); None:
        every client.

    Returns:
      `[K, D]`, row k being u of client `ids[k]` (zero for an empty row).
    """
    if ids is None:
        return tf.matmul(mixing_weights(coefficients), params)
    valid = tf.cast(ids >= 0, coefficients.dtype)
    rows = tf.maximum(ids, 0)
    weights = mixing_weights(coefficients, presence(ids, coefficients.shape[0]))
    # S x S block of the weights, in the order of `ids`; empty rows and columns are zero.
    block = tf.gather(tf.gather(weights, rows), rows, axis=1) * valid[:, tf.newaxis] * valid[tf.newaxis, :]
    return tf.matmul(block, params) * valid[:, tf.newaxis]


def homogeneous_objective(coefficients, params, weights, rho, imitation, ids=None):
    """Eq. 11's objective in c (models fixed).

    lambda sum_n (D_n/D) L_dis(sum_m c[n, m] w_m, w_n) + rho ||c - 1/N||^2,
    with the rows of c normalised by `mixing_weights`; with `ids`,
    restricted to this round's clients as `paper_objective` is.

    Args:
      coefficients: c, `[N, N]`.
      params: the models, `[K, D]` of the clients `ids` (see
        `personalized_parameters`).
      weights: D_n, `[N]` (0 for absent clients).
      rho: the regulariser's weight.
      imitation: lambda.
      ids: the clients of `params`' rows (None: every client).

    Returns:
      The objective, a float32 scalar.
    """
    mixed = personalized_parameters(coefficients, params, ids)
    distances = parameter_distance(mixed, params)
    if ids is None:
        return _regularised(coefficients, distances, weights, rho, imitation)
    num_clients = coefficients.shape[0]
    return _regularised(
        coefficients,
        rows_by_client(ids, distances, num_clients),
        weights,
        rho,
        imitation,
        presence(ids, num_clients),
    )


def homogeneous_update(coefficients, params, weights, *, learning_rate, rho, imitation, ids=None):
    """One gradient step of Eq. 11, then c is clipped at 0.

    Args:
      coefficients: c, `[N, N]`.
      params: the models, `[K, D]` of the clients `ids`.
      weights: D_n, `[N]`.
      learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda.
      ids: the clients of `params`' rows (`personalized_parameters`): only
        their block of c takes the step (see `paper_update`). None: every
        client.

    Returns:
      The new c, `[N, N]`.
    """
    return _clipped_step(
        lambda c: homogeneous_objective(c, params, weights, rho, imitation, ids),
        coefficients,
        learning_rate,
        None if ids is None else presence(ids, coefficients.shape[0]),
    )


def build_ktpfl_homogeneous_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    settings: KTpFLHomoSettings = KTpFLHomoSettings(),
    *,
    dp: privacy.DPConfig | None = None,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
    max_clients_per_round: int | None = None,
) -> template.PersonalizedProcess:
    """Builds homogeneous KT-pFL (the paper's Appendix C, Algorithm 2).

    Every client has the same architecture and uploads its parameters (this
    variant exchanges models, as the paper says). The server forms client
    n's personalized model u_n = sum_m c[n, m] w_m, sends it back, and the
    client takes R gradient steps on L_dis(u_n, w_n) = 1/2 ||u_n - w_n||^2
    (Eq. 10), i.e. w_n <- w_n - eta_2 (w_n - u_n); then c takes one step of
    Eq. 11 on the uploaded parameters.

    Args:
      spec: the partition on disk.
      model_fn: no-arg builder of the shared architecture (no non-trainable
        weights).
      settings: the `KTpFLHomoSettings`: local training (Eq. 9: E epochs or
        exactly `local_steps` SGD steps, batch size, eta_1), R
        (`kt_transfer_steps`), eta_2 (`kt_transfer_learning_rate`; 1 with
        R = 1: the client adopts u_n), eta_3 (0 keeps c at 1/N), rho and
        lambda.
      dp: local DP of the uploaded parameters (fixed clip;
        `_local_output`); None: none.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): KT-pFL's server learns its knowledge-
        coefficient matrix by its own gradient step (Zhang et al., 2021, Eq. 7, kt_coefficient_learning_rate).
      model_aggregator: not taken (ValueError if given): KT-pFL mixes the clients' uploads per
        client by the coefficient matrix, not into one mean; pass dp= for its local DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy). Only the private
        training: the distillation towards the soft targets is KL.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.
      max_clients_per_round: K, the most clients a round takes (None: N).
        The server holds the round's K models, `[K, D]`, and sends them
        back mixed; a round with more clients fails at an assertion.

    Returns:
      A `template.PersonalizedProcess` declaring the bytes it exchanges
      (`communication`); server state `<coefficients, round_num>`, client
      state `<client_id, num_participations, last_round, client_index,
      params=float32[D]>`. `next` takes every client's state or a sample's
      (the paper's Table 2): only the sampled clients' u_n are formed and
      only their block of c is updated (see the module docstring).

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `KTpFLHomoSettings`.
      ValueError: `dp` clips adaptively.
    """
    model_fn = adapters.keras_model_fn(model_fn)
    if not isinstance(settings, KTpFLHomoSettings):
        raise TypeError(f'build_ktpfl_homogeneous_process takes KTpFLHomoSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_ktpfl_homogeneous_process',
        _UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    _check_local_dp(dp)
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    transfer_steps, transfer_learning_rate = settings.kt_transfer_steps, settings.kt_transfer_learning_rate
    num_clients = spec.num_clients
    capacity = _capacity(max_clients_per_round, num_clients)
    archs = heterogeneous.Architectures([model_fn])
    num_params = archs.max_size
    # The round's models, and its personalized models: row k is client ids[k]'s (`_gather`).
    rows_type = _rows_type(tff.TensorType(np.float32, (num_params,)), capacity)
    sizes_type = tff.TensorType(np.float32, (num_clients,))

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        return building_blocks.participation_state(client_id, client_index=index, params=archs.initial_packed(seed)[0])

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        private = client_data.read_split(spec, state['client_id'], 'train')
        params, _, stats = heterogeneous.train_packed(
            archs,
            tf.constant(0),
            state['params'],
            private,
            training,
            seed=local_training.client_seed(seed, round_num, state['client_id']),
            optimizer=client_optimizer,
            loss_fn=loss_fn,
        )
        return _local_output(state, num_clients, params, stats, private.num_examples, dp=dp, params=params)

    @tff.tensorflow.computation(rows_type, np.int32, client_state_type)
    def transfer_stage(personalized, round_num, state):
        target = _own_row(personalized, state['client_index'])
        params = state['params']
        for _ in range(transfer_steps):  # Eq. 10: gradient steps on 1/2 ||u_n - w_n||^2
            params = params - transfer_learning_rate * (params - target)
        distance = parameter_distance(params, target)
        return building_blocks.participated(state, round_num, params=params), distance

    server_init = _build_server_init(num_clients)
    server_state_type = server_init.type_signature.result

    @tff.tensorflow.computation(server_state_type, rows_type, sizes_type)
    def personalized_models(state, params, present):
        del present  # the rows' ids name the round's clients
        return collections.OrderedDict(
            ids=params['ids'], values=personalized_parameters(state['coefficients'], params['values'], params['ids'])
        )

    @tff.tensorflow.computation(server_state_type, rows_type, sizes_type, sizes_type)
    def update_coefficients(state, params, sizes, present):
        del present
        coefficients = homogeneous_update(
            state['coefficients'],
            params['values'],
            sizes,
            learning_rate=settings.kt_coefficient_learning_rate,
            rho=settings.kt_rho,
            imitation=settings.kt_imitation,
            ids=params['ids'],
        )
        return collections.OrderedDict(coefficients=coefficients, round_num=state['round_num'] + 1)

    stages = _Stages(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='params',
        mix=personalized_models,
        second_stage=transfer_stage,
        update_coefficients=update_coefficients,
        metric='transfer_distance',
        evaluate_client=heterogeneous.build_personalized_evaluation(
            spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
        ),
    )
    return _personalized_process(
        stages,
        capacity,
        extras={
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=num_params * 4, parameter_bytes_down_per_client=num_params * 4
            )
        },
    )


def _build_server_init(num_clients: int) -> tff.Computation:
    """The server's initial state `<coefficients=1/N, round_num=0>` (either variant).

    Args:
      num_clients: N.

    Returns:
      A no-arg `tff.tensorflow.computation`.
    """

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            coefficients=tf.fill([num_clients, num_clients], 1.0 / num_clients),  # c_0 = 1/N
            round_num=tf.constant(0, tf.int32),
        )

    return server_init


# Why the KT-pFL family's local DP takes a fixed clip and no secure aggregation (one line each).
LOCAL_DP_ADAPTIVE = (
    "the KT-pFL family's DP is local (each client noises its own upload): give --dp_clip, not --dp_target_quantile "
    '(an adaptive clip would need the server to see the norms)'
)
LOCAL_DP_SECURE = (
    "--secure_aggregation: the server needs each KT-pFL client's upload on its own (a row of its own), which a secure "
    'sum does not hide (docs/privacy.md); protect it with --dp_noise_multiplier and --dp_clip (local DP)'
)


# Why the KT-pFL builders take no server optimizer or model aggregator (`building_blocks.refuse_unused`).
_UNUSED = dict(
    server_optimizer=(
        "KT-pFL's server learns its knowledge-coefficient matrix by its own gradient step (Zhang et al., 2021, "
        'Eq. 7, kt_coefficient_learning_rate)'
    ),
    model_aggregator=(
        "KT-pFL mixes the clients' uploads per client by the coefficient matrix, not into one mean; pass dp= for "
        'its local DP'
    ),
)


def _check_local_dp(dp) -> None:
    if dp is not None and dp.adaptive:
        raise ValueError(
            "dp: the KT-pFL family's DP is local (each client noises its own upload): give it a fixed clip, not an "
            'adaptive one (that would need the server to see the norms)'
        )


def _local_output(state, num_clients, params, stats, num_examples, /, dp=None, **upload) -> collections.OrderedDict:
    """A local stage's output: the client's upload with its index, its size, presence, metrics and new state (TF code).

    Args:
      state: the client state (with `client_index` and `params`).
      num_clients: N.
      params: the client's packed weights after local training.
      stats: the training's `local_training.Stats`.
      num_examples: the client's number of training examples, D_n.
      dp: local DP (`privacy.DPConfig` with a fixed clip): the upload is
        clipped and noised on the client (`privacy.local_gaussian`) and
        the size is sent as 1 (every client weighs the same); None: none.
      **upload: one entry, `name=value`: what the client uploads (soft
        predictions `[P, C]` or parameters `[D]`).

    Returns:
      `<name=<index, value>, num_examples=[N], present=[N], metric_sums,
      client_state>`: the upload and the client's index (the server keeps
      it as one of the round's rows, `_gather`); the size and a 1
      (`present`: who took part) in the client's slot of length-N vectors;
      the client state with `params` replaced (the second stage counts the
      participation).
    """
    ((name, value),) = upload.items()
    if dp is not None:
        value = privacy.local_gaussian(value, dp.clip, dp.noise_multiplier)
        num_examples = 1
    slot = tf.one_hot(state['client_index'], num_clients)
    new_state = collections.OrderedDict((k, state[k]) for k in state)
    new_state['params'] = params
    return collections.OrderedDict(
        [
            (name, collections.OrderedDict(index=state['client_index'], value=value)),
            ('num_examples', slot * tf.cast(num_examples, tf.float32)),
            ('present', slot),
            ('metric_sums', building_blocks.training_metric_sums(stats)),
            ('client_state', new_state),
        ]
    )


class _Stages(typing.NamedTuple):
    """The computations that make a KT-pFL round (either variant).

    One round: every client of the round runs `local_stage` and uploads
    `upload` with its index, its size and its presence; the server mixes the
    uploads of the present clients with c (`mix`) and broadcasts the mix;
    every client of the round runs `second_stage` towards its row; the
    server updates c's block of present clients (`update_coefficients`) and
    reports the clients' mean of the second stage's scalar as `metric`.

    Attributes:
      server_init: no-arg computation, the server state `<coefficients,
        round_num>`.
      initial_client_state: `client_id -> client state`.
      local_stage: `(round_num, client_state) -> <upload, num_examples,
        present, metric_sums, client_state>` (`_local_output`).
      upload: the name of the uploaded field of `local_stage`'s result.
      mix: `(server_state, rows, present) -> mixed`, from the round's rows
        `<ids=int32[K], values=[K, ...]>` (`_gather`); `mixed` holds every
        present client's target (heterogeneous: `[N, P, C]`, absent
        clients' rows zero; homogeneous: the K rows' u_n, `<ids, values>`).
      second_stage: `(mixed, round_num, client_state) -> (client_state,
        scalar)`.
      update_coefficients: `(server_state, rows, sizes, present) ->
        server_state`.
      metric: the name under which the scalar's client mean is reported.
      evaluate_client: `client_state -> metrics`.
    """

    server_init: tff.Computation
    initial_client_state: tff.Computation
    local_stage: tff.Computation
    upload: str
    mix: tff.Computation
    second_stage: tff.Computation
    update_coefficients: tff.Computation
    metric: str
    evaluate_client: tff.Computation


def _capacity(max_clients_per_round: int | None, num_clients: int) -> int:
    """K, the rows of the server's `[K, ...]` uploads: `max_clients_per_round`, or N."""
    if max_clients_per_round is None:
        return num_clients
    if not 1 <= max_clients_per_round <= num_clients:
        raise ValueError(f'max_clients_per_round must be in [1, {num_clients}], got {max_clients_per_round}')
    return max_clients_per_round


def _rows_type(value_type: tff.TensorType, capacity: int) -> tff.StructType:
    """`<ids=int32[K], values=T[K, ...]>`: K clients' values, row k client `ids[k]`'s (-1: an empty row)."""
    return tff.StructWithPythonType(
        [
            ('ids', tff.TensorType(np.int32, (capacity,))),
            ('values', tff.TensorType(value_type.dtype, (capacity, *value_type.shape))),
        ],
        collections.OrderedDict,
    )


def _own_row(rows, client_index):
    """A client's row of `<ids, values>` (TF code); fails if the client has none."""
    position = tf.argmax(tf.cast(tf.equal(rows['ids'], client_index), tf.int32), output_type=tf.int32)
    found = tf.debugging.assert_equal(rows['ids'][position], client_index, message='no row for this client')
    with tf.control_dependencies([found]):
        return tf.identity(rows['values'][position])


def _gather(uploads, capacity: int):
    """`{<index, value>}@CLIENTS` -> `<ids=int32[K], values=T[K, ...]>@SERVER` (federated code).

    The server receives each client's value with its index and keeps them
    as K rows, in increasing order of index (-1 and zeros after the last
    client): a `federated_aggregate` whose accumulator appends each upload.
    Its size is K x value, K = the round's most clients, not N x value: a
    federated sum of per-client `[N, ...]` slot tensors, or an accumulator
    of N rows, would hold N x value per client or per accumulation step in
    TFF's runtime (benchmarks/results/ktpfl_memory.md: homogeneous KT-pFL
    with the CNN, 40 clients, 10 per round: 9.3 GB with slot sums, 2.4 GB
    with K rows).

    Args:
      uploads: the clients' `<index=int32, value=T[...]>`; every index in
        `[0, N)`, no two clients with the same one, at most `capacity`
        clients (more fail at an assertion).
      capacity: K.

    Returns:
      The server's rows.
    """
    zero, accumulate, merge, report = gather_steps(uploads.type_signature.member['value'], capacity)
    return tff.federated_aggregate(uploads, zero(), accumulate, merge, report)


def gather_steps(value_type: tff.TensorType, capacity: int):
    """`_gather`'s `federated_aggregate` steps: `(zero, accumulate, merge, report)`.

    Args:
      value_type: the type of one client's value.
      capacity: K.

    Returns:
      `zero: () -> A`, `accumulate: (A, <index, value>) -> A` (appends),
      `merge: (A, A) -> A` (appends the second's rows to the first's) and
      `report: A -> <ids=int32[K], values=T[K, ...]>` (rows in increasing
      order of index, empty rows last), for an accumulator A.
    """
    member = tff.StructWithPythonType([('index', np.int32), ('value', value_type)], collections.OrderedDict)
    # One tensor per row, not one [K, ...] tensor: an accumulation step passes the K - 1 rows it
    # does not write through `tf.cond` untouched, so TFF's runtime, which keeps every step's
    # accumulator until the aggregate is done, does not hold K copies of all K rows.
    accumulator_type = tff.StructWithPythonType(
        [
            ('count', np.int32),
            ('ids', tff.TensorType(np.int32, (capacity,))),
            ('rows', tff.StructWithPythonType([value_type] * capacity, tuple)),
        ],
        collections.OrderedDict,
    )

    @tff.tensorflow.computation
    def zero():
        row = tf.zeros(value_type.shape, value_type.dtype)
        return collections.OrderedDict(count=tf.constant(0), ids=tf.fill([capacity], -1), rows=(row,) * capacity)

    def put(accumulator, index, value):
        count = accumulator['count']
        fits = tf.debugging.assert_less(count, capacity, message='more clients in the round than its capacity')
        with tf.control_dependencies([fits]):
            count = tf.identity(count)
        rows = tuple(
            tf.cond(tf.equal(count, k), lambda: tf.identity(value), lambda row=row: tf.identity(row))
            for k, row in enumerate(accumulator['rows'])
        )
        ids = tf.tensor_scatter_nd_update(accumulator['ids'], [[count]], [index])
        return collections.OrderedDict(count=count + 1, ids=ids, rows=rows)

    @tff.tensorflow.computation(accumulator_type, member)
    def accumulate(accumulator, upload):
        return put(accumulator, upload['index'], upload['value'])

    @tff.tensorflow.computation(accumulator_type, accumulator_type)
    def merge(a, b):
        # Only where several workers aggregate (TFF's single runtime does not call it): b's rows after a's.
        for k in range(capacity):
            a = tf.cond(
                k < b['count'],
                lambda k=k, a=a: put(a, b['ids'][k], b['rows'][k]),
                lambda a=a: collections.OrderedDict(a),
            )
        return a

    @tff.tensorflow.computation(accumulator_type)
    def report(accumulator):
        # Increasing index, empty rows last: the rows do not depend on the order the uploads arrived in.
        key = tf.where(accumulator['ids'] >= 0, accumulator['ids'], tf.int32.max)
        order = tf.argsort(key, stable=True)
        return collections.OrderedDict(
            ids=tf.gather(accumulator['ids'], order), values=tf.gather(tf.stack(accumulator['rows']), order)
        )

    return zero, accumulate, merge, report


def _uploads_sizes_presence(outputs, upload, capacity: int):
    """The server's `[K, ...]` rows of uploads (`_gather`), and the sums of the size and presence slots (federated)."""
    # The size and presence vectors are length N: each client writes into its own slot of them.
    return (
        _gather(outputs[upload], capacity),
        tff.federated_sum(outputs.num_examples),
        tff.federated_sum(outputs.present),
    )


def _client_mean(metric, values):
    """`<metric=mean of values>@SERVER` (federated code)."""
    return tff.federated_zip(collections.OrderedDict([(metric, tff.federated_mean(values))]))


def _personalized_process(stages: _Stages, capacity: int, **declared) -> template.PersonalizedProcess:
    """KT-pFL's process from its stages, in process and on devices (`_device_process`).

    Args:
      stages: the round's computations.
      capacity: K, the most clients of a round (the rows of `_gather`).
      **declared: the process's `extras` (its `architectures` and `communication`).

    Returns:
      The `template.PersonalizedProcess`.
    """
    server_init, initial_client_state, local_stage, upload, mix, second_stage, update_coefficients, metric, _ = stages
    initialize = building_blocks.server_initialize(server_init)
    server_state_type = initialize.type_signature.result
    client_states_type = tff.FederatedType(initial_client_state.type_signature.result, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(state, client_states):
        round_num = tff.federated_broadcast(state.round_num)
        local = tff.federated_map(local_stage, (round_num, client_states))
        uploads, sizes, present = _uploads_sizes_presence(local, upload, capacity)
        mixed = tff.federated_broadcast(tff.federated_map(mix, (state, uploads, present)))
        second = tff.federated_map(second_stage, (mixed, round_num, local.client_state))
        new_state = tff.federated_map(update_coefficients, (state, uploads, sizes, present))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        means = _client_mean(metric, second[1])
        return template.RoundOutput(new_state, second[0], building_blocks.with_server_metrics(metrics, means))

    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=building_blocks.build_client_states_evaluation(server_state_type, stages.evaluate_client),
        device=_device_process(stages, capacity),
        no_global_model=(
            "KT-pFL's server holds the knowledge-coefficient matrix; each client keeps its own model "
            '(the personalized model is the client state)'
        ),
        **declared,
    )


def _zeros(type_spec):
    """Zeros of a tensor or struct type (TF code)."""
    if isinstance(type_spec, tff.TensorType):
        return tf.zeros(type_spec.shape, type_spec.dtype)
    return collections.OrderedDict((name, _zeros(member)) for name, member in tff.structure.iter_elements(type_spec))


def _device_process(stages: _Stages, capacity: int):
    """KT-pFL's round with device-held client states, as two phases of one aggregation each.

    In process, one round aggregates every client's upload (soft predictions,
    or parameters), has the server mix them with the coefficient matrix, and
    broadcasts the mix back for a second client stage: two aggregation
    stages. Here they are two phases:

    * `share`: broadcast the round number; each device runs `local_stage`
      and sends its upload in its own slot of an `[N, ...]` tensor, its size
      and presence (federated sums); the server takes the present clients'
      rows (`compact`, the rows `_gather` gives in process), updates the
      coefficients and keeps the mixed targets in its state;
    * `distill`: broadcast the targets (the whole matrix; each device takes its
      own row) and the round's number; each device runs `second_stage`; the
      server keeps the mean of its scalar (`metric`).

    A MapReduceForm returns the state type it takes, so the device form's
    server state is `<coefficients, round_num, targets>` throughout (targets
    zero before the first round).

    Why slots here and `_gather` in process: TFF 0.87's
    DistributeAggregateForm conversion fails on any `federated_aggregate`
    (`form_utils.get_distribute_aggregate_form_for_computation` tries to
    place its accumulate function at the server), while federated sums
    convert to both forms. A slot costs N x the upload on a device and in
    the sum (docs/export.md).

    Both phases read and write the same state files, so a round of the two
    equals one in-process round (tests/test_export.py).

    Args:
      stages: the round's computations.
      capacity: K, the rows of the uploads the server mixes (`_gather`).

    Returns:
      The `device_state.build_device_process` of the two phases.
    """
    server_init, initial_client_state, local_stage, upload, mix, second_stage, update_coefficients, metric, _ = stages
    sizes_type = local_stage.type_signature.result['num_examples']
    present_type = local_stage.type_signature.result['present']
    num_clients = present_type.shape[0]
    upload_type = local_stage.type_signature.result[upload]  # <index, value>
    slots_type = tff.TensorType(upload_type['value'].dtype, (num_clients, *upload_type['value'].shape))
    targets_type = mix.type_signature.result

    @tff.tensorflow.computation(upload_type)
    def to_slot(value):
        # The client's value in row `index` of an [N, ...] tensor of zeros.
        return rows_by_client(value['index'][tf.newaxis], value['value'][tf.newaxis], num_clients)

    @tff.tensorflow.computation
    def device_server_init():
        state = server_init()
        return collections.OrderedDict(
            coefficients=state['coefficients'], round_num=state['round_num'], targets=_zeros(targets_type)
        )

    device_initialize = building_blocks.server_initialize(device_server_init)
    state_type = device_server_init.type_signature.result
    round_of = building_blocks.build_round_number(state_type)

    @tff.tensorflow.computation(state_type, slots_type, sizes_type, present_type)
    def share_update(state, slots, sizes, present):
        kept = collections.OrderedDict(coefficients=state['coefficients'], round_num=state['round_num'])
        ids, values = compact(present, slots, capacity)
        uploads = collections.OrderedDict(ids=ids, values=values)
        updated = update_coefficients(kept, uploads, sizes, present)
        return collections.OrderedDict(
            coefficients=updated['coefficients'], round_num=updated['round_num'], targets=mix(kept, uploads, present)
        )

    def share_finish(state, outputs):
        slots = tff.federated_sum(tff.federated_map(to_slot, outputs[upload]))
        sizes, present = tff.federated_sum(outputs.num_examples), tff.federated_sum(outputs.present)
        return (
            tff.federated_map(share_update, (state, slots, sizes, present)),
            building_blocks.aggregate_training_metrics(outputs.metric_sums),
        )

    @tff.tensorflow.computation(state_type)
    def distill_broadcast(state):
        return collections.OrderedDict(targets=state['targets'], round_num=state['round_num'] - 1)

    @tff.tensorflow.computation(distill_broadcast.type_signature.result, initial_client_state.type_signature.result)
    def distill_step(value, client_state):
        new_state, scalar = second_stage(value['targets'], value['round_num'], client_state)
        return collections.OrderedDict([(metric, scalar), ('client_state', new_state)])

    def distill_finish(state, outputs):
        return state, _client_mean(metric, outputs[metric])

    return device_state.build_device_process(
        device_initialize,
        initial_client_state,
        phases=[
            device_state.Phase('share', round_of, local_stage, share_finish),
            device_state.Phase('distill', distill_broadcast, distill_step, distill_finish),
        ],
        evaluate_input=round_of,
        evaluate_client=building_blocks.build_evaluation_at(stages.evaluate_client),
    )


def _build(settings, spec, model_fn, run):
    del model_fn  # each client has its own architecture
    return build_ktpfl_process(
        spec, settings, dp=run.dp, seed=run.seed, max_clients_per_round=run.max_clients_per_round
    )


def _build_homogeneous(settings, spec, model_fn, run):
    return build_ktpfl_homogeneous_process(
        spec, model_fn, settings, dp=run.dp, seed=run.seed, max_clients_per_round=run.max_clients_per_round
    )


def _check_sampling(settings, client_fraction):
    """KT-pFL samples clients (the paper's Table 2), except with the released code's c step."""
    if client_fraction < 1.0 and settings.kt_c_update == 'released':
        return (
            '--kt_c_update=released needs every client every round (its softmax renormalises c over all of them): '
            '--client_fraction=1'
        )
    return None


def _soft_prediction_uploads(settings, spec, process, client_fraction):
    del process
    batch = heterogeneous.public_batch_for(settings, spec)
    return [algorithm.Upload(batch * spec.num_classes, client_fraction * spec.num_clients, 'soft predictions')]


def _plots(out, result, process):
    client_ids = list(result.client_states)
    architectures = process.extras.get('architectures') or [''] * len(client_ids)
    labels = [f'{s} {a}'.strip() for s, a in zip(reports.short_ids(client_ids), architectures)]
    reports.plot_client_matrix(
        out,
        'knowledge_coefficients',
        "Knowledge coefficients c[n, m] (row n: client n's mix)",
        np.asarray(result.state['coefficients']),
        client_ids,
        row_labels=labels,
    )
    reports.write_csv(os.path.join(out, 'communication.csv'), [dict(process.extras['communication'])])
    return [('Knowledge coefficients', 'knowledge_coefficients.png')]


def _local_dp(uploads, dp_uploads=None):
    return algorithm.Privacy(
        uploads,
        local=True,
        fixed_clip_only=LOCAL_DP_ADAPTIVE,
        no_secure=LOCAL_DP_SECURE,
        dp_uploads=dp_uploads,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'ktpfl',
        'KT-pFL (Zhang et al., 2021): soft predictions on public data mixed by a learned coefficient matrix',
        KTpFLSettings,
        _build,
        lambda state: {'architecture_id': int(state['architecture'])},
        _plots,
        check=_check_sampling,
        privacy=_local_dp(
            "each client's soft predictions, clipped and noised on the client (local DP)", _soft_prediction_uploads
        ),
        own_architectures=True,
    ),
    algorithm.Algorithm(
        'ktpfl_homo',
        'KT-pFL, homogeneous variant (Zhang et al., 2021): parameters mixed by the coefficient matrix',
        KTpFLHomoSettings,
        _build_homogeneous,
        plots=_plots,
        privacy=_local_dp("each client's parameters, clipped and noised on the client (local DP)"),
    ),
)
