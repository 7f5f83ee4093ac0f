"""APFL: each client mixes a local model with the global one, with a learned alpha.

Y. Deng, M. M. Kamani, M. Mahdavi, "Adaptive Personalized Federated
Learning" (arXiv 2003.13461), Algorithm 1 with adaptive alpha (Eq. 10).

Client i keeps a local model v_i and a mixing weight alpha_i in [0, 1]; its
personalized model is v_bar_i = alpha_i v_i + (1 - alpha_i) w. In a round
the server broadcasts w^t; each sampled client sets w_i = w^t and, for each
local mini-batch xi, with the values of the previous step on the right:

* w_i     <- w_i - eta grad f_i(w_i; xi)
* v_i     <- v_i - eta grad_v f_i(v_bar_i; xi) = v_i - eta alpha_i grad f_i(v_bar_i; xi)
* alpha_i <- alpha_i - eta_alpha <v_i - w_i, grad f_i(v_bar_i; xi)>, clipped to [0, 1]

and sends back its w_i update; the server takes the example-weighted mean
(FedAvg). v_i and alpha_i stay on the client. A local step updates all
three on one batch, so `local_steps` = L means L steps of w_i and of v_i.

`evaluate` reports the global model and, as `personalized_model`,
alpha_i v_i + (1 - alpha_i) w with the current global w.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, client_plots
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_apfl_process', 'APFLSettings']


@dataclasses.dataclass(frozen=True)
class APFLSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """APFL (`apfl`): per batch, a step of w_i, of v_i and of alpha_i; FedAvg on w."""

    apfl_alpha: float = settings_lib.setting(0.5, "APFL: every client's initial mixing weight alpha, in [0, 1].")
    apfl_alpha_learning_rate: float = settings_lib.setting(
        0.01, 'APFL: eta_alpha, the step size of alpha (Eq. 10; 0 keeps alpha fixed).'
    )

    def _checks(self):
        return super()._checks() + [
            (0.0 <= self.apfl_alpha <= 1.0, f'apfl_alpha must be in [0, 1], got {self.apfl_alpha}'),
            (
                self.apfl_alpha_learning_rate >= 0,
                f'apfl_alpha_learning_rate must be >= 0, got {self.apfl_alpha_learning_rate}',
            ),
        ]


def mix(alpha, local, global_weights) -> list:
    """alpha * local + (1 - alpha) * global, tensor by tensor (TF code).

    Args:
      alpha: the client's mixing weight, a float32 scalar in [0, 1].
      local: the client's local weights v, a list of tensors.
      global_weights: the global weights w, tensors matching `local`.

    Returns:
      The list of mixed weights.
    """
    return [alpha * v + (1.0 - alpha) * w for v, w in zip(local, global_weights)]


@builder_inputs.checked
def build_apfl_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: APFLSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds APFL as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local epochs or steps, batch size, eta
        (`client_learning_rate`), the server learning rate, the initial alpha
        and eta_alpha (default 0.01, smaller than usual local learning rates
        on purpose: see docs/algorithms/baselines.md); None: `APFLSettings()`.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      client_optimizer: not taken (ValueError if given): APFL's client step updates w, v and alpha
        together with SGD (Deng et al., 2020, Algorithm 1).
      model_aggregator: aggregation of the uploaded updates (`averaging.build_averaging_process`);
        default the example-weighted mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; v_i starts from the same initial model as w.

    Returns:
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, local, alpha>`.

    Raises:
      SettingsError: a setting out of range (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (APFLSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_apfl_process',
        dict(
            client_optimizer=(
                "APFL's client step updates w, v and alpha together with SGD (Deng et al., 2020, Algorithm 1)"
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    local_config = settings.training_config()
    initial_alpha, alpha_learning_rate = settings.apfl_alpha, settings.apfl_alpha_learning_rate
    eta = local_config.learning_rate
    weights_type = model_weights.weights_type(model_fn)
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(
            client_id,
            local=model_weights.initial_weights(model_fn, seed),
            alpha=tf.constant(initial_alpha, tf.float32),
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        model = model_fn()

        def gradients(values, x, y):
            model_weights.assign_weights(model, values)
            with tf.GradientTape() as tape:
                loss, logits = loss_fn(model, x, y)
            return local_training.dense_gradients(tape, loss, model.trainable_variables), loss, logits

        def step(batches, carry):
            x, y, n = batches[0]
            w, v, alpha = carry['w'], carry['v'], carry['alpha']
            grad_w, _, _ = gradients(w, x, y)
            grad_mixed, loss, logits = gradients(mix(alpha, v, w), x, y)
            alpha_grad = tf.add_n([tf.reduce_sum((a - b) * g) for a, b, g in zip(v, w, grad_mixed)])
            new_carry = dict(
                w=[a - eta * g for a, g in zip(w, grad_w)],
                v=[a - eta * alpha * g for a, g in zip(v, grad_mixed)],
                alpha=tf.clip_by_value(alpha - alpha_learning_rate * alpha_grad, 0.0, 1.0),
            )
            # The reported training metrics are those of the personalized model.
            return new_carry, local_training.batch_stats(loss, logits, y, n)

        data = client_data.read_split(spec, client_id, 'train')
        carry, stats = local_training.sgd_steps(
            data,
            step,
            epochs=local_config.epochs,
            batch_size=local_config.batch_size,
            seed=local_training.client_seed(seed, round_num, client_id),
            carry=dict(w=list(weights), v=list(client_state['local']), alpha=client_state['alpha']),
            max_steps=local_config.max_steps,
        )
        return collections.OrderedDict(
            update=[a - b for a, b in zip(weights, carry['w'])],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num, local=carry['v'], alpha=carry['alpha']),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(mix(client_state['alpha'], client_state['local'], weights), client_id),
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


def _plots(out, result, process):
    del process
    client_ids, fields = client_plots.client_fields(result.client_states, ('alpha',))
    client_plots.plot_client_field(
        out, client_ids, fields['alpha'], 'apfl_alpha.png', 'alpha', 'APFL mixing weight alpha per client', 'alpha'
    )
    return [('APFL alpha per client', 'apfl_alpha.png')]


ALGORITHMS = (
    algorithm.Algorithm(
        'apfl',
        'APFL (Deng et al., 2020): adaptive mixture of local and global models',
        APFLSettings,
        algorithm.model_update_builder(build_apfl_process),
        lambda state: {'alpha': float(state['alpha'])},
        _plots,
        privacy=algorithm.Privacy("the global model w's updates (v_i and alpha_i stay on the clients)"),
        family='model interpolation',
    ),
)
