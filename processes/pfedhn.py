"""pFedHN: a server-side hypernetwork that writes each client's personalized model.

A. Shamsian, A. Navon, E. Fetaya, G. Chechik, "Personalized Federated Learning
using Hypernetworks" (ICML 2021), Algorithm 1.

The server holds a hypernetwork h(v_i; phi): a learned embedding v_i per
client and an MLP whose output heads produce every weight tensor of the
client's target model (`pfedhn_network.HyperNetwork`). Client i's
personalized model is theta_i = h(v_i; phi). A round, for the sampled clients:

1. the server generates theta_i = h(v_i; phi) and sends it to client i;
2. client i runs K local SGD steps from theta_i on its training data
   (theta_i_tilde) and sends back delta theta_i = theta_i_tilde - theta_i;
3. the server steps phi <- phi - alpha (grad_phi theta_i)^T delta theta_i and
   v_i <- v_i - alpha (grad_{v_i} theta_i)^T delta theta_i: a step of the
   hypernetwork's optimizer along the vector-Jacobian product of h with
   -delta theta_i as the output gradient, averaged over the round's clients.

In TFF (`build_pfedhn_process`): each client of the round sends a 1 in its
slot of an `[N]` presence sum; the server generates the round's K models as
rows and broadcasts them; each client trains from its own row and sends its
delta with its index; the server keeps the K deltas as rows
(`ktpfl_rounds.gather_steps`) and takes the step. Only the presence slots,
the deltas and the training metrics cross from the clients to the server.

Settings: `PFedHNSettings` (docs/algorithms/pfedhn.md, "Settings").
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import ktpfl_rounds, pfedhn_network
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import builder_inputs, building_blocks, heterogeneous, local_training, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_pfedhn_process', 'PFedHNSettings']

_setting = settings_lib.setting

LAYOUTS = ('auto', *pfedhn_network.LAYOUTS)
OPTIMIZERS = ('sgd', 'sgdm', 'adam')
EVALUATIONS = ('generated', 'tuned')
# Under `pfedhn_layout='auto'`, the dense heads are used while they hold at most this many parameters (64 MiB).
DENSE_LIMIT = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class PFedHNSettings(settings_lib.ClientSGD):
    """pFedHN (`pfedhn`): a hypernetwork at the server writes each client's model; clients send their deltas.

    The paper's defaults where it gives them (3 hidden layers of 100, an
    embedding of 1 + N / 4, 50 local steps, batch 64); the rest are the
    project's, measured on the learning gate (docs/algorithms/pfedhn.md,
    "Settings").
    """

    batch_size: int = _setting(64, settings_lib.help_of(settings_lib.ClientSGD.__dataclass_fields__['batch_size']))
    client_learning_rate: float = _setting(
        0.05, settings_lib.help_of(settings_lib.ClientSGD.__dataclass_fields__['client_learning_rate'])
    )
    pfedhn_local_steps: int = _setting(50, 'K, the local SGD steps each client takes from theta_i = h(v_i) a round.')
    pfedhn_embedding_dim: int = _setting(0, "The size of each client embedding v_i (0: the paper's 1 + N / 4).")
    pfedhn_hidden_units: int = _setting(100, "The width of the hypernetwork's MLP.")
    pfedhn_hidden_layers: int = _setting(3, "The hidden layers of the hypernetwork's MLP (linear, then ReLU).")
    pfedhn_layout: str = _setting(
        'auto',
        "The hypernetwork's output heads: 'dense' (one head per weight tensor, hidden x D weights), 'chunked' "
        "(one head of pfedhn_chunk_size outputs shared by learned chunk embeddings), or 'auto' (dense while its "
        'heads hold at most 16 Mi parameters, else chunked).',
    )
    pfedhn_chunk_size: int = _setting(10_000, 'C, the parameters one chunk of the chunked layout writes.')
    pfedhn_chunk_embedding_dim: int = _setting(8, 'The size of each chunk embedding of the chunked layout.')
    pfedhn_optimizer: str = _setting(
        'adam', "The hypernetwork's optimizer: 'sgd', 'sgdm' (momentum 0.9, the paper's) or 'adam'."
    )
    pfedhn_learning_rate: float = _setting(
        0.001, "alpha, the hypernetwork optimizer's learning rate (phi and the embeddings v_i)."
    )
    pfedhn_evaluate: str = _setting(
        'generated',
        "The personalized model evaluated: 'generated' (h(v_i), the paper's) or 'tuned' (h(v_i) after the K local "
        'steps on the training split).',
    )

    def _checks(self):
        return super()._checks() + [
            (self.pfedhn_local_steps >= 1, f'pfedhn_local_steps must be >= 1, got {self.pfedhn_local_steps}'),
            (self.pfedhn_embedding_dim >= 0, f'pfedhn_embedding_dim must be >= 0, got {self.pfedhn_embedding_dim}'),
            (self.pfedhn_hidden_units >= 1, f'pfedhn_hidden_units must be >= 1, got {self.pfedhn_hidden_units}'),
            (self.pfedhn_hidden_layers >= 1, f'pfedhn_hidden_layers must be >= 1, got {self.pfedhn_hidden_layers}'),
            (
                self.pfedhn_layout in LAYOUTS,
                f'pfedhn_layout must be one of {", ".join(LAYOUTS)}, got {self.pfedhn_layout!r}',
            ),
            (self.pfedhn_chunk_size >= 1, f'pfedhn_chunk_size must be >= 1, got {self.pfedhn_chunk_size}'),
            (
                self.pfedhn_chunk_embedding_dim >= 1,
                f'pfedhn_chunk_embedding_dim must be >= 1, got {self.pfedhn_chunk_embedding_dim}',
            ),
            (
                self.pfedhn_optimizer in OPTIMIZERS,
                f'pfedhn_optimizer must be one of {", ".join(OPTIMIZERS)}, got {self.pfedhn_optimizer!r}',
            ),
            (self.pfedhn_learning_rate > 0, f'pfedhn_learning_rate must be > 0, got {self.pfedhn_learning_rate}'),
            (
                self.pfedhn_evaluate in EVALUATIONS,
                f'pfedhn_evaluate must be one of {", ".join(EVALUATIONS)}, got {self.pfedhn_evaluate!r}',
            ),
        ]

    def training_config(self) -> settings_lib.TrainingConfig:
        """The K local steps as a `TrainingConfig`.

        Returns:
          As many epochs as needed, capped at `pfedhn_local_steps` SGD steps, of batch
          `batch_size` at `client_learning_rate`.
        """
        steps = self.pfedhn_local_steps
        return settings_lib.TrainingConfig(steps, self.batch_size, self.client_learning_rate, max_steps=steps)

    def embedding_dim(self, num_clients: int) -> int:
        """The size of v_i.

        Args:
          num_clients: N.

        Returns:
          `pfedhn_embedding_dim`, or the paper's 1 + N / 4 when it is 0.
        """
        return self.pfedhn_embedding_dim or pfedhn_network.default_embedding_dim(num_clients)

    def sizes(self, shapes, num_clients: int) -> collections.OrderedDict:
        """|phi| of the dense and the chunked layout.

        Args:
          shapes: the target model's weight shapes.
          num_clients: N.

        Returns:
          `pfedhn_network.sizes` of both layouts, in parameters.
        """
        return pfedhn_network.sizes(
            shapes,
            num_clients,
            embedding_dim=self.embedding_dim(num_clients),
            hidden_units=self.pfedhn_hidden_units,
            hidden_layers=self.pfedhn_hidden_layers,
            chunk_size=self.pfedhn_chunk_size,
            chunk_embedding_dim=self.pfedhn_chunk_embedding_dim,
        )

    def layout(self, shapes) -> str:
        """The layout used for a target.

        Args:
          shapes: the target model's weight shapes.

        Returns:
          `pfedhn_layout`, or under 'auto' 'dense' while its heads hold <= `DENSE_LIMIT` parameters,
          else 'chunked'.
        """
        if self.pfedhn_layout != 'auto':
            return self.pfedhn_layout
        num_params = sum(int(np.prod(s)) for s in shapes)
        return 'dense' if (self.pfedhn_hidden_units + 1) * num_params <= DENSE_LIMIT else 'chunked'

    def server_optimizer(self) -> tff.learning.optimizers.Optimizer:
        """The hypernetwork's optimizer.

        Returns:
          A `tff.learning.optimizers.Optimizer` (`pfedhn_optimizer`) at `pfedhn_learning_rate`.
        """
        rate = self.pfedhn_learning_rate
        if self.pfedhn_optimizer == 'adam':
            return tff.learning.optimizers.build_adam(learning_rate=rate)
        return tff.learning.optimizers.build_sgdm(
            learning_rate=rate, momentum=0.9 if self.pfedhn_optimizer == 'sgdm' else None
        )

    def hypernetwork(self, shapes, num_clients: int, seed: int) -> pfedhn_network.HyperNetwork:
        """The hypernetwork of these settings.

        Args:
          shapes: the target model's weight shapes.
          num_clients: N.
          seed: the seed of phi's initialisation.

        Returns:
          A `pfedhn_network.HyperNetwork`.
        """
        return pfedhn_network.HyperNetwork(
            shapes,
            num_clients,
            embedding_dim=self.embedding_dim(num_clients),
            hidden_units=self.pfedhn_hidden_units,
            hidden_layers=self.pfedhn_hidden_layers,
            layout=self.layout(shapes),
            chunk_size=self.pfedhn_chunk_size,
            chunk_embedding_dim=self.pfedhn_chunk_embedding_dim,
            seed=seed,
        )


UNUSED = dict(
    model_aggregator=(
        "pFedHN's server needs each client's delta on its own (the Jacobian of h differs per client's embedding), "
        'not their mean'
    ),
)

# Completes "pfedhn ..." (the run's refusal of DP and secure aggregation).
NO_PRIVACY = (
    "sends each client's whole model delta to the server on its own (the server's step multiplies each by its own "
    "client's Jacobian), which neither a DP mean nor a secure sum can protect"
)

NOT_ONE_AGGREGATION = (
    "the server generates the round's models only after it learns which clients take part (a presence sum), so "
    'its broadcast depends on an aggregate; a device form is not built'
)


def _presence_ids(present: tf.Tensor, capacity: int) -> tf.Tensor:
    """int32 `[K]`: the indices with a nonzero presence, increasing, then -1s (TF code)."""
    ids = tf.cast(tf.where(present > 0)[:, 0], tf.int32)
    fits = tf.debugging.assert_less_equal(tf.size(ids), capacity, message='more clients in the round than its capacity')
    with tf.control_dependencies([fits]):
        ids = tf.pad(ids, [[0, capacity - tf.size(ids)]], constant_values=-1)
    return tf.ensure_shape(ids, [capacity])


@builder_inputs.checked
def build_pfedhn_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    settings: PFedHNSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator=None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
    max_clients_per_round: int | None = None,
) -> template.PersonalizedProcess:
    """Builds pFedHN as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: the target model, a no-arg Keras model function or a
        `tff.learning.models.FunctionalModel` (`adapters.keras_model_fn`);
        every trainable weight tensor is written by the hypernetwork (a model
        with non-trainable weights is refused).
      settings: the `PFedHNSettings` (K local steps, batch size and
        learning rate; the hypernetwork's size, layout and optimizer; the
        evaluated model); None: `PFedHNSettings()`.
      client_optimizer: the clients' optimizer for the K local steps, a
        `tff.learning.optimizers.Optimizer` started fresh each round; None:
        SGD at `settings.client_learning_rate`.
      server_optimizer: the hypernetwork's optimizer (phi and the
        embeddings); None: `settings.server_optimizer()`.
      model_aggregator: not taken (ValueError if given): the server needs
        each client's delta on its own.
      loss: the clients' training loss (`local_training.loss_from`; None:
        cross-entropy).
      metrics: extra per-client test metrics (`local_training.metrics_from`).
      seed: run seed (phi's initial values and the batch orders).
      max_clients_per_round: K, the most clients a round takes (None: N);
        the server holds the round's K models and K deltas, `[K, D]` each.

    Returns:
      A `template.PersonalizedProcess`. Server state `<hypernetwork=<embeddings
      [N, E], mlp, heads>, optimizer_state, round_num>`; client state
      `<client_id, num_participations, last_round, client_index>`. Metrics:
      the local training's, `mean_delta_norm` (||delta theta_i||) and
      `gradient_norm` (of the step's VJP). `extras['hypernetwork']` reports
      the layout used and |phi| in parameters and bytes for both layouts.

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `PFedHNSettings`.
      ValueError: a keyword pFedHN has no use for (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = PFedHNSettings() if settings is None else settings
    if not isinstance(settings, PFedHNSettings):
        raise TypeError(f'build_pfedhn_process takes PFedHNSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_pfedhn_process',
        UNUSED,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    training = settings.training_config()
    num_clients = spec.num_clients
    capacity = ktpfl_rounds.round_capacity(max_clients_per_round, num_clients)
    archs = heterogeneous.Architectures([model_fn])  # the target: theta_i packed into one [D] vector
    shapes = archs.shapes[0]
    hyper = settings.hypernetwork(shapes, num_clients, seed)
    optimizer = server_optimizer or settings.server_optimizer()
    tuned = settings.pfedhn_evaluate == 'tuned'
    model_type = tff.TensorType(np.float32, (archs.max_size,))
    rows_type = ktpfl_rounds.gathered_rows_type(model_type, capacity)

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id, client_index=client_data.client_index(client_id))

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def initial_hypernetwork():
        return hyper.initial()

    phi_type = initial_hypernetwork.type_signature.result
    phi_specs = tff.types.type_to_tf_tensor_specs(phi_type)

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            hypernetwork=hyper.initial(),
            optimizer_state=optimizer.initialize(phi_specs),
            round_num=tf.constant(0, tf.int32),
        )

    server_state_type = server_init.type_signature.result

    @tff.tensorflow.computation(client_state_type)
    def presence(state):
        # A 1 in the client's slot: the server learns who takes part, and nothing else.
        return tf.one_hot(state['client_index'], num_clients)

    present_type = presence.type_signature.result

    def generated_rows(count):
        @tff.tensorflow.computation(server_state_type, present_type)
        def generate(state, present):
            ids = _presence_ids(present, count)
            theta = hyper.generate(state['hypernetwork'], tf.maximum(ids, 0))  # theta_i = h(v_i; phi)
            theta = theta * tf.cast(ids >= 0, tf.float32)[:, tf.newaxis]
            return collections.OrderedDict(
                models=collections.OrderedDict(ids=ids, values=theta), round_num=state['round_num']
            )

        return generate

    generate_round = generated_rows(capacity)
    sent_type = generate_round.type_signature.result

    @tff.tensorflow.computation(sent_type, client_state_type)
    def client_update(sent, state):
        theta = ktpfl_rounds.own_row(sent['models'], state['client_index'])
        round_num = sent['round_num']
        params, _, stats = heterogeneous.train_packed(
            archs,
            tf.constant(0),
            theta,
            client_data.read_split(spec, state['client_id'], 'train'),
            training,
            seed=local_training.client_seed(seed, round_num, state['client_id']),
            optimizer=client_optimizer,
            loss_fn=loss_fn,
        )
        delta = params - theta  # delta theta_i = theta_i_tilde - theta_i
        metric_sums = building_blocks.training_metric_sums(stats)
        metric_sums['delta_norm'] = tf.norm(delta)
        return collections.OrderedDict(
            upload=collections.OrderedDict(index=state['client_index'], value=delta),
            metric_sums=metric_sums,
            client_state=building_blocks.participated(state, round_num),
        )

    @tff.tensorflow.computation(server_state_type, rows_type)
    def server_update(state, deltas):
        phi = state['hypernetwork']
        gradient = hyper.gradient(phi, deltas['ids'], deltas['values'])
        optimizer_state, phi = optimizer.next(state['optimizer_state'], phi, gradient)
        norm = tf.linalg.global_norm(tf.nest.flatten(gradient))
        new_state = collections.OrderedDict(
            hypernetwork=phi, optimizer_state=optimizer_state, round_num=state['round_num'] + 1
        )
        return collections.OrderedDict(state=new_state, metrics=collections.OrderedDict(gradient_norm=norm))

    zero, accumulate, merge, report = ktpfl_rounds.gather_steps(model_type, capacity)
    initialize = building_blocks.server_initialize(server_init)
    placed_state_type = initialize.type_signature.result

    @tff.federated_computation(placed_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def next_fn(state, client_states):
        # CLIENTS -> SERVER (1): who takes part, as presence slots.
        present = tff.federated_sum(tff.federated_map(presence, client_states))
        sent = tff.federated_broadcast(tff.federated_map(generate_round, (state, present)))
        trained = tff.federated_map(client_update, (sent, client_states))
        # CLIENTS -> SERVER (2): each client's delta theta_i with its index, kept as the round's K rows.
        deltas = tff.federated_aggregate(trained.upload, zero(), accumulate, merge, report)
        updated = tff.federated_map(server_update, (state, deltas))
        metrics = building_blocks.with_server_metrics(
            building_blocks.aggregate_training_metrics(trained.metric_sums), updated.metrics
        )
        return template.RoundOutput(updated.state, trained.client_state, metrics)

    evaluation_metrics = local_training.metrics_from(metrics, spec)
    generate_all = generated_rows(num_clients)

    @tff.tensorflow.computation(generate_all.type_signature.result, client_state_type)
    def evaluate_client(sent, state):
        theta = ktpfl_rounds.own_row(sent['models'], state['client_index'])
        if tuned:
            theta, _, _ = heterogeneous.train_packed(
                archs,
                tf.constant(0),
                theta,
                client_data.read_split(spec, state['client_id'], 'train'),
                training,
                seed=local_training.client_seed(seed, sent['round_num'], state['client_id'], salt=1),
                optimizer=client_optimizer,
                loss_fn=loss_fn,
            )
        data = client_data.read_split(spec, state['client_id'], spec.evaluation_split)
        return collections.OrderedDict(
            personalized_model=heterogeneous.evaluate_packed(archs, tf.constant(0), theta, data, evaluation_metrics)
        )

    @tff.federated_computation(placed_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def evaluate(state, client_states):
        present = tff.federated_sum(tff.federated_map(presence, client_states))
        sent = tff.federated_broadcast(tff.federated_map(generate_all, (state, present)))
        return tff.federated_map(evaluate_client, (sent, client_states))

    sizes = settings.sizes(shapes, num_clients)
    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        extras={
            'hypernetwork': collections.OrderedDict(
                layout=hyper.layout,
                parameters=hyper.parameter_count(),
                dense_parameters=sizes['dense'],
                chunked_parameters=sizes['chunked'],
                dense_bytes=4 * sizes['dense'],
                chunked_bytes=4 * sizes['chunked'],
                target_parameters=hyper.num_params,
            ),
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=4 * hyper.num_params,
                parameter_bytes_down_per_client=4 * hyper.num_params * capacity,
            ),
        },
        no_global_model="pFedHN's server keeps a hypernetwork, not one model: theta_i = h(v_i; phi) per client",
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'pfedhn',
        "pFedHN (Shamsian et al., 2021): a server hypernetwork writes each client's model from its embedding",
        PFedHNSettings,
        algorithm.gathering_builder(build_pfedhn_process),
        client_columns=algorithm.participation_columns,
        not_one_aggregation=NOT_ONE_AGGREGATION,
        privacy=algorithm.Privacy(why_not=NO_PRIVACY),
        family='hypernetwork',
    ),
)
