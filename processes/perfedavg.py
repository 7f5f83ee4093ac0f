"""Per-FedAvg: a global model meant to be adapted by one local gradient step.

A. Fallah, A. Mokhtari, A. Ozdaglar, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach" (NeurIPS
2020), Algorithm 1.

The objective is F(w) = mean_i f_i(w - alpha grad f_i(w)). In a round the
server broadcasts w^t; each sampled client sets w_{i,0} = w^t and takes tau
local steps (meta steps: tau = `local_steps`, or as many as `local_epochs`
passes over the batches give), each on independent mini-batches D, D' (and
D'' for the Hessian-free variant):

* w~ = w - alpha grad f_i(w; D)                            (the inner step)
* FO: w <- w - beta grad f_i(w~; D')                       (first order)
* HF: w <- w - beta (I - alpha H f_i(w; D'')) grad f_i(w~; D'), with the
  Hessian-vector product by central differences
  (grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')) / (2 delta),
  g = grad f_i(w~; D')                                     (Hessian-free)

beta is `client_learning_rate`. The server averages the clients' w_i
uniformly over the sampled clients (line 12).

`evaluate` reports the global model and, as `personalized_model`, the model
each client gets after one step of gradient descent of size alpha on its
whole training split, from the current global model (computed at evaluation
time; it is not kept).
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
__all__ = ['build_perfedavg_process', 'variant_of', 'PerFedAvgSettings', 'PerFedAvgHFSettings']


@dataclasses.dataclass(frozen=True)
class PerFedAvgSettings(settings_lib.LocalTraining):
    """Per-FedAvg FO (`perfedavg_fo`): tau meta steps per round; `client_learning_rate` is beta.

    A local step is one meta step (the inner step of size alpha on D, then the
    outer step of size beta on D'); `local_steps` = tau counts them.
    """

    perfedavg_alpha: float = settings_lib.setting(
        0.01, 'Per-FedAvg: alpha, the adaptation step (client_learning_rate is beta, the meta step).'
    )

    def _checks(self):
        return super()._checks() + [
            (self.perfedavg_alpha > 0, f'perfedavg_alpha must be > 0, got {self.perfedavg_alpha}'),
        ]


@dataclasses.dataclass(frozen=True)
class PerFedAvgHFSettings(PerFedAvgSettings):
    """Per-FedAvg HF (`perfedavg_hf`): the meta step with a finite-difference Hessian-vector product."""

    perfedavg_delta: float = settings_lib.setting(
        0.001, 'Per-FedAvg HF: delta, the finite-difference step of the Hessian-vector product.'
    )

    def _checks(self):
        return super()._checks() + [
            (self.perfedavg_delta > 0, f'perfedavg_delta must be > 0, got {self.perfedavg_delta}'),
        ]


# The settings each variant takes.
VARIANT_SETTINGS = {'fo': PerFedAvgSettings, 'hf': PerFedAvgHFSettings}


def variant_of(settings: PerFedAvgSettings) -> str:
    """The variant a settings object selects: 'hf' for `PerFedAvgHFSettings`, else 'fo'.

    Args:
      settings: a `PerFedAvgSettings`.

    Returns:
      'fo' or 'hf'.
    """
    return 'hf' if isinstance(settings, PerFedAvgHFSettings) else 'fo'


def _gradients(model, x, y, loss_fn: local_training.LossFn):
    with tf.GradientTape() as tape:
        loss, logits = loss_fn(model, x, y)
    return local_training.dense_gradients(tape, loss, model.trainable_variables), loss, logits


def _assign(model, values):
    for variable, value in zip(model.trainable_variables, values):
        variable.assign(value)


@builder_inputs.checked
def build_perfedavg_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: PerFedAvgSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds Per-FedAvg (first-order or Hessian-free) as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: tau meta steps (`local_steps`, or epochs: a step consumes
        two batches (FO) or three (HF)), the batch size, beta
        (`client_learning_rate`), alpha, and for HF delta. The settings type
        is the variant: `PerFedAvgSettings` Per-FedAvg FO,
        `PerFedAvgHFSettings` Per-FedAvg HF; None: FO's defaults.
      server_optimizer: applied to the aggregated update; None: SGD at
        learning rate 1.0 (the plain average of the paper).
      client_optimizer: not taken (ValueError if given): Per-FedAvg's client step is a MAML step
        with its own alpha and beta (Fallah et al., 2020, Algorithm 1).
      model_aggregator: aggregation of the uploaded updates (`averaging.build_averaging_process`);
        default the example-weighted mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess` with participation-only client state;
      `mean_local_steps` counts meta steps.

    Raises:
      SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `PerFedAvgSettings`.
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = PerFedAvgSettings() if settings is None else settings
    if not isinstance(settings, PerFedAvgSettings):
        raise TypeError(
            f'build_perfedavg_process takes PerFedAvgSettings or PerFedAvgHFSettings, got {type(settings).__name__}'
        )
    settings = settings.validate()
    variant = variant_of(settings)
    building_blocks.refuse_unused(
        'build_perfedavg_process',
        dict(
            client_optimizer=(
                "Per-FedAvg's client step is a MAML step with its own alpha and beta (Fallah et al., 2020, Algorithm 1)"
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    batches_per_step = 3 if variant == 'hf' else 2
    alpha = settings.perfedavg_alpha
    delta = settings.perfedavg_delta if variant == 'hf' else None
    beta = settings.client_learning_rate
    if settings.local_steps:
        # tau meta steps exactly: enough epochs of batches for them, capped at tau.
        epochs, max_steps = settings.local_steps * batches_per_step, settings.local_steps
    else:
        epochs, max_steps = settings.local_epochs, None
    weights_type = model_weights.weights_type(model_fn)
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id)

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        model = model_fn()

        def step(batches, carry):
            (x, y, n), (x2, y2, _) = batches[0], batches[1]
            w = [tf.identity(v) for v in model.trainable_variables]
            grads, loss, logits = _gradients(model, x, y, loss_fn)  # at w, on D
            _assign(model, [v - alpha * g for v, g in zip(w, grads)])  # w~
            outer, _, _ = _gradients(model, x2, y2, loss_fn)  # at w~, on D'
            if variant == 'hf':
                x3, y3, _ = batches[2]
                _assign(model, [v + delta * g for v, g in zip(w, outer)])
                plus, _, _ = _gradients(model, x3, y3, loss_fn)
                _assign(model, [v - delta * g for v, g in zip(w, outer)])
                minus, _, _ = _gradients(model, x3, y3, loss_fn)
                outer = [g - alpha * (p - m) / (2.0 * delta) for g, p, m in zip(outer, plus, minus)]
            _assign(model, [v - beta * g for v, g in zip(w, outer)])
            return carry, local_training.batch_stats(loss, logits, y, n)

        data = client_data.read_split(spec, client_id, 'train')
        with tf.control_dependencies(model_weights.assign_weights(model, weights)):
            _, stats = local_training.sgd_steps(
                data,
                step,
                epochs=epochs,
                batch_size=settings.batch_size,
                seed=local_training.client_seed(seed, round_num, client_id),
                max_steps=max_steps,
                batches_per_step=batches_per_step,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
        return collections.OrderedDict(
            update=[w - t for w, t in zip(weights, trained)],
            weight=tf.constant(1.0),  # line 12: the uniform mean over sampled clients
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        train = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        with tf.control_dependencies(model_weights.fresh_weights(model, weights)):
            x, y = train.slice(0, train.num_examples)
            grads, _, _ = _gradients(model, x, y, loss_fn)
        adapted = [w - alpha * g for w, g in zip(weights, grads)]
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(adapted, client_id),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'perfedavg_fo',
        'Per-FedAvg FO (Fallah et al., 2020): first-order MAML',
        PerFedAvgSettings,
        algorithm.model_update_builder(build_perfedavg_process),
        privacy=algorithm.Privacy('meta-model updates'),
        family='meta-learning',
    ),
    algorithm.Algorithm(
        'perfedavg_hf',
        'Per-FedAvg HF (Fallah et al., 2020): Hessian-free MAML',
        PerFedAvgHFSettings,
        algorithm.model_update_builder(build_perfedavg_process),
        privacy=algorithm.Privacy('meta-model updates'),
        family='meta-learning',
    ),
)
