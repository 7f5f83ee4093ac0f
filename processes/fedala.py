"""FedALA: FedAvg whose clients start each round from an adaptive, element-wise mix of the global model and their own.

J. Zhang, Y. Hua, H. Wang, T. Song, Z. Xue, R. Ma, H. Guan, "FedALA: Adaptive
Local Aggregation for Personalized Federated Learning" (AAAI 2023), Algorithm 1.

The server is FedAvg's. Each client i keeps its last trained model theta_i
and element-wise aggregation weights W_i of the top p layers (the last
`fedala_layers` layers with weights). In round t the server broadcasts
Theta^t; each sampled client

1. adaptive local aggregation (ALA): theta_hat = theta_i + (Theta^t - theta_i) * W
   (element-wise), W = 1 on the lower layers (they take Theta^t) and W = W_i
   on the top p, learned with theta_i and Theta^t fixed, one step per
   mini-batch of a random s % sample of its training split
   (`fedala_sample_percent`): W_i <- clip_[0,1](W_i - eta grad_W L(theta_hat)),
   grad_W L = grad_theta L(theta_hat) * (Theta^t - theta_i) (`fedala_eta`).
   W_i starts at ones. The first time the mix can move (theta_i differs from
   Theta^t on the top layers), passes over the sample repeat until the std of
   the last `fedala_loss_window` pass losses is under `fedala_threshold`, at
   most `fedala_start_passes` (the start phase); afterwards one pass a round;
2. trains theta_hat (`local_epochs` or `local_steps` of SGD, or the
   `client_optimizer`) into theta_i^{t+1}, keeps it and W_i, and uploads
   Theta^t - theta_i^{t+1};

and the server takes FedAvg's example-weighted mean:
Theta^{t+1} = Theta^t - eta_g sum_i (n_i / n) (Theta^t - theta_i^{t+1}).

`evaluate`: `global_model` is Theta^t; `personalized_model` is the client's
ALA model theta_hat against Theta^t (from its kept theta_i and W_i, with the
passes its next round would run), before local training: the model the
authors' code evaluates. Every theta_i starts as the run seed's initial
model, so a client's first mix is the global model itself.
"""

import collections
import dataclasses
import functools
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
__all__ = ['build_fedala_process', 'FedALASettings', 'adaptive_local_aggregation']


@dataclasses.dataclass(frozen=True)
class FedALASettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedALA (`fedala`): FedAvg; each client mixes the global model into its own element-wise before training."""

    fedala_layers: int = settings_lib.setting(
        1, 'FedALA: p, how many of the last layers with weights ALA mixes (the lower layers take the global model).'
    )
    fedala_eta: float = settings_lib.setting(1.0, 'FedALA: eta, the step size of the aggregation weights W.')
    fedala_sample_percent: float = settings_lib.setting(
        80.0, "FedALA: s, the percent of the client's training split W is learned on (a new random sample each time)."
    )
    fedala_start_passes: int = settings_lib.setting(
        20, 'FedALA: the most passes over the sample when W is first learned (the start phase); later, one a round.'
    )
    fedala_threshold: float = settings_lib.setting(
        0.1, 'FedALA: the start phase ends when the std of the last fedala_loss_window pass losses is under this.'
    )
    fedala_loss_window: int = settings_lib.setting(
        10, "FedALA: how many of the last passes' losses the start phase's stopping rule looks at."
    )

    def _checks(self):
        return super()._checks() + [
            (self.fedala_layers >= 1, f'fedala_layers must be >= 1, got {self.fedala_layers}'),
            (self.fedala_eta > 0, f'fedala_eta must be > 0, got {self.fedala_eta}'),
            (
                0 < self.fedala_sample_percent <= 100,
                f'fedala_sample_percent must be in (0, 100], got {self.fedala_sample_percent}',
            ),
            (self.fedala_start_passes >= 1, f'fedala_start_passes must be >= 1, got {self.fedala_start_passes}'),
            (self.fedala_threshold >= 0, f'fedala_threshold must be >= 0, got {self.fedala_threshold}'),
            (self.fedala_loss_window >= 2, f'fedala_loss_window must be >= 2, got {self.fedala_loss_window}'),
        ]


def _top_layers(model_fn: Callable[[], tf.keras.Model], layers: int) -> tuple[list[int], list[int]]:
    """Indices of the lower and of the top `layers` layers' variables in `model_fn()`'s `trainable_variables`.

    Raises:
      ValueError: one line, if the model has no Keras layers (a
        FunctionalModel) or fewer layers with weights than `layers`.
    """
    with tf.Graph().as_default():
        model = model_fn()
        with_weights = [layer for layer in model.layers if layer.trainable_weights]
        if not with_weights and model.trainable_variables:
            raise ValueError(
                f'model_fn: FedALA mixes the top fedala_layers Keras layers element-wise and {model.name!r} has no '
                'Keras layers; pass a Keras model function'
            )
        if layers > len(with_weights):
            count = f'{len(with_weights)} layers with weights'
            raise ValueError(f'fedala_layers={layers} is more than the {count} of model {model.name!r}')
        top_refs = {v.ref() for layer in with_weights[-layers:] for v in layer.trainable_weights}
        lower, top = [], []
        for i, variable in enumerate(model.trainable_variables):
            (top if variable.ref() in top_refs else lower).append(i)
    return lower, top


def adaptive_local_aggregation(
    model, data, variables, local, global_, weights, *, passes, settings: FedALASettings, seed, loss_fn
):
    """ALA's weight learning, in place on `variables`, the model's top-layer variables (TF code).

    The model's other variables must hold Theta already. Each step sets
    `variables` to theta_i + (Theta - theta_i) * W and takes W <- clip(W -
    eta grad L * (Theta - theta_i), 0, 1) on one mini-batch of a seeded s %
    sample of `data` (a `ClientSplit`); a pass visits the sample once, always
    in the same order. At the end `variables` hold the mix of the final W.

    Args:
      model: the Keras model the loss is computed with.
      data: the client's training split.
      variables: the top layers' variables of `model`.
      local: theta_i's top-layer weights.
      global_: Theta's top-layer weights.
      weights: W_i, one tensor per top-layer weight, in [0, 1].
      passes: the most passes (int32 scalar; 0: W stays); they stop early
        once more than `fedala_loss_window` passes have run and the std of
        the last that many pass losses is under `fedala_threshold`.
      settings: eta, s, the batch size and the stopping rule.
      seed: int64 [2], the sample's seed.
      loss_fn: `(model, x, y) -> (mean loss, logits)`.

    Returns:
      `(passes run, W)`.
    """
    eta, window, size_of = settings.fedala_eta, settings.fedala_loss_window, settings.batch_size

    def mix(local, global_, weights):
        return [t + (g - t) * w for t, g, w in zip(local, global_, weights)]

    @tf.function(autograph=False)
    def learn(features, labels, seed, passes, local, global_, weights):
        split = data.with_tensors(features, labels)
        num_examples = split.num_examples
        share = tf.cast(num_examples, tf.float32) * settings.fedala_sample_percent / 100
        size = tf.maximum(tf.cast(share, tf.int32), 1)
        sample = local_training.epoch_permutations(seed, 1, num_examples)[0, :size]
        num_batches = (size + size_of - 1) // size_of

        def step(b, weights, loss_sum, count):
            x, y = split.gather(sample[b * size_of : tf.minimum((b + 1) * size_of, size)])
            assigned = [v.assign(m) for v, m in zip(variables, mix(local, global_, weights))]
            with tf.control_dependencies(assigned), tf.GradientTape() as tape:
                loss, _ = loss_fn(model, x, y)
            grads = local_training.dense_gradients(tape, loss, variables)
            weights = [
                tf.clip_by_value(w - eta * grad * (g - t), 0.0, 1.0)
                for w, grad, t, g in zip(weights, grads, local, global_)
            ]
            n = client_data.count_labels(y)
            return b + 1, weights, loss_sum + loss * n, count + n

        def one_pass(k, weights, recent):
            zero = tf.constant(0.0)
            _, weights, loss_sum, count = tf.while_loop(
                lambda b, *_: b < num_batches, step, (tf.constant(0), weights, zero, zero)
            )
            return k + 1, weights, tf.concat([recent[1:], [loss_sum / tf.maximum(count, 1.0)]], 0)

        def going(k, weights, recent):
            settled = tf.logical_and(k > window, tf.math.reduce_std(recent) < settings.fedala_threshold)
            return tf.logical_and(k < passes, tf.logical_not(settled))

        k, weights, _ = tf.while_loop(going, one_pass, (tf.constant(0), weights, tf.zeros([window])))
        with tf.control_dependencies([v.assign(m) for v, m in zip(variables, mix(local, global_, weights))]):
            return tf.identity(k), [tf.identity(w) for w in weights]

    return learn(data.features, data.labels, seed, passes, list(local), list(global_), list(weights))


@builder_inputs.checked
def build_fedala_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedALASettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedALA as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local training (from the ALA model), the server learning
        rate and ALA's p, eta, s and start phase; None: `FedALASettings()`.
      client_optimizer: the local training's optimizer, started fresh for
        each client's training; None: SGD at `client_learning_rate`. ALA's
        weight step is its own (`fedala_eta`).
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the loss of local training and of ALA's weight learning
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics (`local_training.metrics_from`).
      seed: run seed; fixes the initial model (every client's first
        theta_i), the batch orders and ALA's samples.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model,
      optimizer_state, aggregator_state, round_num>`; client state:
      `<client_id, num_participations, last_round, local (theta_i),
      ala_weights (W_i), ala_start_passes (the start phase's passes, 0: not
      run yet)>`; `evaluate`: `<global_model, personalized_model>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: fewer layers with weights than `fedala_layers`, or no Keras layers (one line, `_top_layers`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedALASettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedala_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    _, top = _top_layers(model_fn, settings.fedala_layers)
    weights_type = model_weights.weights_type(model_fn)
    loss_fn = local_training.loss_from(loss, spec)
    local_work = settings.training_config()
    learn_weights = functools.partial(adaptive_local_aggregation, settings=settings, loss_fn=loss_fn)
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        initial = model_weights.initial_weights(model_fn, seed)
        return building_blocks.participation_state(
            client_id,
            local=initial,
            ala_weights=[tf.ones_like(initial[i]) for i in top],
            ala_start_passes=tf.constant(0, tf.int32),
        )

    client_state_type = initial_client_state.type_signature.result

    def ala(model, data, weights, client_state, ala_seed):
        """Sets `model` to theta_hat (TF code); returns (W_i, the start phase's passes)."""
        local_top, global_top = [client_state['local'][i] for i in top], [weights[i] for i in top]
        moves = tf.reduce_any([tf.reduce_any(tf.not_equal(t, g)) for t, g in zip(local_top, global_top)])
        started = client_state['ala_start_passes'] > 0
        passes = tf.where(moves, tf.where(started, 1, settings.fedala_start_passes), 0)
        variables, kept = [model.trainable_variables[i] for i in top], client_state['ala_weights']
        with tf.control_dependencies(model_weights.fresh_weights(model, weights)):  # the lower layers take Theta
            passes_run, ala_weights = learn_weights(
                model, data, variables, local_top, global_top, kept, passes=passes, seed=ala_seed
            )
        return ala_weights, tf.where(started, client_state['ala_start_passes'], passes_run)

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        data = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        ala_weights, start_passes = ala(
            model, data, weights, client_state, local_training.client_seed(seed, round_num, client_id, salt=1)
        )
        with tf.control_dependencies(ala_weights):
            stats = local_training.train_with(
                model,
                data,
                local_work,
                seed=local_training.client_seed(seed, round_num, client_id),
                optimizer=client_optimizer,
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
        return collections.OrderedDict(
            update=[w - t for w, t in zip(weights, trained)],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(
                client_state, round_num, local=trained, ala_weights=ala_weights, ala_start_passes=start_passes
            ),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        model = model_fn()
        # ALA as the client's next round would run it; its sample is the client's own, the same at every evaluation.
        data = client_data.read_split(spec, client_id, 'train')
        ala_weights, _ = ala(model, data, weights, client_state, local_training.client_seed(seed, 0, client_id, salt=2))
        with tf.control_dependencies(ala_weights):
            mixed = model_weights.get_weights(model)
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(mixed, client_id),
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


def _client_columns(state):
    weights = np.concatenate([np.ravel(w) for w in state['ala_weights']])
    return {'ala_start_passes': int(state['ala_start_passes']), 'ala_weight_mean': float(weights.mean())}


ALGORITHMS = (
    algorithm.Algorithm(
        'fedala',
        'FedALA (Zhang et al., 2023): FedAvg; each client mixes the global model into its own, element-wise weights '
        'learned on its data',
        FedALASettings,
        algorithm.model_update_builder(build_fedala_process),
        _client_columns,
        privacy=algorithm.Privacy('model updates (theta_i and the aggregation weights stay on the clients)'),
        family='model interpolation',
    ),
)
