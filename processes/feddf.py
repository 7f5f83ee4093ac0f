"""FedDF and pFedDF over heterogeneous client models (KT-pFL's Table 1 baselines).

FedDF: T. Lin, L. Kong, S. U. Stich, M. Jaggi, "Ensemble Distillation for
Robust Model Fusion in Federated Learning" (NeurIPS 2020). pFedDF: KT-pFL's
personalized variant (Zhang et al. 2021, footnote 3): each client fine-tunes
the fused prototype of its architecture on its private data.

The server keeps one prototype per architecture. One round:

1. every client receives its architecture's prototype and trains it on its
   private data, E epochs;
2. it sends back its trained parameters (weighted by its example count,
   into the slot of its architecture) and its logits on this round's public
   batch;
3. the server averages the parameters per architecture (FedAvg within an
   architecture; a prototype no client of this round trained is kept), and
   distils every prototype towards the ensemble of all received models,
   softmax(mean logits / T), on the public batch (R passes of SGD).

FedDF is a parameter-exchange method: models go up and down every round.
`evaluate` reports each client's accuracy with its architecture's prototype
(`global_model`, FedDF) and, with `finetune_epochs > 0`, with that prototype
fine-tuned on its training split (`personalized_model`, pFedDF); the
fine-tuned copy is not kept, so every evaluation point is pFedDF "as of this
round".
"""

import collections
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import building_blocks, device_state, distillation, heterogeneous, local_training, template
from tff_pfl.data import client_data


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


def build_feddf_process(
    spec: client_data.ClientDataSpec,
    architectures: Sequence[str],
    *,
    local_config: local_training.TrainingConfig,
    server_distill_epochs: int = 1,
    distill_batch_size: int = 256,
    distill_learning_rate: float = 0.01,
    public_batch: int = 1000,
    temperature: float = 10.0,
    finetune_epochs: int = 0,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds FedDF (and pFedDF's evaluation) over heterogeneous clients.

    Args:
      spec: the partition on disk; it must hold public data.
      architectures: one model name per client (in `spec.client_ids` order).
      local_config: local epochs, batch size and learning rate.
      server_distill_epochs: R, the server's passes over the public batch per
        prototype (0: per-architecture FedAvg without distillation).
      distill_batch_size: public mini-batch size.
      distill_learning_rate: the server's SGD step size.
      public_batch: P, public examples drawn per round.
      temperature: T of the ensemble's and the students' softmax.
      finetune_epochs: pFedDF's local fine-tuning epochs at evaluation (0:
        FedDF only).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`; server state `<prototypes=float32[A,
      D_max], round_num>`, client state `<client_id, num_participations,
      last_round, architecture>`; any subset of clients may take part in a
      round.

    Raises:
      ValueError: on bad arguments.
    """
    local_config.validate()
    if not spec.public_size:
        raise ValueError('FedDF needs public data: prepare the partition with public examples')
    if server_distill_epochs < 0 or finetune_epochs < 0:
        raise ValueError('server_distill_epochs and finetune_epochs must be >= 0')
    archs, arch_ids = heterogeneous.for_clients(architectures, spec)
    num_archs = len(archs.model_fns)
    public_batch = min(public_batch, spec.public_size)
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

    @tff.federated_computation
    def initialize():
        return tff.federated_eval(server_init, tff.SERVER)

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(prototypes_type, np.int32, client_state_type)
    def client_stage(prototypes, round_num, state):
        client_id, architecture = state['client_id'], state['architecture']
        private = client_data.read_split(spec, client_id, 'train')
        x_public = client_data.read_public_batch(spec, public_batch, seed, round_num)

        def work(model):
            stats = local_training.train(
                model,
                private,
                epochs=local_config.epochs,
                batch_size=local_config.batch_size,
                learning_rate=local_config.learning_rate,
                max_steps=local_config.max_steps,
                seed=local_training.client_seed(seed, round_num, client_id),
            )
            with tf.control_dependencies(list(stats)):
                return archs.pack(model.trainable_weights), model(x_public, training=False), stats

        params, logits, stats = archs.dispatch(architecture, tf.gather(prototypes, architecture), work)
        weight = tf.cast(private.num_examples, tf.float32)
        slot = tf.one_hot(architecture, num_archs)
        return collections.OrderedDict(
            weighted_params=slot[:, tf.newaxis] * (weight * params)[tf.newaxis],
            weights=slot * weight,
            public_logits=logits,
            metric_sums=building_blocks.training_metric_sums(local_training.Stats(*stats)),
            client_state=building_blocks.participated(state, round_num),
        )

    @tff.tensorflow.computation(
        server_state_type.member, prototypes_type, tff.TensorType(np.float32, (num_archs,)), logits_type
    )
    def server_update(state, weighted_sums, weights, mean_logits):
        averaged = average_prototypes(state['prototypes'], weighted_sums, weights)
        x_public = client_data.read_public_batch(spec, public_batch, seed, state['round_num'])
        teacher = tf.nn.softmax(mean_logits / temperature, axis=-1)
        rows, kls = [], []
        for index, model_fn in enumerate(archs.model_fns):
            model = model_fn()
            loads = [v.assign(w) for v, w in zip(model.trainable_weights, archs.unpack(index, averaged[index]))]
            with tf.control_dependencies(loads):
                kl = distillation.distill_towards(
                    model,
                    x_public,
                    teacher,
                    temperature=temperature,
                    epochs=server_distill_epochs,
                    batch_size=distill_batch_size,
                    learning_rate=distill_learning_rate,
                    seed=local_training.client_seed(seed, state['round_num'], tf.constant(f'server_{index}'), salt=4),
                )
            with tf.control_dependencies([kl]):
                rows.append(archs.pack(model.trainable_weights))
            kls.append(kl)
        new_state = collections.OrderedDict(prototypes=tf.stack(rows), round_num=state['round_num'] + 1)
        return new_state, collections.OrderedDict(server_distill_kl=tf.reduce_mean(tf.stack(kls)))

    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)

    def finish(state, local):
        """Aggregation and server step (federated code)."""
        weighted_sums = tff.federated_sum(local.weighted_params)
        weights = tff.federated_sum(local.weights)
        mean_logits = tff.federated_mean(local.public_logits)  # the ensemble's logits
        updated = tff.federated_map(server_update, (state, weighted_sums, weights, mean_logits))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        return updated[0], building_blocks.with_server_metrics(metrics, updated[1])

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(state, client_states):
        prototypes = tff.federated_broadcast(state.prototypes)
        round_num = tff.federated_broadcast(state.round_num)
        local = tff.federated_map(client_stage, (prototypes, round_num, client_states))
        new_state, metrics = finish(state, local)
        return template.RoundOutput(new_state, local.client_state, metrics)

    broadcast, client_step = device_state.field_and_round(
        server_state_type.member, 'prototypes', client_stage, client_state_type
    )

    @tff.tensorflow.computation(server_state_type.member, client_state_type)
    def evaluate_client(state, client_state):
        client_id, architecture = client_state['client_id'], client_state['architecture']
        prototype = tf.gather(state['prototypes'], architecture)
        test = client_data.read_split(spec, client_id, 'test')
        stats = archs.dispatch(architecture, prototype, lambda model: local_training.evaluate(model, test))
        result = collections.OrderedDict(global_model=template.client_metrics(local_training.Stats(*stats)))
        if finetune_epochs:
            private = client_data.read_split(spec, client_id, 'train')

            def finetune_and_evaluate(model):
                tuned = local_training.train(
                    model,
                    private,
                    epochs=finetune_epochs,
                    batch_size=local_config.batch_size,
                    learning_rate=local_config.learning_rate,
                    seed=local_training.client_seed(seed, state['round_num'], client_id, salt=5),
                )
                with tf.control_dependencies(list(tuned)):
                    return local_training.evaluate(model, test)

            stats = archs.dispatch(architecture, prototype, finetune_and_evaluate)
            result['personalized_model'] = template.client_metrics(local_training.Stats(*stats))
        return result

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        return tff.federated_map(evaluate_client, (tff.federated_broadcast(state), client_states))

    @tff.tensorflow.computation(server_state_type.member)
    def whole_state(state):
        return state

    device = device_state.build_device_process(
        initialize,
        initial_client_state,
        phases=[device_state.Phase('next', broadcast, client_step, finish)],
        evaluate_input=whole_state,
        evaluate_client=evaluate_client,
    )
    process = template.PersonalizedProcess(
        initialize, next_fn, initial_client_state=initial_client_state, evaluate=evaluate, device=device
    )
    process.architectures = list(architectures)
    parameter_bytes = float(np.mean([archs.sizes[i] for i in arch_ids])) * 4
    process.communication = collections.OrderedDict(
        parameter_bytes_up_per_client=parameter_bytes,
        logit_bytes_up_per_client=public_batch * spec.num_classes * 4,
        parameter_bytes_down_per_client=parameter_bytes,
    )
    return process
