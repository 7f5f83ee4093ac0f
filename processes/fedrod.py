"""FedRoD: a generic head trained with a balanced loss, and a personal head on top of it.

H.-Y. Chen, W.-L. Chao, "On Bridging Generic and Personalized Federated
Learning for Image Classification" (ICLR 2022), Fed-RoD with the linear
personalized head (the variant without a hypernetwork: the head's weights
are each client's own, not generated from its class distribution; the
hypernetwork variant is not implemented).

The model is a body z = f(x; theta) and a generic head (G-head) g = G(z; psi),
both shared and averaged; each client m also keeps a personal head (P-head)
P(.; phi_m) of the G-head's architecture. In round t the server broadcasts
(theta, psi); each sampled client m, with N_{m,c} the number of its training
examples of class c, runs SGD over its batches on

  L_BSM(theta, psi) = mean_i -log( N_{m,y_i}^gamma exp(g_{y_i}(x_i))
                                   / sum_c N_{m,c}^gamma exp(g_c(x_i)) )
                    = cross-entropy of g(x) + gamma log N_m   (balanced softmax),
  L_P(phi_m) = mean_i l( y_i, sg[g(x_i)] + P(sg[z_i]; phi_m) ),

one step on their sum: sg (stop-gradient) keeps L_P from moving theta and psi,
and L_BSM does not involve phi_m. A class the client lacks (N_{m,c} = 0) gets
weight 0^gamma: left out of its softmax for gamma > 0. The client keeps phi_m
and uploads its update of (theta, psi); the server takes the example-weighted
mean (FedAvg's step). The generic model g is `global_model` (the server's
state holds it whole, for TFF's tools); the personalized model g(x) + P(z) is
`personalized_model`.

The G-head is the last `fedrod_head_layers` layers with weights (1, the
default, is the classifier), as FedPer's `personal_layers` counts them, and
every layer after the first of them; the P-head starts as a copy of the run
seed's initial G-head (as the public implementations do) or at zero
(`fedrod_p_head_init`). docs/algorithms/fedrod.md maps each equation to the code.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper, head_split
from tff_pfl import algorithm, losses
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedrod_process', 'FedRoDSettings']

# How the P-head starts (`fedrod_p_head_init`).
P_HEAD_INITS = ('initial', 'zeros')

# The log-prior of a class the client lacks: finite (an ignored sequence position weighted by 0 stays 0, where
# -inf would give nan), and far enough below any logit that the class's exp underflows to 0 as with -inf.
_ABSENT = -1e9


@dataclasses.dataclass(frozen=True)
class FedRoDSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """FedRoD (`fedrod`): a shared body and generic head trained with balanced softmax; a personal head on top."""

    fedrod_head_layers: int = settings_lib.setting(
        1,
        'FedRoD: how many of the last layers with weights are the generic head (1: the classifier); each '
        "client's personal head has the same layers.",
    )
    fedrod_bsm_gamma: float = settings_lib.setting(
        1.0,
        "FedRoD: gamma, the power of the client's class counts in the balanced softmax, the loss of the body and "
        'generic head (cross-entropy of g + gamma log N_c; a class the client lacks is left out); 0: plain '
        'cross-entropy.',
    )
    fedrod_p_head_init: str = settings_lib.setting(
        'initial',
        "FedRoD: the personal head's start: 'initial', a copy of the run seed's initial generic head (the same on "
        "every client); 'zeros', so that the personalized model starts as the generic one.",
    )

    def _checks(self):
        return super()._checks() + [
            (self.fedrod_head_layers >= 1, f'fedrod_head_layers must be >= 1, got {self.fedrod_head_layers}'),
            (self.fedrod_bsm_gamma >= 0, f'fedrod_bsm_gamma must be >= 0, got {self.fedrod_bsm_gamma}'),
            (
                self.fedrod_p_head_init in P_HEAD_INITS,
                f'fedrod_p_head_init must be one of {", ".join(P_HEAD_INITS)}, got {self.fedrod_p_head_init!r}',
            ),
        ]


def _logits_width(model_fn: Callable[[], tf.keras.Model], head_layers: int) -> int:
    """The model's number of logits; refuses, in one line, a functional model whose head is not one chain.

    The head is the layers from the G-head's first on; they run one after another on the body's features.
    """
    name, is_chain, _, width = head_split.inspect(model_fn, head_layers)
    if not is_chain:
        raise ValueError(
            f'model_fn: FedRoD runs the layers from the generic head on (fedrod_head_layers={head_layers}) one '
            f"after another on the body's features, and in {name!r} they are not one chain ending at the output"
        )
    return width


class _TwoHeads:
    """The body and G-head of `model`, the P-head of `personal` (a second model of the same architecture; TF code).

    Only `personal`'s head layers are used: its variables at `head_indices` are phi_m.
    """

    def __init__(self, model, personal, head_layers, head_indices):
        self._split = head_split.BodyHead(model, head_layers)
        self._personal_head = personal.layers[self._split.start :]
        self.shared_variables = model.trainable_variables
        self.personal_variables = [personal.trainable_variables[i] for i in head_indices]

    def features(self, x, training=False):
        """z = f(x; theta)."""
        return self._split.features(x, training)

    def generic(self, z, training=False):
        """g = G(z; psi)."""
        return self._split.logits(z, training)

    def personal(self, z, training=False):
        """P(z; phi_m)."""
        return head_split.chain(self._personal_head, z, training)

    def personalized(self, x, training=False):
        """The personalized model's logits, g + P(z)."""
        z = self.features(x, training)
        return self.generic(z, training) + self.personal(z, training)


def _balanced_log_prior(labels: tf.Tensor, width: int, gamma: float) -> tf.Tensor:
    """gamma log N_c of a client's training labels, `_ABSENT` for a class it lacks (0 everywhere for gamma 0; TF code).

    Args:
      labels: int32 `[n]` (or `[n, L]`, `client_data.IGNORED_LABEL` not counted).
      width: the model's number of logits (at least the number of classes; a logit no label reaches is a
        class every client lacks).
      gamma: the power of the counts.

    Returns:
      float32 `[width]`, added to the G-head's logits by the balanced softmax.
    """
    if gamma == 0:  # N^0 = 1 for every class, a lacking one included: plain cross-entropy
        return tf.zeros([width])
    counted = tf.boolean_mask(labels, tf.not_equal(labels, client_data.IGNORED_LABEL))
    counts = tf.math.bincount(counted, minlength=width, maxlength=width, dtype=tf.float32)
    return tf.where(counts > 0, gamma * tf.math.log(tf.maximum(counts, 1.0)), _ABSENT)


def _local_update(heads: _TwoHeads, data, log_prior, config, seed, loss_fn) -> local_training.Stats:
    """SGD on L_BSM + L_P over the client's batches, in place on both models; the personalized stats (TF code)."""
    variables = list(heads.shared_variables) + heads.personal_variables

    def step(batches, carry):
        x, y, n = batches[0]
        with tf.GradientTape() as tape:
            z = heads.features(x, training=True)
            g = heads.generic(z, training=True)
            balanced = losses.hard_cross_entropy(g + log_prior, y)  # L_BSM
            logits = tf.stop_gradient(g) + heads.personal(tf.stop_gradient(z), training=True)
            personal, _ = loss_fn(lambda _, training=True: logits, x, y)  # L_P
            total = balanced + personal
        grads = local_training.dense_gradients(tape, total, variables)
        for variable, grad in zip(variables, grads):
            variable.assign_sub(tf.cast(config.learning_rate, tf.float32) * grad)
        return carry, local_training.batch_stats(personal, logits, y, n)

    _, stats = local_training.sgd_steps(
        data, step, epochs=config.epochs, batch_size=config.batch_size, seed=seed, max_steps=config.max_steps
    )
    return stats


@builder_inputs.checked
def build_fedrod_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedRoDSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedRoD (the linear personal head, no hypernetwork) as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out),
        Sequential or functional; the layers from the generic head's first on
        must be one chain ending at the output.
      settings: local work (`local_epochs` / `local_steps`), batch size,
        learning rate (of both heads and the body), the server learning rate,
        `fedrod_head_layers`, `fedrod_bsm_gamma` and `fedrod_p_head_init`;
        None: `FedRoDSettings()`.
      client_optimizer: not taken (ValueError if given): each step is SGD on
        the sum of the two heads' losses, at `client_learning_rate`.
      server_optimizer: applied to the aggregated update of the body and
        generic head; None: SGD at `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the personal head's loss l on g + P(z), as the builder contract
        takes it (`local_training.loss_from`; None: cross-entropy). The body
        and generic head keep the balanced softmax.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; fixes the initial model, hence the initial P-heads.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the whole
      model: body and generic head), optimizer_state, aggregator_state,
      round_num>`; client state: `<client_id, num_participations, last_round,
      p_head>`; `evaluate`: `<global_model, personalized_model>` per client.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: `fedrod_head_layers` leaves the model no body, the model has
        no Keras layers, or its head is not a chain (one line).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedRoDSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedrod_process',
        dict(client_optimizer="each step is SGD on the sum of the two heads' losses at client_learning_rate"),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    head_layers = settings.fedrod_head_layers
    body_indices, head_indices = fedper.split_layers(
        model_fn, head_layers, who='FedRoD', setting='fedrod_head_layers', rest='body'
    )
    width = _logits_width(model_fn, head_layers)
    weights_type = model_weights.weights_type(model_fn)
    loss_fn = local_training.loss_from(loss, spec)
    work = settings.training_config()
    user_metrics = local_training.metrics_from(metrics, spec)
    client_evaluation = building_blocks.build_client_evaluation(spec, model_fn, metrics=user_metrics)

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        initial = model_weights.initial_weights(model_fn, seed)
        p_head = [initial[i] for i in head_indices]
        if settings.fedrod_p_head_init == 'zeros':
            p_head = [tf.zeros_like(w) for w in p_head]
        return building_blocks.participation_state(client_id, p_head=p_head)

    client_state_type = initial_client_state.type_signature.result

    def two_heads(weights, p_head):
        """Both models built and assigned: (theta, psi) in one, phi_m in the other's head (TF code)."""
        model, personal = model_fn(), model_fn()
        assigned = model_weights.fresh_weights(model, weights) + model_weights.fresh_weights(
            personal,
            model_weights.merge_weights([(body_indices, [weights[i] for i in body_indices]), (head_indices, p_head)]),
        )
        return _TwoHeads(model, personal, head_layers, head_indices), assigned

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        client_id = client_state['client_id']
        data = client_data.read_split(spec, client_id, 'train')
        heads, assigned = two_heads(weights, client_state['p_head'])
        with tf.control_dependencies(assigned):
            log_prior = _balanced_log_prior(data.labels, width, settings.fedrod_bsm_gamma)
            stats = _local_update(
                heads, data, log_prior, work, local_training.client_seed(seed, round_num, client_id), loss_fn
            )
        with tf.control_dependencies(list(stats)):
            trained = [tf.identity(v) for v in heads.shared_variables]
            p_head = [tf.identity(v) for v in heads.personal_variables]
        return collections.OrderedDict(
            update=[w - t for w, t in zip(weights, trained)],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num, p_head=p_head),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        heads, assigned = two_heads(weights, client_state['p_head'])
        with tf.control_dependencies(assigned):
            data = client_data.read_split(spec, client_id, spec.evaluation_split)
            stats = local_training.evaluate(heads.personalized, data)
            extra = local_training.metric_sums(heads.personalized, data, user_metrics) if user_metrics else None
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=template.client_metrics(stats, extra),
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


ALGORITHMS = (
    algorithm.Algorithm(
        'fedrod',
        'FedRoD (Chen and Chao, 2022): a shared body and generic head trained with balanced softmax, '
        'a personal head on top (linear P-head, no hypernetwork)',
        FedRoDSettings,
        algorithm.model_update_builder(build_fedrod_process),
        # Logistic regression has one layer: there would be no body under the heads.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy("the body's and generic head's updates (the personal head stays on the clients)"),
        family='parameter decoupling',
    ),
)
