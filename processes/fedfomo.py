"""FedFomo: each client weighs other clients' models by how much they lower its validation loss.

M. Zhang, K. Sapra, S. Fidler, S. Yeung, J. M. Alvarez, "Personalized Federated
Learning with First Order Model Optimization" (ICLR 2021).

Every client i keeps its own model theta_i and a validation split. A round:

1. the server chooses M candidate clients for every client i, epsilon-greedily
   on its affinity matrix P (`choose_candidates`): a candidate slot is, with
   probability 1 - epsilon_t, the next client of highest P_ij, else a client
   drawn at random; epsilon_t = max(0, epsilon - t x decay);
2. it sends the clients its store of the clients' last uploaded models, and each
   client takes its candidates' models theta_j;
3. client i weighs them by the first-order approximation of its validation loss
   L_i (`fomo_weights`):

       w_ij = max(0, (L_i(theta_i^{t-1}) - L_i(theta_j)) / ||theta_j - theta_i^{t-1}||),

   normalises them by their sum, and moves (`fomo_update`)

       theta_i^t = theta_i^{t-1} + sum_j w_ij (theta_j - theta_i^{t-1})

   (all w_ij zero: it keeps theta_i^{t-1}); then it trains theta_i^t by local
   SGD on its training split and keeps it as its personalized model
   (`fedfomo_own_candidate`: the authors' reading, theta_i^{t-1} one more
   candidate and everything measured from the model the client started its
   previous training from, `own_candidate_step`);
4. each client uploads theta_i^t and its weights w_i; the server stores theta_i^t
   as client i's model and adds w_ij to P_ij (`affinity_row`).

A round (`build_fedfomo_process`) is one broadcast and one aggregation: the
server picks every client's candidates from its state alone (for all N
clients; the clients of the round take their own row), so nothing it sends
depends on the round's uploads; the device form (`_device_process`) is that
round with sums in place of the gather. The server's state holds N models
(the paper's store): docs/algorithms/fedfomo.md ("Costs").

Settings: `FedFomoSettings` (docs/algorithms/fedfomo.md, "Settings").
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
__all__ = ['build_fedfomo_process', 'FedFomoSettings']

_setting = settings_lib.setting

AFFINITIES = ('normalized', 'raw', 'signed')


@dataclasses.dataclass(frozen=True)
class FedFomoSettings(settings_lib.LocalTraining):
    """FedFomo (`fedfomo`): first-order weighting of candidate models on each client's validation split.

    The defaults and their sources are in docs/algorithms/fedfomo.md
    ("Settings"): M = 5 candidates and epsilon = 0.3 decaying by 0.05 a
    round are the paper's; the local training is the project's.
    """

    fedfomo_candidates: int = _setting(
        5, "M, the candidate clients' models the server sends each client a round (at most N - 1 are sent)."
    )
    fedfomo_epsilon: float = _setting(
        0.3,
        'epsilon, the chance that a candidate slot goes to a client drawn at random rather than to the client '
        'of next highest affinity P_ij (round 0; it decays by fedfomo_epsilon_decay a round).',
    )
    fedfomo_epsilon_decay: float = _setting(
        0.05, 'How much epsilon falls each round: epsilon_t = max(0, fedfomo_epsilon - t x fedfomo_epsilon_decay).'
    )
    fedfomo_affinity: str = _setting(
        'normalized',
        "What the server adds to P_ij: 'normalized' (the w_ij client i applied, summing to 1 or all zero), "
        "'raw' (w_ij before the normalisation) or 'signed' (the gains before the clipping at 0, divided by the "
        "absolute value of their sum, as the authors' code does: a worse model lowers P_ij).",
    )

    fedfomo_own_candidate: bool = _setting(
        False,
        "Offer the client's own model theta_i^{t-1} as one more candidate, as the authors' code does, and measure "
        'every gain and distance from r_i, the model client i started its previous local training from (the '
        'model it moved to last round): w_n = max(0, (L_i(r_i) - L_i(theta_n)) / ||theta_n - r_i||) over its own '
        'model and the M others, normalised, and theta_i^t = r_i + sum_n w_n (theta_n - r_i) (all zero: r_i). '
        "False: the paper's update from theta_i^{t-1} over the M others.",
    )

    def _checks(self):
        return super()._checks() + [
            (self.fedfomo_candidates >= 1, f'fedfomo_candidates must be >= 1, got {self.fedfomo_candidates}'),
            (0 <= self.fedfomo_epsilon <= 1, f'fedfomo_epsilon must be in [0, 1], got {self.fedfomo_epsilon}'),
            (
                self.fedfomo_epsilon_decay >= 0,
                f'fedfomo_epsilon_decay must be >= 0, got {self.fedfomo_epsilon_decay}',
            ),
            (
                self.fedfomo_affinity in AFFINITIES,
                f'fedfomo_affinity must be one of {", ".join(AFFINITIES)}, got {self.fedfomo_affinity!r}',
            ),
        ]

    def epsilon_at(self, round_num):
        """epsilon_t = max(0, epsilon - t x decay) (Python numbers or TF tensors).

        Args:
          round_num: t, counted from 0.

        Returns:
          epsilon_t.
        """
        decayed = self.fedfomo_epsilon - tf.cast(round_num, tf.float32) * self.fedfomo_epsilon_decay
        return tf.maximum(decayed, 0.0)


def choose_candidates(affinity: tf.Tensor, available: tf.Tensor, *, count: int, epsilon, seed: tf.Tensor) -> tf.Tensor:
    """Every client's M candidates, epsilon-greedily on the affinity matrix P (TF code).

    For client i the pool is the clients j != i whose model the server holds.
    Each of the M slots explores with probability epsilon; the r exploring
    slots go to clients drawn uniformly from the rest of the pool, the M - r
    others to the pool's clients of highest P_ij (ties in a random order). A pool of fewer
    than M clients gives all of them and -1 in the other slots.

    Args:
      affinity: P, float32 `[N, N]`.
      available: bool `[N]`, whether the server holds client j's model.
      count: M (at most N).
      epsilon: the exploration probability of this round.
      seed: int64 `[2]`, a stateless seed (the run's seed and the round).

    Returns:
      int32 `[N, M]`: row i, client i's candidates, highest-affinity ones
      first, then the explored ones; -1 for an empty slot.
    """
    num_clients = affinity.shape[0]
    seeds = tf.random.experimental.stateless_split(seed, 3)
    pool = tf.logical_and(available[tf.newaxis, :], tf.logical_not(tf.eye(num_clients, dtype=tf.bool)))
    explore = tf.random.stateless_uniform([num_clients, count], seeds[0]) < epsilon
    greedy_count = count - tf.reduce_sum(tf.cast(explore, tf.int32), axis=1, keepdims=True)  # M - r, per row
    # Rank by P_ij (descending), ties in a random order: a random shuffle, then a stable sort by P.
    shuffle = tf.argsort(tf.random.stateless_uniform([num_clients, num_clients], seeds[1]), axis=1)
    shuffled = tf.gather(tf.where(pool, affinity, -np.inf), shuffle, batch_dims=1)
    order = tf.gather(shuffle, tf.argsort(-shuffled, axis=1, stable=True), batch_dims=1)
    rank = tf.argsort(order, axis=1)  # rank[i, j]: j's place in i's order
    greedy = tf.logical_and(pool, rank < greedy_count)
    # Greedy picks score 2, the rest of the pool a uniform draw in [0, 1), the others -1; the top M are taken.
    draw = tf.random.stateless_uniform([num_clients, num_clients], seeds[2])
    score = tf.where(greedy, 2.0 + 1.0 / (1.0 + tf.cast(rank, tf.float32)), tf.where(pool, draw, -1.0))
    best = tf.math.top_k(score, k=count)
    return tf.where(best.values >= 0, best.indices, -1)


def fomo_weights(
    own_loss: tf.Tensor, candidate_losses: tf.Tensor, distances: tf.Tensor, valid: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """w_ij = max(0, (L_i(theta_i^{t-1}) - L_i(theta_j)) / ||theta_j - theta_i^{t-1}||), and normalised (TF code).

    A candidate that is not there, or whose model equals theta_i^{t-1}, gets 0.

    Args:
      own_loss: L_i(theta_i^{t-1}), a scalar.
      candidate_losses: L_i(theta_j), `[M]`.
      distances: ||theta_j - theta_i^{t-1}||_2, `[M]`.
      valid: bool `[M]`, whether slot j holds a candidate.

    Returns:
      `(raw [M], normalized [M])`: the w_ij, and the w_ij divided by their sum
      (all zero when every w_ij is zero).
    """
    counted = tf.logical_and(valid, distances > 0)
    raw = tf.where(counted, tf.maximum(own_loss - candidate_losses, 0.0) / tf.where(counted, distances, 1.0), 0.0)
    total = tf.reduce_sum(raw)
    return raw, tf.where(total > 0, raw / tf.where(total > 0, total, 1.0), 0.0)


def signed_gains(own_loss: tf.Tensor, candidate_losses: tf.Tensor, distances: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """(L_i(theta_i^{t-1}) - L_i(theta_j)) / ||theta_j - theta_i^{t-1}||, not clipped, over |their sum| (TF code).

    What `fedfomo_affinity='signed'` adds to P: the authors' code adds these
    to its client-to-client weights, so a model worse than the client's own
    lowers P_ij. A candidate that is not there, or equals theta_i^{t-1}, gets 0.

    Args:
      own_loss: L_i(theta_i^{t-1}).
      candidate_losses: L_i(theta_j), `[M]`.
      distances: ||theta_j - theta_i^{t-1}||_2, `[M]`.
      valid: bool `[M]`.

    Returns:
      float32 `[M]` (all zero when their sum is 0).
    """
    counted = tf.logical_and(valid, distances > 0)
    gains = tf.where(counted, (own_loss - candidate_losses) / tf.where(counted, distances, 1.0), 0.0)
    total = tf.abs(tf.reduce_sum(gains))
    return tf.where(total > 0, gains / tf.where(total > 0, total, 1.0), 0.0)


def fomo_update(own: tf.Tensor, candidates: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """theta_i^t = theta_i^{t-1} + sum_j w_ij (theta_j - theta_i^{t-1}) (TF code).

    Args:
      own: theta_i^{t-1}, `[D]`.
      candidates: the theta_j, `[M, D]`.
      weights: the normalised w_ij, `[M]` (zero for an empty slot).

    Returns:
      `[D]`.
    """
    return own + tf.linalg.matvec(candidates - own[tf.newaxis, :], weights, transpose_a=True)


def validation_losses(archs: heterogeneous.Architectures, models: tf.Tensor, data) -> tf.Tensor:
    """The mean cross-entropy of each packed model on a split, one model after another in one Keras model (TF code).

    Args:
      archs: the `Architectures` (one architecture).
      models: `[R, D]`, packed models.
      data: the split (`client_data.read_split`).

    Returns:
      float32 `[R]`.
    """
    model = archs.model_fns[0]()
    losses, after = [], []
    for row in range(models.shape[0]):
        with tf.control_dependencies(after):
            loads = [v.assign(w) for v, w in zip(model.trainable_weights, archs.unpack(0, models[row]))]
        with tf.control_dependencies(loads):
            stats = local_training.evaluate(model, data)
            loss = stats.loss_sum / tf.maximum(stats.num_examples, 1.0)
        losses.append(loss)
        after = [loss]
    return tf.stack(losses)


def paper_step(archs, own, models, valid, val) -> dict:
    """The paper's step of client i: its M candidates weighed against theta_i^{t-1}, the move from there (TF code).

    Args:
      archs: the `Architectures`.
      own: theta_i^{t-1}, `[D]`.
      models: the candidates' theta_j, `[M, D]`.
      valid: bool `[M]`.
      val: the client's validation split.

    Returns:
      `raw`, `weights`, `signed` (`[M]`: the candidates' w_ij, normalised, and
      the signed gains), `start` (theta_i^t before local training) and
      `own_loss` (L_i(theta_i^{t-1})).
    """
    losses = validation_losses(archs, tf.concat([own[tf.newaxis], models], axis=0), val)
    distances = tf.norm(models - own[tf.newaxis, :], axis=1)
    raw, weights = fomo_weights(losses[0], losses[1:], distances, valid)
    return dict(
        raw=raw,
        weights=weights,
        signed=signed_gains(losses[0], losses[1:], distances, valid),
        start=fomo_update(own, models, weights),
        own_loss=losses[0],
    )


def own_candidate_step(archs, own, reference, models, valid, val) -> dict:
    """The authors' reading of client i's step (`fedfomo_own_candidate`): theta_i^{t-1} is a candidate too (TF code).

    The M + 1 models theta_n (theta_i^{t-1} first, then the M others) are
    weighed against r_i, the model client i started its previous local
    training from: w_n = max(0, (L_i(r_i) - L_i(theta_n)) / ||theta_n - r_i||),
    normalised over the M + 1, and theta_i^t = r_i + sum_n w_n (theta_n - r_i)
    (`fomo_update` from r_i; all zero: r_i). The signed gains are normalised
    over the M + 1 too, as the authors' code does.

    Args:
      archs: the `Architectures`.
      own: theta_i^{t-1}, `[D]`.
      reference: r_i, `[D]`.
      models: the others' theta_j, `[M, D]`.
      valid: bool `[M]`.
      val: the client's validation split.

    Returns:
      As `paper_step` (`raw`, `weights`, `signed` of the M others,
      `start`, `own_loss` = L_i(theta_i^{t-1})), and `own_weight` (theta_i^{t-1}'s
      normalised w).
    """
    pool = tf.concat([own[tf.newaxis], models], axis=0)  # [M + 1, D]
    pool_valid = tf.concat([[True], valid], axis=0)
    losses = validation_losses(archs, tf.concat([reference[tf.newaxis], pool], axis=0), val)
    distances = tf.norm(pool - reference[tf.newaxis, :], axis=1)
    raw, weights = fomo_weights(losses[0], losses[1:], distances, pool_valid)
    signed = signed_gains(losses[0], losses[1:], distances, pool_valid)
    return dict(
        raw=raw[1:],
        weights=weights[1:],
        signed=signed[1:],
        start=fomo_update(reference, pool, weights),
        own_loss=losses[1],
        own_weight=weights[0],
    )


def affinity_row(candidates: tf.Tensor, weights: tf.Tensor, num_clients: int) -> tf.Tensor:
    """Client i's row of increments of P: w_ij in column j of each candidate j (TF code).

    Args:
      candidates: int32 `[M]`, -1 for an empty slot.
      weights: `[M]`, zero for an empty slot.
      num_clients: N.

    Returns:
      float32 `[N]`.
    """
    valid = candidates >= 0
    return tf.scatter_nd(
        tf.boolean_mask(candidates, valid)[:, tf.newaxis], tf.boolean_mask(weights, valid), [num_clients]
    )


# Why FedFomo's builder takes no server optimizer or model aggregator (`building_blocks.refuse_unused`).
UNUSED = dict(
    server_optimizer=(
        "FedFomo's server keeps the clients' models and an affinity matrix; each client weighs its candidates "
        'itself, with no optimizer step on one model'
    ),
    model_aggregator="FedFomo's server stores each client's model on its own and averages none",
)

# Why FedFomo takes neither DP nor secure aggregation (completes "fedfomo ...").
NO_PRIVACY = (
    "sends each client's whole model to the server on its own (the server stores it and sends it to other "
    'clients as a candidate), which neither a DP mean nor a secure sum can protect'
)


@builder_inputs.checked
def build_fedfomo_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    settings: FedFomoSettings | None = None,
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
    """Builds FedFomo as a `PersonalizedProcess`.

    Each round: the server chooses M candidates for every client
    epsilon-greedily on P and broadcasts its store of models; client i
    weighs its candidates' models by the first-order rule on its validation
    split, moves theta_i towards them, trains by local SGD, and uploads the
    result with its weights; the server stores the models and adds the
    weights to P.

    Args:
      spec: the partition on disk; every client needs validation examples.
      model_fn: no-arg builder of the clients' model (logits out, no
        non-trainable weights); a Keras model function or a
        `tff.learning.models.FunctionalModel` (`adapters.keras_model_fn`).
      settings: the `FedFomoSettings` (local training; M, epsilon, its decay
        and what P accumulates); None: `FedFomoSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): FedFomo's server keeps the clients' models and
        an affinity matrix, with no optimizer step on one model.
      model_aggregator: not taken (ValueError if given): FedFomo's server stores each client's model on
        its own and averages none.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy). The weights w_ij
        read the validation cross-entropy.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed (the initial model, the same for every client, the
        candidates' draws and the batch orders).
      max_clients_per_round: K, the most clients a round takes (None: N);
        the server gathers the round's K uploaded models, `[K, D]`.

    Returns:
      A `template.PersonalizedProcess` declaring the bytes it exchanges
      (`extras['communication']`). Server state `<models=float32[N, D],
      uploaded=int32[N], affinity=float32[N, N], round_num>` (the store,
      whether each client's model is in it, and P). Client state
      `<client_id, num_participations, last_round, client_index,
      params=float32[D]>` (theta_i, packed; with `fedfomo_own_candidate`
      also `reference=float32[D]`, r_i). Metrics: the local training's,
      and the client means of `candidates` (slots filled), `kept_own_model`
      (1 when every other client's w_ij was zero), `validation_loss` (of
      theta_i^{t-1}) and, with `fedfomo_own_candidate`, `own_weight`
      (theta_i^{t-1}'s normalised w).

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `FedFomoSettings`.
      ValueError: a keyword FedFomo has no use for, or a client without
        validation examples (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = FedFomoSettings() if settings is None else settings
    if not isinstance(settings, FedFomoSettings):
        raise TypeError(f'build_fedfomo_process takes FedFomoSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_fedfomo_process',
        UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    client_data.require_validation(spec, "FedFomo's weights of the candidate models")
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    num_clients = spec.num_clients
    capacity = ktpfl_rounds.round_capacity(max_clients_per_round, num_clients)
    count = max(1, min(settings.fedfomo_candidates, num_clients - 1))  # M, at most N - 1 others
    affinity_kind = settings.fedfomo_affinity
    archs = heterogeneous.Architectures([model_fn])  # one architecture: packs theta_i into one [D] vector
    num_params = archs.max_size
    model_type = tff.TensorType(np.float32, (num_params,))

    own_candidate = settings.fedfomo_own_candidate

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        # Every client starts from the same seeded model theta^0 (and, with the own candidate, r_i = theta^0).
        initial = archs.initial_packed(seed)[0]
        kept = dict(reference=initial) if own_candidate else {}
        return building_blocks.participation_state(
            client_id, client_index=client_data.client_index(client_id), params=initial, **kept
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            models=tf.zeros([num_clients, num_params]),  # no client's model yet
            uploaded=tf.zeros([num_clients], tf.int32),
            affinity=tf.zeros([num_clients, num_clients]),  # P
            round_num=tf.constant(0, tf.int32),
        )

    server_state_type = server_init.type_signature.result

    @tff.tensorflow.computation(server_state_type)
    def offer(state):
        # Every client's candidates from the server's state alone, and the store they index.
        round_num = state['round_num']
        candidates = choose_candidates(
            state['affinity'],
            state['uploaded'] > 0,
            count=count,
            epsilon=settings.epsilon_at(round_num),
            seed=tf.stack([tf.constant(seed, tf.int64), tf.cast(round_num, tf.int64)]),
        )
        return collections.OrderedDict(models=state['models'], candidates=candidates, round_num=round_num)

    offer_type = offer.type_signature.result

    @tff.tensorflow.computation(offer_type, client_state_type)
    def client_update(value, state):
        index, own = state['client_index'], state['params']  # i, theta_i^{t-1}
        candidates = value['candidates'][index]
        valid = candidates >= 0
        models = tf.gather(value['models'], tf.maximum(candidates, 0))  # theta_j, [M, D]
        val = client_data.read_split(spec, state['client_id'], 'val')
        if own_candidate:
            # The authors' reading: theta_i^{t-1} is one more candidate, everything measured from r_i.
            step = own_candidate_step(archs, own, state['reference'], models, valid, val)
        else:
            step = paper_step(archs, own, models, valid, val)
        raw, weights, signed, start = step['raw'], step['weights'], step['signed'], step['start']
        round_num = value['round_num']
        params, _, stats = heterogeneous.train_packed(
            archs,
            tf.constant(0),
            start,
            client_data.read_split(spec, state['client_id'], 'train'),
            training,
            seed=local_training.client_seed(seed, round_num, state['client_id']),
            optimizer=client_optimizer,
            loss_fn=loss_fn,
        )
        metric_sums = building_blocks.training_metric_sums(stats)
        metric_sums['candidates'] = tf.reduce_sum(tf.cast(valid, tf.float32))
        metric_sums['kept_own_model'] = tf.cast(tf.reduce_all(tf.equal(weights, 0.0)), tf.float32)
        metric_sums['validation_loss'] = step['own_loss']
        if own_candidate:
            metric_sums['own_weight'] = step['own_weight']
        added = dict(normalized=weights, raw=raw, signed=signed)
        row = affinity_row(candidates, added[affinity_kind], num_clients)
        kept = dict(reference=start) if own_candidate else {}
        return collections.OrderedDict(
            model=collections.OrderedDict(index=index, value=params),
            affinity=tf.scatter_nd([[index]], row[tf.newaxis], [num_clients, num_clients]),
            metric_sums=metric_sums,
            client_state=building_blocks.participated(state, round_num, params=params, **kept),
        )

    rows_type = ktpfl_rounds.gathered_rows_type(model_type, capacity)
    affinity_type = client_update.type_signature.result['affinity']

    @tff.tensorflow.computation(server_state_type, rows_type, affinity_type)
    def server_update(state, rows, increments):
        valid = rows['ids'] >= 0
        ids = tf.boolean_mask(rows['ids'], valid)[:, tf.newaxis]
        return collections.OrderedDict(
            models=tf.tensor_scatter_nd_update(state['models'], ids, tf.boolean_mask(rows['values'], valid)),
            uploaded=tf.tensor_scatter_nd_update(state['uploaded'], ids, tf.ones_like(ids[:, 0])),
            affinity=state['affinity'] + increments,
            round_num=state['round_num'] + 1,
        )

    zero, accumulate, merge, report = ktpfl_rounds.gather_steps(model_type, capacity)
    initialize = building_blocks.server_initialize(server_init)
    placed_state_type = initialize.type_signature.result

    @tff.federated_computation(placed_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def next_fn(state, client_states):
        value = tff.federated_broadcast(tff.federated_map(offer, state))
        trained = tff.federated_map(client_update, (value, client_states))
        # CLIENTS -> SERVER: each client's theta_i^t with its index (the server's store), its w_ij in its row of
        # P's increments, and the training metric sums.
        models = tff.federated_aggregate(trained.model, zero(), accumulate, merge, report)
        increments = tff.federated_sum(trained.affinity)
        new_state = tff.federated_map(server_update, (state, models, increments))
        metrics = building_blocks.aggregate_training_metrics(trained.metric_sums)
        return template.RoundOutput(new_state, trained.client_state, metrics)

    evaluate_client = heterogeneous.build_personalized_evaluation(
        spec, archs, client_state_type, metrics=local_training.metrics_from(metrics, spec)
    )
    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=building_blocks.build_client_states_evaluation(placed_state_type, evaluate_client),
        device=_device_process(initialize, initial_client_state, offer, client_update, evaluate_client),
        extras={
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=num_params * 4 + count * 4,
                parameter_bytes_down_per_client=count * num_params * 4,
            ),
            'server_state_bytes': (num_clients * (num_params + num_clients + 1) + 1) * 4,  # models, P, uploaded, t
        },
        no_global_model="FedFomo's server keeps no model of its own: each client keeps its own theta_i",
    )


def _device_process(initialize, initial_client_state, offer, client_update, evaluate_client):
    """FedFomo's round with device-held client states: one phase, one broadcast and sums only.

    The server's offer goes to every device as in process; each device
    sends its theta_i^t in its own row of an `[N, D]` sum and a 1 in its
    slot of an `[N]` presence sum (TFF 0.87's DistributeAggregateForm
    conversion fails on the in-process gather's `federated_aggregate`, as
    for FedAMP), with its row of P's increments; the server stores the
    present rows. A slot costs N x D on a device and in the sum. The
    server state is the in-process one, and the rounds equal the
    in-process rounds (tests/test_fedfomo.py).

    Args:
      initialize: the in-process `initialize`.
      initial_client_state: `tf.string -> C`.
      offer: `S -> B`, the round's broadcast.
      client_update: `(B, C) -> <model, affinity, metric_sums, client_state>`.
      evaluate_client: `C -> E`.

    Returns:
      The `device_state.build_device_process` of the phase.
    """
    state_type = initialize.type_signature.result.member
    num_clients, num_params = state_type['models'].shape

    @tff.tensorflow.computation(offer.type_signature.result, initial_client_state.type_signature.result)
    def device_update(value, state):
        out = client_update(value, state)
        index, params = out['model']['index'], out['model']['value']
        return collections.OrderedDict(
            rows=tf.scatter_nd([[index]], params[tf.newaxis], [num_clients, num_params]),
            present=tf.one_hot(index, num_clients, dtype=tf.int32),
            affinity=out['affinity'],
            metric_sums=out['metric_sums'],
            client_state=out['client_state'],
        )

    result_type = device_update.type_signature.result

    @tff.tensorflow.computation(state_type, result_type['rows'], result_type['present'], result_type['affinity'])
    def store(state, rows, present, increments):
        held = present[:, tf.newaxis] > 0
        return collections.OrderedDict(
            models=tf.where(held, rows, state['models']),
            uploaded=tf.maximum(state['uploaded'], present),
            affinity=state['affinity'] + increments,
            round_num=state['round_num'] + 1,
        )

    def finish(state, outputs):
        sums = [tff.federated_sum(outputs[name]) for name in ('rows', 'present', 'affinity')]
        new_state = tff.federated_map(store, (state, *sums))
        return new_state, building_blocks.aggregate_training_metrics(outputs.metric_sums)

    return device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=[device_state.Phase('next', offer, device_update, finish)],
        evaluate_input=building_blocks.build_round_number(state_type),
        evaluate_client=building_blocks.build_evaluation_at(evaluate_client),
    )


def _plots(out, result, process):
    """FedFomo's report plot: the server's affinity matrix P as a heatmap (and CSV).

    Args:
      out: the run's directory.
      result: the finished run (its server state holds `affinity`).
      process: its process (unused).

    Returns:
      `[(title, file)]`.
    """
    del process
    affinity = np.asarray(result.state['affinity'])
    client_plots.plot_client_matrix(
        out,
        'affinity',
        "Affinity P[i, j]: the weights client i gave client j's model, summed over the rounds",
        affinity,
        [client_data.client_id_for(i) for i in range(len(affinity))],
    )
    return [('Affinity of the clients', 'affinity.png')]


ALGORITHMS = (
    algorithm.Algorithm(
        'fedfomo',
        'FedFomo (Zhang et al., 2021): clients weigh candidate models by their first-order validation gain',
        FedFomoSettings,
        algorithm.gathering_builder(build_fedfomo_process),
        client_columns=algorithm.participation_columns,
        plots=_plots,
        privacy=algorithm.Privacy(why_not=NO_PRIVACY),
        family='personalized aggregation',
    ),
)
