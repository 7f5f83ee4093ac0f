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
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import averaging, building_blocks, local_training, template
from tff_pfl.data import client_data


def split_variables(model: tf.keras.Model, personal_layers: int) -> tuple[list[int], list[int]]:
    """Indices of the base and of the personal trainable variables.

    Args:
      model: the Keras model.
      personal_layers: how many of the last layers with trainable weights are
        personal.

    Returns:
      `(base_indices, personal_indices)` into `model.trainable_variables`.

    Raises:
      ValueError: if `personal_layers` is not in [1, number of layers with
        weights - 1] (FedPer needs both a base and a head).
    """
    layers = [layer for layer in model.layers if layer.trainable_weights]
    if not 1 <= personal_layers < len(layers):
        raise ValueError(
            f'personal_layers must be in [1, {len(layers) - 1}] for model {model.name!r} '
            f'({len(layers)} layers with weights), got {personal_layers}'
        )
    personal_refs = {v.ref() for layer in layers[-personal_layers:] for v in layer.trainable_weights}
    base, personal = [], []
    for i, variable in enumerate(model.trainable_variables):
        (personal if variable.ref() in personal_refs else base).append(i)
    return base, personal


def build_fedper_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    *,
    local_config: local_training.TrainingConfig,
    personal_layers: int = 1,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedPer as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      local_config: local epochs, batch size and learning rate.
      personal_layers: how many of the last layers with weights stay on the
        clients.
      server_optimizer: applied to the mean base-layer update; default plain
        averaging.
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the base
      layers' weights), optimizer_state, aggregator_state, round_num>`; client
      state: `<client_id, num_participations, last_round, head>`.

    Raises:
      ValueError: on a bad configuration or `personal_layers`.
    """
    local_config.validate()
    with tf.Graph().as_default():
        base_indices, personal_indices = split_variables(model_fn(), personal_layers)
    base_type = local_training.weights_type(model_fn, base_indices)
    client_training = building_blocks.build_client_training(spec, model_fn, local_config, seed=seed)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, 'test')

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        weights = local_training.initial_weights(model_fn, seed)
        return building_blocks.participation_state(client_id, head=[weights[i] for i in personal_indices])

    client_state_type = initial_client_state.type_signature.result

    def full_weights(base, client_state):
        return local_training.merge_weights([(base_indices, base), (personal_indices, client_state['head'])])

    @tff.tensorflow.computation(base_type, np.int32, client_state_type)
    def client_work(base, round_num, client_state):
        # Train the whole model; split its update into the base part (sent)
        # and the head part (kept).
        result = client_training(full_weights(base, client_state), round_num, client_state['client_id'])
        update = result['update']
        head = [h - update[i] for h, i in zip(client_state['head'], personal_indices)]
        return collections.OrderedDict(
            update=[update[i] for i in base_indices],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num, head=head),
        )

    @tff.tensorflow.computation(base_type, client_state_type)
    def evaluate_client(base, client_state):
        return collections.OrderedDict(
            personalized_model=client_evaluation(full_weights(base, client_state), client_state['client_id'])
        )

    process = averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer,
        shared_indices=base_indices,
        seed=seed,
    )
    process.base_indices, process.personal_indices = base_indices, personal_indices
    return process
