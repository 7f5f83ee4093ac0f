"""Federated Averaging on the project's personalized-process template.

McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017). Every sampled client reads its own
training split by id inside the TFF worker, runs local SGD from the broadcast
global model, and the server applies the example-weighted mean of the updates
with TFF's SGD at `server_learning_rate` (1.0 is the plain FedAvg average).
With `local_steps` L > 0 every sampled client runs exactly L SGD steps (the
round metric `mean_local_steps` counts them), else `local_epochs` epochs.

FedAvg has no personalized model: `evaluate` reports each client's accuracy of
the global model on its own test split. The per-client state only records
participation (its client id, number of rounds taken part in, last round).

FedAvg + local fine-tuning (`FedAvgFTSettings`), the baseline of the
personalization papers: after the last round, `personalize` has every client
fine-tune the final global model on its own training split for 0, 1, ...,
`finetune_epochs` epochs (batch size and learning rate of local training) and
keep the number of epochs whose model scores best on its validation split
(`fine_tuning.finetune_on_validation`). The chosen
model is the client's `personalized_model`; before fine-tuning it is the
global model (zero epochs).
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, client_plots
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    averaging,
    builder_inputs,
    building_blocks,
    fine_tuning,
    local_training,
    model_weights,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedavg_process', 'FedAvgSettings', 'FedAvgFTSettings']


@dataclasses.dataclass(frozen=True)
class FedAvgSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedAvg's settings: local SGD (B, E or a number of steps, eta) and the server step.

    Defaults and where they come from: docs/algorithms/fedavg.md, "Settings".
    """


@dataclasses.dataclass(frozen=True)
class FedAvgFTSettings(FedAvgSettings):
    """FedAvg + local fine-tuning: FedAvg's settings and the most fine-tuning epochs.

    Fine-tuning uses `batch_size` and `client_learning_rate`.
    """

    finetune_epochs: int = settings_lib.setting(
        5,
        'FedAvg + fine-tuning: the most epochs a client fine-tunes the final global model for; '
        'it keeps the count (0 to this) best on its validation split.',
    )

    def _checks(self):
        return super()._checks() + [
            (self.finetune_epochs >= 1, f'finetune_epochs must be >= 1, got {self.finetune_epochs}'),
        ]


@builder_inputs.checked
def build_fedavg_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedAvgSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedAvg, or FedAvg + fine-tuning, as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk (`tff_pfl.data.client_data`).
      model_fn: no-arg function returning a fresh, un-compiled Keras model
        whose outputs are logits.
      settings: a `FedAvgSettings` (plain FedAvg) or a `FedAvgFTSettings`
        (FedAvg + fine-tuning: adds `personalize`); None: `FedAvgSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
        Fine-tuning (FedAvg + fine-tuning) keeps SGD.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; fixes the initial model and every client's batch order.

    Returns:
      A `template.PersonalizedProcess`. Server state:
      `<model, optimizer_state, aggregator_state, round_num>`; client state:
      `<client_id, num_participations, last_round>`, with fine-tuning also
      `<personalized, finetune_epochs, finetune_val_accuracy>`
      (`finetune_epochs` -1 until fine-tuned); metrics:
      `<train_loss, train_accuracy, num_examples, num_clients,
      mean_local_steps>`.

    Raises:
      TypeError: if `settings` is not a `FedAvgSettings`, or an optimizer
        is not a `tff.learning.optimizers.Optimizer`.
      SettingsError: on a bad setting (`settings.validate()`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = FedAvgSettings() if settings is None else settings
    if not isinstance(settings, FedAvgSettings):
        raise TypeError(f'build_fedavg_process takes FedAvgSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_fedavg_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    finetune_epochs = settings.finetune_epochs if isinstance(settings, FedAvgFTSettings) else 0
    if finetune_epochs:
        client_data.require_validation(spec, "FedAvg + fine-tuning's choice of epochs")
    local_config = settings.training_config()
    loss_fn = local_training.loss_from(loss, spec)
    weights_type = model_weights.weights_type(model_fn)
    client_training = building_blocks.build_client_training(
        spec, model_fn, local_config, seed=seed, optimizer=client_optimizer, loss_fn=loss_fn
    )
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        if not finetune_epochs:
            return building_blocks.participation_state(client_id)
        return building_blocks.participation_state(
            client_id,
            personalized=[tf.zeros(t.shape, t.dtype) for t in weights_type],
            finetune_epochs=tf.constant(-1, tf.int32),  # -1: not fine-tuned yet
            finetune_val_accuracy=tf.zeros([finetune_epochs + 1]),
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        result = client_training(weights, round_num, client_state['client_id'])
        return collections.OrderedDict(
            update=result['update'],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        metrics = collections.OrderedDict(global_model=client_evaluation(weights, client_id))
        if finetune_epochs:
            tuned = client_state['finetune_epochs'] >= 0
            personalized = [tf.where(tuned, p, w) for p, w in zip(client_state['personalized'], weights)]
            metrics['personalized_model'] = client_evaluation(personalized, client_id)
        return metrics

    personalize_builder = None
    if finetune_epochs:

        @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
        def client_finetune(weights, round_num, client_state):
            client_id = client_state['client_id']
            model = model_fn()
            with tf.control_dependencies(model_weights.fresh_weights(model, weights)):
                tuned, epochs, accuracies = fine_tuning.finetune_on_validation(
                    model,
                    client_data.read_split(spec, client_id, 'train'),
                    client_data.read_split(spec, client_id, 'val'),
                    max_epochs=finetune_epochs,
                    batch_size=settings.batch_size,
                    learning_rate=settings.client_learning_rate,
                    seed=local_training.client_seed(seed, round_num, client_id, salt=2),
                    loss_fn=loss_fn,
                )
            state = collections.OrderedDict((k, client_state[k]) for k in client_state)
            state.update(personalized=tuned, finetune_epochs=epochs, finetune_val_accuracy=accuracies)
            return state

        personalize_builder = averaging.broadcast_personalize(client_finetune)

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        model_aggregator=model_aggregator,
        personalize_builder=personalize_builder,
        seed=seed,
    )


def _finetune_plots(out, result, process):
    del process
    client_ids, fields = client_plots.client_fields(result.client_states, ('finetune_epochs',))
    client_plots.plot_client_field(
        out,
        client_ids,
        fields['finetune_epochs'],
        'finetune_epochs.png',
        'fine-tuning epochs',
        'Fine-tuning epochs chosen on validation',
        'epochs',
        kind=int,
    )
    return [('Fine-tuning epochs per client', 'finetune_epochs.png')]


ALGORITHMS = (
    algorithm.Algorithm(
        'fedavg',
        'FedAvg (McMahan et al., 2017)',
        FedAvgSettings,
        algorithm.model_update_builder(build_fedavg_process),
        privacy=algorithm.Privacy('model updates'),
        family='global model',
    ),
    algorithm.Algorithm(
        'fedavg_ft',
        'FedAvg + local fine-tuning chosen on validation',
        FedAvgFTSettings,
        algorithm.model_update_builder(build_fedavg_process),
        lambda state: {'finetune_epochs': int(state['finetune_epochs'])},
        _finetune_plots,
        privacy=algorithm.Privacy('model updates (fine-tuning stays on the clients)'),
        family='fine-tuning',
    ),
)
