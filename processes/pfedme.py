"""pFedMe: personalized models through Moreau envelopes.

C. T. Dinh, N. H. Tran, T. D. Nguyen, "Personalized Federated Learning with
Moreau Envelopes" (NeurIPS 2020), Algorithm 1.

Each client's personalized model is the proximal point
theta_i(w) = argmin_theta f_i(theta) + lambda/2 ||theta - w||^2  (Eq. 3).
In a round the server broadcasts w^t; each sampled client sets its local
model w_{i,0} = w^t and, for r = 0..R-1 (R = `local_steps` local rounds, or
as many as `local_epochs` passes over the batches give; one mini-batch D_i
each):

* approximates theta_i(w_{i,r}) with K steps of gradient descent on
  f_i(theta; D_i) + lambda/2 ||theta - w_{i,r}||^2 with the personal learning
  rate (theta carries over from step to step, starting at w^t);
* updates w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta)  (line 8).

The server averages the clients' w_{i,R} uniformly over the sampled clients
and moves w^{t+1} = (1 - beta) w^t + beta mean_i w_{i,R} (line 10); with the
project's update convention this is a server SGD step of learning rate beta
on the mean of (w^t - w_{i,R}).

The client keeps theta (its personalized model) in its state; `evaluate`
reports the global model and theta (`personalized_model`). Choices where the
paper is silent are in docs/algorithms/baselines.md.
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
__all__ = ['build_pfedme_process', 'PFedMeSettings']

_setting = settings_lib.setting


def _paper_default(group: type, name: str, default):
    """Field `name` of `group` with the paper's default and the same help (one name, one meaning)."""
    (field,) = [f for f in dataclasses.fields(group) if f.name == name]
    return _setting(default, settings_lib.help_of(field))


@dataclasses.dataclass(frozen=True)
class PFedMeSettings(settings_lib.LocalTraining):
    """pFedMe (`pfedme`): R local rounds of a Moreau-envelope step, then the server's beta step.

    A local step is one of Algorithm 1's R local rounds (K inner steps on
    theta, then one step on w), each on its own mini-batch D. The defaults
    of R (20), |D| (20) and eta (0.005) are the paper's MNIST settings.
    """

    batch_size: int = _paper_default(settings_lib.ClientSGD, 'batch_size', 20)  # |D|
    client_learning_rate: float = _paper_default(settings_lib.ClientSGD, 'client_learning_rate', 0.005)  # eta
    local_steps: int = _paper_default(settings_lib.LocalTraining, 'local_steps', 20)  # R
    pfedme_lambda: float = _setting(15.0, 'pFedMe: lambda, the strength of the Moreau envelope.')
    pfedme_inner_steps: int = _setting(5, 'pFedMe: K, the gradient steps that approximate theta per local round.')
    pfedme_personal_learning_rate: float = _setting(0.09, 'pFedMe: the step size of the K steps on theta.')
    pfedme_beta: float = _setting(1.0, "pFedMe: beta, the server's step towards the clients' mean (1: the mean).")

    def _checks(self):
        return super()._checks() + [
            (self.pfedme_lambda > 0, f'pfedme_lambda must be > 0, got {self.pfedme_lambda}'),
            (self.pfedme_inner_steps >= 1, f'pfedme_inner_steps must be >= 1, got {self.pfedme_inner_steps}'),
            (
                self.pfedme_personal_learning_rate > 0,
                f'pfedme_personal_learning_rate must be > 0, got {self.pfedme_personal_learning_rate}',
            ),
            (self.pfedme_beta > 0, f'pfedme_beta must be > 0, got {self.pfedme_beta}'),
        ]


@builder_inputs.checked
def build_pfedme_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: PFedMeSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds pFedMe as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: R (`local_steps`, or epochs over the batches), |D|
        (`batch_size`), eta (`client_learning_rate`, the local model's
        learning rate), lambda, K, the personal learning rate and beta;
        None: `PFedMeSettings()`.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.pfedme_beta` (pFedMe's beta).
      client_optimizer: not taken (ValueError if given): pFedMe's client solves its Moreau-envelope
        problem with its own inner steps (Dinh et al., 2020, Algorithm 1).
      model_aggregator: aggregation of the uploaded updates (`averaging.build_averaging_process`);
        default the example-weighted mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, personalized>` (theta, zeros until
      the client first trains). `mean_local_steps` counts local rounds.

    Raises:
      SettingsError: a setting out of range (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (PFedMeSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_pfedme_process',
        dict(
            client_optimizer=(
                "pFedMe's client solves its Moreau-envelope problem with its own inner steps (Dinh et al., "
                '2020, Algorithm 1)'
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
    pfedme_lambda, inner_steps = settings.pfedme_lambda, settings.pfedme_inner_steps
    personal_learning_rate = settings.pfedme_personal_learning_rate
    weights_type = model_weights.weights_type(model_fn)
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(
            client_id, personalized=[tf.zeros(t.shape, t.dtype) for t in weights_type]
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        theta_model = model_fn()  # theta, the personalized model

        def step(batches, local):
            x, y, n = batches[0]
            # K steps on f_i(theta; D) + lambda/2 ||theta - w_{i,r}||^2; the
            # batch's stats are those of theta before the first of them.
            stats = None
            for _ in range(inner_steps):
                with tf.GradientTape() as tape:
                    loss, logits = loss_fn(theta_model, x, y)
                grads = tape.gradient(loss, theta_model.trainable_variables)
                if stats is None:
                    stats = local_training.batch_stats(loss, logits, y, n)
                for theta, grad, w in zip(theta_model.trainable_variables, grads, local):
                    theta.assign_sub(personal_learning_rate * (grad + pfedme_lambda * (theta - w)))
            # Line 8: w <- w - eta lambda (w - theta).
            theta = [tf.identity(v) for v in theta_model.trainable_variables]
            local = [w - local_config.learning_rate * pfedme_lambda * (w - t) for w, t in zip(local, theta)]
            return local, stats

        with tf.control_dependencies(model_weights.assign_weights(theta_model, weights)):
            local, stats = local_training.sgd_steps(
                client_data.read_split(spec, client_id, 'train'),
                step,
                epochs=local_config.epochs,
                batch_size=local_config.batch_size,
                seed=local_training.client_seed(seed, round_num, client_id),
                carry=list(weights),
                max_steps=local_config.max_steps,
            )
        with tf.control_dependencies(list(stats) + local):
            theta = model_weights.get_weights(theta_model)
        return collections.OrderedDict(
            update=[w - w_local for w, w_local in zip(weights, local)],
            weight=tf.constant(1.0),  # line 10: the uniform mean over sampled clients
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num, personalized=theta),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        trained = client_state['num_participations'] > 0
        theta = [tf.where(trained, t, w) for t, w in zip(client_state['personalized'], weights)]
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(theta, client_id),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or tff.learning.optimizers.build_sgdm(learning_rate=settings.pfedme_beta),
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'pfedme',
        'pFedMe (Dinh et al., 2020): Moreau envelopes',
        PFedMeSettings,
        algorithm.model_update_builder(build_pfedme_process),
        privacy=algorithm.Privacy("the local models' updates (the personalized theta_i stays on the clients)"),
        family='regularized personal model',
    ),
)
