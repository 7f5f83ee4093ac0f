"""Keras metric objects as a builder's `metrics` (`tff_pfl.computations.keras_metrics`): each client's value is
the result of a fresh copy updated over its whole test split, checked against numpy and an eager copy."""

import numpy as np
import pytest
import tensorflow as tf

from processes import fedavg
from tests.test_builder_contract import LOCAL, make_data
from tff_pfl.computations import keras_metrics, local_training
from tff_pfl.data import client_data


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('keras_metrics')))


class _Refuses(tf.keras.metrics.Metric):
    def update_state(self, y_true, y_pred, sample_weight=None):
        raise ValueError('no labels suit me')

    def result(self):
        return tf.constant(0.0)


def test_inputs_are_chosen_on_the_datas_shapes(data):
    spec, _ = data
    chosen = {
        name: keras_metrics.from_metric(metric, spec, name)
        for name, metric in {
            'acc': tf.keras.metrics.SparseCategoricalAccuracy(),
            'auc': tf.keras.metrics.AUC(from_logits=True),
            'auc_probabilities': tf.keras.metrics.AUC(),
            'categorical': tf.keras.metrics.CategoricalAccuracy(),
        }.items()
    }
    assert [(c.one_hot, c.from_logits) for c in chosen.values()] == [
        (False, False),
        (True, True),
        (True, False),
        (True, False),
    ]
    with pytest.raises(ValueError) as raised:
        keras_metrics.from_metric(_Refuses(name='picky'), spec, "metrics['picky']")
    assert str(raised.value) == (
        "metrics['picky']: _Refuses fails on one-hot labels and 3 probabilities per label "
        '(ValueError: no labels suit me); a Keras Sparse... metric gets class indices, any other one-hot labels'
    )


def test_metrics_refuses_what_is_neither_a_function_nor_a_keras_metric(data):
    spec, _ = data
    with pytest.raises(
        TypeError, match=r"^metrics\['auc'\] must be a function .* or a tf.keras.metrics.Metric, got str$"
    ):
        local_training.metrics_from({'auc': 'auc'}, spec)


def test_each_client_reports_its_own_auc_and_accuracy_of_the_whole_test_split(data, tff_runtime):
    spec, model_fn = data
    user_metrics = {
        'auc': tf.keras.metrics.AUC(from_logits=True),
        'auc_probabilities': tf.keras.metrics.AUC(num_thresholds=50),
        'acc': tf.keras.metrics.SparseCategoricalAccuracy(),
    }
    process = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), metrics=user_metrics)
    state, clients = process.initialize(), process.initial_client_states(spec.client_ids)
    for _ in range(2):
        state, clients, _ = process.next(state, clients)
    evaluated = process.evaluate(state, clients)
    model = model_fn()
    process.get_model_weights(state).assign_weights_to(model)
    for client_id, result in zip(spec.client_ids, evaluated):
        x, y = client_data.read_split_numpy(spec, client_id, 'test')
        logits = model(x, training=False).numpy()
        got = result['global_model']
        np.testing.assert_allclose(float(got['acc']), np.mean(logits.argmax(-1) == y), rtol=1e-6)
        np.testing.assert_allclose(float(got['acc']), float(got['accuracy']), rtol=1e-6)
        for name in ('auc', 'auc_probabilities'):
            reference = type(user_metrics[name]).from_config(user_metrics[name].get_config())
            predictions = logits if name == 'auc' else tf.nn.softmax(logits).numpy()
            reference.update_state(np.eye(3)[y], predictions)
            np.testing.assert_allclose(float(got[name]), float(reference.result()), rtol=1e-5, err_msg=name)
    assert all(float(tf.reduce_sum(v)) == 0.0 for v in user_metrics['auc'].variables)  # the user's own untouched
