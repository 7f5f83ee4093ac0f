"""A model-averaging round with per-client state, shared by FedAvg-style algorithms.

`build_averaging_process` assembles the typed round every FedAvg-based
algorithm has: broadcast the global model and round number, run the
algorithm's client work on each sampled client's state, aggregate the model
updates with a `tff.aggregators` factory, apply a `tff.learning` server
optimizer, and sum the training metrics. The algorithm supplies only its
client work, its initial client state and its per-client evaluation (and
optionally a clients-only personalization stage).
"""

import collections
import inspect
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import building_blocks, device_state, model_weights, template

# The keyword arguments of `template.PersonalizedProcess` this module sets itself;
# any other one is a declared output the caller may pass through.
_SET_HERE = ('initial_client_state', 'evaluate', 'personalize', 'device', 'global_model', 'no_global_model')

# How the clients' updates are aggregated: weighted (by examples) or unweighted (user-level DP).
Aggregator = tff.aggregators.WeightedAggregationFactory | tff.aggregators.UnweightedAggregationFactory

# Builds `personalize` from the server state type and the client state type.
PersonalizeBuilder = Callable[[tff.Type, tff.Type], tff.Computation]


def weigh(update, weight):
    """A client's update times its weight: `tff.aggregators.MeanFactory`'s client step (TF code).

    Args:
      update: a structure of float tensors.
      weight: a float32 scalar.

    Returns:
      `update` with every tensor multiplied by `weight`.
    """
    return tf.nest.map_structure(lambda x: x * tf.cast(weight, x.dtype), update)


def divide_by_weight(weighted_sum, weight_sum):
    """The summed weighted updates over the summed weights: `MeanFactory`'s server step (TF code).

    Args:
      weighted_sum: a structure of float tensors, the sum of `weigh`'s results.
      weight_sum: the float32 sum of the weights.

    Returns:
      `weighted_sum` with every tensor divided by `weight_sum` (no guard
      against a zero sum, as `MeanFactory()`).
    """
    return tf.nest.map_structure(lambda x: tf.math.divide(x, tf.cast(weight_sum, x.dtype)), weighted_sum)


def broadcast_personalize(client_fn: tff.Computation) -> PersonalizeBuilder:
    """A `personalize` stage that runs `client_fn` on every client from the final global model.

    Args:
      client_fn: `(weights, round_num, client_state) -> client_state`, a
        `tff.tensorflow.computation` (e.g. PersFL's distillation, FedAvg's
        fine-tuning).

    Returns:
      A `PersonalizeBuilder` for `build_averaging_process`: its
      `personalize: (S@SERVER, {C}@CLIENTS) -> {C}@CLIENTS` broadcasts the
      server's model and round number and maps `client_fn` over the clients.
    """

    def builder(server_state_type, client_state_type):
        @tff.federated_computation(server_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
        def personalize(server_state, client_states):
            model = tff.federated_broadcast(server_state.model)
            round_num = tff.federated_broadcast(server_state.round_num)
            return tff.federated_map(client_fn, (model, round_num, client_states))

        return personalize

    builder.client_fn = client_fn  # what each device runs, for the `DeviceProcess`
    return builder


def build_averaging_process(
    model_fn: Callable[[], tf.keras.Model],
    *,
    client_work: tff.Computation,
    initial_client_state: tff.Computation,
    evaluate_client: tff.Computation,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: Aggregator | None = None,
    personalize_builder: PersonalizeBuilder | None = None,
    server_info: Callable[[tff.Type], tff.Computation] | None = None,
    shared_indices: Sequence[int] | None = None,
    seed: int = 0,
    **declared_outputs,
) -> template.PersonalizedProcess:
    """Builds a FedAvg-shaped `PersonalizedProcess` around `client_work`.

    Args:
      model_fn: no-arg function returning a fresh Keras model (logits out).
      client_work: `(weights, round_num, client_state) -> <update, weight,
        metric_sums, client_state>`, a `tff.tensorflow.computation`; `update`
        is `initial - trained` and `metric_sums` is
        `building_blocks.training_metric_sums(...)`.
      initial_client_state: `tf.string -> client_state`.
      evaluate_client: `(weights, client_state) -> E`, the client's metrics
        (of the global `weights` and of any personalized model it holds).
      server_optimizer: applied to the aggregated update; default SGD with
        learning rate 1.0 (plain averaging).
      model_aggregator: aggregation of updates. A weighted factory receives
        each client's `weight`; an unweighted one (user-level DP,
        `privacy.DPConfig.factory`) counts every client once. Default (None):
        the example-weighted mean with `tff.aggregators.MeanFactory()`'s
        arithmetic and state, fused into the round: each client weighs its
        own update (`weigh`) and one `federated_sum` adds the weighted
        updates, the weights and the metric sums (docs/runtime.md, "The
        default mean in one sum").
      personalize_builder: optional; called with the server state type and
        the client state type, returns the process's `personalize`.
      server_info: optional; called with the aggregator state type, returns
        a `tff.tensorflow.computation` mapping the aggregator state to a value
        broadcast to the clients with the model (e.g. an aggregator's
        variance estimate). `client_work` then takes `(weights, round_num,
        info, client_state)`.
      shared_indices: optional; which of the model's trainable variables
        are global (broadcast, averaged), in order; default all of them.
        FedPer keeps the others on the clients.
      seed: fixes the initial global model.
      **declared_outputs: passed on to `template.PersonalizedProcess`: the
        process's `extras` (what the algorithm's report hooks read, e.g.
        PersFL's `grid_candidates`), so that nothing is assigned to the process
        after construction.

    Returns:
      A `template.PersonalizedProcess` whose server state is `<model,
      optimizer_state, aggregator_state, round_num>` and whose metrics are
      `<train_loss, train_accuracy, num_examples, num_clients, ...>` plus the
      client means of any extra metric sums and the aggregator's
      measurements (`aggregator`). Its `next`
      (`device_state.next_from_phases`) and its `device` form
      (`device_state.build_device_process`) are both made from the one
      phase of the round; the device form keeps the client states on the
      devices.

    Raises:
      TypeError: if `personalize_builder` was not made by
        `broadcast_personalize`, or `declared_outputs` names an argument
        `template.PersonalizedProcess` does not take.
    """
    parameters = inspect.signature(template.PersonalizedProcess.__init__).parameters
    declarable = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY and n not in _SET_HERE]
    unknown = sorted(set(declared_outputs) - set(declarable))
    if unknown:
        raise TypeError(f'PersonalizedProcess declares no output {unknown}; it declares {declarable}')
    if server_optimizer is None:
        server_optimizer = tff.learning.optimizers.build_sgdm(learning_rate=1.0)
    # The default mean is fused into the round: one `federated_sum` a client (below).
    fused_mean = model_aggregator is None
    if model_aggregator is None:
        model_aggregator = tff.aggregators.MeanFactory()
    weights_type = model_weights.weights_type(model_fn, shared_indices)
    client_state_type = initial_client_state.type_signature.result
    optimizer_init, optimizer_apply = building_blocks.build_server_update(weights_type, server_optimizer)
    # An unweighted factory (user-level DP: every client counts once) gets no weights.
    weighted = isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory)
    if weighted:
        aggregation = model_aggregator.create(weights_type, tff.TensorType(np.float32))
    else:
        aggregation = model_aggregator.create(weights_type)

    @tff.tensorflow.computation
    def server_init():
        weights = model_weights.initial_weights(model_fn, seed)
        if shared_indices is not None:
            weights = [weights[i] for i in shared_indices]
        return collections.OrderedDict(
            model=weights,
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
    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)
    info_fn = server_info(server_state_type.member['aggregator_state']) if server_info else None

    @tff.tensorflow.computation(server_state_type.member, weights_type)
    def server_update(state, update):
        applied = optimizer_apply(state['optimizer_state'], state['model'], update)
        return collections.OrderedDict(
            model=applied['weights'],
            optimizer_state=applied['optimizer_state'],
            round_num=state['round_num'] + 1,
        )

    broadcast_fields = [('model', weights_type), ('round_num', np.int32)]
    if info_fn is not None:
        broadcast_fields.append(('info', info_fn.type_signature.result))
    broadcast_type = tff.StructWithPythonType(broadcast_fields, collections.OrderedDict)

    @tff.tensorflow.computation(server_state_type.member)
    def server_broadcast(state):
        broadcast = collections.OrderedDict(model=state['model'], round_num=state['round_num'])
        if info_fn is not None:
            broadcast['info'] = info_fn(state['aggregator_state'])
        return broadcast

    @tff.tensorflow.computation(broadcast_type, client_state_type)
    def client_step(broadcast, client_state):
        if info_fn is None:
            outputs = client_work(broadcast['model'], broadcast['round_num'], client_state)
        else:
            outputs = client_work(broadcast['model'], broadcast['round_num'], broadcast['info'], client_state)
        if not fused_mean:
            return outputs
        return collections.OrderedDict(
            sums=collections.OrderedDict(
                weighted_update=weigh(outputs['update'], outputs['weight']),
                weight=outputs['weight'],
                metric_sums=outputs['metric_sums'],
            ),
            client_state=outputs['client_state'],
        )

    @tff.tensorflow.computation(weights_type, np.float32)
    def mean_update(weighted_sum, weight_sum):
        return divide_by_weight(weighted_sum, weight_sum)

    def finish(state, outputs):
        """Aggregation, server update and metrics of a round (federated code)."""
        if fused_mean:
            totals = tff.federated_sum(outputs.sums)
            mean = tff.federated_map(mean_update, (totals.weighted_update, totals.weight))
            aggregator_state = state.aggregator_state  # MeanFactory's: empty
            metrics = building_blocks.training_metrics(totals.metric_sums)
        else:
            if weighted:
                aggregated = aggregation.next(state.aggregator_state, outputs.update, outputs.weight)
            else:
                aggregated = aggregation.next(state.aggregator_state, outputs.update)
            mean, aggregator_state = aggregated.result, aggregated.state
            metrics = building_blocks.aggregate_training_metrics(outputs.metric_sums, aggregated.measurements)
        updated = tff.federated_map(server_update, (state, mean))
        new_state = tff.federated_zip(
            collections.OrderedDict(
                model=updated.model,
                optimizer_state=updated.optimizer_state,
                aggregator_state=aggregator_state,
                round_num=updated.round_num,
            )
        )
        return new_state, metrics

    # The round, written once: `next` in process and the device form are both made from it.
    phases = [device_state.Phase('next', server_broadcast, client_step, finish)]

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        model = tff.federated_broadcast(state.model)
        return tff.federated_map(evaluate_client, (model, client_states))

    personalize = None
    personalize_fn = None
    if personalize_builder is not None:
        personalize = personalize_builder(server_state_type, client_state_type)
        personalize_fn = getattr(personalize_builder, 'client_fn', None)
        if personalize_fn is None:
            raise TypeError('personalize_builder has no client_fn; build it with broadcast_personalize')

    @tff.tensorflow.computation(server_state_type.member)
    def evaluate_input(state):
        return state['model']

    personalize_input = personalize_client = None
    if personalize_fn is not None:
        personalize_input, personalize_client = device_state.field_and_round(
            server_state_type.member, 'model', personalize_fn, client_state_type
        )

    device = device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=phases,
        evaluate_input=evaluate_input,
        evaluate_client=evaluate_client,
        personalize_input=personalize_input,
        personalize_client=personalize_client,
    )

    return template.PersonalizedProcess(
        initialize,
        device_state.next_from_phases(server_state_type, client_state_type, phases),
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        personalize=personalize,
        device=device,
        global_model='model' if shared_indices is None else None,
        non_trainable=model_weights.non_trainable_values(model_fn, seed) if shared_indices is None else (),
        no_global_model=(
            'its server holds only the shared layers of the model, not a whole model (FedPer, FedRep, LG-FedAvg: '
            'each client keeps the others; FedBABU: its head stays at the initialization)'
        ),
        **declared_outputs,
    )
