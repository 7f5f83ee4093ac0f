"""Ditto: a global FedAvg model plus personal models pulled towards it.

T. Li, S. Hu, A. Beirami, V. Smith, "Ditto: Fair and Robust Federated
Learning Through Personalization" (ICML 2021), Algorithm 1.

Each client k solves  min_v  F_k(v) + lambda/2 ||v - w*||^2  (Eq. 2) next to
the global objective. In a round the server broadcasts w^t; each sampled
client (a) runs local SGD on w^t for the global model and sends back its
update, which the server averages as in FedAvg, and (b) runs SGD on its
personal model v_k with the gradient of F_k(v_k) + lambda (v_k - w^t) (line
8), for `personal_config`'s epochs. v_k stays on the client.

Every v_k starts from the same initial model as w (built from the run seed on
the client itself). `evaluate` reports the global model and each client's
v_k (`personalized_model`).
"""

import collections
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import averaging, building_blocks, local_training, template
from tff_pfl.data import client_data


def proximal_loss(anchor, strength) -> local_training.LossFn:
    """Cross-entropy plus `strength / 2 * ||weights - anchor||^2` (TF code).

    Args:
      anchor: a list of tensors, one per trainable variable.
      strength: the proximal weight (Ditto's lambda).

    Returns:
      A `local_training.LossFn`.
    """

    def loss_fn(model, x, y):
        loss, logits = local_training.supervised_loss(model, x, y)
        squared = tf.add_n([tf.reduce_sum(tf.square(v - a)) for v, a in zip(model.trainable_variables, anchor)])
        return loss + 0.5 * strength * squared, logits

    return loss_fn


def build_ditto_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    *,
    local_config: local_training.TrainingConfig,
    personal_config: local_training.TrainingConfig | None = None,
    ditto_lambda: float = 0.1,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds Ditto as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      local_config: the global model's local SGD (epochs, batch, lr).
      personal_config: the personal model's SGD per round (Ditto's s local
        iterations); default `local_config`.
      ditto_lambda: lambda >= 0, the pull towards the global model (0: local
        training alongside FedAvg).
      server_optimizer: FedAvg's server optimizer; default plain averaging.
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, personal>`.

    Raises:
      ValueError: on a bad configuration or a negative lambda.
    """
    local_config.validate()
    personal_config = (personal_config or local_config).validate()
    if not ditto_lambda >= 0:
        raise ValueError(f'ditto_lambda must be >= 0, got {ditto_lambda}')
    weights_type = local_training.weights_type(model_fn)
    client_training = building_blocks.build_client_training(spec, model_fn, local_config, seed=seed)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, 'test')

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id, personal=local_training.initial_weights(model_fn, seed))

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        result = client_training(weights, round_num, client_id)
        # Line 8: v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)).
        model = model_fn()
        with tf.control_dependencies(local_training.assign_weights(model, client_state['personal'])):
            stats = local_training.train(
                model,
                client_data.read_split(spec, client_id, 'train'),
                epochs=personal_config.epochs,
                batch_size=personal_config.batch_size,
                learning_rate=personal_config.learning_rate,
                seed=local_training.client_seed(seed, round_num, client_id, salt=1),
                loss_fn=proximal_loss(weights, ditto_lambda),
                max_steps=personal_config.max_steps,
            )
        with tf.control_dependencies(list(stats)):
            personal = local_training.get_weights(model)
        return collections.OrderedDict(
            update=result['update'],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num, personal=personal),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(client_state['personal'], client_id),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer,
        seed=seed,
    )
