"""Ditto: a global FedAvg model plus personal models pulled towards it.

T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated
Learning Through Personalization" (ICML 2021), Algorithm 1.

Each client k solves  min_v  F_k(v) + lambda/2 ||v - w*||^2  (Eq. 2) next to
the global objective. In a round the server broadcasts w^t; each sampled
client (a) runs local SGD on w^t for the global model and sends back its
update, which the server averages as in FedAvg, and (b) runs SGD on its
personal model v_k with the gradient of F_k(v_k) + lambda (v_k - w^t) (line
8). v_k stays on the client.

How much each model trains per round: with `local_steps` = L both w_k and
v_k take exactly L SGD steps (Ditto's s = L); with `local_steps` = 0, w_k
trains `local_epochs` epochs and v_k `personal_epochs` epochs.

Every v_k starts from the same initial model as w (built from the run seed on
the client itself). `evaluate` reports the global model and each client's
v_k (`personalized_model`).
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
__all__ = ['build_ditto_process', 'DittoSettings']


@dataclasses.dataclass(frozen=True)
class DittoSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """Ditto (`ditto`): FedAvg for w, and per client a personal model v_k pulled towards w.

    `local_steps` = L bounds both models: w_k and v_k each take exactly L SGD
    steps per round. With `local_steps` = 0, w_k trains `local_epochs` epochs
    and v_k `personal_epochs` epochs.
    """

    ditto_lambda: float = settings_lib.setting(0.1, 'Ditto: lambda, the pull of the personal models towards w.')
    personal_epochs: int = settings_lib.setting(
        1, 'Ditto: epochs of the personal model v_k per round (with local_steps=0; else it takes local_steps steps).'
    )

    def _checks(self):
        return super()._checks() + [
            (self.ditto_lambda >= 0, f'ditto_lambda must be >= 0, got {self.ditto_lambda}'),
            (self.personal_epochs >= 1, f'personal_epochs must be >= 1, got {self.personal_epochs}'),
            (
                self.local_steps == 0 or self.personal_epochs == 1,
                f'personal_epochs={self.personal_epochs} applies only with local_steps=0: with '
                f'local_steps={self.local_steps} both Ditto models take {self.local_steps} steps',
            ),
        ]

    def personal_training_config(self) -> local_training.TrainingConfig:
        """The personal model's SGD per round (Ditto's s iterations).

        Returns:
          Exactly `local_steps` steps when it is set, else `personal_epochs`
          epochs; with `batch_size` and `client_learning_rate`.
        """
        if self.local_steps:
            return self.training_config()
        return local_training.TrainingConfig(self.personal_epochs, self.batch_size, self.client_learning_rate)


def proximal_loss(
    anchor, strength, base: local_training.LossFn = local_training.supervised_loss
) -> local_training.LossFn:
    """The client's loss (`base`, cross-entropy by default) plus `strength / 2 * ||weights - anchor||^2` (TF code).

    Args:
      anchor: a list of tensors, one per trainable variable.
      strength: the proximal weight (Ditto's lambda).
      base: the client's loss F_k (`local_training.loss_from`).

    Returns:
      A `local_training.LossFn`.
    """

    def loss_fn(model, x, y):
        loss, logits = base(model, x, y)
        squared = tf.add_n([tf.reduce_sum(tf.square(v - a)) for v, a in zip(model.trainable_variables, anchor)])
        return loss + 0.5 * strength * squared, logits

    return loss_fn


@builder_inputs.checked
def build_ditto_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: DittoSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds Ditto as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local training of both models, the server learning rate,
        lambda and the personal epochs; None: `DittoSettings()`.
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
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, personal>`, and `statistics` (v_k's
      non-trainable weights: BatchNormalization's moving statistics,
      trained with it) for a model that has any. Metrics: those of w_k's
      local training (`mean_local_steps`: its SGD steps) and
      `mean_personal_steps`, v_k's SGD steps.

    Raises:
      SettingsError: a setting out of range (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (DittoSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_ditto_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    ditto_lambda = settings.ditto_lambda
    personal_config = settings.personal_training_config()
    weights_type = model_weights.weights_type(model_fn)
    loss_fn = local_training.loss_from(loss, spec)
    client_training = building_blocks.build_client_training(
        spec,
        model_fn,
        settings.training_config(),
        seed=seed,
        optimizer=client_optimizer,
        loss_fn=loss_fn,
    )
    extra_metrics = local_training.metrics_from(metrics, spec)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, metrics=extra_metrics)
    # A model with non-trainable weights (BatchNormalization's moving statistics): v_k keeps its own,
    # trained with it; w keeps a fresh model's, as TFF's FedAvg does.
    kept = model_weights.statistics_type(model_fn) is not None
    if kept:
        personal_evaluation = building_blocks.build_client_evaluation(
            spec, model_fn, metrics=extra_metrics, statistics=True
        )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        own = dict(statistics=model_weights.initial_statistics(model_fn)) if kept else {}
        return building_blocks.participation_state(
            client_id, personal=model_weights.initial_weights(model_fn, seed), **own
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        result = client_training(weights, round_num, client_id)
        # Line 8: v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)).
        model = model_fn()
        if kept:
            assigned = model_weights.assign_weights(model, client_state['personal'])
            assigned += model_weights.assign_non_trainable(model, client_state['statistics'])
        else:
            assigned = model_weights.fresh_weights(model, client_state['personal'])
        with tf.control_dependencies(assigned):
            stats = local_training.train_with(
                model,
                client_data.read_split(spec, client_id, 'train'),
                personal_config,
                seed=local_training.client_seed(seed, round_num, client_id, salt=1),
                loss_fn=proximal_loss(weights, ditto_lambda, loss_fn),
                optimizer=client_optimizer,
            )
        with tf.control_dependencies(list(stats)):
            personal = model_weights.get_weights(model)
            own = dict(statistics=model_weights.get_non_trainable(model)) if kept else {}
        metric_sums = collections.OrderedDict(result['metric_sums'])
        metric_sums['personal_steps'] = tf.cast(stats.num_steps, tf.float32)
        return collections.OrderedDict(
            update=result['update'],
            weight=result['weight'],
            metric_sums=metric_sums,
            client_state=building_blocks.participated(client_state, round_num, personal=personal, **own),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        # A client that has not taken part yet has an untrained v_k: its personal model is w
        # (docs/algorithms/baselines.md, Ditto: "clients that never took part").
        trained = client_state['num_participations'] > 0
        personal = [tf.where(trained, v, w) for v, w in zip(client_state['personal'], weights)]
        if kept:  # an untrained v_k's statistics are a fresh model's, as w's are
            personalized = personal_evaluation(personal, client_state['statistics'], client_id)
        else:
            personalized = client_evaluation(personal, client_id)
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=personalized,
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'ditto',
        'Ditto (Li et al., 2021): personal models pulled towards the global one',
        DittoSettings,
        algorithm.model_update_builder(build_ditto_process),
        privacy=algorithm.Privacy("the global model's updates (v_i stays on the clients)"),
        family='regularized personal model',
    ),
)
