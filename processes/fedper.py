"""FedPer: federated base layers, personal head layers.

M. G. Arivazhagan, V. Aggarwal, A. K. Singh, S. Choudhary, "Federated
Learning with Personalization Layers" (arXiv 1912.00818), Algorithm 1.

The model is split into base layers W_B, shared by all clients and trained
with FedAvg, and personalization layers W_P, which never leave their client.
In a round the server broadcasts W_B; each sampled client trains the whole
model (W_B, its own W_P) with local SGD, keeps its new W_P and sends back its
W_B update; the server takes the example-weighted mean (FedAvg). Which
layers are personal is `personal_layers`: the last that many layers with
weights (1, the default, is the classifier head).

Every client's W_P starts from the same initial head (built from the run
seed on the client itself). `evaluate` reports the client's own model, the
current W_B with its W_P, as `personalized_model`; there is no meaningful
global model.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedper_process', 'FedPerSettings']


@dataclasses.dataclass(frozen=True)
class FedPerSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedPer (`fedper`): FedAvg on the base layers; the last `personal_layers` stay on the clients."""

    personal_layers: int = settings_lib.setting(
        1,
        'FedPer, FedRep, FedBABU: how many of the last layers with weights are the head (1: the classifier): '
        'kept on each client in FedPer and FedRep, fixed at its initialization in FedBABU.',
    )

    def _checks(self):
        return super()._checks() + [
            (self.personal_layers >= 1, f'personal_layers must be >= 1, got {self.personal_layers}'),
        ]


def split_layers(
    model_fn: Callable[[], tf.keras.Model],
    personal_layers: int,
    who: str = 'FedPer',
    *,
    setting: str = 'personal_layers',
    rest: str = 'shared',
) -> tuple[list[int], list[int]]:
    """Indices of the base and of the personal trainable variables of `model_fn()`'s model.

    Layers are counted, not variables: a Dense layer's kernel and bias move
    together.

    Args:
      model_fn: no-arg function returning a fresh Keras model (built in a
        graph of its own here).
      personal_layers: how many of the last layers with trainable weights are
        personal (`FedPerSettings.personal_layers`).
      who: the algorithm, for the messages (FedPer, FedRep).
      setting: the setting that holds `personal_layers`, for the messages
        (LG-FedAvg's `global_layers` counts its shared layers from the end).
      rest: what the layers before them are, for the messages.

    Returns:
      `(base_indices, personal_indices)` into the model's
      `trainable_variables`.

    Raises:
      ValueError: one line, if the model has no more layers with weights than
        `personal_layers` (FedPer needs a shared base and a personal head),
        or no Keras layers at all (a FunctionalModel).
    """
    with tf.Graph().as_default():
        model = model_fn()
        layers = [layer for layer in model.layers if layer.trainable_weights]
        if not layers and model.trainable_variables:  # a FunctionalModel / VariableModel (models.adapters)
            raise ValueError(
                f'model_fn: {who} splits the model into shared and personal Keras layers and {model.name!r} has '
                'no Keras layers; pass a Keras model function'
            )
        if not 1 <= personal_layers < len(layers):
            count = f'{len(layers)} layer{"" if len(layers) == 1 else "s"}'
            raise ValueError(
                f'{setting}={personal_layers} leaves no {rest} layer: model {model.name!r} has {count} '
                f'with weights; {who} needs at least {setting} + 1 = {personal_layers + 1}'
            )
        personal_refs = {v.ref() for layer in layers[-personal_layers:] for v in layer.trainable_weights}
        base, personal = [], []
        for i, variable in enumerate(model.trainable_variables):
            (personal if variable.ref() in personal_refs else base).append(i)
    return base, personal


@builder_inputs.checked
def build_fedper_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedPerSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedPer as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local training, the server learning rate (applied to the
        mean base-layer update) and `personal_layers`; None:
        `FedPerSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates (`averaging.build_averaging_process`);
        default the example-weighted mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the base
      layers' weights), optimizer_state, aggregator_state, round_num>`; client
      state: `<client_id, num_participations, last_round, head>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: `personal_layers` leaves the model no shared layer (one
        line, `split_layers`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedPerSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedper_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    base_indices, personal_indices = split_layers(model_fn, settings.personal_layers)
    return joint_training_round(
        spec,
        model_fn,
        settings,
        base_indices=base_indices,
        personal_indices=personal_indices,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
        seed=seed,
    )


def joint_training_round(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: settings_lib.LocalTraining,
    *,
    base_indices,
    personal_indices,
    client_optimizer: tff.learning.optimizers.Optimizer | None,
    server_optimizer: tff.learning.optimizers.Optimizer | None,
    model_aggregator: averaging.Aggregator | None,
    loss: local_training.Loss | None,
    metrics: local_training.MetricsArg | None,
    seed: int,
    personal_field: str = 'head',
) -> template.PersonalizedProcess:
    """`shared_base_round` with both parts trained together by local SGD (FedPer's round, LG-FedAvg's).

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: the local training (`training_config()`) and the server
        learning rate (`server_optimizer()`) when `server_optimizer` is None.
      base_indices: the shared variables' indices (`split_layers`).
      personal_indices: the personal ones'.
      client_optimizer: the clients' optimizer, or None for SGD.
      server_optimizer: applied to the mean update of the shared part, or
        None.
      model_aggregator: aggregation of the shared part's updates, or None.
      loss: the clients' training loss (`local_training.loss_from`).
      metrics: extra per-client test metrics.
      seed: run seed.
      personal_field: the client state's name for the personal part.

    Returns:
      The `template.PersonalizedProcess` of `shared_base_round`.
    """
    client_training = building_blocks.build_client_training(
        spec,
        model_fn,
        settings.training_config(),
        seed=seed,
        optimizer=client_optimizer,
        loss_fn=local_training.loss_from(loss, spec),
    )
    return shared_base_round(
        spec,
        model_fn,
        client_training,
        base_indices=base_indices,
        personal_indices=personal_indices,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        model_aggregator=model_aggregator,
        metrics=metrics,
        seed=seed,
        personal_field=personal_field,
    )


def shared_base_round(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    client_training: tff.Computation,
    *,
    base_indices,
    personal_indices,
    server_optimizer: tff.learning.optimizers.Optimizer,
    model_aggregator: averaging.Aggregator | None,
    metrics: local_training.MetricsArg | None,
    seed: int,
    personal_field: str = 'head',
) -> template.PersonalizedProcess:
    """The round of a shared base and a personal head (FedPer's, FedRep's), around the clients' training.

    The server holds and averages the base; each client keeps its head in
    its state (every head starts from the run seed's initial model), trains
    the whole model with `client_training` from the base it receives and
    its head, keeps the trained head and uploads the base's update.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      client_training: `(weights, round_num, client_id) -> <update, weight,
        metric_sums>` on the whole model's weights, as
        `building_blocks.build_client_training` returns it (FedPer's: SGD on
        every layer; FedRep's: the head, then the base).
      base_indices: the shared variables' indices (`split_layers`).
      personal_indices: the head's.
      server_optimizer: applied to the mean base update.
      model_aggregator: aggregation of the base updates; None: the
        example-weighted mean.
      metrics: extra per-client test metrics (`local_training.metrics_from`).
      seed: run seed.
      personal_field: the client state's name for the personal part
        (LG-FedAvg's is its lower layers, `local_layers`).

    Returns:
      A `template.PersonalizedProcess`: server state `<model (the base's
      weights), optimizer_state, aggregator_state, round_num>`, client state
      `<client_id, num_participations, last_round, head>`, `evaluate`'s
      `personalized_model` the base with the client's head.
    """
    base_type = model_weights.weights_type(model_fn, base_indices)
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        weights = model_weights.initial_weights(model_fn, seed)
        return building_blocks.participation_state(
            client_id, **{personal_field: [weights[i] for i in personal_indices]}
        )

    client_state_type = initial_client_state.type_signature.result

    def full_weights(base, client_state):
        return model_weights.merge_weights([(base_indices, base), (personal_indices, client_state[personal_field])])

    @tff.tensorflow.computation(base_type, np.int32, client_state_type)
    def client_work(base, round_num, client_state):
        # Train the whole model; split its update into the base part (sent)
        # and the head part (kept).
        result = client_training(full_weights(base, client_state), round_num, client_state['client_id'])
        update = result['update']
        head = [h - update[i] for h, i in zip(client_state[personal_field], personal_indices)]
        return collections.OrderedDict(
            update=[update[i] for i in base_indices],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num, **{personal_field: head}),
        )

    @tff.tensorflow.computation(base_type, client_state_type)
    def evaluate_client(base, client_state):
        return collections.OrderedDict(
            personalized_model=client_evaluation(full_weights(base, client_state), client_state['client_id'])
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer,
        shared_indices=base_indices,
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'fedper',
        'FedPer (Arivazhagan et al., 2019): shared base layers, personal head',
        FedPerSettings,
        algorithm.model_update_builder(build_fedper_process),
        # Logistic regression has one layer: nothing would be shared.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy("the shared base's updates (the head stays on the clients)"),
        family='parameter decoupling',
    ),
)
