"""Local-only training: every client trains its own model on its own data.

The no-collaboration baseline of the personalization papers (PersFL's and
KD-PDFL's "local learning"). Every client starts from the same initial model
(built from the run seed on the client itself, so nothing is broadcast but the
round number) and, in each round it is sampled, runs local SGD on its own
training split. No model leaves a client: the only CLIENTS -> SERVER value is
the sum of the training metrics.

`evaluate` reports each client's own model on its test split as
`personalized_model`.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import builder_inputs, building_blocks, device_state, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_local_process', 'LocalSettings']


@dataclasses.dataclass(frozen=True)
class LocalSettings(settings_lib.LocalTraining):
    """Local-only training (`local`): each sampled client's local SGD per round, nothing else."""


@builder_inputs.checked
def build_local_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: LocalSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds local-only training as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local epochs or steps per round, batch size and learning
        rate; None: `LocalSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): local-only training has no server step.
      model_aggregator: not taken (ValueError if given): local-only training uploads no model to
        aggregate.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; fixes the common initial model and the batch orders.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<round_num>`; client
      state: `<client_id, num_participations, last_round, model>`, and
      `statistics` (the model's non-trainable weights: BatchNormalization's
      moving statistics, trained with it) for a model that has any; metrics:
      `<train_loss, train_accuracy, num_examples, num_clients,
      mean_local_steps>`.

    Raises:
      SettingsError: a setting out of range (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (LocalSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_local_process',
        dict(
            server_optimizer='local-only training has no server step',
            model_aggregator='local-only training uploads no model to aggregate',
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    # A model with non-trainable weights (BatchNormalization's moving statistics): each client keeps
    # its own with its model, as a Keras model trained on its data alone would.
    kept = model_weights.statistics_type(model_fn) is not None
    client_training = building_blocks.build_client_training(
        spec,
        model_fn,
        settings.training_config(),
        seed=seed,
        optimizer=client_optimizer,
        loss_fn=local_training.loss_from(loss, spec),
        statistics=kept,
    )
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec), statistics=kept
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        own = dict(statistics=model_weights.initial_statistics(model_fn)) if kept else {}
        return building_blocks.participation_state(
            client_id, model=model_weights.initial_weights(model_fn, seed), **own
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(np.int32, client_state_type)
    def client_work(round_num, client_state):
        weights = client_state['model']
        client_id = client_state['client_id']
        if kept:
            result = client_training(weights, client_state['statistics'], round_num, client_id)
            own = dict(statistics=result['statistics'])
        else:
            result, own = client_training(weights, round_num, client_id), {}
        trained = [w - u for w, u in zip(weights, result['update'])]
        return collections.OrderedDict(
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num, model=trained, **own),
        )

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(round_num=tf.constant(0, tf.int32))

    initialize = building_blocks.server_initialize(server_init)
    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(server_state_type.member)
    def advance(state):
        return collections.OrderedDict(round_num=state['round_num'] + 1)

    round_of = building_blocks.build_round_number(server_state_type.member)

    def finish(state, outputs):
        return tff.federated_map(advance, state), building_blocks.aggregate_training_metrics(outputs.metric_sums)

    # The round, written once: `next` in process and the device form are both made from it.
    phases = [device_state.Phase('next', round_of, client_work, finish)]

    @tff.tensorflow.computation(client_state_type)
    def evaluate_client(client_state):
        own = [client_state['statistics']] if kept else []
        return collections.OrderedDict(
            personalized_model=client_evaluation(client_state['model'], *own, client_state['client_id'])
        )

    device = device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=phases,
        evaluate_input=round_of,
        evaluate_client=building_blocks.build_evaluation_at(evaluate_client),
    )
    evaluate = building_blocks.build_client_states_evaluation(server_state_type, evaluate_client)
    return template.PersonalizedProcess(
        initialize,
        device_state.next_from_phases(server_state_type, client_state_type, phases),
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        device=device,
        no_global_model='local-only training has no server model; each client trains its own',
    )


def _build(settings, spec, model_fn, run):
    return build_local_process(spec, model_fn, settings, seed=run.seed)


ALGORITHMS = (
    algorithm.Algorithm(
        'local',
        'Local-only training',
        LocalSettings,
        _build,
        privacy=algorithm.Privacy(why_not='uploads nothing but training metrics: there is no model to protect'),
        family='local',
    ),
)
