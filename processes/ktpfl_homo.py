"""KT-pFL's homogeneous variant: the coefficient matrix mixes the clients' parameters (Appendix C).

Zhang et al., "Parameterized Knowledge Transfer for Personalized Federated
Learning" (NeurIPS 2021), Appendix C: every client trains the same model; it
uploads its parameters, the server sends client n the mix u_n = sum_m c[n, m]
w_m, the client takes a transfer step towards u_n (`parameter_distance`,
L_dis), and the server updates c on Eq. 11's objective. The round and local
DP (`processes.ktpfl_rounds`) and the coefficient matrix
(`processes.ktpfl_coefficients`) are the family's. With
`kt_distill_schedule='every_epoch'` (Algorithm 2's lines 11-15 read
literally) the client takes the R transfer steps after each of its E epochs,
towards the u_n it received at the end of its previous round (none in its
first round), as `processes.ktpfl` distils.

Settings: `KTpFLHomoSettings`; defaults from the paper's Appendix B.2
(docs/algorithms/ktpfl.md, "Settings").
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
    heterogeneous,
    local_training,
    privacy,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_ktpfl_homogeneous_process', 'KTpFLHomoSettings']

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class KTpFLHomoSettings(settings_lib.LocalTraining):
    """Homogeneous KT-pFL (Appendix C, Algorithm 2): parameters mixed by c.

    Defaults: the paper's Appendix B.2, homogeneous models, EMNIST /
    Fashion-MNIST (private batch 32, E = 20, R = 1, eta_1 = eta_2 = 0.01,
    eta_3 = 0.005, lambda = 1); rho, not stated for this setting, is the
    heterogeneous setting's 0.6.
    """

    batch_size: int = _setting(32, ktpfl_rounds.LOCAL_HELP['batch_size'])
    client_learning_rate: float = _setting(0.01, ktpfl_rounds.LOCAL_HELP['client_learning_rate'])
    local_epochs: int = _setting(20, ktpfl_rounds.LOCAL_HELP['local_epochs'])
    kt_transfer_steps: int = _setting(
        1, 'R, gradient steps of each client towards its personalized model u_n (Eq. 10; 0: no transfer).'
    )
    kt_transfer_learning_rate: float = _setting(
        0.01, 'eta_2, the step size of the transfer towards u_n (Eq. 10; 1 with R = 1: adopt u_n).'
    )
    kt_distill_schedule: str = _setting('after_training', ktpfl_rounds.SCHEDULE_HELP)
    kt_coefficient_learning_rate: float = _setting(0.005, ktpfl_coefficients.COEFFICIENT_LR_HELP)
    kt_rho: float = _setting(0.6, ktpfl_coefficients.RHO_HELP)
    kt_imitation: float = _setting(1.0, ktpfl_coefficients.IMITATION_HELP)

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
            + ktpfl_rounds.schedule_checks(self)
            + ktpfl_coefficients.coefficient_checks(self)
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


def personalized_parameters(coefficients: tf.Tensor, params: tf.Tensor, ids: tf.Tensor | None = None) -> tf.Tensor:
    """Appendix C's personalized models u_n = sum_m c[n, m] w_m, rows of c normalised.

    With `ids`, the round's clients S only: u_n for n in S mixes the models
    of S (row n of c restricted to S's columns, renormalised: `ktpfl_coefficients.mixing_weights`
    with S's ktpfl_rounds.presence). The models come as S's rows, `[K, D]`, so nothing
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
        return tf.matmul(ktpfl_coefficients.mixing_weights(coefficients), params)
    valid = tf.cast(ids >= 0, coefficients.dtype)
    rows = tf.maximum(ids, 0)
    weights = ktpfl_coefficients.mixing_weights(coefficients, ktpfl_rounds.presence(ids, coefficients.shape[0]))
    # S x S block of the weights, in the order of `ids`; empty rows and columns are zero.
    block = tf.gather(tf.gather(weights, rows), rows, axis=1) * valid[:, tf.newaxis] * valid[tf.newaxis, :]
    return tf.matmul(block, params) * valid[:, tf.newaxis]


def homogeneous_objective(coefficients, params, weights, rho, imitation, ids=None):
    """Eq. 11's objective in c (models fixed).

    lambda sum_n (D_n/D) L_dis(sum_m c[n, m] w_m, w_n) + rho ||c - 1/N||^2,
    with the rows of c normalised by `ktpfl_coefficients.mixing_weights`; with `ids`,
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
        return ktpfl_coefficients.regularised(coefficients, distances, weights, rho, imitation)
    num_clients = coefficients.shape[0]
    return ktpfl_coefficients.regularised(
        coefficients,
        ktpfl_rounds.rows_by_client(ids, distances, num_clients),
        weights,
        rho,
        imitation,
        ktpfl_rounds.presence(ids, num_clients),
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
    return ktpfl_coefficients.clipped_step(
        lambda c: homogeneous_objective(c, params, weights, rho, imitation, ids),
        coefficients,
        learning_rate,
        None if ids is None else ktpfl_rounds.presence(ids, coefficients.shape[0]),
    )


@builder_inputs.checked
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
        R = 1: the client adopts u_n), eta_3 (0 keeps c at 1/N), rho,
        lambda, and when clients transfer (`kt_distill_schedule`:
        'after_training', or 'every_epoch', the R steps after each of the E
        epochs).
      dp: local DP of the uploaded parameters (fixed clip;
        `ktpfl_rounds.local_output`); None: none.
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
      params=float32[D]>` (with 'every_epoch', also `target=float32[D]`,
      the client's next u_n). `next` takes every client's state or a sample's
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
    transfer_steps, transfer_learning_rate = settings.kt_transfer_steps, settings.kt_transfer_learning_rate
    num_clients = spec.num_clients
    capacity = ktpfl_rounds.round_capacity(max_clients_per_round, num_clients)
    archs = heterogeneous.Architectures([model_fn])
    num_params = archs.max_size
    # The round's models, and its personalized models: row k is client ids[k]'s (`ktpfl_rounds._gather`).
    rows_type = ktpfl_rounds.gathered_rows_type(tff.TensorType(np.float32, (num_params,)), capacity)
    sizes_type = tff.TensorType(np.float32, (num_clients,))

    every_epoch = settings.kt_distill_schedule == 'every_epoch'

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        # every_epoch: the client's u_n, [D], kept between its rounds.
        kept = dict(target=tf.zeros([num_params])) if every_epoch else {}
        return building_blocks.participation_state(
            client_id, client_index=index, params=archs.initial_packed(seed)[0], **kept
        )

    client_state_type = initial_client_state.type_signature.result

    def transfer(params, target):
        for _ in range(transfer_steps):  # Eq. 10: gradient steps on 1/2 ||u_n - w_n||^2
            params = params - transfer_learning_rate * (params - target)
        return params

    def train_and_transfer_every_epoch(round_num, state, private):
        # kt_distill_schedule=every_epoch: R transfer steps after each epoch, towards the u_n kept in the state
        # (mixed in the client's last round); none before the first.
        has_target = state['num_participations'] > 0

        def work(model):
            targets = archs.unpack(0, state['target'])

            def after_epoch(epoch):
                del epoch

                def steps():
                    moved = [v.assign(transfer(v.read_value(), t)) for v, t in zip(model.trainable_variables, targets)]
                    with tf.control_dependencies(moved):
                        return tf.constant(0.0)

                return tf.cond(has_target, steps, lambda: tf.constant(0.0))

            stats, _ = local_training.train_with(
                model,
                private,
                training,
                seed=local_training.client_seed(seed, round_num, state['client_id']),
                optimizer=client_optimizer,
                loss_fn=loss_fn,
                after_epoch=after_epoch,
            )
            with tf.control_dependencies(list(stats)):
                return archs.pack(model.trainable_weights), tuple(stats)

        params, stats = archs.dispatch(tf.constant(0), state['params'], work)
        return params, local_training.Stats(*stats)

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        private = client_data.read_split(spec, state['client_id'], 'train')
        if every_epoch:
            params, stats = train_and_transfer_every_epoch(round_num, state, private)
            return ktpfl_rounds.local_output(
                state, num_clients, params, stats, private.num_examples, dp=dp, params=params
            )
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
        return ktpfl_rounds.local_output(state, num_clients, params, stats, private.num_examples, dp=dp, params=params)

    def transfer_stage(personalized, round_num, state):
        target = ktpfl_rounds.own_row(personalized, state['client_index'])
        params = transfer(state['params'], target)
        distance = parameter_distance(params, target)
        return building_blocks.participated(state, round_num, params=params), distance

    def keep_target(personalized, round_num, state):
        # every_epoch: the client keeps its u_n for its next round; the metric is the distance to the u_n it
        # transferred towards this round, after its last transfer (0 before any).
        target = ktpfl_rounds.own_row(personalized, state['client_index'])
        distance = tf.where(state['num_participations'] > 0, parameter_distance(state['params'], state['target']), 0.0)
        return building_blocks.participated(state, round_num, target=target), distance

    second_stage = tff.tensorflow.computation(
        keep_target if every_epoch else transfer_stage, rows_type, np.int32, client_state_type
    )

    server_init = ktpfl_rounds.build_server_init(num_clients)
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

    stages = ktpfl_rounds.Stages(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='params',
        mix=personalized_models,
        second_stage=second_stage,
        update_coefficients=update_coefficients,
        metric='transfer_distance',
        evaluate_client=heterogeneous.build_personalized_evaluation(
            spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
        ),
        schedule=settings.kt_distill_schedule,
    )
    return ktpfl_rounds.process_from_stages(
        stages,
        capacity,
        extras={
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=num_params * 4, parameter_bytes_down_per_client=num_params * 4
            )
        },
    )


def _build(settings, spec, model_fn, run):
    return build_ktpfl_homogeneous_process(
        spec, model_fn, settings, dp=run.dp, seed=run.seed, max_clients_per_round=run.max_clients_per_round
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'ktpfl_homo',
        'KT-pFL, homogeneous variant (Zhang et al., 2021): parameters mixed by the coefficient matrix',
        KTpFLHomoSettings,
        _build,
        plots=ktpfl_rounds.plots,
        privacy=ktpfl_rounds.local_dp_privacy("each client's parameters, clipped and noised on the client (local DP)"),
        family='knowledge distillation',
    ),
)
