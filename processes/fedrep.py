"""FedRep: a shared representation, a personal head, trained in turn.

L. Collins, H. Hassani, A. Mokhtari, S. Shakkottai, "Exploiting Shared
Representations for Personalized Federated Learning" (ICML 2021), Algorithm 1.

The model is a representation (body) phi, shared by all clients, and a head
h_i per client, which never leaves it. In round t the server broadcasts
phi^t; each sampled client i

1. trains its head with the body frozen: tau_h epochs of SGD on
   f_i(h, phi^t), starting from its own h_i (`fedrep_head_epochs`);
2. trains the body with its new head frozen: tau_phi epochs of SGD on
   f_i(h_i^{t+1}, phi), starting from phi^t (`local_epochs`, or `local_steps`);
3. keeps h_i^{t+1} and sends back its body update phi^t - phi_i^{t+1};

and the server averages the body updates (example-weighted, FedAvg's step).
Which layers are the head is `personal_layers`: the last that many layers
with weights (1, the default, is the classifier), as FedPer's.

The difference from FedPer is the alternation: FedPer trains head and base
together; FedRep fits the head to the current body first, then moves the
body under that head only. `evaluate` reports the client's own model,
phi with h_i, as `personalized_model`; there is no global model.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedrep_process', 'FedRepSettings', 'alternating_update']


@dataclasses.dataclass(frozen=True)
class FedRepSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedRep (`fedrep`): per round, the head alone, then the shared body alone; the body is averaged."""

    personal_layers: int = settings_lib.setting(
        1,
        'FedPer, FedRep, FedBABU: how many of the last layers with weights are the head (1: the classifier): '
        'kept on each client in FedPer and FedRep, fixed at its initialization in FedBABU.',
    )
    fedrep_head_epochs: int = settings_lib.setting(
        10, 'FedRep: tau_h, epochs of head training (body frozen) before the body epochs of a round.'
    )

    def _checks(self):
        return super()._checks() + [
            (self.personal_layers >= 1, f'personal_layers must be >= 1, got {self.personal_layers}'),
            (self.fedrep_head_epochs >= 0, f'fedrep_head_epochs must be >= 0, got {self.fedrep_head_epochs}'),
        ]


def alternating_update(
    model: tf.keras.Model,
    data: client_data.ClientSplit,
    head_indices,
    body_indices,
    *,
    head_epochs,
    body: local_training.TrainingConfig,
    head_seed: tf.Tensor,
    body_seed: tf.Tensor,
    loss_fn: local_training.LossFn = local_training.supervised_loss,
) -> local_training.Stats:
    """FedRep's local update, in place on `model`: head epochs, then body epochs (TF code).

    Each phase is SGD at `body.learning_rate` on its own variables only, the
    others held fixed, over its own seeded batch order.

    Args:
      model: the Keras model holding phi and h_i.
      data: the client's training split.
      head_indices: indices of the head's variables in `model.trainable_variables`.
      body_indices: the body's.
      head_epochs: tau_h (int or scalar tensor; 0: no head phase).
      body: the body phase's local work (`local_epochs` or `local_steps`),
        batch size and learning rate.
      head_seed: int64 [2], the head phase's batch order (`local_training.client_seed`).
      body_seed: int64 [2], the body phase's.
      loss_fn: `(model, x, y) -> (mean loss, logits)`.

    Returns:
      The body phase's `Stats` (the round's training metrics and local
      steps: the work `local_epochs` / `local_steps` sets, under the head
      just fitted).
    """
    variables = model.trainable_variables

    def phase(indices, epochs, phase_seed, max_steps, after):
        chosen = [variables[i] for i in indices]

        def step(batches, carry):
            x, y, n = batches[0]
            with tf.GradientTape() as tape:
                loss, logits = loss_fn(model, x, y)
            grads = local_training.dense_gradients(tape, loss, chosen)
            for variable, grad in zip(chosen, grads):
                variable.assign_sub(tf.cast(body.learning_rate, tf.float32) * grad)
            return carry, local_training.batch_stats(loss, logits, y, n)

        with tf.control_dependencies(after):
            phase_seed = tf.identity(phase_seed)
        _, stats = local_training.sgd_steps(
            data, step, epochs=epochs, batch_size=body.batch_size, seed=phase_seed, max_steps=max_steps
        )
        return stats

    head = phase(head_indices, head_epochs, head_seed, None, [])
    return phase(body_indices, body.epochs, body_seed, body.max_steps, list(head))


@builder_inputs.checked
def build_fedrep_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedRepSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedRep as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: the body's local work (`local_epochs` / `local_steps`), the
        head epochs, batch size, learning rate, the server learning rate
        (applied to the mean body update) and `personal_layers`; None:
        `FedRepSettings()`.
      client_optimizer: not taken (ValueError if given): each phase is SGD
        on its own variables at `client_learning_rate`.
      server_optimizer: applied to the aggregated body update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded body updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the body's
      weights), optimizer_state, aggregator_state, round_num>`; client state:
      `<client_id, num_participations, last_round, head>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: `personal_layers` leaves the model no body, or the model
        has no Keras layers (one line, `fedper.split_layers`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedRepSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedrep_process',
        dict(client_optimizer='the head and body phases are SGD steps on their own variables at client_learning_rate'),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    base_indices, personal_indices = fedper.split_layers(model_fn, settings.personal_layers, who='FedRep')
    weights_type = model_weights.weights_type(model_fn)
    loss_fn = local_training.loss_from(loss, spec)
    body = settings.training_config()

    @tff.tensorflow.computation(weights_type, np.int32, np.str_)
    def client_training(weights, round_num, client_id):
        data = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        with tf.control_dependencies(model_weights.fresh_weights(model, weights)):
            stats = alternating_update(
                model,
                data,
                personal_indices,
                base_indices,
                head_epochs=settings.fedrep_head_epochs,
                body=body,
                head_seed=local_training.client_seed(seed, round_num, client_id, salt=1),
                body_seed=local_training.client_seed(seed, round_num, client_id),
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
        return collections.OrderedDict(
            update=[w - t for w, t in zip(weights, trained)],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
        )

    return fedper.shared_base_round(
        spec,
        model_fn,
        client_training,
        base_indices=base_indices,
        personal_indices=personal_indices,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        model_aggregator=model_aggregator,
        metrics=metrics,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'fedrep',
        'FedRep (Collins et al., 2021): a shared body, a personal head, trained in turn',
        FedRepSettings,
        algorithm.model_update_builder(build_fedrep_process),
        # Logistic regression has one layer: there would be no body to share.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy("the shared body's updates (the head stays on the clients)"),
        family='parameter decoupling',
    ),
)
