"""KD-PDFL: personalized decentralized FL with distillation-based similarity.

E. Jeong, M. Kountouris, "Personalized Decentralized Federated Learning with
Knowledge Distillation" (ICC 2023), §IV and Algorithm 1.

There is no server. Every `exchange_interval` (T_ex) time slots a random
client wakes up as the star node i and draws its reachable neighbours N_i.
In TFF the star's work is the SERVER placement of one exchange and only the
neighbours are CLIENTS:

1. the star's invitation (its neighbours' indices, one slot each) is
   broadcast; each neighbour writes its model into its own slot of a
   fixed-size structure (`federated_sum` of one-hot slots: the star receives
   every neighbour's model individually, not a mean);
2. on a batch of its own training data the star computes its model's outputs
   and every neighbour model's (the "MidGetter": the output layer, or a
   shared hidden layer), and the distances
   d_W(i, j) = (1/n_i) sum_x sum_l (p_il(x) - p_jl(x))^2 (Eq. 3);
3. it updates its private connectivity row (Eq. 2):
   grad h_i = mu_1 d_W,i + mu_2 grad g_i(w_i), eta = 1 / ||grad h_i||
   (`kd_step='norm'`) or 1 / |grad h_ij| per entry ('elementwise'),
   w_ij <- max(0, w_ij - eta grad h_ij) for its neighbours j;
4. its new model is c_i theta_i + (1 - c_i) sum_j (w_ij / sum_k w_ik)
   theta_j, with the confidence c_i = min(|X_i| / c_base, 1 / (|N_i| + 1))
   (Eq. 4), over this exchange's models (`kd_mix='exchange'`) or over the
   latest model it has received from every client, its footprints, kept in
   its own state ('footprints');
5. in the next slot the star sends its new model to those neighbours
   (Algorithm 1, lines 14-17), which adopt it (`broadcast='adopt'`) or ignore
   it (`'keep'`).

In every other slot each client trains locally (`local_work`). Only the
star's own data are read by the star's computation; no data move. The
arithmetic of steps 2-4 is in `processes.kdpdfl_exchange`.

Modes: 'kdpdfl' (the above), 'fedavg' (decentralized FedAvg: the star takes
the plain mean of its own and the received models, W is not used), 'local'
(no exchange; the driver never calls `next`). FedAvg+ is 'fedavg' with
exchanges stopped at a given slot, after which clients fine-tune locally
(the driver's `finetune_from`).

Settings: one class per registered name, each holding exactly what that name
uses (`ServerlessSettings` and its subclasses below); the defaults and their
sources are in docs/algorithms/kdpdfl.md.
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import kdpdfl_exchange as exchange
from tff_pfl import algorithm, client_plots
from tff_pfl import settings as settings_lib
from tff_pfl.computations import builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters, stacked

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = [
    'build_kdpdfl_process',
    'mode_of',
    'KDPDFLSettings',
    'ServerlessFedAvgSettings',
    'ServerlessFedAvgPlusSettings',
    'ServerlessLocalSettings',
]

MODES = ('kdpdfl', 'fedavg', 'local')
BROADCASTS = ('adopt', 'keep')
MIXES = ('exchange', 'footprints')  # what the star mixes (`KDPDFLSettings.kd_mix`)

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class ServerlessSettings(settings_lib.LocalTraining):
    """What every serverless variant uses: the slots of an interval and one slot's local work.

    A slot of local work (Algorithm 1, line 20) is one local-training round of
    the client: exactly `local_steps` SGD steps when `local_steps` is set, else
    `local_epochs` epochs over its training split, with `batch_size` and
    `client_learning_rate`. A client trains in every slot of an interval but
    the two an exchange takes (gather, broadcast) when it is the star or one
    of its neighbours.
    """

    exchange_interval: int = _setting(5, 'T_ex, time slots per exchange interval (--rounds counts intervals).')

    def loop_arguments(self) -> dict:
        """What the run loop takes from these settings (`tff_pfl.program.decentralized.run`).

        Returns:
          `exchange_interval`, `mean_reachable` (`kd_mean_neighbours`, None
          where the mode never draws neighbours) and `finetune_from`
          (`finetune_from_slot` for FedAvg+, else None), as keyword arguments.
        """
        return dict(exchange_interval=self.exchange_interval, mean_reachable=None, finetune_from=None)

    def _checks(self):
        return super()._checks() + [
            (
                self.exchange_interval >= 2,
                f'exchange_interval must be >= 2 (an exchange takes a gather and a broadcast slot), '
                f'got {self.exchange_interval}',
            ),
        ]


@dataclasses.dataclass(frozen=True)
class StarExchangeSettings(ServerlessSettings):
    """The star exchange shared by KD-PDFL and decentralized FedAvg: who is reached, what they do after."""

    kd_mean_neighbours: float = _setting(5.0, 'Mean number of peers a star reaches under Rayleigh fading.')
    kd_max_neighbours: int = _setting(5, "K, the cap on a star's neighbours per exchange (Fig. 4).")
    kd_broadcast: str = _setting(
        'adopt', "What the neighbours do with the star's new model: adopt (Alg. 1, lines 14-17) or keep."
    )

    def loop_arguments(self) -> dict:
        """See `ServerlessSettings.loop_arguments`; `mean_reachable` is `kd_mean_neighbours`.

        Returns:
          The run loop's keyword arguments.
        """
        return {**super().loop_arguments(), 'mean_reachable': self.kd_mean_neighbours}

    def _checks(self):
        return super()._checks() + [
            (self.kd_mean_neighbours > 0, f'kd_mean_neighbours must be > 0, got {self.kd_mean_neighbours}'),
            (self.kd_max_neighbours >= 1, f'kd_max_neighbours must be >= 1, got {self.kd_max_neighbours}'),
            (
                self.kd_broadcast in BROADCASTS,
                f'kd_broadcast must be one of {", ".join(BROADCASTS)}, got {self.kd_broadcast!r}',
            ),
        ]


@dataclasses.dataclass(frozen=True)
class KDPDFLSettings(StarExchangeSettings):
    """KD-PDFL (`kdpdfl`): the star exchange plus the distance-driven weight update (Eqs. 2-4)."""

    kd_mu1: float = _setting(1.0, 'mu_1, the weight of the output distances in Eq. 2.')
    kd_mu2: float = _setting(1.0, 'mu_2, the weight of the collaboration regulariser g in Eq. 2.')
    kd_c_base: float = _setting(100.0, 'c_base, the base confidence of Eq. 4: c_i = min(|X_i| / c_base, 1/(|N_i|+1)).')
    kd_distance_batch: int = _setting(32, "n_i, the star's training examples the distances (Eq. 3) are measured on.")
    kd_distance_layer: int = _setting(
        -1, 'The MidGetter layer: -1 compares softmax outputs, L >= 1 the raw outputs of the first L layers.'
    )
    kd_step: str = _setting(
        'norm',
        'eta of Eq. 2: norm (1 over the L2 norm of grad h_i: a unit-length step) or elementwise (w_ij moves by 1).',
    )
    kd_mix: str = _setting(
        'exchange',
        "What the star mixes: exchange (this exchange's models) or footprints (every client's latest model it holds).",
    )

    def _checks(self):
        return super()._checks() + [
            (self.kd_mu1 >= 0, f'kd_mu1 must be >= 0, got {self.kd_mu1}'),
            (self.kd_mu2 >= 0, f'kd_mu2 must be >= 0, got {self.kd_mu2}'),
            (self.kd_c_base > 0, f'kd_c_base must be > 0, got {self.kd_c_base}'),
            (self.kd_distance_batch >= 1, f'kd_distance_batch must be >= 1, got {self.kd_distance_batch}'),
            (
                self.kd_distance_layer == -1 or self.kd_distance_layer >= 1,
                f'kd_distance_layer must be -1 (the output) or >= 1, got {self.kd_distance_layer}',
            ),
            (
                self.kd_step in exchange.STEPS,
                f'kd_step must be one of {", ".join(exchange.STEPS)}, got {self.kd_step!r}',
            ),
            (self.kd_mix in MIXES, f'kd_mix must be one of {", ".join(MIXES)}, got {self.kd_mix!r}'),
        ]


@dataclasses.dataclass(frozen=True)
class ServerlessFedAvgSettings(StarExchangeSettings):
    """Decentralized FedAvg (`kdpdfl_fedavg`): the star takes the plain mean; no distances, no W."""


@dataclasses.dataclass(frozen=True)
class ServerlessFedAvgPlusSettings(ServerlessFedAvgSettings):
    """FedAvg+ (`kdpdfl_fedavg_plus`): decentralized FedAvg, then local fine-tuning only."""

    finetune_from_slot: int = _setting(
        150, 'FedAvg+: the slot from which exchanges stop and clients only train locally.'
    )

    def loop_arguments(self) -> dict:
        """See `ServerlessSettings.loop_arguments`; `finetune_from` is `finetune_from_slot`.

        Returns:
          The run loop's keyword arguments.
        """
        return {**super().loop_arguments(), 'finetune_from': self.finetune_from_slot}

    def _checks(self):
        return super()._checks() + [
            (self.finetune_from_slot >= 0, f'finetune_from_slot must be >= 0, got {self.finetune_from_slot}'),
        ]


@dataclasses.dataclass(frozen=True)
class ServerlessLocalSettings(ServerlessSettings):
    """Local learning in the serverless loop (`kdpdfl_local`): every slot is local work, no exchange."""


# The settings each mode of the builder takes.
MODE_SETTINGS = {'kdpdfl': KDPDFLSettings, 'fedavg': ServerlessFedAvgSettings, 'local': ServerlessLocalSettings}


def mode_of(settings: ServerlessSettings) -> str:
    """The mode a settings object selects (its type is the variant).

    Args:
      settings: a `KDPDFLSettings`, `ServerlessFedAvgSettings` (or its FedAvg+
        subclass) or `ServerlessLocalSettings`.

    Returns:
      'kdpdfl', 'fedavg' or 'local'.

    Raises:
      TypeError: for settings of none of these types.
    """
    for mode, cls in MODE_SETTINGS.items():
        if isinstance(settings, cls):
            return mode
    names = ', '.join(cls.__name__ for cls in MODE_SETTINGS.values())
    raise TypeError(f'build_kdpdfl_process takes {names}, got {type(settings).__name__}')


def draw_neighbours(
    rng: np.random.Generator,
    num_clients: int,
    star: int,
    *,
    mean_reachable: float,
    max_neighbours: int | None = None,
) -> list[int]:
    """The star's reachable neighbours under Rayleigh fading (numpy, driver side).

    Each link's power gain |h|^2 is Exp(1) (Rayleigh amplitude); a peer is
    reachable when its gain exceeds the threshold tau = ln((M - 1) /
    mean_reachable), so that mean_reachable peers are reachable on average
    (the paper: about 5). With more than `max_neighbours` reachable, the
    strongest links are kept (Fig. 4's cap).

    Args:
      rng: the driver's NumPy generator (draws the link gains).
      num_clients: M, the number of clients.
      star: the star's client index.
      mean_reachable: the expected number of reachable peers
        (`kd_mean_neighbours`).
      max_neighbours: optional cap on the number of neighbours.

    Returns:
      Sorted client indices, possibly empty.
    """
    peers = np.array([j for j in range(num_clients) if j != star])
    if peers.size == 0:
        return []
    gains = rng.exponential(1.0, size=peers.size)
    threshold = np.log(max(peers.size / mean_reachable, 1.0))
    reachable = np.flatnonzero(gains > threshold)
    if max_neighbours is not None and reachable.size > max_neighbours:
        reachable = reachable[np.argsort(-gains[reachable], kind='stable')[:max_neighbours]]
    return sorted(int(j) for j in peers[reachable])


@builder_inputs.checked
def build_kdpdfl_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    settings: ServerlessSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.ServerlessProcess:
    """Builds KD-PDFL (or decentralized FedAvg, or local learning) as a `ServerlessProcess`.

    `next` is one exchange: `(<star, neighbours, exchange_num>@SERVER,
    {neighbour states}@CLIENTS) -> <same@SERVER, {neighbour states}@CLIENTS,
    metrics@SERVER>`. The driver (`tff_pfl.program.decentralized`) puts the
    star's client state and its neighbours' indices into the SERVER value and
    writes the star's new state back. `process.local_work: ({C}@CLIENTS,
    {slots: int32}@CLIENTS, slot_num@SERVER) -> <{C}@CLIENTS, metrics@SERVER>`
    trains each client for its number of local slots; its metrics count the
    clients that trained (`num_clients`), their SGD steps per slot
    (`mean_local_steps`, exactly `local_steps` when it is set) and their slots
    (`mean_local_slots`).

    Args:
      spec: the partition on disk.
      model_fn: no-arg builder of every client's model (a Sequential model
        `models.stacked` supports).
      settings: its type is the mode (`mode_of`): `KDPDFLSettings` 'kdpdfl'
        (Eqs. 2-4), `ServerlessFedAvgSettings` or its FedAvg+ subclass
        'fedavg' (the star takes the plain mean of its own and the received
        models), `ServerlessLocalSettings` 'local' (no exchange: `next`
        changes nothing and the driver never calls it); None:
        `KDPDFLSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): KD-PDFL is serverless: there is no server
        step.
      model_aggregator: not taken (ValueError if given): KD-PDFL is serverless: each star node
        weighs its neighbours itself.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed (initial model, batch orders, distance batches).

    Returns:
      A `template.ServerlessProcess` (`local_work`, `mode`, `max_neighbours`:
      K, the slots of `next`; 1 in 'local' mode).

    Raises:
      SettingsError: a setting out of range (one line).
      TypeError: settings of no serverless mode.
      ValueError: a `kd_distance_layer` the model does not have.
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = KDPDFLSettings() if settings is None else settings
    mode = mode_of(settings)
    settings.validate()
    building_blocks.refuse_unused(
        'build_kdpdfl_process',
        dict(
            server_optimizer='KD-PDFL is serverless: there is no server step',
            model_aggregator='KD-PDFL is serverless: each star node weighs its neighbours itself',
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    local_config = settings.training_config()  # one slot of local work
    exchanging = mode != 'local'
    max_neighbours = settings.kd_max_neighbours if exchanging else 1
    adopt = exchanging and settings.kd_broadcast == 'adopt'
    num_clients = spec.num_clients
    weights_type = model_weights.weights_type(model_fn)
    footprints = mode == 'kdpdfl' and settings.kd_mix == 'footprints'
    if mode == 'kdpdfl':
        mu1, mu2, c_base, step = settings.kd_mu1, settings.kd_mu2, settings.kd_c_base, settings.kd_step
        distance_batch, distance_layer = settings.kd_distance_batch, settings.kd_distance_layer
        with tf.Graph().as_default():
            model = model_fn()
            try:
                layers = stacked.plan(model)
            except ValueError as e:
                raise ValueError(
                    f"model_fn: KD-PDFL's logit distances run the neighbours' models stacked and cannot run "
                    f'{model.name!r} ({e})'
                ) from None
        if distance_layer != -1 and not 1 <= distance_layer <= len(layers):
            raise ValueError(
                f'kd_distance_layer={distance_layer} is not a layer of the model: it has {len(layers)} layers '
                f'(use -1 for the output or 1..{len(layers)})'
            )
        mid_layers = layers if distance_layer == -1 else layers[:distance_layer]
        mid_weights = sum(layer.num_weights for layer in mid_layers)
    slot_models_type = tff.to_type([tff.TensorType(t.dtype, (max_neighbours,) + tuple(t.shape)) for t in weights_type])

    def fresh_state(client_id):
        index = client_data.client_index(client_id)
        initial = model_weights.initial_weights(model_fn, seed)  # every client starts from the same model
        row = tf.where(tf.equal(tf.range(num_clients), index), 0.0, 1.0 / num_clients)  # w_ii = 0, w_ij = 1/M
        kept = {}
        if footprints:  # the latest model received from each client (none yet): M models per client
            kept['footprints'] = [tf.zeros([num_clients] + list(w.shape), w.dtype) for w in initial]
            kept['footprints_held'] = tf.zeros([num_clients])
        return building_blocks.participation_state(
            client_id, client_index=index, model=initial, connectivity=row, confidence=tf.constant(0.0), **kept
        )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return fresh_state(client_id)

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        # Until the driver's first exchange the star slot holds client 0's initial state.
        return collections.OrderedDict(
            star=fresh_state(tf.constant(spec.client_ids[0])),
            neighbours=tf.fill([max_neighbours], -1),
            exchange_num=tf.constant(0, tf.int32),
        )

    @tff.federated_computation
    def initialize():
        return tff.federated_eval(server_init, tff.SERVER)

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(server_state_type.member['neighbours'], client_state_type)
    def upload(invitation, state):
        """A neighbour's model into its slot (the star invited it by index)."""
        # Invited indices are distinct (padding is -1), so the match is a one-hot slot.
        slot = tf.cast(tf.equal(invitation, state['client_index']), tf.float32)
        return collections.OrderedDict(
            models=[tf.reshape(slot, [max_neighbours] + [1] * len(w.shape)) * w[tf.newaxis] for w in state['model']],
            present=slot,
        )

    def outputs(weights, x):
        """The MidGetter: [G, n, L] outputs of G stacked models (sequences: positions x classes flattened)."""
        out = stacked.forward(mid_layers, list(weights)[:mid_weights], x)
        if distance_layer == -1:
            out = tf.nn.softmax(out, axis=-1)  # a distribution per example (per position of a sequence)
        return tf.reshape(out, tf.concat([tf.shape(out)[:2], [-1]], axis=0))

    def weigh_neighbours(star, own, theirs, neighbour_ids, present, num_neighbours, exchange_num):
        """KD-PDFL's star: distances on its own batch (Eq. 3), its row of W (Eq. 2), the mix (Eq. 4, step 5).

        Returns the new model, row, confidence, mean distance and the star's
        new footprints (`{}` unless `kd_mix='footprints'`).
        """
        train = client_data.read_split(spec, star['client_id'], 'train')  # the star's own data only
        order = local_training.epoch_permutations(
            local_training.client_seed(seed, exchange_num, star['client_id'], salt=7), 1, train.num_examples
        )[0]
        x, _ = train.gather(order[:distance_batch])
        own_out = outputs([w[tf.newaxis] for w in own], x)[0]
        distances = exchange.output_distances(own_out, outputs(theirs, x)) * present
        c = exchange.confidence(train.num_examples, num_neighbours, c_base)
        row = exchange.connectivity_update(
            star['connectivity'], neighbour_ids, present, distances, mu1=mu1, mu2=mu2, step=step
        )
        mean_distance = tf.reduce_sum(distances) / tf.maximum(num_neighbours, 1.0)
        if not footprints:  # this exchange's models only
            weights = tf.gather(row, tf.where(present > 0, neighbour_ids, 0)) * present
            return exchange.star_mix(own, theirs, weights, c), row, c, mean_distance, {}
        kept, held = exchange.keep_footprints(
            list(star['footprints']), star['footprints_held'], theirs, neighbour_ids, present
        )
        mixed = exchange.star_mix(own, kept, row * held, c)  # w_ii = 0 and the star holds no footprint of itself
        return mixed, row, c, mean_distance, dict(footprints=kept, footprints_held=held)

    @tff.tensorflow.computation(
        server_state_type.member, slot_models_type, tff.TensorType(np.float32, (max_neighbours,))
    )
    def star_update(server_state, slot_models, present):
        star = server_state['star']
        own = list(star['model'])
        theirs = list(slot_models)
        neighbour_ids = server_state['neighbours']
        num_neighbours = tf.reduce_sum(present)
        row = star['connectivity']
        metrics = collections.OrderedDict(num_neighbours=num_neighbours)
        kept = {}
        if mode == 'kdpdfl':
            mixed, row, c, mean_distance, kept = weigh_neighbours(
                star, own, theirs, neighbour_ids, present, num_neighbours, server_state['exchange_num']
            )
            metrics['mean_distance'] = mean_distance
            if footprints:  # the clients whose latest model the star holds
                metrics['num_footprints'] = tf.reduce_sum(kept['footprints_held'])
        elif mode == 'fedavg':  # decentralized FedAvg: the plain mean of the star's and the received models
            c = 1.0 / (num_neighbours + 1.0)
            mixed = exchange.star_mix(own, theirs, present, c)
        else:  # local learning: an exchange changes nothing
            c = tf.constant(1.0)
            mixed = own
        metrics['confidence'] = c  # the star's own share in its new model
        new_star = building_blocks.participated(
            star, server_state['exchange_num'], model=mixed, connectivity=row, confidence=c, **kept
        )
        new_state = collections.OrderedDict(
            star=new_star, neighbours=neighbour_ids, exchange_num=server_state['exchange_num'] + 1
        )
        return new_state, metrics

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def receive(star_model, exchange_num, state):
        """Lines 14-17: a neighbour receives the star's new model."""
        model = star_model if adopt else state['model']
        return building_blocks.participated(state, exchange_num, model=model)

    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(server_state, neighbour_states):
        invitation = tff.federated_broadcast(server_state.neighbours)
        uploaded = tff.federated_map(upload, (invitation, neighbour_states))
        slot_models = tff.federated_sum(uploaded.models)  # one slot per neighbour, not a mean
        present = tff.federated_sum(uploaded.present)
        updated = tff.federated_map(star_update, (server_state, slot_models, present))
        new_state = updated[0]
        star_model = tff.federated_broadcast(new_state.star.model)
        exchange_num = tff.federated_broadcast(server_state.exchange_num)
        received = tff.federated_map(receive, (star_model, exchange_num, neighbour_states))
        return template.RoundOutput(new_state, received, updated[1])

    @tff.tensorflow.computation(client_state_type, np.int32, np.int32)
    def local_client_work(state, slots, slot_num):
        """`slots` slots of local work: `slots` times one slot's steps (or epochs), in one pass."""
        train = client_data.read_split(spec, state['client_id'], 'train')
        model = model_fn()
        with tf.control_dependencies(model_weights.fresh_weights(model, state['model'])):
            stats = local_training.train(
                model,
                train,
                epochs=slots * local_config.epochs,
                batch_size=local_config.batch_size,
                learning_rate=local_config.learning_rate,
                seed=local_training.client_seed(seed, slot_num, state['client_id'], salt=8),
                max_steps=None if local_config.max_steps is None else slots * local_config.max_steps,
                optimizer=client_optimizer,
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            new_state = collections.OrderedDict((k, state[k]) for k in state)
            new_state['model'] = model_weights.get_weights(model)
        slot_count = tf.cast(slots, tf.float32)
        sums = building_blocks.training_metric_sums(stats)
        sums['num_clients'] = tf.cast(slots > 0, tf.float32)  # the clients that trained this interval
        sums['local_steps'] = stats.num_steps / tf.maximum(slot_count, 1.0)  # SGD steps per slot
        sums['local_slots'] = slot_count
        return new_state, sums

    @tff.federated_computation(
        client_states_type, tff.FederatedType(np.int32, tff.CLIENTS), tff.FederatedType(np.int32, tff.SERVER)
    )
    def local_work(client_states, slots, slot_num):
        trained = tff.federated_map(local_client_work, (client_states, slots, tff.federated_broadcast(slot_num)))
        return trained[0], building_blocks.aggregate_training_metrics(trained[1])

    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(client_state_type)
    def evaluate_client(state):
        return collections.OrderedDict(personalized_model=client_evaluation(state['model'], state['client_id']))

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(server_state, client_states):
        del server_state
        return tff.federated_map(evaluate_client, client_states)

    return template.ServerlessProcess(
        initialize,
        next_fn,
        local_work=local_work,
        mode=mode,
        max_neighbours=max_neighbours,
        draw_neighbours=draw_neighbours,
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        no_global_model='KD-PDFL is serverless: each client keeps its own model and there is no global one',
    )


def _build(settings, spec, model_fn, run):
    return build_kdpdfl_process(spec, model_fn, settings, seed=run.seed)


def _columns(state):
    return collections.OrderedDict(
        num_exchanges=int(state['num_participations']), confidence=float(state['confidence'])
    )


def _plots(out, result, process):
    del process
    graph = np.stack([np.asarray(s['connectivity']) for s in result.client_states.values()])
    client_plots.plot_client_matrix(
        out,
        'collaboration_graph',
        "Collaboration weights w[i, j] (row i: client i's private vector)",
        graph,
        list(result.client_states),
    )
    return [('Collaboration graph W', 'collaboration_graph.png')]


# Why the serverless family has no device form (no worker split, no MapReduceForm).
NOT_ONE_AGGREGATION = (
    "it is serverless: each exchange gathers every neighbour's own model at the star (one slot per "
    "neighbour) and sends the star's new model back for a second client stage, and its own run loop "
    "samples the star and its neighbours per time slot; a device form of two phases, like KT-pFL's, "
    'is not built'
)


def _declare(name, title, settings_cls, plots=None, family='decentralized'):
    """A KD-PDFL-family entry: its settings (whose type is the exchange mode), run by the serverless loop."""
    return algorithm.Algorithm(
        name,
        title,
        settings_cls,
        _build,
        _columns,
        plots,
        serverless=True,
        not_one_aggregation=NOT_ONE_AGGREGATION,
        family=family,
    )


ALGORITHMS = (
    _declare(
        'kdpdfl',
        'KD-PDFL (Jeong & Kountouris, 2023): serverless, star nodes weigh neighbours by logit distances',
        KDPDFLSettings,
        _plots,
    ),
    _declare(
        'kdpdfl_fedavg', 'Serverless FedAvg over the same star exchanges (KD-PDFL baseline)', ServerlessFedAvgSettings
    ),
    _declare(
        'kdpdfl_fedavg_plus',
        'Serverless FedAvg, then local fine-tuning from a slot on (KD-PDFL baseline)',
        ServerlessFedAvgPlusSettings,
    ),
    _declare(
        'kdpdfl_local',
        'Local learning in the serverless loop (KD-PDFL baseline)',
        ServerlessLocalSettings,
        family='local',
    ),
)
