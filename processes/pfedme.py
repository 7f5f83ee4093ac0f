"""pFedMe: personalized models through Moreau envelopes.

C. T. Dinh, N. H. Tran, T. D. Nguyen, "Personalized Federated Learning with
Moreau Envelopes" (NeurIPS 2020), Algorithm 1.

Each client's personalized model is the proximal point
theta_i(w) = argmin_theta f_i(theta) + lambda/2 ||theta - w||^2  (Eq. 3).
In a round the server broadcasts w^t; each sampled client sets its local
model w_{i,0} = w^t and, for r = 0..R-1 (`local_config`'s steps, one
mini-batch D_i each):

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
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import averaging, building_blocks, local_training, template
from tff_pfl.data import client_data


def build_pfedme_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    *,
    local_config: local_training.TrainingConfig,
    pfedme_lambda: float = 15.0,
    inner_steps: int = 5,
    personal_learning_rate: float = 0.09,
    beta: float = 1.0,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds pFedMe as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      local_config: R local steps (`max_steps`, or epochs over the batches),
        batch size |D|, and eta, the local model's learning rate.
      pfedme_lambda: lambda > 0, the strength of the Moreau envelope.
      inner_steps: K, gradient steps that approximate theta per local step.
      personal_learning_rate: the step size of those K steps.
      beta: the server's step towards the clients' mean (1: plain mean).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, personalized>` (theta, zeros until
      the client first trains).

    Raises:
      ValueError: on a bad configuration.
    """
    local_config.validate()
    if not pfedme_lambda > 0:
        raise ValueError(f'pfedme_lambda must be > 0, got {pfedme_lambda}')
    if int(inner_steps) != inner_steps or inner_steps < 1:
        raise ValueError(f'inner_steps must be a positive integer, got {inner_steps}')
    if not personal_learning_rate > 0:
        raise ValueError(f'personal_learning_rate must be > 0, got {personal_learning_rate}')
    if not beta > 0:
        raise ValueError(f'beta must be > 0, got {beta}')
    weights_type = local_training.weights_type(model_fn)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, 'test')

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
                    loss, logits = local_training.supervised_loss(theta_model, x, y)
                grads = tape.gradient(loss, theta_model.trainable_variables)
                if stats is None:
                    stats = local_training.batch_stats(loss, logits, y, n)
                for theta, grad, w in zip(theta_model.trainable_variables, grads, local):
                    theta.assign_sub(personal_learning_rate * (grad + pfedme_lambda * (theta - w)))
            # Line 8: w <- w - eta lambda (w - theta).
            theta = [tf.identity(v) for v in theta_model.trainable_variables]
            local = [w - local_config.learning_rate * pfedme_lambda * (w - t) for w, t in zip(local, theta)]
            return local, stats

        with tf.control_dependencies(local_training.assign_weights(theta_model, weights)):
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
            theta = local_training.get_weights(theta_model)
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
        server_optimizer=tff.learning.optimizers.build_sgdm(learning_rate=beta),
        seed=seed,
    )
