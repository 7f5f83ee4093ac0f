"""FedAMP: federated attentive message passing, so that clients with similar models collaborate more.

Y. Huang, L. Chu, Z. Zhou, L. Wang, J. Liu, J. Pei, Y. Zhang, "Personalized
Cross-Silo Federated Learning on Non-IID Data" (AAAI 2021).

Every client i keeps its own model w_i; the federation minimises

    G(W) = sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2),   A(x) = 1 - exp(-x / sigma),

by alternating two steps per round (attentive message passing):

1. the server forms client i's personalized cloud model
   u_i = xi_ii w_i + sum_{j != i} xi_ij w_j, with xi_ij = alpha_k A'(||w_i - w_j||^2)
   (A'(x) = exp(-x / sigma) / sigma) and xi_ii = 1 - sum_{j != i} xi_ij: a
   gradient step of size alpha_k on the attention term, in which the models
   closest to w_i weigh most (`attention_weights`, `attentive_message_passing`);
2. client i solves min_w F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2 approximately,
   by local SGD from u_i (`proximal_loss`), and keeps the result as its new w_i,
   its personalized model.

HeurFedAMP, the paper's heuristic for deep networks, is a setting
(`fedamp_attention='cosine'`): xi_ii is a fixed self-attention and 1 - xi_ii is
split over the other clients by a softmax of sigma' cos(w_i, w_j).

A round (`build_fedamp_process`): every client of the round sends its current
w_i with its index, and the server keeps the round's K models as rows
(`ktpfl_rounds.gather_steps`, the KT-pFL family's gather: K x D, not N x D);
it mixes them into the K cloud models and broadcasts those rows; each client
trains from its own row. With partial participation the server mixes the
models of the round's clients only: it keeps no client's model between
rounds (docs/algorithms/fedamp.md, "Partial participation"). The device form
(`_device_process`) is the same round as two phases of one aggregation each.

Settings: `FedAMPSettings` (docs/algorithms/fedamp.md, "Settings").
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl_rounds
from tff_pfl import algorithm, client_plots
from tff_pfl import settings as settings_lib
from tff_pfl.computations import builder_inputs, building_blocks, device_state, heterogeneous, local_training, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedamp_process', 'FedAMPSettings']

_setting = settings_lib.setting

ATTENTIONS = ('distance', 'cosine')
STARTS = ('cloud', 'own')


@dataclasses.dataclass(frozen=True)
class FedAMPSettings(settings_lib.LocalTraining):
    """FedAMP (`fedamp`): attentive message passing at the server, proximal local training at the clients.

    The defaults are documented with their sources in docs/algorithms/fedamp.md
    ("Settings"): the paper tunes alpha_k, lambda and sigma per data set, so
    the defaults here are the project's, measured on the learning gate and the
    KT-pFL Table 2 setting.
    """

    batch_size: int = _setting(32, settings_lib.help_of(settings_lib.ClientSGD.__dataclass_fields__['batch_size']))
    client_learning_rate: float = _setting(
        0.01, settings_lib.help_of(settings_lib.ClientSGD.__dataclass_fields__['client_learning_rate'])
    )
    local_epochs: int = _setting(
        5, settings_lib.help_of(settings_lib.LocalTraining.__dataclass_fields__['local_epochs'])
    )
    fedamp_alpha: float | None = _setting(
        None,
        "alpha_k, the step size of the attentive message passing: xi_ij = alpha_k A'(d_ij) for j != i, d_ij the "
        'squared distance of w_i and w_j (unset: sigma / K, K the most clients of a round, so that every '
        'xi_ii >= 1 / K).',
    )
    fedamp_lambda: float = _setting(
        0.1,
        'lambda, the weight of the attention term of the objective; the clients train on F_i(w) plus '
        'lambda / (2 alpha_k) times the squared distance of w to u_i.',
    )
    fedamp_sigma: float = _setting(
        10.0, 'sigma, the scale of the attention-inducing function A(x) = 1 - exp(-x / sigma) (squared distances).'
    )
    fedamp_attention: str = _setting(
        'distance',
        "How the server weighs the clients' models: 'distance' (FedAMP, xi_ij = alpha_k A'(d_ij)) or "
        "'cosine' (HeurFedAMP: xi_ii = fedamp_self_attention, the rest by a softmax of "
        'fedamp_cosine_scale x cos(w_i, w_j)).',
    )
    fedamp_self_attention: float = _setting(
        0.5, "HeurFedAMP's xi_ii, the weight of the client's own model in u_i (fedamp_attention='cosine' only)."
    )
    fedamp_cosine_scale: float = _setting(
        100.0, "HeurFedAMP's sigma, the scale of cos(w_i, w_j) in the softmax (fedamp_attention='cosine' only)."
    )
    fedamp_start: str = _setting(
        'cloud',
        "Where each client's local SGD starts: 'cloud' (u_i, the centre of its proximal problem) or 'own' (its "
        'model w_i of the last round it took part in).',
    )

    def _checks(self):
        return super()._checks() + [
            (self.fedamp_alpha is None or self.fedamp_alpha > 0, f'fedamp_alpha must be > 0, got {self.fedamp_alpha}'),
            (self.fedamp_lambda >= 0, f'fedamp_lambda must be >= 0, got {self.fedamp_lambda}'),
            (self.fedamp_sigma > 0, f'fedamp_sigma must be > 0, got {self.fedamp_sigma}'),
            (
                self.fedamp_attention in ATTENTIONS,
                f'fedamp_attention must be one of {", ".join(ATTENTIONS)}, got {self.fedamp_attention!r}',
            ),
            (
                0 <= self.fedamp_self_attention <= 1,
                f'fedamp_self_attention must be in [0, 1], got {self.fedamp_self_attention}',
            ),
            (self.fedamp_cosine_scale >= 0, f'fedamp_cosine_scale must be >= 0, got {self.fedamp_cosine_scale}'),
            (
                self.fedamp_start in STARTS,
                f'fedamp_start must be one of {", ".join(STARTS)}, got {self.fedamp_start!r}',
            ),
        ]

    def alpha(self, capacity: int) -> float:
        """alpha_k: `fedamp_alpha`, or sigma / K when it is unset.

        With alpha_k = sigma / K every xi_ii is at least 1 / K (A' <= 1 / sigma), and
        models within much less than sigma of each other are mixed into their plain mean.

        Args:
          capacity: K, the most clients of a round.

        Returns:
          alpha_k.
        """
        return self.fedamp_sigma / capacity if self.fedamp_alpha is None else self.fedamp_alpha

    def attention_fn(self, capacity: int):
        """xi with these settings: `(values [K, D], ids int32[K]) -> xi [K, K]` (TF code).

        Args:
          capacity: K, the most clients of a round (for the default alpha_k).

        Returns:
          `attention_weights` or, for HeurFedAMP, `cosine_attention_weights`, with these settings.
        """
        if self.fedamp_attention == 'cosine':
            return lambda values, ids: cosine_attention_weights(
                values, ids, self_attention=self.fedamp_self_attention, scale=self.fedamp_cosine_scale
            )
        alpha = self.alpha(capacity)
        return lambda values, ids: attention_weights(values, ids, alpha=alpha, sigma=self.fedamp_sigma)


def squared_distances(values: tf.Tensor) -> tf.Tensor:
    """`[K, K]`: ||w_i - w_j||^2 of the rows of `values`, computed from the differences (TF code).

    Args:
      values: the models, `[K, D]`.

    Returns:
      float32 `[K, K]`, symmetric, zero on the diagonal.
    """
    # One row at a time ([K, D] at once, not [K, K, D]); differences, not the Gram matrix, so that two close
    # models are not the small difference of two large norms.
    return tf.map_fn(lambda w: tf.reduce_sum(tf.square(values - w), axis=1), values)


def _pairs(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """`(valid [K], others [K, K])`: the real rows, and 1 where j != i and both rows are real."""
    valid = tf.cast(ids >= 0, tf.float32)
    k = tf.shape(ids)[0]
    others = valid[:, tf.newaxis] * valid[tf.newaxis, :] * (1.0 - tf.eye(k))
    return valid, others


def attention_weights(values: tf.Tensor, ids: tf.Tensor, *, alpha: float, sigma: float) -> tf.Tensor:
    """FedAMP's xi over the round's models: xi_ij = alpha A'(||w_i - w_j||^2), xi_ii = 1 - sum_{j != i} xi_ij.

    A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma: the
    closer w_j to w_i, the more it weighs in u_i. Each row sums to 1; xi_ii
    is not clipped (it is negative when alpha (K - 1) / sigma > 1 and the
    models are close; the round reports `min_self_attention`).

    Args:
      values: the round's models, `[K, D]`, row k client `ids[k]`'s.
      ids: `int32[K]`, -1 for an empty row (which neither gets nor gives weight).
      alpha: alpha_k.
      sigma: sigma.

    Returns:
      float32 `[K, K]`; rows of empty rows are zero.
    """
    valid, others = _pairs(ids)
    derivative = tf.exp(-squared_distances(values) / sigma) / sigma  # A'(||w_i - w_j||^2)
    off_diagonal = alpha * derivative * others
    return off_diagonal + tf.linalg.diag((1.0 - tf.reduce_sum(off_diagonal, axis=1)) * valid)


def cosine_attention_weights(values: tf.Tensor, ids: tf.Tensor, *, self_attention: float, scale: float) -> tf.Tensor:
    """HeurFedAMP's xi: xi_ii = `self_attention`, xi_ij = (1 - xi_ii) softmax_{j != i}(scale cos(w_i, w_j)).

    A client alone in its round keeps xi_ii = 1.

    Args:
      values: the round's models, `[K, D]`.
      ids: `int32[K]`, -1 for an empty row.
      self_attention: xi_ii.
      scale: the softmax's scale of the cosine similarity.

    Returns:
      float32 `[K, K]`; rows of empty rows are zero.
    """
    valid, others = _pairs(ids)
    unit = values / tf.maximum(tf.norm(values, axis=1, keepdims=True), 1e-12)
    cosine = tf.matmul(unit, unit, transpose_b=True)
    # Softmax over the other real rows (shifted by the row's largest cosine, 1 at most, for stability).
    scores = tf.exp(scale * (cosine - 1.0)) * others
    totals = tf.reduce_sum(scores, axis=1, keepdims=True)
    alone = tf.cast(totals[:, 0] <= 0, tf.float32)
    own = (self_attention + (1.0 - self_attention) * alone) * valid
    return (1.0 - self_attention) * scores / tf.maximum(totals, 1e-30) + tf.linalg.diag(own)


def attentive_message_passing(values: tf.Tensor, ids: tf.Tensor, attention_fn) -> tuple[tf.Tensor, tf.Tensor]:
    """The server's step: every client's cloud model u_i = sum_j xi_ij w_j over the round's models.

    Args:
      values: the round's models, `[K, D]`, row k client `ids[k]`'s.
      ids: `int32[K]`, -1 for an empty row.
      attention_fn: `(values, ids) -> xi [K, K]` (`FedAMPSettings.attention_fn`).

    Returns:
      `(xi [K, K], clouds [K, D])`, row k of `clouds` client `ids[k]`'s u (zero for an empty row).
    """
    xi = attention_fn(values, ids)
    return xi, tf.matmul(xi, values)


def proximal_loss(base: local_training.LossFn, anchor, weight) -> local_training.LossFn:
    """The client's objective: `base` (F_i) plus `weight / 2 * ||weights - anchor||^2` (TF code).

    Args:
      base: the client's loss F_i (`local_training.loss_from`).
      anchor: u_i as a list of tensors, one per trainable variable.
      weight: lambda / alpha_k.

    Returns:
      A `local_training.LossFn`.
    """

    def loss_fn(model, x, y):
        loss, logits = base(model, x, y)
        squared = tf.add_n([tf.reduce_sum(tf.square(v - a)) for v, a in zip(model.trainable_variables, anchor)])
        return loss + 0.5 * weight * squared, logits

    return loss_fn


def attention_rows(attention: tf.Tensor, ids: tf.Tensor, xi: tf.Tensor) -> tf.Tensor:
    """The server's `[N, N]` attention record with the round's rows replaced by this round's xi (TF code).

    Row i of the record holds the weights of client i's last cloud model over
    every client (zero for the clients that were not in that round).

    Args:
      attention: `[N, N]`, the record before the round.
      ids: `int32[K]`, the round's clients (-1: an empty row).
      xi: `[K, K]`, this round's weights.

    Returns:
      The new `[N, N]` record.
    """
    num_clients = attention.shape[0]
    # [K, N]: row k is xi[k] in the columns of the round's clients.
    rows = tf.transpose(ktpfl_rounds.rows_by_client(ids, tf.transpose(xi), num_clients))
    valid = ids >= 0
    return tf.tensor_scatter_nd_update(
        attention, tf.boolean_mask(ids, valid)[:, tf.newaxis], tf.boolean_mask(rows, valid)
    )


def _self_attention_metrics(xi: tf.Tensor, ids: tf.Tensor) -> collections.OrderedDict:
    """`<mean_self_attention, min_self_attention>`: xi_ii over the round's clients (TF code)."""
    own = tf.boolean_mask(tf.linalg.diag_part(xi), ids >= 0)
    return collections.OrderedDict(mean_self_attention=tf.reduce_mean(own), min_self_attention=tf.reduce_min(own))


# Why FedAMP's builder takes no server optimizer or model aggregator (`building_blocks.refuse_unused`).
UNUSED = dict(
    server_optimizer=(
        "FedAMP's server step is the attentive message passing (each client's cloud model u_i, step size "
        'fedamp_alpha), not an optimizer step on one model'
    ),
    model_aggregator=(
        "FedAMP's server mixes each client's model on its own into that client's cloud model u_i, not into one mean"
    ),
)


# Why FedAMP takes neither DP nor secure aggregation (completes "fedamp ...").
NO_PRIVACY = (
    "sends each client's whole model to the server on its own (the server weighs every pair of models to form "
    'each cloud model), which neither a DP mean nor a secure sum can protect'
)


@builder_inputs.checked
def build_fedamp_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    settings: FedAMPSettings | None = None,
    *,
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
    """Builds FedAMP (or HeurFedAMP, `fedamp_attention='cosine'`) as a `PersonalizedProcess`.

    Each round: every client of the round sends its model w_i with its index;
    the server forms every such client's cloud model u_i = sum_j xi_ij w_j over
    the round's models and broadcasts them; client i runs local SGD on
    F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2 from u_i (or from w_i,
    `fedamp_start='own'`) and keeps the result as its w_i.

    Args:
      spec: the partition on disk.
      model_fn: no-arg builder of the clients' model (logits out, no
        non-trainable weights); a Keras model function or a
        `tff.learning.models.FunctionalModel` (`adapters.keras_model_fn`).
      settings: the `FedAMPSettings` (local training: E epochs or exactly
        `local_steps` steps, batch size, learning rate; alpha_k, lambda,
        sigma; the attention and the start point); None: `FedAMPSettings()`.
      client_optimizer: the clients' local optimizer for their proximal
        problem, a `tff.learning.optimizers.Optimizer` started fresh for each
        client's local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): FedAMP's server step is the attentive
        message passing (each client's cloud model u_i, step size fedamp_alpha), not an optimizer step
        on one model.
      model_aggregator: not taken (ValueError if given): FedAMP's server mixes each client's model
        on its own into that client's cloud model u_i, not into one mean.
      loss: the clients' training loss F_i, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy); the proximal term
        is added to it.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed (the initial model, the same for every client, and the
        batch orders).
      max_clients_per_round: K, the most clients a round takes (None: N).
        The server holds the round's K models, `[K, D]`; a round with more
        clients fails at an assertion.

    Returns:
      A `template.PersonalizedProcess` declaring the bytes it exchanges
      (`extras['communication']`). Server state `<attention=float32[N, N],
      round_num>` (row i: the weights of client i's last cloud model over
      the clients; the identity before any round); client state
      `<client_id, num_participations, last_round, client_index,
      params=float32[D]>` (w_i, packed). Metrics: the local training's
      (`train_loss` is the proximal objective's), `mean_distance_to_cloud`
      (||w_i - u_i||^2 after training) and the mean and least xi_ii of the
      round.

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `FedAMPSettings`.
      ValueError: a keyword FedAMP has no use for (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = FedAMPSettings() if settings is None else settings
    if not isinstance(settings, FedAMPSettings):
        raise TypeError(f'build_fedamp_process takes FedAMPSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_fedamp_process',
        UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    from_cloud = settings.fedamp_start == 'cloud'
    num_clients = spec.num_clients
    capacity = ktpfl_rounds.round_capacity(max_clients_per_round, num_clients)
    proximal_weight = settings.fedamp_lambda / settings.alpha(capacity)  # lambda / alpha_k
    attention_fn = settings.attention_fn(capacity)
    archs = heterogeneous.Architectures([model_fn])  # one architecture: packs w_i into one [D] vector
    num_params = archs.max_size
    model_type = tff.TensorType(np.float32, (num_params,))
    rows_type = ktpfl_rounds.gathered_rows_type(model_type, capacity)

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        # Every client starts from the same seeded model w^0.
        return building_blocks.participation_state(
            client_id, client_index=client_data.client_index(client_id), params=archs.initial_packed(seed)[0]
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(attention=tf.eye(num_clients), round_num=tf.constant(0, tf.int32))

    server_state_type = server_init.type_signature.result

    @tff.tensorflow.computation(client_state_type)
    def upload(state):
        # Client i's w_i with its index: the server needs each model on its own.
        return collections.OrderedDict(index=state['client_index'], value=state['params'])

    @tff.tensorflow.computation(rows_type)
    def message_passing(rows):
        xi, clouds = attentive_message_passing(rows['values'], rows['ids'], attention_fn)
        return collections.OrderedDict(ids=rows['ids'], xi=xi, clouds=clouds)

    passed_type = message_passing.type_signature.result

    @tff.tensorflow.computation(server_state_type, passed_type)
    def server_update(state, passed):
        return collections.OrderedDict(
            attention=attention_rows(state['attention'], passed['ids'], passed['xi']),
            round_num=state['round_num'] + 1,
        )

    @tff.tensorflow.computation(passed_type)
    def attention_metrics(passed):
        return _self_attention_metrics(passed['xi'], passed['ids'])

    # What the clients of a round receive: every cloud model as K rows (each takes its own) and the round.
    train_input_type = tff.StructWithPythonType(
        [('clouds', rows_type), ('round_num', np.int32)], collections.OrderedDict
    )

    @tff.tensorflow.computation(server_state_type, passed_type)
    def train_input(state, passed):
        clouds = collections.OrderedDict(ids=passed['ids'], values=passed['clouds'])
        return collections.OrderedDict(clouds=clouds, round_num=state['round_num'])

    @tff.tensorflow.computation(train_input_type, client_state_type)
    def client_update(value, state):
        cloud = ktpfl_rounds.own_row(value['clouds'], state['client_index'])  # u_i
        round_num = value['round_num']
        data = client_data.read_split(spec, state['client_id'], 'train')
        params, _, stats = heterogeneous.train_packed(
            archs,
            tf.constant(0),
            cloud if from_cloud else state['params'],
            data,
            training,
            seed=local_training.client_seed(seed, round_num, state['client_id']),
            optimizer=client_optimizer,
            loss_fn=proximal_loss(loss_fn, archs.unpack(0, cloud), proximal_weight),
        )
        metric_sums = building_blocks.training_metric_sums(stats)
        metric_sums['distance_to_cloud'] = tf.reduce_sum(tf.square(params - cloud))
        return collections.OrderedDict(
            metric_sums=metric_sums, client_state=building_blocks.participated(state, round_num, params=params)
        )

    zero, accumulate, merge, report = ktpfl_rounds.gather_steps(model_type, capacity)
    initialize = building_blocks.server_initialize(server_init)
    placed_state_type = initialize.type_signature.result

    @tff.federated_computation(placed_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def next_fn(state, client_states):
        # CLIENTS -> SERVER: each client's model with its index, kept by the server as the round's K rows.
        models = tff.federated_aggregate(tff.federated_map(upload, client_states), zero(), accumulate, merge, report)
        passed = tff.federated_map(message_passing, models)
        value = tff.federated_broadcast(tff.federated_map(train_input, (state, passed)))
        trained = tff.federated_map(client_update, (value, client_states))
        new_state = tff.federated_map(server_update, (state, passed))
        metrics = building_blocks.with_server_metrics(
            tff.federated_map(attention_metrics, passed),
            building_blocks.aggregate_training_metrics(trained.metric_sums),
        )
        return template.RoundOutput(new_state, trained.client_state, metrics)

    evaluate_client = heterogeneous.build_personalized_evaluation(
        spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
    )
    parts = _Parts(
        server_init,
        initial_client_state,
        upload,
        message_passing,
        server_update,
        attention_metrics,
        train_input,
        client_update,
        evaluate_client,
    )
    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=building_blocks.build_client_states_evaluation(placed_state_type, evaluate_client),
        device=_device_process(parts, num_clients, capacity),
        extras={
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=num_params * 4, parameter_bytes_down_per_client=num_params * 4
            )
        },
        no_global_model="FedAMP's server keeps no model: each client keeps its own w_i (its personalized model)",
    )


# The typed parts of FedAMP's round, from which `_device_process` makes its device form.
_Parts = collections.namedtuple(
    '_Parts',
    [
        'server_init',
        'initial_client_state',
        'upload',
        'message_passing',
        'server_update',
        'attention_metrics',
        'train_input',
        'client_update',
        'evaluate_client',
    ],
)


def _device_process(parts: _Parts, num_clients: int, capacity: int) -> template.DeviceProcess:
    """FedAMP's round with device-held client states: two phases of one aggregation each.

    * `share`: the server broadcasts the round number; each device sends its
      w_i in its own row of an `[N, D]` sum and a 1 in its slot of an `[N]`
      presence sum; the server takes the present rows (`ktpfl_rounds.compact`:
      the rows the gather gives in process), forms the cloud models, updates
      its attention record and keeps the clouds in its state;
    * `train`: the server broadcasts the clouds and the round's number; each
      device trains towards its own row; the training metrics go up.

    The slots are there because TFF 0.87's DistributeAggregateForm
    conversion fails on a `federated_aggregate` (as for KT-pFL,
    docs/algorithms/ktpfl.md); a slot costs N x D on a device and in the sum.
    The device form's server state is `<attention, round_num, clouds>` (the
    clouds zero before the first round), and its rounds equal the in-process
    rounds (tests/test_fedamp.py).

    Args:
      parts: the round's typed parts.
      num_clients: N.
      capacity: K.

    Returns:
      The `device_state.build_device_process` of the two phases.
    """
    client_state_type = parts.initial_client_state.type_signature.result
    model_type = parts.upload.type_signature.result['value']

    @tff.tensorflow.computation
    def device_server_init():
        state = parts.server_init()
        empty = collections.OrderedDict(
            ids=tf.fill([capacity], -1), values=tf.zeros([capacity, *model_type.shape], model_type.dtype)
        )
        return collections.OrderedDict(attention=state['attention'], round_num=state['round_num'], clouds=empty)

    initialize = building_blocks.server_initialize(device_server_init)
    state_type = device_server_init.type_signature.result
    round_of = building_blocks.build_round_number(state_type)

    @tff.tensorflow.computation(np.int32, client_state_type)
    def share_step(round_num, state):
        del round_num  # the model a client sends does not depend on the round
        sent = parts.upload(state)
        slot = tf.one_hot(sent['index'], num_clients)
        return collections.OrderedDict(
            rows=ktpfl_rounds.rows_by_client(sent['index'][tf.newaxis], sent['value'][tf.newaxis], num_clients),
            present=slot,
            client_state=state,
        )

    slots_type = share_step.type_signature.result['rows']
    present_type = share_step.type_signature.result['present']

    @tff.tensorflow.computation(state_type, slots_type, present_type)
    def share_update(state, slots, present):
        ids, values = ktpfl_rounds.compact(present, slots, capacity)
        passed = parts.message_passing(collections.OrderedDict(ids=ids, values=values))
        kept = collections.OrderedDict(attention=state['attention'], round_num=state['round_num'])
        updated = parts.server_update(kept, passed)
        new_state = collections.OrderedDict(
            attention=updated['attention'],
            round_num=updated['round_num'],
            clouds=collections.OrderedDict(ids=passed['ids'], values=passed['clouds']),
        )
        return collections.OrderedDict(state=new_state, metrics=parts.attention_metrics(passed))

    def share_finish(state, outputs):
        slots, present = tff.federated_sum(outputs.rows), tff.federated_sum(outputs.present)
        updated = tff.federated_map(share_update, (state, slots, present))
        return updated.state, updated.metrics

    @tff.tensorflow.computation(state_type)
    def train_broadcast(state):
        return collections.OrderedDict(clouds=state['clouds'], round_num=state['round_num'] - 1)

    def train_finish(state, outputs):
        return state, building_blocks.aggregate_training_metrics(outputs.metric_sums)

    return device_state.build_device_process(
        initialize,
        parts.initial_client_state,
        phases=[
            device_state.Phase('share', round_of, share_step, share_finish),
            device_state.Phase('train', train_broadcast, parts.client_update, train_finish),
        ],
        evaluate_input=round_of,
        evaluate_client=building_blocks.build_evaluation_at(parts.evaluate_client),
    )


def _plots(out, result, process):
    """FedAMP's report plot: the server's attention record xi as a heatmap (and CSV).

    Args:
      out: the run's directory.
      result: the finished run (its server state holds `attention`).
      process: its process (unused).

    Returns:
      `[(title, file)]`.
    """
    del process
    attention = np.asarray(result.state['attention'])
    client_plots.plot_client_matrix(
        out,
        'attention',
        "Attention xi[i, j] of client i's last cloud model u_i (row i)",
        attention,
        [client_data.client_id_for(i) for i in range(len(attention))],  # row i is client i's, sampled or not
    )
    return [('Attention of the cloud models', 'attention.png')]


ALGORITHMS = (
    algorithm.Algorithm(
        'fedamp',
        'FedAMP (Huang et al., 2021): attentive message passing between clients with similar models',
        FedAMPSettings,
        algorithm.gathering_builder(build_fedamp_process),
        client_columns=algorithm.participation_columns,
        plots=_plots,
        privacy=algorithm.Privacy(why_not=NO_PRIVACY),
        family='personalized aggregation',
    ),
)
