"""Models with non-trainable weights (BatchNormalization): handled as TFF's FedAvg handles them."""

import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import ditto, fedavg, fedbn, local
from tests.conftest import make_linear_problem
from tff_pfl.computations import audit, local_training, model_weights
from tff_pfl.data import client_data, client_data_writer

SEED = 5
SETTINGS = fedavg.FedAvgSettings(local_epochs=2, batch_size=8, client_learning_rate=0.2)


def bn_model(dim=4, num_classes=3):
    inputs = tf.keras.Input([dim])
    hidden = tf.keras.layers.Dense(6)(inputs)
    hidden = tf.keras.layers.BatchNormalization(name='norm')(hidden)
    hidden = tf.keras.layers.ReLU()(hidden)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(hidden), name='bn_mlp')


@pytest.fixture(scope='module')
def spec(tmp_path_factory):
    return make_linear_problem(tmp_path_factory.mktemp('batch_norm') / 'data')


def _tff_datasets(spec, client_ids, round_num):
    """Each client's train split, batched in the order our local training takes it in `round_num`, epoch by epoch."""
    datasets = []
    for client_id in client_ids:
        x, y = client_data.read_split_numpy(spec, client_id, 'train')
        seed = local_training.client_seed(SEED, tf.constant(round_num), tf.constant(client_id))
        epochs = [
            tf.data.Dataset.from_tensor_slices((x[perm].astype(np.float32), y[perm].astype(np.int32))).batch(
                SETTINGS.batch_size
            )
            for perm in local_training.epoch_permutations(seed, SETTINGS.local_epochs, len(y)).numpy()
        ]
        datasets.append(functools.reduce(lambda a, b: a.concatenate(b), epochs))
    return datasets


def test_fedavg_with_batch_norm_trains_as_tffs_fedavg(spec, tff_runtime):
    """Three rounds of our FedAvg and of `tff.learning.algorithms.build_weighted_fed_avg` from the same initial
    weights on the same batches give the same global model; TFF's non-trainable weights stay the initial ones."""
    process = fedavg.build_fedavg_process(spec, bn_model, SETTINGS, seed=SEED)
    state = process.initialize()
    sampled = list(spec.client_ids)
    clients = [process.initial_client_state(c) for c in sampled]

    def tff_model_fn():
        return tff.learning.models.from_keras_model(
            bn_model(),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            input_spec=(tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int32)),
        )

    tffs = tff.learning.algorithms.build_weighted_fed_avg(
        tff_model_fn,
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(SETTINGS.client_learning_rate),
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0),
    )
    initial = model_weights.non_trainable_values(bn_model, SEED)
    tff_state = tffs.set_model_weights(
        tffs.initialize(), tff.learning.models.ModelWeights([np.asarray(w) for w in state['model']], initial)
    )
    for round_num in range(3):
        output = process.next(state, clients)
        state, clients = output.state, output.client_states
        tff_state = tffs.next(tff_state, _tff_datasets(spec, sampled, round_num)).state
        theirs = tffs.get_model_weights(tff_state)
        for got, want in zip(state['model'], theirs.trainable):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(theirs.non_trainable[0], np.zeros(6))  # moving mean: the initial one
    np.testing.assert_array_equal(theirs.non_trainable[1], np.ones(6))


def input_norm_model(dim=4, num_classes=3):
    """Batch normalization of the inputs themselves: its batch statistics do not depend on the weights."""
    inputs = tf.keras.Input([dim])
    normed = tf.keras.layers.BatchNormalization(name='input_norm')(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(normed), name='input_norm_linear')


def test_fedbn_keeps_each_clients_batch_norm_and_its_moving_statistics(spec, tff_runtime):
    """After a round, a client's moving mean and variance are numpy's running averages (momentum 0.99) of the
    batch statistics of its own inputs in our batch order; its scale and offset moved; neither reaches the server."""
    settings = fedbn.FedBNSettings(local_epochs=2, batch_size=8, client_learning_rate=0.2)
    process = fedbn.build_fedbn_process(spec, input_norm_model, settings, seed=SEED)
    assert fedbn.split_batch_norm(input_norm_model) == ([2, 3], [0, 1])
    state = process.initialize()
    assert [tuple(np.shape(w)) for w in state['model']] == [(4, 3), (3,)]  # no batch-norm weight on the server
    clients = [process.initial_client_state(c) for c in spec.client_ids]
    output = process.next(state, clients)
    for client_id, client in zip(spec.client_ids, output.client_states):
        x, _ = client_data.read_split_numpy(spec, client_id, 'train')
        seed = local_training.client_seed(SEED, tf.constant(0), tf.constant(client_id))
        mean, variance = np.zeros(4), np.ones(4)
        for perm in local_training.epoch_permutations(seed, settings.local_epochs, len(x)).numpy():
            for idx in np.array_split(perm, range(settings.batch_size, len(perm), settings.batch_size)):
                batch = x[idx].astype(np.float64)
                mean = 0.99 * mean + 0.01 * batch.mean(axis=0)
                variance = 0.99 * variance + 0.01 * batch.var(axis=0)
        np.testing.assert_allclose(client['statistics'][0], mean, atol=1e-5)
        np.testing.assert_allclose(client['statistics'][1], variance, atol=1e-5)
        assert not np.allclose(client['batch_norm'][0], 1.0)  # the scale trained
    first, second = output.client_states[:2]
    assert not np.allclose(first['batch_norm'][1], second['batch_norm'][1])

    # A client is scored with its own statistics and layers: numpy's inference-mode forward pass (epsilon 1e-3).
    evaluated = process.evaluate(output.state, output.client_states)
    for client_id, client, result in zip(spec.client_ids, output.client_states, evaluated):
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        mean, variance = client['statistics']
        gamma, beta = client['batch_norm']
        kernel, bias = output.state['model']
        logits = ((x - mean) / np.sqrt(variance + 1e-3) * gamma + beta) @ kernel + bias
        assert float(result['personalized_model']['accuracy']) == pytest.approx(np.mean(logits.argmax(1) == y))
    assert 'global_model' not in evaluated[0]


def test_what_fedbn_uploads_is_the_shared_layers_only(spec):
    process = fedbn.build_fedbn_process(spec, input_norm_model, fedbn.FedBNSettings(), seed=SEED)
    uploads = ' '.join(str(t) for _, t in audit.clients_to_server_values(process.next))
    assert 'float32[4,3]' in uploads and 'float32[4]' not in uploads


def test_a_model_fedbn_cannot_take_is_refused_in_one_line(spec):
    with pytest.raises(ValueError, match=r"^model_fn: FedBN keeps the BatchNormalization layers .* 'plain' has none"):
        fedbn.build_fedbn_process(
            spec, lambda: tf.keras.Sequential([tf.keras.Input([4]), tf.keras.layers.Dense(3)], name='plain')
        )


def test_non_trainable_weights_that_differ_from_build_to_build_are_refused_naming_the_layer(spec):
    def frozen_model():
        inputs = tf.keras.Input([4])
        hidden = tf.keras.layers.Dense(5, trainable=False, name='frozen')(inputs)
        return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden), name='frozen_mlp')

    with pytest.raises(ValueError, match=r"^model 'frozen_mlp' has non-trainable weights that differ .*'frozen'"):
        fedavg.build_fedavg_process(spec, frozen_model)


def test_tffs_evaluation_of_the_global_model_with_batch_norm_scores_as_ours(spec, tff_runtime):
    """`get_model_weights` carries the initial statistics as `non_trainable`, so TFF's `build_fed_eval` takes it."""
    process = fedavg.build_fedavg_process(spec, bn_model, SETTINGS, seed=SEED)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    state = process.next(state, clients).state
    weights = process.get_model_weights(state)
    np.testing.assert_array_equal(weights.non_trainable[1], np.ones(6))
    ours = process.evaluate(state, clients)
    counts = np.array([float(r['global_model']['num_examples']) for r in ours])
    pooled = float((counts * np.array([float(r['global_model']['accuracy']) for r in ours])).sum() / counts.sum())

    def tff_model_fn():
        return tff.learning.models.from_keras_model(
            bn_model(),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            input_spec=(tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int32)),
            metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
        )

    evaluation = tff.learning.algorithms.build_fed_eval(tff_model_fn)
    eval_state = evaluation.set_model_weights(evaluation.initialize(), weights)
    data = []
    for client_id in spec.client_ids:
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        data.append(tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y.astype(np.int32))).batch(16))
    output = evaluation.next(eval_state, data)
    theirs = output.metrics['client_work']['eval']['current_round_metrics']['sparse_categorical_accuracy']
    assert theirs == pytest.approx(pooled, abs=1e-6)


def shifted_input_norm_model(dim=4, num_classes=3):
    """Input batch normalization (fast moving statistics) before a linear layer."""
    inputs = tf.keras.Input([dim])
    normed = tf.keras.layers.BatchNormalization(momentum=0.5, name='input_norm')(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(normed), name='input_norm_linear')


@pytest.fixture(scope='module')
def shifted_spec(tmp_path_factory):
    """Inputs far from a fresh model's statistics (mean 0, variance 1): each client's scaled and shifted its own way."""
    rng = np.random.default_rng(3)
    sizes = (30, 41)
    x = rng.normal(size=(3 * sum(sizes), 4)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(4, 3)), axis=1).astype(np.int32)
    splits, start = [], 0
    for k, n in enumerate(sizes):
        idx = np.arange(start, start + 3 * n)
        x[idx] = x[idx] * (2.0 + k) + 3.0 * (k + 1)
        splits.append({'train': idx[:n], 'val': idx[n : 2 * n], 'test': idx[2 * n :]})
        start += 3 * n
    root = tmp_path_factory.mktemp('shifted') / 'data'
    return client_data_writer.write_client_data(str(root), x, y, 3, splits)


def _running_statistics(x, seed, epochs, batch_size, momentum=0.5):
    mean, variance = np.zeros(x.shape[1]), np.ones(x.shape[1])
    for perm in local_training.epoch_permutations(seed, epochs, len(x)).numpy():
        for idx in np.array_split(perm, range(batch_size, len(perm), batch_size)):
            batch = x[idx].astype(np.float64)
            mean = momentum * mean + (1 - momentum) * batch.mean(axis=0)
            variance = momentum * variance + (1 - momentum) * batch.var(axis=0)
    return mean, variance


def _numpy_scores(x, y, mean, variance, gamma, beta, kernel, bias):
    """Inference-mode forward pass (epsilon 1e-3): mean cross-entropy and accuracy."""
    logits = ((x - mean) / np.sqrt(variance + 1e-3) * gamma + beta) @ kernel + bias
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -log_p[np.arange(len(y)), y].mean(), np.mean(logits.argmax(1) == y)


@pytest.mark.parametrize('name', ['local', 'ditto'])
def test_a_personal_model_keeps_its_own_batch_norm_statistics(name, shifted_spec, tff_runtime):
    """Local's model and Ditto's v_k carry their moving statistics: after a round they are numpy's running averages
    of the client's own training batches (in our batch order), and the client is scored with them, as a Keras
    model trained on its data alone would be; Ditto's global model keeps a fresh model's, as TFF's FedAvg does."""
    spec = shifted_spec
    if name == 'local':
        settings = local.LocalSettings(local_epochs=2, batch_size=8, client_learning_rate=0.1)
        process = local.build_local_process(spec, shifted_input_norm_model, settings, seed=SEED)
        field, salt, epochs = 'model', 0, settings.local_epochs
        state = process.initialize()
    else:
        settings = ditto.DittoSettings(local_epochs=1, personal_epochs=2, batch_size=8, client_learning_rate=0.1)
        process = ditto.build_ditto_process(spec, shifted_input_norm_model, settings, seed=SEED)
        field, salt, epochs = 'personal', 1, settings.personal_epochs
        state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    np.testing.assert_array_equal(clients[0]['statistics'][1], np.ones(4))
    output = process.next(state, clients)
    evaluated = process.evaluate(output.state, output.client_states)
    for client_id, client, result in zip(spec.client_ids, output.client_states, evaluated):
        x, _ = client_data.read_split_numpy(spec, client_id, 'train')
        seed = local_training.client_seed(SEED, tf.constant(0), tf.constant(client_id), salt=salt)
        mean, variance = _running_statistics(x, seed, epochs, settings.batch_size)
        np.testing.assert_allclose(client['statistics'][0], mean, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(client['statistics'][1], variance, rtol=1e-5, atol=1e-4)
        x_test, y_test = client_data.read_split_numpy(spec, client_id, 'test')
        gamma, beta, kernel, bias = client[field]
        loss, accuracy = _numpy_scores(x_test, y_test, mean, variance, gamma, beta, kernel, bias)
        fresh_loss, _ = _numpy_scores(x_test, y_test, 0.0, 1.0, gamma, beta, kernel, bias)
        assert abs(fresh_loss - loss) > 0.1  # the statistics matter here
        personal = result['personalized_model']
        assert float(personal['loss']) == pytest.approx(loss, rel=1e-4)
        assert float(personal['accuracy']) == pytest.approx(accuracy)
        if name == 'ditto':
            gamma, beta, kernel, bias = output.state['model']
            loss, _ = _numpy_scores(x_test, y_test, 0.0, 1.0, gamma, beta, kernel, bias)
            assert float(result['global_model']['loss']) == pytest.approx(loss, rel=1e-4)


def test_a_model_without_non_trainable_weights_keeps_the_personal_state_it_had(spec):
    def plain():
        return tf.keras.Sequential([tf.keras.Input([4]), tf.keras.layers.Dense(3)], name='plain')

    assert model_weights.statistics_type(plain) is None
    assert model_weights.statistics_type(bn_model) is not None
    for process, field in (
        (local.build_local_process(spec, plain), 'model'),
        (ditto.build_ditto_process(spec, plain), 'personal'),
    ):
        names = [name for name, _ in tff.structure.iter_elements(process.initial_client_state.type_signature.result)]
        assert names == ['client_id', 'num_participations', 'last_round', field]
