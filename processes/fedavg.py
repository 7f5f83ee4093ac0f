"""Federated Averaging on the project's personalized-process template.

McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017). Every sampled client reads its own
training split by id inside the TFF worker, runs local SGD from the broadcast
global model, and the server applies the example-weighted mean of the updates
with a `tff.learning.optimizers` optimizer (SGD with learning rate 1.0 is the
plain FedAvg average; other optimizers give FedOpt-style server steps).

FedAvg has no personalized model: `evaluate` reports each client's accuracy of
the global model on its own test split. The per-client state only records
participation (its client id, number of rounds taken part in, last round).
"""

import collections
from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import building_blocks
from tff_pfl.computations import local_training
from tff_pfl.computations import template
from tff_pfl.data import client_data


def build_fedavg_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    *,
    local_config: local_training.TrainingConfig,
    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedAvg as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk (`tff_pfl.data.client_data`).
      model_fn: no-arg function returning a fresh, un-compiled Keras model
        whose outputs are logits.
      local_config: local epochs, batch size and client learning rate.
      server_optimizer: applied to the aggregated update; default SGD with
        learning rate 1.0 (plain averaging).
      model_aggregator: weighted aggregation of client updates; default
        `tff.aggregators.MeanFactory()` (example-weighted mean).
      seed: run seed; fixes the initial model and every client's batch order.

    Returns:
      A `template.PersonalizedProcess`. Server state:
      `<model, optimizer_state, aggregator_state, round_num>`; client state:
      `<client_id, num_participations, last_round>`; metrics:
      `<train_loss, train_accuracy, num_examples, num_clients>`.
    """
    local_config.validate()
    if server_optimizer is None:
        server_optimizer = tff.learning.optimizers.build_sgdm(learning_rate=1.0)
    if model_aggregator is None:
        model_aggregator = tff.aggregators.MeanFactory()

    weights_type = local_training.weights_type(model_fn)
    client_training = building_blocks.build_client_training(
        spec, model_fn, local_config, seed=seed
    )
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, 'test')
    optimizer_init, optimizer_apply = building_blocks.build_server_update(
        weights_type, server_optimizer
    )
    aggregation = model_aggregator.create(weights_type, tff.TensorType(np.float32))

    @tff.tensorflow.computation
    def initial_model():
        tf.random.set_seed(seed)
        return local_training.get_weights(model_fn())

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            model=initial_model(),
            optimizer_state=optimizer_init(),
            round_num=tf.constant(0, tf.int32),
        )

    @tff.federated_computation
    def initialize():
        init = tff.federated_eval(server_init, tff.SERVER)
        return tff.federated_zip(
            collections.OrderedDict(
                model=init.model,
                optimizer_state=init.optimizer_state,
                aggregator_state=aggregation.initialize(),
                round_num=init.round_num,
            )
        )

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return collections.OrderedDict(
            client_id=client_id,
            num_participations=tf.constant(0, tf.int32),
            last_round=tf.constant(-1, tf.int32),
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        result = client_training(weights, round_num, client_state['client_id'])
        new_state = collections.OrderedDict(
            client_id=client_state['client_id'],
            num_participations=client_state['num_participations'] + 1,
            last_round=round_num,
        )
        return collections.OrderedDict(
            update=result['update'],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=new_state,
        )

    @tff.tensorflow.computation(server_state_type.member, weights_type)
    def server_update(state, update):
        applied = optimizer_apply(state['optimizer_state'], state['model'], update)
        return collections.OrderedDict(
            model=applied['weights'],
            optimizer_state=applied['optimizer_state'],
            round_num=state['round_num'] + 1,
        )

    @tff.federated_computation(server_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def next_fn(state, client_states):
        model = tff.federated_broadcast(state.model)
        round_num = tff.federated_broadcast(state.round_num)
        outputs = tff.federated_map(client_work, (model, round_num, client_states))
        aggregated = aggregation.next(state.aggregator_state, outputs.update, outputs.weight)
        updated = tff.federated_map(server_update, (state, aggregated.result))
        new_state = tff.federated_zip(
            collections.OrderedDict(
                model=updated.model,
                optimizer_state=updated.optimizer_state,
                aggregator_state=aggregated.state,
                round_num=updated.round_num,
            )
        )
        metrics = building_blocks.aggregate_training_metrics(outputs.metric_sums)
        return template.RoundOutput(new_state, outputs.client_state, metrics)

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_state['client_id'])
        )

    @tff.federated_computation(server_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def evaluate(state, client_states):
        model = tff.federated_broadcast(state.model)
        return tff.federated_map(evaluate_client, (model, client_states))

    return template.PersonalizedProcess(
        initialize,
        next_fn,
        initial_client_state=initial_client_state,
        evaluate=evaluate,
    )
