"""FedDBE: a personal bias added to the representation, and its running mean pulled to the global mean.

J. Zhang, Y. Hua, J. Cao, H. Wang, T. Song, Z. Xue, R. Ma, H. Guan,
"Eliminating Domain Bias for Federated Learning in Representation Space"
(NeurIPS 2023), as the authors' code (PFLlib's clientdbe.py / serverdbe.py)
runs it on a FedAvg server.

The model is a feature extractor z = f(x; theta) and a head h(.; psi), the last
layer with weights; z is the head's input. Each client i keeps a personalized
representation bias (PRBM) zbar_i^p (a vector of z's width, zero at first),
never uploaded. Over its batches x_1, x_2, ... it keeps the running mean

  zbar_i^0 = 0,  zbar_i^s = (1 - mu) sg[zbar_i^{s-1}] + mu mean_j f(x_{s,j}; theta)

(mu: `feddbe_momentum`; restarted every round; sg: stop-gradient), and each
step is SGD at the client learning rate on theta, psi and zbar_i^p of

  L_i = mean_j l(y_j, h(f(x_j; theta) + zbar_i^p; psi))
        + kappa mean_k 0.5 (zbar_{i,k}^s - zbar^g_k)^2     (MR: mean regularization)

(kappa: `feddbe_kl_weight`). In the first round (round 0) the global mean
zbar^g does not exist yet: the clients train h(f(x)) without the bias and
without MR, and each uploads with its model update n_i zbar_i (its running mean
after local training, n_i its training examples); the server sets once

  zbar^g = sum_i n_i zbar_i / sum_i n_i

(the example-weighted mean, as serverdbe.py forms it; here over round 0's
clients, where the authors' code runs an extra pass of every client before
round 0). zbar^g then stays fixed. The model update is averaged as FedAvg's,
Theta^{t+1} = Theta^t - eta_g sum_i (n_i / n) (Theta^t - theta_i^{t+1}); the
bias never leaves the client. `global_model` is Theta; `personalized_model`
is h(f(x; Theta) + zbar_i^p; Psi), the global model with the client's bias.
With a `model_aggregator` (DP, secure sums) each client uploads one record,
[Theta^t - theta_i^{t+1}, zbar_i] (zeros in zbar_i's place after round 0),
aggregated as one: a weighted factory, given n_i, forms both means above; DP
clips the record jointly, so user-level DP covers zbar_i too.
docs/algorithms/feddbe.md maps each equation to the code.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper, head_split
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    averaging,
    builder_inputs,
    building_blocks,
    device_state,
    local_training,
    model_weights,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder and its settings.
__all__ = ['build_feddbe_process', 'FedDBESettings']


@dataclasses.dataclass(frozen=True)
class FedDBESettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedDBE (`feddbe`): FedAvg with a personal bias on the representation and a mean regularizer."""

    feddbe_momentum: float = settings_lib.setting(
        0.1, "FedDBE: mu, the weight of each batch's representation mean in the client's running mean."
    )
    feddbe_kl_weight: float = settings_lib.setting(
        0.0,
        "FedDBE: kappa, the weight of MR, the mean of 0.5 (running mean - global mean)^2 over the representation's "
        'units (0, as in PFLlib: the bias alone).',
    )

    def _checks(self):
        return super()._checks() + [
            (0 < self.feddbe_momentum <= 1, f'feddbe_momentum must be in (0, 1], got {self.feddbe_momentum}'),
            (self.feddbe_kl_weight >= 0, f'feddbe_kl_weight must be >= 0, got {self.feddbe_kl_weight}'),
        ]


def _representation_width(model_fn: Callable[[], tf.keras.Model]) -> int:
    """z's width; refuses, in one line, a model whose head is not one chain ending at the output or z not a vector."""
    name, is_chain, shape, _ = head_split.inspect(model_fn)
    if not is_chain or len(shape) != 2 or shape[-1] is None:
        raise ValueError(
            f"model_fn: FedDBE adds a bias to the head's input, and in {name!r} the layers from the last with "
            'weights on are not one chain on a [batch, width] input ending at the output'
        )
    return int(shape[-1])


@builder_inputs.checked
def build_feddbe_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedDBESettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedDBE (PRBM and MR on a FedAvg server) as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out),
        Sequential or functional, with a layer before the last with weights;
        the layers from the last with weights on must be one chain on a
        `[batch, width]` representation.
      settings: local work, batch size, learning rate (of the model and the
        bias), the server learning rate, `feddbe_momentum` and
        `feddbe_kl_weight`; None: `FedDBESettings()`.
      client_optimizer: not taken (ValueError if given): each step is SGD on
        the model and the bias at `client_learning_rate`.
      server_optimizer: applied to the mean of the model updates (by
        examples, unless `model_aggregator` says otherwise); None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of each client's one record, the model
        update and its running mean zbar_i (round 0; zeros later) as
        `[update tensors..., zbar_i]`. A weighted factory receives n_i (the
        paper's example-weighted means); an unweighted one (user-level DP,
        `privacy.DPConfig.factory`) counts every client once and clips the
        record jointly. Default (None): the example-weighted means, fused
        into one `federated_sum` with the metrics.
      loss: l, as the builder contract takes it (`local_training.loss_from`;
        None: cross-entropy).
      metrics: extra per-client test metrics (`local_training.metrics_from`).
      seed: run seed; fixes the initial model.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model, optimizer_state,
      global_mean, round_num>`, and `aggregator_state` with a
      `model_aggregator` (whose measurements are the metrics' `aggregator`);
      client state: `<client_id, num_participations, last_round, bias>`;
      `evaluate`: `<global_model, personalized_model>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: the model has no layer with weights before its head, or
        its head is not a chain on a vector (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedDBESettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_feddbe_process',
        dict(
            client_optimizer='each step is SGD on the model and the bias at client_learning_rate',
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    fedper.split_layers(model_fn, 1, who='FedDBE', setting='head_layers', rest='feature extractor')
    width = _representation_width(model_fn)
    weights_type = model_weights.weights_type(model_fn)
    loss_fn = local_training.loss_from(loss, spec)
    work = settings.training_config()
    mu, kappa = settings.feddbe_momentum, settings.feddbe_kl_weight
    user_metrics = local_training.metrics_from(metrics, spec)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, metrics=user_metrics)
    optimizer_init, optimizer_apply = building_blocks.build_server_update(
        weights_type, server_optimizer or settings.server_optimizer()
    )
    # The default: the example-weighted means of the updates and of the running means in one `federated_sum`.
    fused = model_aggregator is None
    weighted = isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory)
    aggregation = None
    if not fused:
        # One record a client, so that DP clips (and secure sums bound) the running mean with the update.
        record_type = tff.StructWithPythonType([*weights_type, tff.TensorType(np.float32, [width])], list)
        if weighted:
            aggregation = model_aggregator.create(record_type, tff.TensorType(np.float32))
        else:
            aggregation = model_aggregator.create(record_type)

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id, bias=tf.zeros([width]))

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            model=model_weights.initial_weights(model_fn, seed),
            optimizer_state=optimizer_init(),
            global_mean=tf.zeros([width]),
            round_num=tf.constant(0, tf.int32),
        )

    initialize = building_blocks.server_initialize(server_init, aggregation)
    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(server_state_type.member)
    def broadcast(state):
        return collections.OrderedDict((k, state[k]) for k in ('model', 'global_mean', 'round_num'))

    @tff.tensorflow.computation(broadcast.type_signature.result, client_state_type)
    def client_work(value, client_state):
        client_id, round_num, weights = client_state['client_id'], value['round_num'], value['model']
        dbe = tf.cast(round_num > 0, tf.float32)  # round 0: no bias, no MR (zbar^g not formed yet)
        data = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        split = head_split.BodyHead(model)
        bias = tf.Variable(tf.zeros([width]), name='prbm')
        variables = model.trainable_variables + [bias]
        assigned = model_weights.fresh_weights(model, weights) + [bias.assign(client_state['bias'])]
        lr = tf.cast(work.learning_rate, tf.float32)

        def step(batches, running):
            x, y, n = batches[0]
            with tf.GradientTape() as tape:
                z = split.features(x, training=True)
                running = (1.0 - mu) * tf.stop_gradient(running) + mu * tf.reduce_mean(z, axis=0)
                logits = split.logits(z + dbe * bias, training=True)
                supervised, _ = loss_fn(lambda _, training=True: logits, x, y)
                mr = tf.reduce_mean(0.5 * tf.square(running - value['global_mean']))
                total = supervised + dbe * kappa * mr
            grads = local_training.dense_gradients(tape, total, variables)
            for variable, grad in zip(variables, grads):
                variable.assign_sub(lr * grad)
            return tf.stop_gradient(running), local_training.batch_stats(supervised, logits, y, n)

        with tf.control_dependencies(assigned):
            running, stats = local_training.sgd_steps(
                data,
                step,
                epochs=work.epochs,
                batch_size=work.batch_size,
                seed=local_training.client_seed(seed, round_num, client_id),
                carry=tf.zeros([width]),
                max_steps=work.max_steps,
            )
        with tf.control_dependencies(list(stats) + [running]):
            trained = [tf.identity(v) for v in model.trainable_variables]
            new_bias = tf.identity(bias)
        n = tf.cast(data.num_examples, tf.float32)
        update = [w - t for w, t in zip(weights, trained)]
        metric_sums = building_blocks.training_metric_sums(stats)
        new_state = building_blocks.participated(client_state, round_num, bias=new_bias)
        if not fused:  # the record the aggregator weighs (n_i), clips and sums; its mean is read in round 0 only
            outputs = collections.OrderedDict(record=update + [(1.0 - dbe) * running])
            if weighted:
                outputs['weight'] = n
            outputs.update(metric_sums=metric_sums, client_state=new_state)
            return outputs
        return collections.OrderedDict(
            sums=collections.OrderedDict(
                weighted_update=averaging.weigh(update, n),
                weight=n,
                weighted_mean=(1.0 - dbe) * n * running,  # read in round 0 only
                metric_sums=metric_sums,
            ),
            client_state=new_state,
        )

    def server_step(state, update, formed):
        """The server optimizer on the mean update; zbar^g set to `formed` in round 0, then kept (TF code)."""
        applied = optimizer_apply(state['optimizer_state'], state['model'], update)
        new_state = collections.OrderedDict(state)
        new_state.update(
            model=applied['weights'],
            optimizer_state=applied['optimizer_state'],
            global_mean=tf.cond(state['round_num'] > 0, lambda: state['global_mean'], lambda: formed),
            round_num=state['round_num'] + 1,
        )
        return new_state

    if fused:

        @tff.tensorflow.computation(server_state_type.member, client_work.type_signature.result['sums'])
        def server_update(state, totals):
            update = averaging.divide_by_weight(totals['weighted_update'], totals['weight'])
            formed = totals['weighted_mean'] / tf.maximum(totals['weight'], 1e-12)  # zbar^g
            return server_step(state, update, formed)

    else:

        @tff.tensorflow.computation(
            server_state_type.member, record_type, aggregation.next.type_signature.result.state.member
        )
        def server_update(state, mean, aggregator_state):
            new_state = server_step(state, mean[:-1], mean[-1])  # [the mean update, zbar^g]
            new_state['aggregator_state'] = aggregator_state
            return new_state

    def finish(state, outputs):
        """Aggregation, server step and metrics of a round (federated code)."""
        if fused:
            totals = tff.federated_sum(outputs.sums)
            metrics = building_blocks.training_metrics(totals.metric_sums)
            return tff.federated_map(server_update, (state, totals)), metrics
        if weighted:
            aggregated = aggregation.next(state.aggregator_state, outputs.record, outputs.weight)
        else:
            aggregated = aggregation.next(state.aggregator_state, outputs.record)
        metrics = building_blocks.aggregate_training_metrics(outputs.metric_sums, aggregated.measurements)
        return tff.federated_map(server_update, (state, aggregated.result, aggregated.state)), metrics

    # The round, written once: `next` in process and the device form are both made from it.
    phases = [device_state.Phase('next', broadcast, client_work, finish)]

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        model = model_fn()
        split = head_split.BodyHead(model)
        assigned = model_weights.fresh_weights(model, weights)
        with tf.control_dependencies(assigned):
            data = client_data.read_split(spec, client_state['client_id'], spec.evaluation_split)

            def personalized(x, training=False):
                return split.logits(split.features(x, training) + client_state['bias'], training)

            stats = local_training.evaluate(personalized, data)
            extra = local_training.metric_sums(personalized, data, user_metrics) if user_metrics else None
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_state['client_id']),
            personalized_model=template.client_metrics(stats, extra),
        )

    @tff.federated_computation(server_state_type, tff.FederatedType(client_state_type, tff.CLIENTS))
    def evaluate(state, client_states):
        return tff.federated_map(evaluate_client, (tff.federated_broadcast(state.model), client_states))

    @tff.tensorflow.computation(server_state_type.member)
    def evaluate_input(state):
        return state['model']

    device = device_state.build_device_process(
        initialize, initial_client_state, phases=phases, evaluate_input=evaluate_input, evaluate_client=evaluate_client
    )
    return template.PersonalizedProcess(
        initialize,
        device_state.next_from_phases(server_state_type, client_state_type, phases),
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        device=device,
        global_model='model',
        non_trainable=model_weights.non_trainable_values(model_fn, seed),
    )


def _record_upload(settings, spec, process, client_fraction):
    """One noised mean: the model's parameters and the representation's width, over client_fraction x N clients."""
    del settings
    state = process.initialize.type_signature.result.member
    dimension = sum(int(np.prod(t.shape)) for t in [*state['model'], state['global_mean']])
    return [algorithm.Upload(dimension, client_fraction * spec.num_clients)]


ALGORITHMS = (
    algorithm.Algorithm(
        'feddbe',
        'FedDBE (Zhang et al., 2023): FedAvg with a personal bias on the representation (PRBM) and its running '
        'mean pulled to the global mean (MR)',
        FedDBESettings,
        algorithm.model_update_builder(build_feddbe_process),
        # Logistic regression has one layer: there would be no representation under the head.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy(
            'the model updates and, in round 0, the representation mean, as one record per client (the personal '
            'bias stays on the clients)',
            dp_uploads=_record_upload,
        ),
        family='parameter decoupling',
    ),
)
