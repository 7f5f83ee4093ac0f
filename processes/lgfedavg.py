"""LG-FedAvg: local representations, a global head.

P. P. Liang, T. Liu, L. Ziyin, N. B. Allen, R. P. Auerbach, D. Brent,
R. Salakhutdinov, L.-P. Morency, "Think Locally, Act Globally: Federated
Learning with Local and Global Representations" (arXiv 2001.01523),
Algorithm 1.

The model is split the other way round from FedPer's: the lower layers,
the local representation theta_l^m, stay on client m; the last
`global_layers` layers with weights, theta_g, are shared. In a round the
server broadcasts theta_g; each sampled client trains its whole model
(theta_l^m and theta_g) with local SGD, keeps its new theta_l^m and sends
back its update of theta_g; the server takes the example-weighted mean
(FedAvg's step):

    theta_g <- sum_m (N_m / N) theta_g^m.

Client m's model is its own representation under the current global
layers, theta_g o theta_l^m: `evaluate` reports it as `personalized_model`;
there is no global model (theta_g alone cannot read the input). Every
client's representation starts from the run seed's initial model.
"""

import dataclasses
from collections.abc import Callable

import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import averaging, builder_inputs, building_blocks, local_training, template
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder and its settings.
__all__ = ['build_lgfedavg_process', 'LGFedAvgSettings']


@dataclasses.dataclass(frozen=True)
class LGFedAvgSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """LG-FedAvg (`lgfedavg`): FedAvg on the last `global_layers` layers; the layers below stay on the clients."""

    global_layers: int = settings_lib.setting(
        1, 'LG-FedAvg: how many of the last layers with weights are shared (1: the classifier); the rest stay local.'
    )

    def _checks(self):
        return super()._checks() + [
            (self.global_layers >= 1, f'global_layers must be >= 1, got {self.global_layers}'),
        ]


@builder_inputs.checked
def build_lgfedavg_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: LGFedAvgSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds LG-FedAvg as a `PersonalizedProcess`.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model (logits out).
      settings: local training, the server learning rate (applied to the
        mean update of the global layers) and `global_layers`; None:
        `LGFedAvgSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training (both parts train); None: SGD at
        `settings.client_learning_rate`.
      server_optimizer: applied to the aggregated update of the global
        layers; None: SGD at `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates
        (`averaging.build_averaging_process`); default the example-weighted
        mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Server state: `<model (the global
      layers' weights), optimizer_state, aggregator_state, round_num>`;
      client state: `<client_id, num_participations, last_round,
      local_layers>`.

    Raises:
      SettingsError: a setting out of range (one line).
      ValueError: `global_layers` leaves the model no local layer, or the
        model has no Keras layers (one line, `fedper.split_layers`).
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = (LGFedAvgSettings() if settings is None else settings).validate()
    building_blocks.refuse_unused(
        'build_lgfedavg_process',
        {},
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    # FedPer's split counted from the end: its "personal" layers are LG-FedAvg's global ones.
    local_indices, global_indices = fedper.split_layers(
        model_fn, settings.global_layers, who='LG-FedAvg', setting='global_layers', rest='local'
    )
    return fedper.joint_training_round(
        spec,
        model_fn,
        settings,
        base_indices=global_indices,
        personal_indices=local_indices,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
        seed=seed,
        personal_field='local_layers',
    )


ALGORITHMS = (
    algorithm.Algorithm(
        'lgfedavg',
        'LG-FedAvg (Liang et al., 2020): local representation layers, shared global layers',
        LGFedAvgSettings,
        algorithm.model_update_builder(build_lgfedavg_process),
        # Logistic regression has one layer: there would be no local representation.
        default_models={'synthetic': 'mnist_dnn'},
        privacy=algorithm.Privacy("the global layers' updates (the representation stays on the clients)"),
        family='parameter decoupling',
    ),
)
