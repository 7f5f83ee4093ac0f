"""FedBABU: federated averaging of the body; the head stays at its random initialization.

J. Oh, S. Kim, S.-Y. Yun, "FedBABU: Toward Enhanced Representation for
Federated Image Classification" (ICLR 2022), Algorithm 1.

The model is a body (feature extractor) theta_ext and a head (classifier)
theta_cls. The head is drawn once, theta_cls^0 (the run seed's initial
model, the same on every client), and is never trained during federated
training. In round k the server broadcasts theta_ext^k; each sampled client
i, from (theta_ext^k, theta_cls^0),

1. trains the body alone: tau epochs of SGD on
   theta_ext <- theta_ext - alpha grad_ext L_i(theta_ext, theta_cls^0)
   (`local_epochs`, or `local_steps`), the head held at theta_cls^0;
2. sends back its body update theta_ext^k - theta_ext,i;

and the server takes the example-weighted mean (FedAvg's step):
theta_ext^{k+1} = theta_ext^k - eta_g sum_i (n_i / n) (theta_ext^k - theta_ext,i).
The global model is (theta_ext^k, theta_cls^0), `global_model` in `evaluate`.

Personalization (the paper's evaluation): each client fine-tunes the whole
global model, body and head, for tau_f epochs of SGD on its training split
(`fedbabu_finetune_epochs`), and that model is its `personalized_model`.
`evaluate` fine-tunes at every evaluation, from the current global model:
the personalized model is a function of the global model, never stored.
Which layers are the head is `personal_layers`: the last that many layers
with weights (1, the default, is the classifier), as FedPer's and FedRep's.
"""

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper, fedrep
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, model_weights, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_fedbabu_process', 'FedBABUSettings']


@dataclasses.dataclass(frozen=True)
class FedBABUSettings(fedper.FedPerSettings):
    """FedBABU (`fedbabu`): FedAvg on the body under a fixed random head; whole-model fine-tuning to personalize.

    `personal_layers` (FedPer's setting, one meaning) is the head: here the
    layers that stay at their initialization during the rounds.
    """

    fedbabu_finetune_epochs: int = settings_lib.setting(
        5,
        "FedBABU: tau_f, epochs of fine-tuning the whole global model (body and head) on the client's training "
        'split at each evaluation; the fine-tuned model is its personalized model.',
    )

    def _checks(self):
        return super()._checks() + [
            (
                self.fedbabu_finetune_epochs >= 1,
                f'fedbabu_finetune_epochs must be >= 1, got {self.fedbabu_finetune_epochs}',
            ),
        ]


@builder_inputs.checked
def build_fedbabu_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: FedBABUSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedBABU as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: the body's local work (`local_epochs` / `local_steps`), batch
        size, learning rate (also fine-tuning's), the server learning rate
        (applied to the mean body update), `personal_layers` (the head) and
        `fedbabu_finetune_epochs`; None: `FedBABUSettings()`.
      client_optimizer: not taken (ValueError if given): the local step is
        SGD on the body's variables only, at `client_learning_rate`.
      server_optimizer: applied to the aggregated body update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded body updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training and fine-tuning loss, as the builder
        contract takes it (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed; fixes the initial model, hence the head theta_cls^0.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the body's
      weights), optimizer_state, aggregator_state, round_num>`; client state:
      `<client_id, num_participations, last_round>`; `evaluate`:
      `<global_model, personalized_model>` per client.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: `personal_layers` leaves the model no body, or the model
        has no Keras layers (one line, `fedper.split_layers`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (FedBABUSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_fedbabu_process',
        dict(client_optimizer='the local step is SGD on the body alone, the head fixed, at client_learning_rate'),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    body_indices, head_indices = fedper.split_layers(model_fn, settings.personal_layers, who='FedBABU')
    body_type = model_weights.weights_type(model_fn, body_indices)
    loss_fn = local_training.loss_from(loss, spec)
    body_work = settings.training_config()
    client_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )

    def global_weights(body):
        """(theta_ext, theta_cls^0): the body with the run seed's initial head, built on the client (TF code)."""
        initial = model_weights.initial_weights(model_fn, seed)
        return model_weights.merge_weights([(body_indices, body), (head_indices, [initial[i] for i in head_indices])])

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        return building_blocks.participation_state(client_id)

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(body_type, np.int32, client_state_type)
    def client_work(body, round_num, client_state):
        client_id = client_state['client_id']
        data = client_data.read_split(spec, client_id, 'train')
        model = model_fn()
        body_seed = local_training.client_seed(seed, round_num, client_id)
        with tf.control_dependencies(model_weights.fresh_weights(model, global_weights(body))):
            # FedRep's body phase alone (no head epochs): SGD on the body's variables under the fixed head.
            stats = fedrep.alternating_update(
                model,
                data,
                head_indices,
                body_indices,
                head_epochs=0,
                body=body_work,
                head_seed=body_seed,
                body_seed=body_seed,
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            trained = model_weights.get_weights(model)
        return collections.OrderedDict(
            update=[b - trained[i] for b, i in zip(body, body_indices)],
            weight=tf.cast(data.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(client_state, round_num),
        )

    @tff.tensorflow.computation(body_type, client_state_type)
    def evaluate_client(body, client_state):
        client_id = client_state['client_id']
        weights = global_weights(body)
        model = model_fn()
        with tf.control_dependencies(model_weights.fresh_weights(model, weights)):
            # tau_f epochs on the whole model; the batch order is the client's own, the same at every evaluation.
            stats = local_training.train(
                model,
                client_data.read_split(spec, client_id, 'train'),
                epochs=settings.fedbabu_finetune_epochs,
                batch_size=settings.batch_size,
                learning_rate=settings.client_learning_rate,
                seed=local_training.client_seed(seed, 0, client_id, salt=2),
                loss_fn=loss_fn,
            )
        with tf.control_dependencies(list(stats)):
            tuned = model_weights.get_weights(model)
        return collections.OrderedDict(
            global_model=client_evaluation(weights, client_id),
            personalized_model=client_evaluation(tuned, client_id),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        shared_indices=body_indices,
        model_aggregator=model_aggregator,
        seed=seed,
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'fedbabu',
        'FedBABU (Oh et al., 2022): FedAvg on the body under a fixed random head, then whole-model fine-tuning',
        FedBABUSettings,
        algorithm.model_update_builder(build_fedbabu_process),
        # Logistic regression has one layer: there would be no body to train.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy("the body's updates (the head is fixed and never sent)"),
        family='parameter decoupling',
    ),
)
