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

That is `kt_distill_schedule='after_training'`. With 'every_epoch' (Algorithm
1's lines 11-16 read literally) step 1 runs the R distillation passes after
each of the E epochs, towards the target the client received at the end of
its previous round (none in its first round); the server updates c first and
mixes the targets with the new c, and each client keeps its row in its state
for its next round (docs/algorithms/ktpfl.md, "Distillation schedule").

Indexing: row n of c is client n's mixing vector (the paper's c_mn, the
contribution of client m to client n, is c[n, m] here).

Only soft predictions cross from the clients to the server: each client sends
its [P, C] predictions with its index, and the server keeps the round's K
clients' predictions as K rows (`ktpfl_rounds`, K = the round's most clients);
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

Settings: `KTpFLSettings` (Algorithm 1 and its Table 1 baselines); the
defaults are the paper's Appendix B.2 (docs/algorithms/ktpfl.md,
"Settings"). The homogeneous variant (Appendix C) is `processes.ktpfl_homo`;
what the two share is `processes.ktpfl_coefficients` (the coefficient
matrix) and `processes.ktpfl_rounds` (the round's two forms, local DP).
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl_coefficients, ktpfl_rounds
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    builder_inputs,
    building_blocks,
    distillation,
    heterogeneous,
    local_training,
    privacy,
    template,
)
from tff_pfl.data import client_data

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_ktpfl_process', 'KTpFLSettings']

C_UPDATES = ('paper', 'released', 'fedmd', 'similarity', 'topk')


# Baselines of the paper's Table 1 that differ from KT-pFL only in c:
#   fedmd: every client's target is the plain average of all soft predictions;
#   similarity (Sim-pFL): c[n, m] = cosine similarity of the soft predictions;
#   topk (TopK-pFL): the same, kept for the K most similar clients only.
FIXED_OR_SIMILARITY = ('fedmd', 'similarity', 'topk')


_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class KTpFLSettings(settings_lib.LocalTraining, heterogeneous.PublicKnowledge):
    """KT-pFL (Algorithm 1) and the baselines that differ only in c (`kt_c_update`).

    Defaults: the paper's Appendix B.2, heterogeneous models, EMNIST /
    Fashion-MNIST (private batch 128, E = 20, R = 1, eta_1 = eta_2 = eta_3 =
    0.01, rho = 0.6, T = 10, lambda = 1, public batch 256, 3000 public
    examples per round) and footnote 4 (K = 5).
    """

    batch_size: int = _setting(128, ktpfl_rounds.LOCAL_HELP['batch_size'])
    client_learning_rate: float = _setting(0.01, ktpfl_rounds.LOCAL_HELP['client_learning_rate'])
    local_epochs: int = _setting(20, ktpfl_rounds.LOCAL_HELP['local_epochs'])
    kt_distill_epochs: int = _setting(
        1, "R, each client's distillation passes over the public batch of its target (Eq. 6; 0: no distillation)."
    )
    kt_distill_schedule: str = _setting('after_training', ktpfl_rounds.SCHEDULE_HELP)
    kt_coefficient_learning_rate: float = _setting(0.01, ktpfl_coefficients.COEFFICIENT_LR_HELP)
    kt_rho: float = _setting(0.6, ktpfl_coefficients.RHO_HELP)
    kt_imitation: float = _setting(1.0, ktpfl_coefficients.IMITATION_HELP)
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
            + ktpfl_rounds.schedule_checks(self)
            + ktpfl_coefficients.coefficient_checks(self)
        )


def mix(coefficients: tf.Tensor, predictions: tf.Tensor, present: tf.Tensor | None = None) -> tf.Tensor:
    """Personalized soft targets: [N, N] x [N, P, C] -> [N, P, C] (row n: client n's).

    Rows of c are normalised by `ktpfl_coefficients.mixing_weights`, so that every target is a
    probability distribution.

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions s_m on the public batch,
        `[N, P, C]`.
      present: optional `[N]` ktpfl_rounds.presence vector (see `ktpfl_coefficients.mixing_weights`): the
        targets mix this round's clients only, and the rows of absent
        clients are zero (no target is formed for them).

    Returns:
      `[N, P, C]`, row n being client n's target sum_m c[n, m] s_m.
    """
    targets = tf.einsum('nm,mpc->npc', ktpfl_coefficients.mixing_weights(coefficients, present), predictions)
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
      present: optional `[N]` ktpfl_rounds.presence vector (None: every client).

    Returns:
      The objective, a float32 scalar.
    """
    targets = mix(coefficients, predictions, present)
    log_ratio = tf.math.log(tf.maximum(targets, 1e-8)) - tf.math.log(tf.maximum(predictions, 1e-8))
    kl = tf.reduce_mean(tf.reduce_sum(targets * log_ratio, axis=-1), axis=-1)  # [N]
    return ktpfl_coefficients.regularised(coefficients, kl, weights, rho, imitation, present)


def paper_update(coefficients, predictions, weights, *, learning_rate, rho, imitation, present=None):
    """One gradient step of Eq. 7, then c is clipped at 0 (see `mix`).

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions, `[N, P, C]`.
      weights: D_n, `[N]`.
      learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda.
      present: optional `[N]` ktpfl_rounds.presence vector: the step of `paper_objective`
        restricted to this round's clients S, taken on the S x S block of c
        only; every other entry is returned unchanged. None: every client.

    Returns:
      The new c, `[N, N]`.
    """
    return ktpfl_coefficients.clipped_step(
        lambda c: paper_objective(c, predictions, weights, rho, imitation, present),
        coefficients,
        learning_rate,
        present,
    )


def released_update(coefficients, predictions, *, learning_rate, penalty=0.7, sharpness=5.0):
    """The authors' released-code variant of the c step.

    Per row n: the objective MSE(s_n, sum_m c[n, m] s_m) + penalty MSE(c[n],
    1/N), one gradient step, then the row is renormalised as softmax(sharpness
    * c[n]).

    Args:
      coefficients: c, `[N, N]`; mixed with as is (not through
        `ktpfl_coefficients.mixing_weights`).
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
      present: `[N]` ktpfl_rounds.presence vector.

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


@builder_inputs.checked
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
        'similarity' (Sim-pFL), 'topk' (TopK-pFL, with `kt_top_k`)), and
        when clients distil (`kt_distill_schedule`: 'after_training', or
        'every_epoch', the R passes after each of the E epochs).
      dp: local DP of the soft predictions (fixed clip; `ktpfl_rounds.local_output`);
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
      num_participations, last_round, client_index, architecture, params>`
      (with 'every_epoch', also `target=float32[P, C]`, the client's next
      target, and `last_distill_kl`). `next` takes the states of this
      round's clients, every client (the paper's Algorithm 1) or a sample of
      them (its Table 2; see the module docstring), in any order. With a sample, 'released' is not defined
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
        ktpfl_rounds.UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    ktpfl_rounds.check_local_dp(dp)
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    num_clients = spec.num_clients
    public_batch = heterogeneous.public_batch_for(settings, spec)
    architectures = heterogeneous.client_architectures(settings.architectures, spec)
    temperature = settings.public_temperature
    c_update, top_k = settings.kt_c_update, settings.kt_top_k
    archs, arch_ids = heterogeneous.for_clients(architectures, spec)
    num_classes = spec.num_classes
    capacity = ktpfl_rounds.round_capacity(max_clients_per_round, num_clients)
    predictions_type = tff.TensorType(np.float32, (num_clients, public_batch, num_classes))
    # What the server receives: row k is client ids[k]'s predictions (`ktpfl_rounds._gather`).
    rows_type = ktpfl_rounds.gathered_rows_type(tff.TensorType(np.float32, (public_batch, num_classes)), capacity)

    every_epoch = settings.kt_distill_schedule == 'every_epoch'

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        architecture = tf.gather(tf.constant(arch_ids, tf.int32), index)
        # every_epoch: the client's target [P, C], kept between its rounds, and its last round's mean distillation KL.
        kept = (
            dict(target=tf.zeros([public_batch, num_classes]), last_distill_kl=tf.constant(0.0)) if every_epoch else {}
        )
        return building_blocks.participation_state(
            client_id,
            client_index=index,
            architecture=architecture,
            params=tf.gather(archs.initial_packed(seed), architecture),
            **kept,
        )

    client_state_type = initial_client_state.type_signature.result

    def public_batch_of(round_num):
        return client_data.read_public_batch(spec, public_batch, seed, round_num)

    def soft(model, x):
        return tf.nn.softmax(model(x, training=False) / temperature, axis=-1)

    def distil(model, x, target, passes, distill_seed):
        # Eq. 6: `passes` passes of KL distillation towards the client's target on the public inputs x.
        return distillation.distill_towards(
            model,
            x,
            target,
            temperature=temperature,
            epochs=passes,
            batch_size=settings.public_distill_batch_size,
            learning_rate=settings.public_distill_learning_rate,
            seed=distill_seed,
        )

    def train_and_distil_every_epoch(round_num, state, private, x_public):
        # kt_distill_schedule=every_epoch: R passes after each epoch, towards the target kept in the state
        # (mixed in the client's last round, on that round's public batch); none before the first target.
        x_target = public_batch_of(tf.maximum(state['last_round'], 0))
        passes = tf.where(state['num_participations'] > 0, settings.kt_distill_epochs, 0)
        distill_seed = local_training.client_seed(seed, round_num, state['client_id'], salt=2)

        def work(model):
            def after_epoch(epoch):
                offset = tf.stack([tf.cast(epoch, tf.int64), tf.constant(0, tf.int64)])
                return distil(model, x_target, state['target'], passes, distill_seed + offset)

            stats, kl_sum = local_training.train_with(
                model,
                private,
                training,
                seed=local_training.client_seed(seed, round_num, state['client_id']),
                optimizer=client_optimizer,
                loss_fn=loss_fn,
                after_epoch=after_epoch,
            )
            with tf.control_dependencies([*stats, kl_sum]):
                return (
                    archs.pack(model.trainable_weights),
                    soft(model, x_public),
                    tuple(stats),
                    kl_sum / training.epochs,  # each epoch's value is the mean KL of its R passes
                )

        params, predictions, stats, mean_kl = archs.dispatch(state['architecture'], state['params'], work)
        return params, predictions, local_training.Stats(*stats), mean_kl

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        private = client_data.read_split(spec, state['client_id'], 'train')
        x_public = public_batch_of(round_num)
        if every_epoch:
            params, predictions, stats, mean_kl = train_and_distil_every_epoch(round_num, state, private, x_public)
            output = ktpfl_rounds.local_output(
                state, num_clients, params, stats, private.num_examples, dp=dp, predictions=predictions
            )
            output['client_state']['last_distill_kl'] = mean_kl
            return output
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
        return ktpfl_rounds.local_output(
            state, num_clients, params, stats, private.num_examples, dp=dp, predictions=predictions
        )

    def distill_stage(targets, round_num, state):
        x_public = public_batch_of(round_num)
        target = targets[state['client_index']]

        def work(model):
            distill_loss = distil(
                model,
                x_public,
                target,
                settings.kt_distill_epochs,
                local_training.client_seed(seed, round_num, state['client_id'], salt=2),
            )
            with tf.control_dependencies([distill_loss]):
                return archs.pack(model.trainable_weights), tf.identity(distill_loss)

        params, distill_loss = archs.dispatch(state['architecture'], state['params'], work)
        return building_blocks.participated(state, round_num, params=params), distill_loss

    def keep_target(targets, round_num, state):
        # every_epoch: the client keeps its row for its next round; the metric is this round's distillation.
        target = targets[state['client_index']]
        return building_blocks.participated(state, round_num, target=target), state['last_distill_kl']

    second_stage = tff.tensorflow.computation(
        keep_target if every_epoch else distill_stage, predictions_type, np.int32, client_state_type
    )

    server_init = ktpfl_rounds.build_server_init(num_clients)
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
        predictions = ktpfl_rounds.rows_by_client(rows['ids'], rows['values'], num_clients)
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
            coefficients = ktpfl_coefficients.within_block(
                coefficients_for(state, predictions), state['coefficients'], present
            )
        return collections.OrderedDict(coefficients=coefficients, round_num=state['round_num'] + 1)

    stages = ktpfl_rounds.Stages(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='predictions',
        mix=targets_for,
        second_stage=second_stage,
        update_coefficients=update_coefficients,
        metric='distill_kl',
        evaluate_client=heterogeneous.build_personalized_evaluation(
            spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
        ),
        schedule=settings.kt_distill_schedule,
    )
    return ktpfl_rounds.process_from_stages(
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


def _build(settings, spec, model_fn, run):
    del model_fn  # each client has its own architecture
    return build_ktpfl_process(
        spec, settings, dp=run.dp, seed=run.seed, max_clients_per_round=run.max_clients_per_round
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


ALGORITHMS = (
    algorithm.Algorithm(
        'ktpfl',
        'KT-pFL (Zhang et al., 2021): soft predictions on public data mixed by a learned coefficient matrix',
        KTpFLSettings,
        _build,
        lambda state: {'architecture_id': int(state['architecture'])},
        ktpfl_rounds.plots,
        check=_check_sampling,
        privacy=ktpfl_rounds.local_dp_privacy(
            "each client's soft predictions, clipped and noised on the client (local DP)", _soft_prediction_uploads
        ),
        family='knowledge distillation',
    ),
)
