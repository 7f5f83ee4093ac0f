"""FedDF and pFedDF over heterogeneous client models (KT-pFL's Table 1 baselines).

FedDF: T. Lin, L. Kong, S. U. Stich, M. Jaggi, "Ensemble Distillation for
Robust Model Fusion in Federated Learning" (NeurIPS 2020). pFedDF: KT-pFL's
personalized variant (Zhang et al. 2021, footnote 3): each client fine-tunes
the fused prototype of its architecture on its private data.

The server keeps one prototype per architecture. One round:

1. every client receives its architecture's prototype and trains it on its
   private data, E epochs or exactly `local_steps` SGD steps;
2. it sends back its trained parameters (weighted by its example count,
   into the slot of its architecture) and its logits on this round's public
   batch;
3. the server averages the parameters per architecture (FedAvg within an
   architecture; a prototype no client of this round trained is kept), and
   distils every prototype towards the ensemble of all received models,
   softmax(mean logits / T), on the public batch (R passes of SGD).

FedDF is a parameter-exchange method: models go up and down every round.
`evaluate` reports each client's accuracy with its architecture's prototype
(`global_model`, FedDF) and, with `PFedDFSettings`, with that prototype
fine-tuned on its training split for `pfeddf_finetune_epochs`
(`personalized_model`, pFedDF); the fine-tuned copy is not kept, so every
evaluation point is pFedDF "as of this round".

Settings: `FedDFSettings` and `PFedDFSettings`; as baselines of KT-pFL's
Table 1 their defaults are KT-pFL's Appendix B.2 ("for all the methods"),
see docs/algorithms/ktpfl.md, "Settings".
"""

import collections
import dataclasses
import os

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, models, reports
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    builder_inputs,
    building_blocks,
    device_state,
    distillation,
    heterogeneous,
    local_training,
    privacy,
    template,
)
from tff_pfl.data import client_data

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_feddf_process', 'FedDFSettings', 'PFedDFSettings']

_setting = settings_lib.setting
# Inherited local-training fields whose defaults KT-pFL's Appendix B.2 restates keep their help line.
_LOCAL_HELP = {f.name: settings_lib.help_of(f) for f in dataclasses.fields(settings_lib.LocalTraining)}


@dataclasses.dataclass(frozen=True)
class FedDFSettings(settings_lib.LocalTraining, heterogeneous.PublicKnowledge):
    """FedDF as KT-pFL's Table 1 runs it: per-architecture averaging, then server distillation.

    Defaults: KT-pFL's Appendix B.2, heterogeneous models, EMNIST /
    Fashion-MNIST, stated "for all the methods" (private batch 128, E = 20,
    one distillation pass, public batch 256, learning rate 0.01, T = 10, 3000
    public examples per round).
    """

    batch_size: int = _setting(128, _LOCAL_HELP['batch_size'])
    client_learning_rate: float = _setting(0.01, _LOCAL_HELP['client_learning_rate'])
    local_epochs: int = _setting(20, _LOCAL_HELP['local_epochs'])
    feddf_distill_epochs: int = _setting(
        1,
        "The server's distillation passes over the round's public batch, per architecture prototype "
        '(0: per-architecture FedAvg).',
    )

    def _checks(self):
        return super()._checks() + [
            (self.feddf_distill_epochs >= 0, f'feddf_distill_epochs must be >= 0, got {self.feddf_distill_epochs}'),
        ]


@dataclasses.dataclass(frozen=True)
class PFedDFSettings(FedDFSettings):
    """pFedDF (KT-pFL, footnote 3): FedDF, and each client fine-tunes its prototype locally."""

    pfeddf_finetune_epochs: int = _setting(
        5,
        "pFedDF: epochs of fine-tuning of the client's architecture prototype on its training split, at evaluation "
        '(batch size and learning rate of local training).',
    )

    def _checks(self):
        return super()._checks() + [
            (
                self.pfeddf_finetune_epochs >= 1,
                f'pfeddf_finetune_epochs must be >= 1, got {self.pfeddf_finetune_epochs} (FedDF: --algorithm=feddf)',
            ),
        ]


def average_prototypes(previous: tf.Tensor, weighted_sums: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """Per-architecture weighted means `[A, D]`; rows without weight keep `previous`.

    Args:
      previous: float32 `[A, D]`, last round's packed prototype of each of
        the A architectures.
      weighted_sums: float32 `[A, D]`, the sum over clients of example count
        times packed trained weights, in their architecture's row.
      weights: float32 `[A]`, the total example count of each architecture's
        clients.

    Returns:
      float32 `[A, D]`, the new packed prototypes.
    """
    has_clients = weights[:, tf.newaxis] > 0
    return tf.where(has_clients, weighted_sums / tf.maximum(weights[:, tf.newaxis], 1e-12), previous)


# FedDF's secure aggregation comes with DP, whose clipped updates give the secure sums their range.
SECURE_NEEDS_DP = (
    "--secure_aggregation: FedDF's plain round averages raw parameters and logits, whose range is unbounded; "
    'use it with --dp_noise_multiplier (clipped updates)'
)


@builder_inputs.checked
def build_feddf_process(
    spec: client_data.ClientDataSpec,
    settings: FedDFSettings = FedDFSettings(),
    *,
    dp: privacy.DPConfig | None = None,
    secure: bool = False,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedDF (and, with `PFedDFSettings`, pFedDF's evaluation) over heterogeneous clients.

    Args:
      spec: the partition on disk; it must hold public data.
      settings: `FedDFSettings` (FedDF) or `PFedDFSettings` (pFedDF): local
        training (E epochs or exactly `local_steps` SGD steps, batch size,
        learning rate), the architectures (assigned to clients in turn;
        empty: chosen from the data), P, T, the server's distillation passes
        (`feddf_distill_epochs`; 0: per-architecture FedAvg), batch size and
        learning rate, and pFedDF's fine-tuning epochs.
      dp: user-level DP (docs/privacy.md, "FedDF"): each client uploads
        only its update (trained minus received prototype) in its
        architecture's slot, clipped, summed and noised at SERVER by
        `dp.factory`; each prototype moves by its slot's noised sum over
        the expected clients of its architecture per round; the ensemble
        the prototypes are distilled towards is that of the noised
        prototypes themselves (post-processing), not the clients' logits.
        None: none.
      secure: with `dp`, sum the clipped updates through secure sums.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: not taken (ValueError if given): FedDF's server step is ensemble
        distillation on public data (Lin et al., 2020), with its own settings.
      model_aggregator: not taken (ValueError if given): FedDF sums updates per architecture with
        its own aggregator; pass dp= and secure= for DP and secure aggregation.
      loss: the clients' training loss, as the builder contract takes it
        (`local_training.loss_from`; None: cross-entropy).
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess` declaring each client's architecture
      (`architectures`) and the bytes it exchanges (`communication`);
      server state `<prototypes=float32[A, D_max], round_num>`, client state
      `<client_id, num_participations, last_round, architecture>`; any subset
      of clients may take part in a round.

    Raises:
      settings.SettingsError: a setting out of range (one line).
      TypeError: `settings` is not a `FedDFSettings`.
      ValueError: one line, if an architecture cannot take the data or the
        partition has too little public data, or `secure` without `dp`.
    """
    if secure and dp is None:
        raise ValueError(
            "secure=True needs dp: FedDF's plain round averages raw parameters and logits, whose range is unbounded"
        )
    if not isinstance(settings, FedDFSettings):
        raise TypeError(f'build_feddf_process takes FedDFSettings or PFedDFSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_feddf_process',
        dict(
            server_optimizer=(
                "FedDF's server step is ensemble distillation on public data (Lin et al., 2020), with its own settings"
            ),
            model_aggregator=(
                'FedDF sums updates per architecture with its own aggregator; pass dp= and secure= for DP '
                'and secure aggregation'
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    loss_fn = local_training.loss_from(loss, spec)
    user_metrics = local_training.metrics_from(metrics, spec)
    training = settings.training_config()
    public_batch = heterogeneous.public_batch_for(settings, spec)
    architectures = heterogeneous.client_architectures(settings.architectures, spec)
    temperature = settings.public_temperature
    finetune_epochs = settings.pfeddf_finetune_epochs if isinstance(settings, PFedDFSettings) else 0
    archs, arch_ids = heterogeneous.for_clients(architectures, spec)
    num_archs = len(archs.model_fns)
    prototypes_type = tff.TensorType(np.float32, (num_archs, archs.max_size))
    logits_type = tff.TensorType(np.float32, (public_batch, spec.num_classes))

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        return building_blocks.participation_state(
            client_id, architecture=tf.gather(tf.constant(arch_ids, tf.int32), index)
        )

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(prototypes=archs.initial_packed(seed), round_num=tf.constant(0, tf.int32))

    if dp is None:
        initialize = building_blocks.server_initialize(server_init)
    else:
        upload = dp.factory(secure=secure).create(prototypes_type)
        # Each architecture's slot is divided by its own expected clients per round (q N_a), and the
        # padding of the smaller architectures' rows stays zero.
        share = np.bincount(arch_ids, minlength=num_archs).astype(np.float32) / len(arch_ids)
        rescale = np.where(share > 0, 1.0 / np.maximum(share, 1e-12), 0.0).astype(np.float32)
        valid = np.zeros((num_archs, archs.max_size), np.float32)
        for index, size in enumerate(archs.sizes):
            valid[index, :size] = 1.0

        @tff.tensorflow.computation(server_init.type_signature.result, upload.initialize.type_signature.result.member)
        def with_aggregator(state, aggregator_state):
            return collections.OrderedDict(**state, aggregator_state=aggregator_state)

        @tff.federated_computation
        def initialize():
            made = tff.federated_eval(server_init, tff.SERVER)
            return tff.federated_map(with_aggregator, (made, upload.initialize()))

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(prototypes_type, np.int32, client_state_type)
    def client_stage(prototypes, round_num, state):
        client_id, architecture = state['client_id'], state['architecture']
        private = client_data.read_split(spec, client_id, 'train')
        x_public = client_data.read_public_batch(spec, public_batch, seed, round_num)
        params, logits, stats = heterogeneous.train_packed(
            archs,
            architecture,
            tf.gather(prototypes, architecture),
            private,
            training,
            seed=local_training.client_seed(seed, round_num, client_id),
            outputs=lambda model: model(x_public, training=False),
            optimizer=client_optimizer,
            loss_fn=loss_fn,
        )
        slot = tf.one_hot(architecture, num_archs)
        if dp is not None:  # the update alone, in its architecture's slot (clipped by the aggregator)
            return collections.OrderedDict(
                update=slot[:, tf.newaxis] * (params - tf.gather(prototypes, architecture))[tf.newaxis],
                metric_sums=building_blocks.training_metric_sums(stats),
                client_state=building_blocks.participated(state, round_num),
            )
        weight = tf.cast(private.num_examples, tf.float32)
        return collections.OrderedDict(
            weighted_params=slot[:, tf.newaxis] * (weight * params)[tf.newaxis],
            weights=slot * weight,
            public_logits=logits,
            metric_sums=building_blocks.training_metric_sums(stats),
            client_state=building_blocks.participated(state, round_num),
        )

    def distilled(state, averaged, mean_logits=None):
        """Each prototype distilled towards the ensemble; `mean_logits` None: the prototypes' own (TF code)."""
        x_public = client_data.read_public_batch(spec, public_batch, seed, state['round_num'])
        models, loads = [], []
        for index, model_fn in enumerate(archs.model_fns):
            model = model_fn()
            models.append(model)
            loads.append([v.assign(w) for v, w in zip(model.trainable_weights, archs.unpack(index, averaged[index]))])
        if mean_logits is None:  # the ensemble of the (noised) prototypes: post-processing of the DP sums
            with tf.control_dependencies([op for load in loads for op in load]):
                mean_logits = tf.add_n([model(x_public, training=False) for model in models]) / float(num_archs)
        teacher = tf.nn.softmax(mean_logits / temperature, axis=-1)
        rows, kls = [], []
        for index, model in enumerate(models):
            with tf.control_dependencies(loads[index] + [teacher]):
                kl = distillation.distill_towards(
                    model,
                    x_public,
                    teacher,
                    temperature=temperature,
                    epochs=settings.feddf_distill_epochs,
                    batch_size=settings.public_distill_batch_size,
                    learning_rate=settings.public_distill_learning_rate,
                    seed=local_training.client_seed(seed, state['round_num'], tf.constant(f'server_{index}'), salt=4),
                )
            with tf.control_dependencies([kl]):
                rows.append(archs.pack(model.trainable_weights))
            kls.append(kl)
        new_state = collections.OrderedDict(state)
        new_state.update(prototypes=tf.stack(rows), round_num=state['round_num'] + 1)
        return new_state, collections.OrderedDict(server_distill_kl=tf.reduce_mean(tf.stack(kls)))

    @tff.tensorflow.computation(
        server_state_type.member, prototypes_type, tff.TensorType(np.float32, (num_archs,)), logits_type
    )
    def server_update(state, weighted_sums, weights, mean_logits):
        return distilled(state, average_prototypes(state['prototypes'], weighted_sums, weights), mean_logits)

    if dp is not None:

        @tff.tensorflow.computation(server_state_type.member)
        def aggregator_state_of(state):
            return state['aggregator_state']

        aggregated_type = upload.next.type_signature.result

        @tff.tensorflow.computation(
            server_state_type.member,
            prototypes_type,
            aggregated_type.state.member,
            aggregated_type.measurements.member,
        )
        def private_update(state, mean_update, aggregator_state, measurements):
            # mean_update = noised sum / (q N); slot a's mean over its expected clients is that x N / N_a.
            moved = state['prototypes'] + valid * mean_update * rescale[:, np.newaxis]
            new_state, metrics = distilled(state, moved)
            new_state['aggregator_state'] = aggregator_state
            metrics['aggregator'] = measurements
            return new_state, metrics

    def finish_private(state, local):
        """DP aggregation of the updates and the server step (federated code)."""
        aggregated = upload.next(tff.federated_map(aggregator_state_of, state), local.update)
        updated = tff.federated_map(
            private_update, (state, aggregated.result, aggregated.state, aggregated.measurements)
        )
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        return updated[0], building_blocks.with_server_metrics(metrics, updated[1])

    def finish(state, local):
        """Aggregation and server step (federated code)."""
        if dp is not None:
            return finish_private(state, local)
        weighted_sums = tff.federated_sum(local.weighted_params)
        weights = tff.federated_sum(local.weights)
        mean_logits = tff.federated_mean(local.public_logits)  # the ensemble's logits
        updated = tff.federated_map(server_update, (state, weighted_sums, weights, mean_logits))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        return updated[0], building_blocks.with_server_metrics(metrics, updated[1])

    # The round, written once: `next` in process and the device form are both made from it.
    broadcast, client_step = device_state.field_and_round(
        server_state_type.member, 'prototypes', client_stage, client_state_type
    )
    phases = [device_state.Phase('next', broadcast, client_step, finish)]

    @tff.tensorflow.computation(server_state_type.member, client_state_type)
    def evaluate_client(state, client_state):
        client_id, architecture = client_state['client_id'], client_state['architecture']
        prototype = tf.gather(state['prototypes'], architecture)
        test = client_data.read_split(spec, client_id, spec.evaluation_split)
        result = collections.OrderedDict(
            global_model=heterogeneous.evaluate_packed(archs, architecture, prototype, test, user_metrics)
        )
        if finetune_epochs:
            private = client_data.read_split(spec, client_id, 'train')

            def finetune_and_evaluate(model):
                tuned = local_training.train(
                    model,
                    private,
                    epochs=finetune_epochs,
                    batch_size=training.batch_size,
                    learning_rate=training.learning_rate,
                    seed=local_training.client_seed(seed, state['round_num'], client_id, salt=5),
                    loss_fn=loss_fn,
                )
                with tf.control_dependencies(list(tuned)):
                    return heterogeneous.evaluate_model(model, test, user_metrics)

            result['personalized_model'] = archs.dispatch(architecture, prototype, finetune_and_evaluate)
        return result

    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        return tff.federated_map(evaluate_client, (tff.federated_broadcast(state), client_states))

    @tff.tensorflow.computation(server_state_type.member)
    def whole_state(state):
        return state

    device = device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=phases,
        evaluate_input=whole_state,
        evaluate_client=evaluate_client,
    )
    parameter_bytes = float(np.mean([archs.sizes[i] for i in arch_ids])) * 4
    return template.PersonalizedProcess(
        initialize,
        device_state.next_from_phases(server_state_type, client_state_type, phases),
        initial_client_state=initial_client_state,
        evaluate=evaluate,
        device=device,
        no_global_model=(
            'FedDF keeps one prototype model per architecture, packed into one vector, not one global model'
        ),
        extras={
            'architectures': tuple(architectures),
            'communication': collections.OrderedDict(
                parameter_bytes_up_per_client=parameter_bytes,
                logit_bytes_up_per_client=public_batch * spec.num_classes * 4,
                parameter_bytes_down_per_client=parameter_bytes,
            ),
        },
    )


def _build(settings, spec, model_fn, run):
    del model_fn  # each client has its own architecture
    return build_feddf_process(spec, settings, dp=run.dp, secure=run.secure, seed=run.seed)


def _per_architecture_uploads(settings, spec, process, client_fraction):
    """One noised mean per architecture: its prototype's parameters over that architecture's clients."""
    del settings
    architectures = process.extras['architectures']
    return [
        algorithm.Upload(
            models.parameter_count(a, spec.feature_shape, spec.num_classes), client_fraction * architectures.count(a), a
        )
        for a in sorted(set(architectures))
    ]


def _plots(out, result, process):
    del result
    reports.write_csv(os.path.join(out, 'communication.csv'), [dict(process.extras['communication'])])
    return []


def _declare(name, title, settings_cls):
    return algorithm.Algorithm(
        name,
        title,
        settings_cls,
        _build,
        lambda state: {'architecture_id': int(state['architecture'])},
        _plots,
        privacy=algorithm.Privacy(
            "each client's parameter update in its architecture's slot (the ensemble is the noised prototypes', "
            "not the clients' logits)",
            secure_needs_dp=SECURE_NEEDS_DP,
            dp_uploads=_per_architecture_uploads,
        ),
        family='knowledge distillation',
    )


ALGORITHMS = (
    _declare(
        'feddf',
        'FedDF (Lin et al., 2020): per-architecture averaging, then ensemble distillation on public data',
        FedDFSettings,
    ),
    _declare('pfeddf', 'pFedDF: FedDF with local fine-tuning of the prototype', PFedDFSettings),
)
