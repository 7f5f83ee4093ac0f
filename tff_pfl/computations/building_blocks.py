"""Typed computations that several algorithms assemble into rounds.

* `build_client_training`: a client reads its own training split by id,
  starts from broadcast weights and runs local SGD; returns the update in
  TFF's convention (`initial - trained`) and its weight (#examples).
* `build_server_update`: applies an aggregated update with a
  `tff.learning.optimizers` optimizer (SGD with learning rate 1 is FedAvg's
  plain average).
* `build_client_evaluation`: a client's loss/accuracy of given weights on one
  of its splits.
* `server_initialize`, `build_round_number`, `build_client_states_evaluation`
  and `build_evaluation_at`: the small federated wrappers every hand-written
  round repeats (`initialize`, the round number of the server state, an
  `evaluate` of models kept in the client states, and the device form's
  per-client evaluation).
"""

import collections
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import local_training, model_weights, template
from tff_pfl.data import client_data

ModelFn = Callable[[], tf.keras.Model]


def participation_state(client_id, **fields) -> collections.OrderedDict:
    """A client state's common part: its id and participation record (TF code).

    Args:
      client_id: scalar `tf.string`.
      **fields: the algorithm's own initial fields, appended in order.

    Returns:
      `<client_id, num_participations=0, last_round=-1, **fields>`.
    """
    state = collections.OrderedDict(
        client_id=client_id,
        num_participations=tf.constant(0, tf.int32),
        last_round=tf.constant(-1, tf.int32),
    )
    state.update(fields)
    return state


def participated(client_state, round_num, **updates) -> collections.OrderedDict:
    """The client state after taking part in round `round_num` (TF code).

    Args:
      client_state: a state made by `participation_state`.
      round_num: the round just taken part in.
      **updates: new values of the algorithm's own fields.

    Returns:
      A new state, same structure, with participation counted.
    """
    state = collections.OrderedDict((k, client_state[k]) for k in client_state)
    state['num_participations'] = client_state['num_participations'] + 1
    state['last_round'] = round_num
    state.update(updates)
    return state


def training_metric_sums(stats: local_training.Stats) -> collections.OrderedDict:
    """A client's training metrics as sums, ready for one `federated_sum` (TF code).

    Args:
      stats: the `local_training.Stats` of the client's local training.

    Returns:
      `<loss_sum, num_correct, num_examples, num_clients=1.0, local_steps>`,
      all float32; `local_steps` (the SGD steps taken) is reported as the
      round's `mean_local_steps`.
    """
    return collections.OrderedDict(
        loss_sum=stats.loss_sum,
        num_correct=stats.num_correct,
        num_examples=stats.num_examples,
        num_clients=tf.constant(1.0),
        local_steps=tf.cast(stats.num_steps, tf.float32),
    )


def aggregate_training_metrics(client_sums, measurements=None):
    """Round metrics from the clients' `training_metric_sums`, in one sum.

    Must be called inside a `tff.federated_computation`.

    Args:
      client_sums: `{training_metric_sums}@CLIENTS`, optionally with extra
        float entries (e.g. `local_steps`), reported as their client mean
        `mean_<name>`.
      measurements: optional SERVER-placed aggregator measurements, reported
        under `aggregator` when non-empty.

    Returns:
      `<train_loss, train_accuracy, num_examples, num_clients, mean_...,
      aggregator>@SERVER`: the example-weighted loss and accuracy over every
      example seen in local training, the totals, and the extras.
    """
    return training_metrics(tff.federated_sum(client_sums), measurements)


def training_metrics(totals, measurements=None):
    """Round metrics from the sum of the clients' `training_metric_sums`.

    Must be called inside a `tff.federated_computation`; for a round that
    sums the metrics together with other client values in one
    `federated_sum` (`averaging.build_averaging_process`'s default mean).

    Args:
      totals: `{training_metric_sums}` summed over the clients, at SERVER.
      measurements: as in `aggregate_training_metrics`.

    Returns:
      What `aggregate_training_metrics` returns.
    """
    base = ('loss_sum', 'num_correct', 'num_examples', 'num_clients')
    extra = [name for name, _ in tff.structure.iter_elements(totals.type_signature.member) if name not in base]

    @tff.tensorflow.computation(totals.type_signature.member)
    def finalize(sums):
        denominator = tf.maximum(sums['num_examples'], 1.0)
        metrics = collections.OrderedDict(
            train_loss=sums['loss_sum'] / denominator,
            train_accuracy=sums['num_correct'] / denominator,
            num_examples=sums['num_examples'],
            num_clients=tf.cast(sums['num_clients'], tf.int32),
        )
        for name in extra:
            metrics[f'mean_{name}'] = sums[name] / tf.maximum(sums['num_clients'], 1.0)
        return metrics

    metrics = tff.federated_map(finalize, totals)
    if measurements is None or not _has_tensors(measurements.type_signature.member):
        return metrics

    @tff.tensorflow.computation(metrics.type_signature.member, measurements.type_signature.member)
    def merge(metrics, measurements):
        merged = collections.OrderedDict((k, metrics[k]) for k in metrics)
        merged['aggregator'] = measurements
        return merged

    return tff.federated_map(merge, (metrics, measurements))


def with_server_metrics(metrics, extra):
    """Adds SERVER-placed named values to the round metrics.

    Must be called inside a `tff.federated_computation`.

    Args:
      metrics: the round metrics `<...>@SERVER` (e.g. from
        `aggregate_training_metrics`).
      extra: `<name=value, ...>@SERVER`, e.g. a server-side loss.

    Returns:
      `<...metrics, ...extra>@SERVER`.
    """

    @tff.tensorflow.computation(metrics.type_signature.member, extra.type_signature.member)
    def merge(metrics, extra):
        merged = collections.OrderedDict((k, metrics[k]) for k in metrics)
        merged.update((k, extra[k]) for k in extra)
        return merged

    return tff.federated_map(merge, (metrics, extra))


def _has_tensors(type_spec) -> bool:
    if isinstance(type_spec, tff.StructType):
        return any(_has_tensors(t) for t in type_spec)
    return True


def build_client_training(
    spec: client_data.ClientDataSpec,
    model_fn: ModelFn,
    config: local_training.TrainingConfig,
    *,
    seed: int,
    split: str = 'train',
    optimizer: tff.learning.optimizers.Optimizer | None = None,
    loss_fn: local_training.LossFn = local_training.supervised_loss,
    statistics: bool = False,
) -> tff.Computation:
    """Local SGD (or `optimizer`) from given weights on a client's own split.

    Args:
      spec: the partition on disk.
      model_fn: builds a fresh Keras model.
      config: local epochs, batch size and learning rate.
      seed: run seed; with the round number and client id it fixes the
        batch order.
      split: which split to train on.
      optimizer: optional client optimizer (`local_training.train`); None:
        SGD at `config.learning_rate`.
      loss_fn: the loss minimized (`local_training.loss_from` of a
        builder's `loss`).
      statistics: a personal model's training, for a model with
        non-trainable weights (`model_weights.statistics_type`): they start
        from the given ones and the trained ones come back.

    Returns:
      A `tff.tensorflow.computation` `(weights, round_num, client_id) ->
      <update, weight, metric_sums>` where `update = weights - trained
      weights`, `weight` is the number of training examples and
      `metric_sums` the `training_metric_sums` of the examples seen. With
      `statistics`: `(weights, statistics, round_num, client_id) -> <update,
      weight, metric_sums, statistics>`.
    """
    weights_type = model_weights.weights_type(model_fn)

    def train(weights, kept, round_num, client_id):
        data = client_data.read_split(spec, client_id, split)
        model = model_fn()
        if kept is None:
            assigned = model_weights.fresh_weights(model, weights)
        else:
            assigned = model_weights.assign_weights(model, weights) + model_weights.assign_non_trainable(model, kept)
        with tf.control_dependencies(assigned):
            stats = local_training.train_with(
                model,
                data,
                config,
                seed=local_training.client_seed(seed, round_num, client_id),
                optimizer=optimizer,
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
            trained_statistics = None if kept is None else model_weights.get_non_trainable(model)
        result = collections.OrderedDict(
            update=[w - t for w, t in zip(weights, trained)],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=training_metric_sums(stats),
        )
        if kept is not None:
            result['statistics'] = trained_statistics
        return result

    if statistics:

        @tff.tensorflow.computation(weights_type, _statistics_type(model_fn), np.int32, np.str_)
        def personal_training(weights, kept, round_num, client_id):
            return train(weights, kept, round_num, client_id)

        return personal_training

    @tff.tensorflow.computation(weights_type, np.int32, np.str_)
    def client_training(weights, round_num, client_id):
        return train(weights, None, round_num, client_id)

    return client_training


def _statistics_type(model_fn: ModelFn) -> tff.Type:
    kept = model_weights.statistics_type(model_fn)
    if kept is None:
        raise ValueError('statistics=True for a model without non-trainable weights (model_weights.statistics_type)')
    return kept


def build_server_update(
    weights_type: tff.Type, optimizer: tff.learning.optimizers.Optimizer
) -> tuple[tff.Computation, tff.Computation]:
    """The server's optimizer step on aggregated client updates.

    Args:
      weights_type: type of the model weights.
      optimizer: a `tff.learning.optimizers.Optimizer`; it treats the
        aggregated update as a gradient (`w <- w - lr * update`).

    Returns:
      `(init, apply)`: `init: () -> optimizer_state` and
      `apply: (optimizer_state, weights, update) -> <optimizer_state, weights>`,
      both `tff.tensorflow.computation`s.
    """
    specs = tff.types.type_to_tf_tensor_specs(weights_type)

    @tff.tensorflow.computation
    def init():
        return optimizer.initialize(specs)

    state_type = init.type_signature.result

    @tff.tensorflow.computation(state_type, weights_type, weights_type)
    def apply(optimizer_state, weights, update):
        new_state, new_weights = optimizer.next(optimizer_state, weights, update)
        return collections.OrderedDict(optimizer_state=new_state, weights=new_weights)

    return init, apply


def build_client_evaluation(
    spec: client_data.ClientDataSpec,
    model_fn: ModelFn,
    split: str | None = None,
    metrics: local_training.Metrics = (),
    statistics: bool = False,
) -> tff.Computation:
    """A client's loss and accuracy of `weights` on its own `split`.

    Args:
      spec: the partition on disk.
      model_fn: builds a fresh Keras model.
      split: which split to evaluate on; None: `spec.evaluation_split` (the
        test split, or the validation split of a validation curve).
      metrics: a user's extra metrics (`local_training.metrics_from`).
      statistics: a personal model's evaluation, with its own non-trainable
        weights (`model_weights.statistics_type`) instead of a fresh
        model's.

    Returns:
      A `tff.tensorflow.computation` `(weights, client_id) -> <loss, accuracy,
      num_examples, ...metrics>`; with `statistics`, `(weights, statistics,
      client_id) -> ...`.
    """
    weights_type = model_weights.weights_type(model_fn)

    split = spec.evaluation_split if split is None else split

    def evaluate(weights, kept, client_id):
        data = client_data.read_split(spec, client_id, split)
        model = model_fn()
        if kept is None:
            assigned = model_weights.fresh_weights(model, weights)
        else:
            assigned = model_weights.assign_weights(model, weights) + model_weights.assign_non_trainable(model, kept)
        with tf.control_dependencies(assigned):
            stats = local_training.evaluate(model, data)
            extra = local_training.metric_sums(model, data, metrics) if metrics else None
        return template.client_metrics(stats, extra)

    if statistics:

        @tff.tensorflow.computation(weights_type, _statistics_type(model_fn), np.str_)
        def personal_evaluation(weights, kept, client_id):
            return evaluate(weights, kept, client_id)

        return personal_evaluation

    @tff.tensorflow.computation(weights_type, np.str_)
    def client_evaluation(weights, client_id):
        return evaluate(weights, None, client_id)

    return client_evaluation


def server_initialize(server_init: tff.Computation, aggregation=None) -> tff.Computation:
    """A process's `initialize`: the server state made at the server.

    Args:
      server_init: a no-arg `tff.tensorflow.computation` returning the server
        state (an ordered mapping).
      aggregation: optional `tff.templates.AggregationProcess` whose state
        the server keeps: appended to the state as `aggregator_state`.

    Returns:
      A no-arg `tff.federated_computation` returning `server_init()@SERVER`,
      with `aggregator_state` after its fields when `aggregation` is given.
    """
    if aggregation is None:

        @tff.federated_computation
        def initialize():
            return tff.federated_eval(server_init, tff.SERVER)

        return initialize

    @tff.tensorflow.computation(server_init.type_signature.result, aggregation.initialize.type_signature.result.member)
    def with_aggregator(state, aggregator_state):
        return collections.OrderedDict(**state, aggregator_state=aggregator_state)

    @tff.federated_computation
    def initialize_with_aggregator():
        made = tff.federated_eval(server_init, tff.SERVER)
        return tff.federated_map(with_aggregator, (made, aggregation.initialize()))

    return initialize_with_aggregator


def build_round_number(state_type: tff.Type) -> tff.Computation:
    """The round number of a server state that holds one (`round_num`).

    Args:
      state_type: the (unplaced) server state type, with an int32 `round_num`.

    Returns:
      A `tff.tensorflow.computation` `state -> state.round_num`.
    """

    @tff.tensorflow.computation(state_type)
    def round_of(state):
        return state['round_num']

    return round_of


def build_client_states_evaluation(server_state_type: tff.Type, evaluate_client: tff.Computation) -> tff.Computation:
    """`evaluate` of personalized models kept in the client states.

    The server state is not used: each client evaluates what its own state
    holds.

    Args:
      server_state_type: the SERVER-placed server state type (the result of
        `initialize`).
      evaluate_client: a `tff.tensorflow.computation` `client_state ->
        metrics`.

    Returns:
      A `tff.federated_computation` `(server_state@SERVER,
      {client_state}@CLIENTS) -> {metrics}@CLIENTS`.
    """
    client_states_type = tff.FederatedType(evaluate_client.type_signature.parameter, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        del state
        return tff.federated_map(evaluate_client, client_states)

    return evaluate


def build_evaluation_at(evaluate_client: tff.Computation, input_type=np.int32) -> tff.Computation:
    """The device form's per-client evaluation when the broadcast value is not needed.

    `device_state.build_device_process` evaluates with one broadcast value
    (`evaluate_input`); a method whose personalized model is in the client
    state needs none and takes the round number only to fit.

    Args:
      evaluate_client: a `tff.tensorflow.computation` `client_state ->
        metrics`.
      input_type: the type of the broadcast value (default: the int32 round
        number).

    Returns:
      A `tff.tensorflow.computation` `(value, client_state) ->
      evaluate_client(client_state)`.
    """

    @tff.tensorflow.computation(input_type, evaluate_client.type_signature.parameter)
    def evaluate_at(value, client_state):
        del value  # the personalized model is in the client state
        return evaluate_client(client_state)

    return evaluate_at


# The keyword arguments every `build_<algo>_process` takes (docs/architecture.md, "One builder contract").
CONTRACT_KEYWORDS = ('client_optimizer', 'server_optimizer', 'model_aggregator', 'loss', 'metrics')


def refuse_unused(builder: str, reasons: dict[str, str], **given) -> None:
    """Refuses, in one line, a contract keyword the algorithm cannot use.

    Every builder takes `client_optimizer`, `server_optimizer`,
    `model_aggregator`, `loss` and `metrics` and passes them here: one whose
    algorithm has no place for one of them (e.g. a serverless algorithm and
    a server optimizer) says so instead of ignoring it, and the optimizers it
    uses are checked to be TFF's (the loss and metrics are checked by
    `local_training.loss_from` and `metrics_from`).

    Args:
      builder: the builder's name, e.g. 'build_selffl_process'.
      reasons: keyword -> why the algorithm cannot use it (completes
        "<builder> takes no <keyword>: ...").
      **given: the keywords' values as passed (None: not given).

    Raises:
      ValueError: for the first keyword given a value that has a reason.
      TypeError: for an optimizer the algorithm uses that is not a
        `tff.learning.optimizers.Optimizer` (`check_optimizer`), or a
        `model_aggregator` that is not a TFF aggregation factory instance
        (`check_aggregator`).
    """
    for name, value in given.items():
        if value is not None and name in reasons:
            raise ValueError(f'{builder} takes no {name}: {reasons[name]}')
    for name in ('client_optimizer', 'server_optimizer'):
        check_optimizer(name, given.get(name))
    check_aggregator(given.get('model_aggregator'))


_AGGREGATION_FACTORIES = (tff.aggregators.UnweightedAggregationFactory, tff.aggregators.WeightedAggregationFactory)


def check_aggregator(value) -> None:
    """Checks that a `model_aggregator` is a TFF aggregation factory instance.

    Args:
      value: its value (None passes: the algorithm's default).

    Raises:
      TypeError: in one line, for a factory class instead of an instance,
        or anything else that is not a TFF aggregation factory.
    """
    if value is None or isinstance(value, _AGGREGATION_FACTORIES):
        return
    if isinstance(value, type) and issubclass(value, _AGGREGATION_FACTORIES):
        raise TypeError(
            f'model_aggregator must be an aggregation factory instance, got the class {value.__name__}; '
            f'pass {value.__name__}(...) (e.g. tff.aggregators.MeanFactory())'
        )
    raise TypeError(
        'model_aggregator must be a tff.aggregators factory (e.g. tff.aggregators.MeanFactory() or '
        f'tff.learning.robust_aggregator()), got {type(value).__name__} {value!r:.60}'
    )


def check_optimizer(name: str, value) -> None:
    """Checks that a `client_optimizer` / `server_optimizer` is a TFF optimizer.

    Args:
      name: the argument's name.
      value: its value (None passes: the algorithm's default).

    Raises:
      TypeError: if `value` is neither None nor a
        `tff.learning.optimizers.Optimizer`.
    """
    if value is not None and not isinstance(value, tff.learning.optimizers.Optimizer):
        raise TypeError(
            f'{name} must be a tff.learning.optimizers.Optimizer (e.g. tff.learning.optimizers.build_adam(0.01)), '
            f'got {type(value).__name__}'
        )
