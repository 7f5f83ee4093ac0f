"""FedProto: clients share class prototypes, never models.

Y. Tan, G. Long, L. Liu, T. Zhou, Q. Lu, J. Jiang, C. Zhang, "FedProto:
Federated Prototype Learning across Heterogeneous Clients" (AAAI 2022).

Each client i keeps its whole model F_i = g_i o f_i in its client state (at
first the run seed's initial model): the body f_i (the embedding h = f_i(x):
the input of the first of the last `fedproto_head_layers` layers with weights)
and the head g_i. The server holds the global prototypes C_bar^(j) of the
classes j that have one. In round t it broadcasts them; each sampled client
runs SGD over its batches B on

  L(B) = CE(F_i(x), y) + lambda * L_R,
  L_R  = 1 / (|B| d) * sum_{(x, y) in B, y has a C_bar} || f_i(x) - C_bar^(y) ||^2,

(d the embedding width: the mean squared error over the batch's elements, as
the authors' code takes nn.MSELoss, an example of a class without a global
prototype adding 0), then computes its local prototypes with the trained
model over its training split (Eq. 4),

  C_i^(j) = 1 / |D_{i,j}| sum_{(x, y) in D_{i,j}} f_i(x),

and uploads u_i^(j) = C_i^(j) * [j in D_i] and the presence [j in D_i]. The
server sums both and takes, for each class some sampled client has,

  C_bar^(j) = sum_i u_i^(j) / sum_i [j in D_i]        (Eq. 5 as the code has it:
                                                         an equal mean over N_j),

a class no sampled client has has no global prototype in the next round (the
authors' server rebuilds them from each round's uploads). There is no global
model: `evaluate` reports each client's own model as `personalized_model`.

Privacy (`dp=`, `secure=`): the record r_i = (u_i, [j in D_i]) is one upload
per client. Under user-level DP it is clipped as a whole to L2 norm C (scale
s_i = min(1, C / ||r_i||), the same for both parts), summed, noised with
N(0, (z C)^2) per coordinate and divided by the expected clients per round
(TFF's `DifferentiallyPrivateFactory`); the ratio above is then a mean
weighted by s_i, and a class keeps a global prototype only where its noised
count exceeds max(3 z, 0.001) C over the clients per round (a count within
three noise deviations of 0 would divide noise by noise). Secure sums carry
the record without DP within TFF's adaptive range; a class then needs a count
above 1/2 (the plain sum's counts are whole numbers).
docs/algorithms/fedproto.md maps each equation to the code.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    builder_inputs,
    building_blocks,
    device_state,
    local_training,
    model_weights,
    privacy,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedproto_process', 'FedProtoSettings']

# Examples per forward pass when a client computes its prototypes (memory bound only).
_PROTOTYPE_BATCH = 1000
# Under DP a class keeps a global prototype where its noised count exceeds this many noise deviations
# (z C), with a floor of _DP_COUNT_FLOOR C for z = 0 (the secure sum's quantization is not zero).
_DP_COUNT_DEVIATIONS = 3.0
_DP_COUNT_FLOOR = 1e-3
# Without DP the counts are whole numbers: a class has a prototype from one client on (the secure sum's
# quantization can leave a count of about 1e-9 where no client had the class).
_PLAIN_COUNT_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class FedProtoSettings(settings_lib.LocalTraining):
    """FedProto (`fedproto`): each client's own model, regularized towards the global class prototypes."""

    fedproto_lambda: float = settings_lib.setting(
        1.0,
        'FedProto: lambda, the weight of the prototype loss (the mean squared error between the embeddings and '
        "their class's global prototype); the authors' default --ld 1.",
    )
    fedproto_head_layers: int = settings_lib.setting(
        1,
        'FedProto: how many of the last layers with weights are the head; the embedding is the input of the '
        'first of them (1: the input of the classifier).',
    )

    def _checks(self):
        return super()._checks() + [
            (self.fedproto_lambda >= 0, f'fedproto_lambda must be >= 0, got {self.fedproto_lambda}'),
            (self.fedproto_head_layers >= 1, f'fedproto_head_layers must be >= 1, got {self.fedproto_head_layers}'),
        ]


def _embedding_layer(model_fn: Callable[[], tf.keras.Model], head_layers: int) -> tuple[int, int]:
    """`(index in model.layers of the head's first layer, embedding width)`; refuses an unfit model in one line."""
    with tf.Graph().as_default():
        model = model_fn()
        weighted = [layer for layer in getattr(model, 'layers', []) if layer.trainable_weights]
        if not weighted and model.trainable_variables:  # a FunctionalModel (models.adapters)
            raise ValueError(
                f"model_fn: FedProto reads the embedding between the model's Keras layers and {model.name!r} has no "
                'Keras layers; pass a Keras model function'
            )
        if not 1 <= head_layers < len(weighted):
            raise ValueError(
                f'fedproto_head_layers={head_layers} leaves no body: model {model.name!r} has {len(weighted)} '
                f'layer(s) with weights; FedProto needs at least {head_layers + 1}'
            )
        start = model.layers.index(weighted[-head_layers])
        try:
            shape = model.layers[start].input.shape
            single = len(model.inputs) == 1 and len(model.outputs) == 1
        except (AttributeError, TypeError, ValueError):  # no graph (a subclassed model) or a shared layer
            shape, single = None, False
    if not single or shape is None or shape.rank != 2 or shape[-1] is None:
        raise ValueError(
            f'model_fn: FedProto takes the embedding at the input of layer {model.layers[start].name!r} and needs '
            f'one input, one output and a [batch, d] embedding there, got {shape}'
        )
    return start, int(shape[-1])


def _with_embedding(model: tf.keras.Model, start: int) -> tf.keras.Model:
    """`x -> (f(x), F(x))` over `model`'s own layers and variables (TF code)."""
    return tf.keras.Model(model.inputs, [model.layers[start].input, model.outputs[0]])


def _prototype_loss(embedding, labels, prototypes, has_prototype):
    """L_R: sum of ||f(x) - C_bar^(y)||^2 over the batch's examples whose class has one, over |B| d (TF code)."""
    present = tf.gather(has_prototype, labels)
    squared = tf.reduce_sum(tf.square(embedding - tf.gather(prototypes, labels)), axis=1)
    size = tf.cast(tf.size(embedding), tf.float32)
    return tf.reduce_sum(present * squared) / tf.maximum(size, 1.0)


def _local_prototypes(both: tf.keras.Model, data: client_data.ClientSplit, num_classes: int, width: int):
    """`(C_i * presence [K, d], presence [K])` of the trained model over the whole split (TF code)."""
    num_examples = data.num_examples

    def body(start, sums, counts):
        stop = tf.minimum(start + _PROTOTYPE_BATCH, num_examples)
        x, y = data.slice(start, stop)
        embedding, _ = both(x, training=False)
        sums += tf.math.unsorted_segment_sum(embedding, y, num_classes)
        counts += tf.math.unsorted_segment_sum(tf.ones_like(y, tf.float32), y, num_classes)
        return stop, sums, counts

    _, sums, counts = tf.while_loop(
        lambda start, *_: start < num_examples,
        body,
        (tf.constant(0), tf.zeros([num_classes, width]), tf.zeros([num_classes])),
    )
    present = tf.cast(counts > 0, tf.float32)
    return sums / tf.maximum(counts, 1.0)[:, None], present


@builder_inputs.checked
def build_fedproto_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedProtoSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
    dp: privacy.DPConfig | None = None,
    secure: bool = False,
) -> template.PersonalizedProcess:
    """Builds FedProto as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk; one class label per example.
      model_fn: no-arg function returning a fresh Keras model (logits out),
        Sequential or functional, with one input and one output; the
        embedding is the input of the head's first layer and must be
        `[batch, d]`.
      settings: local epochs or steps per round, batch size, learning rate,
        `fedproto_lambda` and `fedproto_head_layers`; None:
        `FedProtoSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): the server averages
        prototypes, it takes no optimizer step.
      model_aggregator: not taken (ValueError if given): no model is
        uploaded; the prototypes are summed (`dp`, `secure`).
      loss: the supervised loss L_S on the logits, as the builder contract
        takes it (`local_training.loss_from`; None: cross-entropy); the
        prototype term is added to it.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; fixes the common initial model and the batch orders.
      dp: user-level DP of the prototype uploads, with a fixed clip (the
        module docstring: each client's record clipped as a whole, noised at
        SERVER); None: summed in the clear.
      secure: sum the records with TFF's secure sums (`SecureSumFactory`:
        in [-C, C] under DP, in TFF's adaptive range without).

    Returns:
      A `template.PersonalizedProcess`. Server state: `<prototypes [K, d],
      prototype_clients [K] (how many clients of the last round had the
      class, under DP its clipped, noised count over the clients per round;
      0: no global prototype), round_num>`, with `aggregator_state` under DP
      or secure sums; client state:
      `<client_id, num_participations, last_round, model>`; metrics: the
      training metrics and `num_prototypes`; `evaluate`:
      `<personalized_model>` per client.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: sequence labels, a model without a body or a `[batch,
        d]` embedding, or `dp` with adaptive clipping (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedProtoSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedproto_process',
        dict(
            server_optimizer='the server averages the prototypes, it takes no optimizer step',
            model_aggregator=(
                'FedProto uploads no model: its per-class prototypes are summed; pass dp= and secure= for DP and '
                'secure sums'
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    if tuple(spec.label_shape):
        raise ValueError(f'FedProto takes one class label per example, got labels of shape {tuple(spec.label_shape)}')
    if dp is not None and dp.adaptive:
        raise ValueError(
            "dp: FedProto's DP needs a fixed clip (its count threshold is a multiple of it): pass a DPConfig with "
            'clip=, not target_quantile='
        )
    start, width = _embedding_layer(model_fn, settings.fedproto_head_layers)
    num_classes = spec.num_classes
    loss_fn = local_training.loss_from(loss, spec)
    work = settings.training_config()
    lam = settings.fedproto_lambda
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id, model=model_weights.initial_weights(model_fn, seed))

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            prototypes=tf.zeros([num_classes, width]),
            prototype_clients=tf.zeros([num_classes]),
            round_num=tf.constant(0, tf.int32),
        )

    # What the clients receive: the server state without the aggregator's.
    broadcast_type = server_init.type_signature.result

    @tff.tensorflow.computation(broadcast_type, client_state_type)
    def client_work(value, client_state):
        client_id, round_num = client_state['client_id'], value['round_num']
        prototypes = value['prototypes']
        has_prototype = tf.cast(value['prototype_clients'] > 0, tf.float32)
        data = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        assigned = model_weights.fresh_weights(model, client_state['model'])
        both = _with_embedding(model, start)

        def fedproto_loss(_, x, y):
            embedding, logits = both(x, training=True)
            supervised, _ = loss_fn(lambda _, training=True: logits, x, y)  # L_S
            return supervised + lam * _prototype_loss(embedding, y, prototypes, has_prototype), logits

        with tf.control_dependencies(assigned):
            stats = local_training.train_with(
                model,
                data,
                work,
                seed=local_training.client_seed(seed, round_num, client_id),
                loss_fn=fedproto_loss,
                optimizer=client_optimizer,
            )
        with tf.control_dependencies(list(stats)):
            trained = [tf.identity(v) for v in model.trainable_variables]
        with tf.control_dependencies(trained):
            means, present = _local_prototypes(both, data, num_classes, width)
        return collections.OrderedDict(
            prototypes=collections.OrderedDict(sums=means * present[:, None], clients=present),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num, model=trained),
        )

    record_type = client_work.type_signature.result['prototypes']
    aggregation, threshold = _record_aggregation(record_type, dp, secure)
    initialize = building_blocks.server_initialize(server_init, aggregation)

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(server_state_type.member)
    def broadcast(state):
        return collections.OrderedDict((k, state[k]) for k in ('prototypes', 'prototype_clients', 'round_num'))

    @tff.tensorflow.computation(np.int32, record_type)
    def server_update(round_num, summed):
        clients = tf.where(summed['clients'] > threshold, summed['clients'], 0.0)  # 0: no global prototype
        prototypes = tf.math.divide_no_nan(summed['sums'], clients[:, None])
        new_state = collections.OrderedDict(prototypes=prototypes, prototype_clients=clients, round_num=round_num + 1)
        return collections.OrderedDict(
            state=new_state,
            metrics=collections.OrderedDict(num_prototypes=tf.reduce_sum(tf.cast(clients > 0, tf.int32))),
        )

    def finish(state, outputs):
        if aggregation is None:
            summed, measurements = tff.federated_sum(outputs.prototypes), None
        else:
            aggregated = aggregation.next(state.aggregator_state, outputs.prototypes)
            summed, measurements = aggregated.result, aggregated.measurements
        updated = tff.federated_map(server_update, (state.round_num, summed))
        new_state = updated.state
        if aggregation is not None:
            new_state = tff.federated_zip(
                collections.OrderedDict(
                    prototypes=new_state.prototypes,
                    prototype_clients=new_state.prototype_clients,
                    round_num=new_state.round_num,
                    aggregator_state=aggregated.state,
                )
            )
        metrics = building_blocks.aggregate_training_metrics(outputs.metric_sums, measurements)
        return new_state, building_blocks.with_server_metrics(metrics, updated.metrics)

    # The round, written once: `next` in process and the device form are both made from it.
    phases = [device_state.Phase('next', broadcast, client_work, finish)]

    @tff.tensorflow.computation(client_state_type)
    def evaluate_client(client_state):
        return collections.OrderedDict(
            personalized_model=client_evaluation(client_state['model'], client_state['client_id'])
        )

    device = device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=phases,
        evaluate_input=building_blocks.build_round_number(server_state_type.member),
        evaluate_client=building_blocks.build_evaluation_at(evaluate_client),
    )
    return template.PersonalizedProcess(
        initialize,
        device_state.next_from_phases(server_state_type, client_state_type, phases),
        initial_client_state=initial_client_state,
        evaluate=building_blocks.build_client_states_evaluation(server_state_type, evaluate_client),
        device=device,
        no_global_model='FedProto shares class prototypes, not a model; each client trains its own',
    )


def _record_aggregation(record_type, dp, secure):
    """`(aggregation process or None, the count a class needs for a global prototype)`.

    None: the plain `federated_sum` (kept as the default's one sum). Under DP,
    `dp.factory`: the record clipped as a whole, summed (securely with
    `secure`), noised, divided by the expected clients per round; without DP,
    `secure` sums it in TFF's adaptive range.
    """
    if dp is not None:
        deviations = max(_DP_COUNT_DEVIATIONS * float(dp.noise_multiplier), _DP_COUNT_FLOOR)
        threshold = deviations * float(dp.clip) / float(dp.clients_per_round)
        return dp.factory(secure=secure).create(record_type), threshold
    if secure:
        return tff.aggregators.SecureSumFactory(privacy.secure_range()).create(record_type), _PLAIN_COUNT_THRESHOLD
    return None, _PLAIN_COUNT_THRESHOLD


def _uploads(settings, spec, process, client_fraction):
    """The noised mean of a DP round: one record of K x (d + 1) coordinates per client."""
    width = int(process.initialize.type_signature.result.member['prototypes'].shape[1])
    return [algorithm.Upload(spec.num_classes * (width + 1), client_fraction * spec.num_clients, 'prototypes')]


def _build(settings, spec, model_fn, run):
    return build_fedproto_process(spec, model_fn, settings, seed=run.seed, dp=run.dp, secure=run.secure)


# Why FedProto's DP takes a fixed clip (one line): the count threshold is a multiple of it.
ADAPTIVE_CLIP_REFUSED = (
    "FedProto's DP keeps a global prototype only where a class's noised count clears a multiple of the clip, which "
    'must be fixed: give --dp_clip, not --dp_target_quantile'
)


ALGORITHMS = (
    algorithm.Algorithm(
        'fedproto',
        'FedProto (Tan et al., 2022): each client its own model, regularized towards the global class prototypes',
        FedProtoSettings,
        _build,
        # Logistic regression has one layer: there would be no body to take the embedding from.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy(
            "each client's per-class prototypes with their presence, as one record (the models stay on the clients)",
            fixed_clip_only=ADAPTIVE_CLIP_REFUSED,
            dp_uploads=_uploads,
        ),
        family='knowledge distillation',
    ),
)
