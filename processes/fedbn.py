"""FedBN: federated averaging of every layer but batch normalization, which stays on the clients.

X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou, "FedBN: Federated Learning on
Non-IID Features via Local Batch Normalization" (ICLR 2021, arXiv 2102.07623).

Each client keeps its own BatchNormalization layers: their trainable scale and
offset and their moving mean and variance never leave it. In a round the
server broadcasts the other layers' weights; each sampled client puts them
together with its own batch-norm layers, trains the whole model with local
SGD (its moving statistics move as Keras moves them in training mode), keeps
its new batch-norm layers and sends back the update of the others; the server
applies the example-weighted mean update (FedAvg). A client is evaluated with
its own batch-norm layers and statistics (`personalized_model`); there is no
global model, since no batch-norm layer is shared.

Where the model has non-trainable weights outside BatchNormalization layers
(constants, `model_weights.check_non_trainable`), they are the client's too.
The choices the paper leaves open are in docs/algorithms/baselines.md (FedBN).
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, models
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedbn_process', 'split_batch_norm', 'FedBNSettings']


@dataclasses.dataclass(frozen=True)
class FedBNSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedBN (`fedbn`): FedAvg on every layer but the BatchNormalization layers, which stay on the clients."""


def split_batch_norm(model_fn: Callable[[], tf.keras.Model]) -> tuple[list[int], list[int]]:
    """Indices of the shared and of the batch-norm trainable variables of `model_fn()`'s model.

    Args:
      model_fn: no-arg function returning a fresh Keras model.

    Returns:
      `(shared_indices, batch_norm_indices)` into the model's
      `trainable_variables`: the scale and offset of every
      BatchNormalization layer (nested ones included) are batch-norm.

    Raises:
      ValueError: one line, if the model has no BatchNormalization layer
        (FedBN would be FedAvg) or nothing but them.
    """
    with tf.Graph().as_default():
        model = model_fn()
        norms = [
            layer
            for layer in model._flatten_layers(include_self=False)  # every nested layer
            if isinstance(layer, tf.keras.layers.BatchNormalization)
        ]
        if not model.layers and model.trainable_variables:  # a FunctionalModel / VariableModel (models.adapters)
            raise ValueError(
                f'model_fn: FedBN keeps the BatchNormalization layers on the clients and {model.name!r} has no '
                'Keras layers; pass a Keras model function'
            )
        if not norms:
            raise ValueError(
                f'model_fn: FedBN keeps the BatchNormalization layers on the clients and model {model.name!r} has '
                'none; add them (e.g. the registered model mnist_dnn_bn) or use fedavg'
            )
        local = {v.ref() for layer in norms for v in layer.trainable_weights}
        shared, batch_norm = [], []
        for i, variable in enumerate(model.trainable_variables):
            (batch_norm if variable.ref() in local else shared).append(i)
        if not shared:
            raise ValueError(f'model_fn: model {model.name!r} has no weights outside its BatchNormalization layers')
    return shared, batch_norm


@builder_inputs.checked
def build_fedbn_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedBNSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedBN as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out)
        with at least one BatchNormalization layer.
      settings: local training and the server learning rate (applied to the
        mean update of the shared layers); None: `FedBNSettings()`.
      client_optimizer: the clients' local optimizer, started fresh for each
        client's local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the shared
      layers' weights), optimizer_state, aggregator_state, round_num>`; client
      state: `<client_id, num_participations, last_round, batch_norm (the
      batch-norm layers' scale and offset), statistics (the model's
      non-trainable weights: the moving means and variances)>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: the model has no BatchNormalization layer (one line,
        `split_batch_norm`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedBNSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedbn_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    model_weights.weights_type(model_fn)  # the model's checks (logits out, ...) before FedBN's own
    shared_indices, norm_indices = split_batch_norm(model_fn)
    shared_type = model_weights.weights_type(model_fn, shared_indices)
    loss_fn = local_training.loss_from(loss, spec)
    extra_metrics = local_training.metrics_from(metrics, spec)
    config = settings.training_config()

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        with models.seeded(seed):  # every client's batch-norm layers start from the run seed's model
            model = model_fn()
        weights = model_weights.get_weights(model)
        return building_blocks.participation_state(
            client_id,
            batch_norm=[weights[i] for i in norm_indices],
            statistics=model_weights.get_non_trainable(model),
        )

    client_state_type = initial_client_state.type_signature.result

    def client_model(shared, client_state):
        """A fresh model holding the shared layers and the client's batch-norm layers; its assign ops."""
        model = model_fn()
        weights = model_weights.merge_weights([(shared_indices, shared), (norm_indices, client_state['batch_norm'])])
        assigned = model_weights.assign_weights(model, weights)
        assigned += model_weights.assign_non_trainable(model, client_state['statistics'])
        return model, weights, assigned

    @tff.tensorflow.computation(shared_type, np.int32, client_state_type)
    def client_work(shared, round_num, client_state):
        client_id = client_state['client_id']
        data = client_data.read_split(spec, client_id, 'train')
        model, initial, assigned = client_model(shared, client_state)
        with tf.control_dependencies(assigned):
            stats = local_training.train_with(
                model,
                data,
                config,
                seed=local_training.client_seed(seed, round_num, client_id),
                optimizer=client_optimizer,
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
            statistics = model_weights.get_non_trainable(model)
        return collections.OrderedDict(
            update=[initial[i] - trained[i] for i in shared_indices],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(
                client_state, round_num, batch_norm=[trained[i] for i in norm_indices], statistics=statistics
            ),
        )

    @tff.tensorflow.computation(shared_type, client_state_type)
    def evaluate_client(shared, client_state):
        data = client_data.read_split(spec, client_state['client_id'], spec.evaluation_split)
        model, _, assigned = client_model(shared, client_state)
        with tf.control_dependencies(assigned):
            stats = local_training.evaluate(model, data)
            extra = local_training.metric_sums(model, data, extra_metrics) if extra_metrics else None
        return collections.OrderedDict(personalized_model=template.client_metrics(stats, extra))

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        shared_indices=shared_indices,
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'fedbn',
        'FedBN (Li et al., 2021): shared layers averaged, batch-norm layers and statistics kept per client',
        FedBNSettings,
        algorithm.model_update_builder(build_fedbn_process),
        default_models={
            'synthetic': 'mnist_dnn_bn',
            'mnist': 'mnist_dnn_bn',
            'fashion_mnist': 'mnist_dnn_bn',
            'npz': 'mnist_dnn_bn',
        },
        privacy=algorithm.Privacy("the shared layers' updates (the batch-norm layers stay on the clients)"),
        family='parameter decoupling',
    ),
)
