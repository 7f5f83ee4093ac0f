"""Our processes to TFF's own tools: the global model as `tff.learning.models.ModelWeights`."""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, fedper, local, persfl
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


def _fedavg_rounds(spec, model, rounds=2):
    process = fedavg.build_fedavg_process(
        spec, model, fedavg.FedAvgSettings(local_steps=3, batch_size=8, client_learning_rate=0.5), seed=3
    )
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    for _ in range(rounds):
        state, clients, _ = process.next(state, clients)
    return [np.asarray(w) for w in state['model']], process.evaluate(state, clients)


def test_a_functional_model_and_a_variable_model_train_as_the_keras_model_does(problem, tff_runtime):
    """FedAvg from `functional_model_from_keras` (started at the Keras run's initial weights) and
    from a `from_keras_model` function gives the Keras model function's rounds."""
    spec, model_fn = problem
    expected, expected_eval = _fedavg_rounds(spec, model_fn)
    initial = fedavg.build_fedavg_process(spec, model_fn, seed=3).initialize()['model']
    keras_model = model_fn()
    for variable, value in zip(keras_model.trainable_weights, initial):
        variable.assign(value)
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    functional = tff.learning.models.functional_model_from_keras(keras_model, loss, input_spec)
    got, got_eval = _fedavg_rounds(spec, functional)
    for g, w in zip(got, expected):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    assert [float(r['global_model']['accuracy']) for r in got_eval] == pytest.approx(
        [float(r['global_model']['accuracy']) for r in expected_eval]
    )
    tff_learning_fn = _tff_learning_model_fn(spec, model_fn)  # a VariableModel function, seeded as model_fn
    got, _ = _fedavg_rounds(spec, tff_learning_fn)
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(g, w)


def test_a_model_the_algorithm_cannot_take_is_refused_in_one_line(problem):
    spec, model_fn = problem
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    functional = tff.learning.models.functional_model_from_keras(
        model_fn(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec
    )
    with pytest.raises(ValueError, match=r"^model_fn: PersFL's distillation grid cannot train 'functional_model'"):
        persfl.build_persfl_process(spec, functional, SETTINGS)
    with pytest.raises(TypeError, match='^model_fn must be a function that builds a new model on each call'):
        fedavg.build_fedavg_process(spec, model_fn())
    with pytest.raises(TypeError, match='^model_fn must return a tf.keras.Model or a tff.learning.models.Var'):
        fedavg.build_fedavg_process(spec, lambda: 'a model')
