"""KT-pFL: parameterized knowledge transfer across heterogeneous client models.

J. Zhang, S. Guo, X. Ma, H. Wang, W. Xu, F. Wu, "Parameterized Knowledge
Transfer for Personalized Federated Learning" (NeurIPS 2021), Algorithm 1.

Every client n keeps its own model w_n, of its own architecture, in its
state (packed, see `computations.heterogeneous`). One round:

1. local training on private data, E epochs (Eq. 5);
2. soft predictions s(w_n, x) = softmax(z / T) on this round's public batch
   (the same batch for everyone, drawn from the public data by round);
3. the server forms each client's personalized soft target
   sum_m c[n, m] s(w_m, x) with the knowledge-coefficient matrix c;
4. each client distils towards its target with KL for R passes over the
   public batch (Eq. 6);
5. the server updates c by gradient descent on Eq. 4's objective (Eq. 7):
   lambda * sum_n (D_n / D) KL(sum_m c[n, m] s_m || s_n) + rho ||c - 1/N||^2.

Indexing: row n of c is client n's mixing vector (the paper's c_mn, the
contribution of client m to client n, is c[n, m] here).

Only soft predictions cross from the clients to the server: each client puts
its [P, C] predictions (and its example count) into its own slot of an
[N, P, C] tensor and the server receives the federated sum, i.e. every
client's predictions side by side. Weights never leave a client.
"""

import collections
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl.computations import building_blocks, device_state, distillation, heterogeneous, local_training, template
from tff_pfl.data import client_data

C_UPDATES = ('paper', 'released', 'fedmd', 'similarity', 'topk')
# Baselines of the paper's Table 1 that differ from KT-pFL only in c:
#   fedmd: every client's target is the plain average of all soft predictions;
#   similarity (Sim-pFL): c[n, m] = cosine similarity of the soft predictions;
#   topk (TopK-pFL): the same, kept for the K most similar clients only.
FIXED_OR_SIMILARITY = ('fedmd', 'similarity', 'topk')


def mixing_weights(coefficients: tf.Tensor) -> tf.Tensor:
    """Rows of c normalised to sum to 1 (c itself is kept non-negative).

    A row that has fallen to all zeros gives the client its own weight only
    (the identity row): a client that trusts nobody keeps its own knowledge.

    Args:
      coefficients: c, `[N, N]`, non-negative.

    Returns:
      `[N, N]`, the row-normalised c.
    """
    totals = tf.reduce_sum(coefficients, axis=1, keepdims=True)
    own = tf.eye(tf.shape(coefficients)[0], dtype=coefficients.dtype)
    return tf.where(totals > 0, coefficients / tf.maximum(totals, 1e-12), own)


def mix(coefficients: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Personalized soft targets: [N, N] x [N, P, C] -> [N, P, C] (row n: client n's).

    Rows of c are normalised by `mixing_weights`, so that every target is a
    probability distribution.

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions s_m on the public batch,
        `[N, P, C]`.

    Returns:
      `[N, P, C]`, row n being client n's target sum_m c[n, m] s_m.
    """
    return tf.einsum('nm,mpc->npc', mixing_weights(coefficients), predictions)


def paper_objective(coefficients, predictions, weights, rho, imitation):
    """Eq. 4 as a function of c (models fixed): lambda sum_n (D_n/D) KL + rho ||c - 1/N||^2.

    KL(mix_n || s_n) with the row-normalised mixture of `mix`, averaged over
    the public batch; probabilities are clipped at 1e-8 inside the logarithm.

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions, `[N, P, C]`.
      weights: D_n, `[N]`.
      rho: the regulariser's weight.
      imitation: lambda.

    Returns:
      The objective, a float32 scalar.
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    targets = mix(coefficients, predictions)
    log_ratio = tf.math.log(tf.maximum(targets, 1e-8)) - tf.math.log(tf.maximum(predictions, 1e-8))
    kl = tf.reduce_mean(tf.reduce_sum(targets * log_ratio, axis=-1), axis=-1)  # [N]
    share = weights / tf.reduce_sum(weights)
    return imitation * tf.reduce_sum(share * kl) + rho * tf.reduce_sum(tf.square(coefficients - 1.0 / num_clients))


def paper_update(coefficients, predictions, weights, *, learning_rate, rho, imitation):
    """One gradient step of Eq. 7, then c is clipped at 0 (see `mix`).

    Args:
      coefficients: c, `[N, N]`.
      predictions: the clients' soft predictions, `[N, P, C]`.
      weights: D_n, `[N]`.
      learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda.

    Returns:
      The new c, `[N, N]`.
    """
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        loss = paper_objective(coefficients, predictions, weights, rho, imitation)
    return tf.maximum(coefficients - learning_rate * tape.gradient(loss, coefficients), 0.0)


def released_update(coefficients, predictions, *, learning_rate, penalty=0.7, sharpness=5.0):
    """The authors' released-code variant of the c step.

    Per row n: the objective MSE(s_n, sum_m c[n, m] s_m) + penalty MSE(c[n],
    1/N), one gradient step, then the row is renormalised as softmax(sharpness
    * c[n]).

    Args:
      coefficients: c, `[N, N]`; mixed with as is (not through
        `mixing_weights`).
      predictions: the clients' soft predictions, `[N, P, C]`.
      learning_rate: the step size.
      penalty: the weight of the pull towards 1/N.
      sharpness: the softmax's scale.

    Returns:
      The new c, `[N, N]`, each row summing to 1.
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        # Rows are softmax-normalised already: the released code mixes with c as is.
        targets = tf.einsum('nm,mpc->npc', coefficients, predictions)
        mse = tf.reduce_mean(tf.square(predictions - targets), axis=[1, 2])
        loss = tf.reduce_sum(mse + penalty * tf.reduce_mean(tf.square(coefficients - 1.0 / num_clients), axis=1))
    stepped = coefficients - learning_rate * tape.gradient(loss, coefficients)
    return tf.nn.softmax(sharpness * stepped, axis=1)


def similarity_coefficients(predictions: tf.Tensor, top_k=None) -> tf.Tensor:
    """Sim-pFL's / TopK-pFL's c from this round's soft predictions.

    c[n, m] = cosine similarity of clients n's and m's predictions on the
    public batch (non-negative for probabilities). With `top_k`, each row
    keeps its K largest entries (the client itself, similarity 1, is always
    among them) and zeroes the rest. Rows are normalised by `mix`.

    Args:
      predictions: the clients' soft predictions, `[N, P, C]`.
      top_k: optional K (None keeps every entry).

    Returns:
      c, `[N, N]`, non-negative.
    """
    num_clients = tf.shape(predictions)[0]
    flat = tf.math.l2_normalize(tf.reshape(predictions, [num_clients, -1]), axis=1)
    similarity = tf.maximum(tf.matmul(flat, flat, transpose_b=True), 0.0)
    if top_k is None:
        return similarity
    k = tf.minimum(top_k, num_clients)
    threshold = tf.math.top_k(similarity, k=k).values[:, -1:]
    return tf.where(similarity >= threshold, similarity, 0.0)


def build_ktpfl_process(
    spec: client_data.ClientDataSpec,
    architectures: Sequence[str],
    *,
    local_config: local_training.TrainingConfig,
    distill_epochs: int = 1,
    distill_batch_size: int = 256,
    distill_learning_rate: float = 0.01,
    public_batch: int = 1000,
    temperature: float = 10.0,
    coefficient_learning_rate: float = 0.1,
    rho: float = 0.7,
    imitation: float = 1.0,
    c_update: str = 'paper',
    top_k: int = 5,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds KT-pFL over clients with heterogeneous models.

    Args:
      spec: the partition on disk; it must hold public data.
      architectures: one model name per client (in `spec.client_ids` order),
        from `tff_pfl.models`.
      local_config: E local epochs, batch size and eta_1 on private data.
      distill_epochs: R, passes over the round's public batch.
      distill_batch_size: public mini-batch size.
      distill_learning_rate: eta_2.
      public_batch: P, public examples drawn per round.
      temperature: T of the soft predictions.
      coefficient_learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda of Eq. 7.
      c_update: 'paper' (Eq. 7), 'released' (the authors' code), or a
        baseline: 'fedmd' (uniform c, never updated), 'similarity' (Sim-pFL),
        'topk' (TopK-pFL, with `top_k`).
      top_k: K of TopK-pFL.
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`; server state `<coefficients,
      round_num>`, client state `<client_id, num_participations, last_round,
      client_index, architecture, params>`; every client takes part in every
      round (the paper's setting): `next` expects all client states in
      partition order.

    Raises:
      ValueError: on bad arguments.
    """
    local_config.validate()
    num_clients = spec.num_clients
    if not spec.public_size:
        raise ValueError('KT-pFL needs public data: prepare the partition with public examples')
    if c_update not in C_UPDATES:
        raise ValueError(f'c_update must be one of {C_UPDATES}, got {c_update!r}')
    archs, arch_ids = heterogeneous.for_clients(architectures, spec)
    public_batch = min(public_batch, spec.public_size)
    num_classes = spec.num_classes
    predictions_type = tff.TensorType(np.float32, (num_clients, public_batch, num_classes))

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        architecture = tf.gather(tf.constant(arch_ids, tf.int32), index)
        return building_blocks.participation_state(
            client_id,
            client_index=index,
            architecture=architecture,
            params=tf.gather(archs.initial_packed(seed), architecture),
        )

    client_state_type = initial_client_state.type_signature.result

    def public_batch_of(round_num):
        return client_data.read_public_batch(spec, public_batch, seed, round_num)

    def soft(model, x):
        return tf.nn.softmax(model(x, training=False) / temperature, axis=-1)

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        client_id = state['client_id']
        private = client_data.read_split(spec, client_id, 'train')
        x_public = public_batch_of(round_num)

        def work(model):
            stats = local_training.train(
                model,
                private,
                epochs=local_config.epochs,
                batch_size=local_config.batch_size,
                learning_rate=local_config.learning_rate,
                seed=local_training.client_seed(seed, round_num, client_id),
            )
            with tf.control_dependencies(list(stats)):
                return archs.pack(model.trainable_weights), soft(model, x_public), stats

        params, predictions, stats = archs.dispatch(state['architecture'], state['params'], work)
        slot = tf.one_hot(state['client_index'], num_clients)
        new_state = collections.OrderedDict((k, state[k]) for k in state)
        new_state['params'] = params
        return collections.OrderedDict(
            predictions=slot[:, tf.newaxis, tf.newaxis] * predictions[tf.newaxis],
            num_examples=slot * tf.cast(private.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(
                local_training.Stats(stats.loss_sum, stats.num_correct, stats.num_examples)
            ),
            client_state=new_state,
        )

    @tff.tensorflow.computation(predictions_type, np.int32, client_state_type)
    def distill_stage(targets, round_num, state):
        x_public = public_batch_of(round_num)
        target = targets[state['client_index']]

        def work(model):
            distill_loss = distillation.distill_towards(
                model,
                x_public,
                target,
                temperature=temperature,
                epochs=distill_epochs,
                batch_size=distill_batch_size,
                learning_rate=distill_learning_rate,
                seed=local_training.client_seed(seed, round_num, state['client_id'], salt=2),
            )
            with tf.control_dependencies([distill_loss]):
                return archs.pack(model.trainable_weights), tf.identity(distill_loss)

        params, distill_loss = archs.dispatch(state['architecture'], state['params'], work)
        return building_blocks.participated(state, round_num, params=params), distill_loss

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            coefficients=tf.fill([num_clients, num_clients], 1.0 / num_clients),  # c_0 = 1/N
            round_num=tf.constant(0, tf.int32),
        )

    @tff.federated_computation
    def initialize():
        return tff.federated_eval(server_init, tff.SERVER)

    server_state_type = initialize.type_signature.result

    def coefficients_for(state, predictions):
        if c_update == 'similarity':
            return similarity_coefficients(predictions)
        if c_update == 'topk':
            return similarity_coefficients(predictions, top_k=top_k)
        return state['coefficients']

    @tff.tensorflow.computation(server_state_type.member, predictions_type)
    def targets_for(state, predictions):
        return mix(coefficients_for(state, predictions), predictions)

    @tff.tensorflow.computation(server_state_type.member, predictions_type, tff.TensorType(np.float32, (num_clients,)))
    def update_coefficients(state, predictions, sizes):
        if c_update == 'paper':
            # Eq. 4's distillation term carries the same T^2 as Eq. 6's step (`distill_towards`).
            coefficients = paper_update(
                state['coefficients'],
                predictions,
                sizes,
                learning_rate=coefficient_learning_rate,
                rho=rho,
                imitation=imitation * temperature**2,
            )
        elif c_update == 'released':
            coefficients = released_update(state['coefficients'], predictions, learning_rate=coefficient_learning_rate)
        else:  # the baselines' c is not learned; keep this round's for reports
            coefficients = coefficients_for(state, predictions)
        return collections.OrderedDict(coefficients=coefficients, round_num=state['round_num'] + 1)

    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(state, client_states):
        round_num = tff.federated_broadcast(state.round_num)
        local = tff.federated_map(local_stage, (round_num, client_states))
        predictions = tff.federated_sum(local.predictions)  # every client's [P, C] in its slot
        sizes = tff.federated_sum(local.num_examples)
        targets = tff.federated_broadcast(tff.federated_map(targets_for, (state, predictions)))
        distilled = tff.federated_map(distill_stage, (targets, round_num, local.client_state))
        new_state = tff.federated_map(update_coefficients, (state, predictions, sizes))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        distill_kl = tff.federated_zip(collections.OrderedDict(distill_kl=tff.federated_mean(distilled[1])))
        return template.RoundOutput(new_state, distilled[0], building_blocks.with_server_metrics(metrics, distill_kl))

    test_evaluation_type = client_state_type

    @tff.tensorflow.computation(test_evaluation_type)
    def evaluate_client(state):
        test = client_data.read_split(spec, state['client_id'], 'test')
        stats = archs.dispatch(
            state['architecture'], state['params'], lambda model: local_training.evaluate(model, test)
        )
        return collections.OrderedDict(personalized_model=template.client_metrics(local_training.Stats(*stats)))

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        del state
        return tff.federated_map(evaluate_client, client_states)

    device = _device_process(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='predictions',
        mix=targets_for,
        second_stage=distill_stage,
        update_coefficients=update_coefficients,
        metric='distill_kl',
        evaluate_client=evaluate_client,
    )
    process = template.PersonalizedProcess(
        initialize, next_fn, initial_client_state=initial_client_state, evaluate=evaluate, device=device
    )
    process.architectures = list(architectures)
    process.communication = collections.OrderedDict(
        soft_prediction_bytes_up_per_client=public_batch * num_classes * 4,
        soft_target_bytes_down_per_client=public_batch * num_classes * 4,
        parameter_bytes_per_client_mean=float(np.mean([archs.sizes[i] for i in arch_ids])) * 4,
    )
    return process


def parameter_distance(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Appendix C's L_dis on parameter vectors: 1/2 ||a - b||^2 over the last axis.

    Args:
      a: parameter vectors, `[..., D]`.
      b: parameter vectors, broadcastable against `a`.

    Returns:
      The distances, `[...]`.
    """
    return 0.5 * tf.reduce_sum(tf.square(a - b), axis=-1)


def homogeneous_objective(coefficients, params, weights, rho, imitation):
    """Eq. 11's objective in c (models fixed).

    lambda sum_n (D_n/D) L_dis(sum_m c[n, m] w_m, w_n) + rho ||c - 1/N||^2,
    with the rows of c normalised by `mixing_weights`.

    Args:
      coefficients: c, `[N, N]`.
      params: the clients' parameter vectors, `[N, D]`.
      weights: D_n, `[N]`.
      rho: the regulariser's weight.
      imitation: lambda.

    Returns:
      The objective, a float32 scalar.
    """
    num_clients = tf.cast(tf.shape(coefficients)[0], tf.float32)
    mixed = tf.matmul(mixing_weights(coefficients), params)
    share = weights / tf.reduce_sum(weights)
    return imitation * tf.reduce_sum(share * parameter_distance(mixed, params)) + rho * tf.reduce_sum(
        tf.square(coefficients - 1.0 / num_clients)
    )


def homogeneous_update(coefficients, params, weights, *, learning_rate, rho, imitation):
    """One gradient step of Eq. 11, then c is clipped at 0.

    Args:
      coefficients: c, `[N, N]`.
      params: the clients' parameter vectors, `[N, D]`.
      weights: D_n, `[N]`.
      learning_rate: eta_3.
      rho: the regulariser's weight.
      imitation: lambda.

    Returns:
      The new c, `[N, N]`.
    """
    with tf.GradientTape() as tape:
        tape.watch(coefficients)
        loss = homogeneous_objective(coefficients, params, weights, rho, imitation)
    return tf.maximum(coefficients - learning_rate * tape.gradient(loss, coefficients), 0.0)


def build_ktpfl_homogeneous_process(
    spec: client_data.ClientDataSpec,
    model_fn,
    *,
    local_config: local_training.TrainingConfig,
    transfer_steps: int = 1,
    transfer_learning_rate: float = 0.01,
    coefficient_learning_rate: float = 0.005,
    rho: float = 0.6,
    imitation: float = 1.0,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds homogeneous KT-pFL (the paper's Appendix C, Algorithm 2).

    Every client has the same architecture and uploads its parameters (this
    variant exchanges models, as the paper says). The server forms client
    n's personalized model u_n = sum_m c[n, m] w_m, sends it back, and the
    client takes R gradient steps on L_dis(u_n, w_n) = 1/2 ||u_n - w_n||^2
    (Eq. 10), i.e. w_n <- w_n - eta_2 (w_n - u_n); then c takes one step of
    Eq. 11 on the uploaded parameters.

    Args:
      spec: the partition on disk.
      model_fn: no-arg builder of the shared architecture (no non-trainable
        weights).
      local_config: E local epochs, batch size and eta_1 (Eq. 9).
      transfer_steps: R.
      transfer_learning_rate: eta_2 (1 with R = 1: the client adopts u_n).
      coefficient_learning_rate: eta_3 (0 keeps c at 1/N).
      rho: the regulariser's weight.
      imitation: lambda.
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`; server state `<coefficients,
      round_num>`, client state `<client_id, num_participations, last_round,
      client_index, params=float32[D]>`; every client takes part in every
      round.

    Raises:
      ValueError: on bad arguments.
    """
    local_config.validate()
    if transfer_steps < 0 or transfer_learning_rate < 0 or coefficient_learning_rate < 0:
        raise ValueError('transfer_steps and the learning rates must be >= 0')
    num_clients = spec.num_clients
    archs = heterogeneous.Architectures([model_fn])
    num_params = archs.max_size
    params_type = tff.TensorType(np.float32, (num_clients, num_params))
    sizes_type = tff.TensorType(np.float32, (num_clients,))

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        index = client_data.client_index(client_id)
        return building_blocks.participation_state(client_id, client_index=index, params=archs.initial_packed(seed)[0])

    client_state_type = initial_client_state.type_signature.result

    @tff.tensorflow.computation(np.int32, client_state_type)
    def local_stage(round_num, state):
        private = client_data.read_split(spec, state['client_id'], 'train')

        def work(model):
            stats = local_training.train(
                model,
                private,
                epochs=local_config.epochs,
                batch_size=local_config.batch_size,
                learning_rate=local_config.learning_rate,
                max_steps=local_config.max_steps,
                seed=local_training.client_seed(seed, round_num, state['client_id']),
            )
            with tf.control_dependencies(list(stats)):
                return archs.pack(model.trainable_weights), stats

        params, stats = archs.dispatch(tf.constant(0), state['params'], work)
        slot = tf.one_hot(state['client_index'], num_clients)
        new_state = collections.OrderedDict((k, state[k]) for k in state)
        new_state['params'] = params
        return collections.OrderedDict(
            params=slot[:, tf.newaxis] * params[tf.newaxis],
            num_examples=slot * tf.cast(private.num_examples, tf.float32),
            metric_sums=building_blocks.training_metric_sums(local_training.Stats(*stats)),
            client_state=new_state,
        )

    @tff.tensorflow.computation(params_type, np.int32, client_state_type)
    def transfer_stage(personalized, round_num, state):
        target = personalized[state['client_index']]
        params = state['params']
        for _ in range(transfer_steps):  # Eq. 10: gradient steps on 1/2 ||u_n - w_n||^2
            params = params - transfer_learning_rate * (params - target)
        distance = parameter_distance(params, target)
        return building_blocks.participated(state, round_num, params=params), distance

    @tff.tensorflow.computation
    def server_init():
        return collections.OrderedDict(
            coefficients=tf.fill([num_clients, num_clients], 1.0 / num_clients), round_num=tf.constant(0, tf.int32)
        )

    @tff.federated_computation
    def initialize():
        return tff.federated_eval(server_init, tff.SERVER)

    server_state_type = initialize.type_signature.result

    @tff.tensorflow.computation(server_state_type.member, params_type)
    def personalized_models(state, params):
        return tf.matmul(mixing_weights(state['coefficients']), params)

    @tff.tensorflow.computation(server_state_type.member, params_type, sizes_type)
    def update_coefficients(state, params, sizes):
        coefficients = homogeneous_update(
            state['coefficients'], params, sizes, learning_rate=coefficient_learning_rate, rho=rho, imitation=imitation
        )
        return collections.OrderedDict(coefficients=coefficients, round_num=state['round_num'] + 1)

    client_states_type = tff.FederatedType(client_state_type, tff.CLIENTS)

    @tff.federated_computation(server_state_type, client_states_type)
    def next_fn(state, client_states):
        round_num = tff.federated_broadcast(state.round_num)
        local = tff.federated_map(local_stage, (round_num, client_states))
        params = tff.federated_sum(local.params)  # every client's parameters in its slot
        sizes = tff.federated_sum(local.num_examples)
        personalized = tff.federated_broadcast(tff.federated_map(personalized_models, (state, params)))
        transferred = tff.federated_map(transfer_stage, (personalized, round_num, local.client_state))
        new_state = tff.federated_map(update_coefficients, (state, params, sizes))
        metrics = building_blocks.aggregate_training_metrics(local.metric_sums)
        distance = tff.federated_zip(collections.OrderedDict(transfer_distance=tff.federated_mean(transferred[1])))
        return template.RoundOutput(new_state, transferred[0], building_blocks.with_server_metrics(metrics, distance))

    @tff.tensorflow.computation(client_state_type)
    def evaluate_client(state):
        test = client_data.read_split(spec, state['client_id'], 'test')
        stats = archs.dispatch(tf.constant(0), state['params'], lambda model: local_training.evaluate(model, test))
        return collections.OrderedDict(personalized_model=template.client_metrics(local_training.Stats(*stats)))

    @tff.federated_computation(server_state_type, client_states_type)
    def evaluate(state, client_states):
        del state
        return tff.federated_map(evaluate_client, client_states)

    device = _device_process(
        server_init,
        initial_client_state,
        local_stage=local_stage,
        upload='params',
        mix=personalized_models,
        second_stage=transfer_stage,
        update_coefficients=update_coefficients,
        metric='transfer_distance',
        evaluate_client=evaluate_client,
    )
    process = template.PersonalizedProcess(
        initialize, next_fn, initial_client_state=initial_client_state, evaluate=evaluate, device=device
    )
    process.communication = collections.OrderedDict(
        parameter_bytes_up_per_client=num_params * 4, parameter_bytes_down_per_client=num_params * 4
    )
    return process


def _device_process(
    server_init,
    initial_client_state,
    *,
    local_stage,
    upload,
    mix,
    second_stage,
    update_coefficients,
    metric,
    evaluate_client,
):
    """KT-pFL's round with device-held client states, as two phases of one aggregation each.

    In process, one round aggregates every client's upload (soft predictions,
    or parameters), has the server mix them with the coefficient matrix, and
    broadcasts the mix back for a second client stage: two aggregation
    stages. Here they are two phases:

    * `share`: broadcast the round number; each device runs `local_stage`
      and sends its `upload` slot and size; the server updates the
      coefficients and keeps the mixed targets in its state;
    * `distill`: broadcast the targets (the whole matrix; each device takes its
      own row) and the round's number; each device runs `second_stage`; the
      server keeps the mean of its scalar (`metric`).

    A MapReduceForm returns the state type it takes, so the device form's
    server state is `<coefficients, round_num, targets>` throughout (targets
    zero before the first round).

    Both phases read and write the same state files, so a round of the two
    equals one in-process round (tests/test_export.py).
    """
    upload_type = local_stage.type_signature.result[upload]
    sizes_type = local_stage.type_signature.result['num_examples']
    targets_type = mix.type_signature.result

    @tff.tensorflow.computation
    def device_server_init():
        state = server_init()
        return collections.OrderedDict(
            coefficients=state['coefficients'],
            round_num=state['round_num'],
            targets=tf.zeros(targets_type.shape, targets_type.dtype),
        )

    @tff.federated_computation
    def device_initialize():
        return tff.federated_eval(device_server_init, tff.SERVER)

    state_type = device_initialize.type_signature.result.member

    @tff.tensorflow.computation(state_type)
    def share_broadcast(state):
        return state['round_num']

    @tff.tensorflow.computation(state_type, upload_type, sizes_type)
    def share_update(state, uploads, sizes):
        kept = collections.OrderedDict(coefficients=state['coefficients'], round_num=state['round_num'])
        updated = update_coefficients(kept, uploads, sizes)
        return collections.OrderedDict(
            coefficients=updated['coefficients'], round_num=updated['round_num'], targets=mix(kept, uploads)
        )

    def share_finish(state, outputs):
        uploads = tff.federated_sum(outputs[upload])  # every client's upload in its slot
        sizes = tff.federated_sum(outputs.num_examples)
        return (
            tff.federated_map(share_update, (state, uploads, sizes)),
            building_blocks.aggregate_training_metrics(outputs.metric_sums),
        )

    @tff.tensorflow.computation(state_type)
    def distill_broadcast(state):
        return collections.OrderedDict(targets=state['targets'], round_num=state['round_num'] - 1)

    @tff.tensorflow.computation(distill_broadcast.type_signature.result, initial_client_state.type_signature.result)
    def distill_step(value, client_state):
        new_state, scalar = second_stage(value['targets'], value['round_num'], client_state)
        return collections.OrderedDict([(metric, scalar), ('client_state', new_state)])

    def distill_finish(state, outputs):
        means = tff.federated_zip(collections.OrderedDict([(metric, tff.federated_mean(outputs[metric]))]))
        return state, means

    @tff.tensorflow.computation(state_type)
    def round_of(state):
        return state['round_num']

    @tff.tensorflow.computation(np.int32, initial_client_state.type_signature.result)
    def evaluate_at(round_num, client_state):
        del round_num  # the personalized model is in the client state
        return evaluate_client(client_state)

    return device_state.build_device_process(
        device_initialize,
        initial_client_state,
        phases=[
            device_state.Phase('share', share_broadcast, local_stage, share_finish),
            device_state.Phase('distill', distill_broadcast, distill_step, distill_finish),
        ],
        evaluate_input=round_of,
        evaluate_client=evaluate_at,
    )
