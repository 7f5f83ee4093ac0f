"""Our processes to TFF's own tools: the global model as `tff.learning.models.ModelWeights`."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedper, local, persfl
from tests.conftest import make_linear_problem
from tff_pfl import models
from tff_pfl.data import client_data

SETTINGS = persfl.PersFLSettings(
    local_epochs=1,
    batch_size=8,
    client_learning_rate=0.5,
    distill_epochs=1,
    distill_batch_size=8,
    temperatures=(1.0,),
    imitations=(0.5,),
)


@pytest.fixture(scope='module')
def problem(tmp_path_factory):
    spec = make_linear_problem(tmp_path_factory.mktemp('interop') / 'data', num_clients=3)
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    return spec, model_fn


def _tff_learning_model_fn(spec, model_fn):
    input_spec = (
        tf.TensorSpec([None, *spec.feature_shape], tf.float32),
        tf.TensorSpec([None], tf.int32),
    )

    def tff_model_fn():
        return tff.learning.models.from_keras_model(
            model_fn(),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            input_spec=input_spec,
            metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
        )

    return tff_model_fn


def test_tffs_own_evaluation_of_persfls_global_model_equals_ours(problem, tff_runtime):
    """After PersFL rounds, `tff.learning.algorithms.build_fed_eval` of `get_model_weights(state)`
    scores the clients' test splits as our evaluation of the global model does."""
    spec, model_fn = problem
    process = persfl.build_persfl_process(spec, model_fn, SETTINGS, seed=3)
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    for _ in range(3):
        state, clients, _ = process.next(state, clients)
    ours = process.evaluate(state, clients)
    counts = np.array([float(r['global_model']['num_examples']) for r in ours])
    accuracies = np.array([float(r['global_model']['accuracy']) for r in ours])
    ours_pooled = float((counts * accuracies).sum() / counts.sum())

    weights = process.get_model_weights(state)
    assert isinstance(weights, tff.learning.models.ModelWeights)
    assert list(weights.non_trainable) == []
    np.testing.assert_array_equal(weights.trainable[0], state['model'][0])

    evaluation = tff.learning.algorithms.build_fed_eval(_tff_learning_model_fn(spec, model_fn))
    eval_state = evaluation.set_model_weights(evaluation.initialize(), weights)
    datasets = []
    for client_id in spec.client_ids:
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        datasets.append(tf.data.Dataset.from_tensor_slices((x.astype(np.float32), y.astype(np.int32))).batch(16))
    output = evaluation.next(eval_state, datasets)
    tffs = output.metrics['client_work']['eval']['current_round_metrics']['sparse_categorical_accuracy']
    assert 0.4 < ours_pooled < 1.0  # trained, not at chance (3 classes)
    assert tffs == pytest.approx(ours_pooled, abs=1e-6)


def test_set_model_weights_replaces_the_global_model_and_keeps_the_rest(problem, tff_runtime):
    spec, model_fn = problem
    process = persfl.build_persfl_process(spec, model_fn, SETTINGS, seed=3)
    state = process.initialize()
    keras_model = model_fn()
    for variable in keras_model.trainable_weights:
        variable.assign(tf.fill(variable.shape, 0.25))
    new_state = process.set_model_weights(state, tff.learning.models.ModelWeights.from_model(keras_model))
    for got in new_state['model']:
        np.testing.assert_array_equal(got, np.full(got.shape, 0.25, np.float32))
    assert [k for k in new_state] == [k for k in state]
    assert int(new_state['round_num']) == int(state['round_num'])
    # The process trains on from the weights set.
    clients = process.initial_client_states(spec.client_ids)
    next_state, _, _ = process.next(new_state, clients)
    assert not np.allclose(next_state['model'][0], 0.25)


def test_an_algorithm_without_a_global_model_says_so_in_one_line(problem):
    spec, model_fn = problem
    deep_fn = functools.partial(models.mnist_dnn, spec.feature_shape, spec.num_classes)
    for process, why in [
        (local.build_local_process(spec, model_fn), 'local-only training has no server model'),
        (fedper.build_fedper_process(spec, deep_fn), 'only the shared layers'),
    ]:
        assert not process.has_global_model
        with pytest.raises(ValueError, match=why) as raised:
            process.get_model_weights  # noqa: B018 (the property raises)
        assert '\n' not in str(raised.value)
        with pytest.raises(ValueError, match='has no global model'):
            process.set_model_weights  # noqa: B018


def test_global_model_must_name_a_server_state_field(problem):
    spec, model_fn = problem
    process = persfl.build_persfl_process(spec, model_fn, dataclasses.replace(SETTINGS), seed=0)
    with pytest.raises(TypeError, match="global_model 'weights' is not a field"):
        type(process)(
            process.initialize,
            process.next,
            initial_client_state=process.initial_client_state,
            evaluate=process.evaluate,
            global_model='weights',
        )
