"""A user's mistakes in a builder's Python arguments are one error naming the argument, before any round runs
(`tff_pfl.computations.builder_inputs`, `federated.from_federated_data`'s labels, `initial_client_states`' ids)."""

import collections
import functools
import inspect
import os
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg, persfl
from tests.test_builder_contract import LOCAL, USERS, _builders, make_data
from tff_pfl import models
from tff_pfl.computations import builder_inputs
from tff_pfl.data import federated


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('inputs')))


def _one_line(raised):
    assert '\n' not in str(raised.value)
    return str(raised.value)


def _fedavg(spec, model_fn, **keywords):
    return fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(**LOCAL), **keywords)


@pytest.mark.parametrize('builder', sorted(_builders()))
def test_every_builder_refuses_a_seed_that_is_not_an_int(data, builder):
    spec, model_fn = data
    build, _ = _builders()[builder]
    with pytest.raises(TypeError, match=r'^seed must be an int .*got None; pass e\.g\. seed=0$') as raised:
        build(spec, model_fn, seed=None)
    _one_line(raised)


@pytest.mark.parametrize('builder', sorted(_builders()))
def test_every_builder_refuses_a_client_data_where_the_spec_goes(data, builder):
    spec, model_fn = data
    build, _ = _builders()[builder]
    client_data = tff.simulation.datasets.TestClientData({'a': collections.OrderedDict(x=np.zeros((2, 6)), y=[0, 1])})
    with pytest.raises(TypeError, match=r'^spec must be a ClientDataSpec, got TestClientData; .*from_federated_data'):
        build(client_data, model_fn)


@pytest.mark.parametrize(
    'seed, error, message',
    [
        (-1, ValueError, r'\[0, 2\*\*31 - 1\], got -1'),
        (2**31, ValueError, 'got 2147483648'),
        (1.0, TypeError, 'got 1.0'),
        (True, TypeError, 'got True'),
    ],
)
def test_a_seed_out_of_range_or_of_another_type_is_refused(data, seed, error, message):
    spec, model_fn = data
    with pytest.raises(error, match=message):
        _fedavg(spec, model_fn, seed=seed)


def test_a_numpy_integer_seed_is_taken(data):
    spec, model_fn = data
    assert _fedavg(spec, model_fn, seed=np.int64(3)) is not None


def test_the_checked_builder_keeps_the_builders_signature_and_docstring():
    wrapped = fedavg.build_fedavg_process.__wrapped__
    assert inspect.signature(fedavg.build_fedavg_process) == inspect.signature(wrapped)
    assert fedavg.build_fedavg_process.__doc__ == wrapped.__doc__


def _dense(units, input_shape, name='user_model'):
    return tf.keras.Sequential(
        [tf.keras.layers.InputLayer(input_shape=input_shape), tf.keras.layers.Flatten(), tf.keras.layers.Dense(units)],
        name=name,
    )


def test_fewer_logits_than_classes_is_refused_naming_the_width_and_the_labels(data):
    spec, _ = data  # 3 classes
    with pytest.raises(ValueError) as raised:
        _fedavg(spec, lambda: _dense(2, (6,)))
    assert _one_line(raised) == (
        "model_fn: model 'user_model' has 2 logits, but the labels go up to 2 (spec.num_classes = 3); "
        'build its last layer with spec.num_classes outputs'
    )


def test_more_logits_than_classes_are_taken(data):
    spec, _ = data
    process = _fedavg(spec, lambda: _dense(5, (6,)))
    assert process.initialize.type_signature.result.placement is tff.SERVER


def test_a_model_that_cannot_take_the_features_is_refused_in_one_line(data):
    spec, _ = data  # features of shape (6,)
    with pytest.raises(
        ValueError,
        match=r"^model_fn: model 'user_model' cannot take the data's features \(shape \(6,\) per example, float32\): ",
    ) as raised:
        _fedavg(spec, lambda: _dense(3, (8,)))
    _one_line(raised)


def test_outputs_per_position_where_the_labels_are_one_per_example_are_refused(data):
    spec, _ = data

    def per_position():
        inputs = tf.keras.Input((6,))
        return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(tf.keras.layers.Reshape((6, 1))(inputs)), name='seq')

    with pytest.raises(ValueError) as raised:
        _fedavg(spec, per_position)
    assert _one_line(raised) == (
        "model_fn: model 'seq' gives outputs of shape (6, 3) per example; the labels (shape () per example, "
        '3 classes) need (3,): one logit per class'
    )


def test_the_model_check_runs_once_per_model_function_and_partition(data, monkeypatch):
    spec, model_fn = data
    calls = []
    original = builder_inputs.check_model_outputs
    monkeypatch.setattr(builder_inputs, 'check_model_outputs', lambda *a: calls.append(1) or original(*a))
    fresh = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    _fedavg(spec, fresh)
    _fedavg(spec, fresh)
    persfl.build_persfl_process(spec, fresh, persfl.PersFLSettings(**LOCAL, temperatures=(1.0,), imitations=(0.5,)))
    assert len(calls) == 1


def _labels_problem(tmp_path, y, x=None):
    x = np.zeros((len(y), 4), np.float32) if x is None else x
    return federated.from_federated_data({'a': (x, np.asarray(y)), 'b': (x, np.asarray(y))}, cache_dir=str(tmp_path))


def test_a_negative_class_of_an_example_is_refused(tmp_path):
    with pytest.raises(ValueError) as raised:
        _labels_problem(tmp_path, [0, 1, -1, 2] * 3)
    assert _one_line(raised) == (
        "train['a']: label -1; a label is a class 0, 1, ..., num_classes - 1 "
        '(-1 marks an ignored position only in per-position sequence labels)'
    )


def test_one_hot_labels_are_refused_with_the_fix(tmp_path):
    y = np.eye(3, dtype=np.int32)[[0, 1, 2, 1, 0, 2]]
    with pytest.raises(ValueError) as raised:
        _labels_problem(tmp_path, y)
    assert _one_line(raised) == (
        "train['a']: labels of shape (3,) per example with features of shape (4,); labels are one class index per "
        "example, or one per sequence position shaped like the features' leading axes; they look one-hot: pass the "
        'class indices, y.argmax(-1)'
    )


def test_per_position_labels_with_ignored_positions_are_taken(tmp_path):
    x = np.arange(40, dtype=np.int32).reshape(8, 5) % 7
    y = np.where(x > 4, -1, x)
    spec = _labels_problem(tmp_path, y, x)
    assert spec.label_shape == (5,) and spec.num_classes == 5
    with pytest.raises(ValueError, match=r"^train\['a'\]: label -2; a label is a class 0, 1, "):
        _labels_problem(tmp_path, np.where(x > 4, -2, x), x)


@pytest.mark.parametrize('n', [1, 2])
def test_a_client_too_small_for_a_test_split_is_refused_not_scored_zero(tmp_path, n):
    x, y = np.zeros((10, 4), np.float32), np.arange(10) % 3
    clients = {'big': (x, y), 'tiny': (x[:n], y[:n])}
    with pytest.raises(ValueError) as raised:
        federated.from_federated_data(clients, cache_dir=str(tmp_path))
    message = _one_line(raised)
    assert message.startswith(f"train['tiny'] has {n} example")
    assert 'test' in message.split(':')[1] and message.endswith('give each client at least 3 examples, or leave it out')
    assert os.listdir(tmp_path) == []  # nothing half-written is left in the cache


def test_with_test_data_one_example_is_refused_for_its_empty_validation_split_and_two_are_taken(tmp_path):
    x, y = np.zeros((10, 4), np.float32), np.arange(10) % 3
    test = {'big': (x, y), 'tiny': (x, y)}
    with pytest.raises(ValueError, match=r"^train\['tiny'\] has 1 example: its val split is empty .* at least 2 "):
        federated.from_federated_data({'big': (x, y), 'tiny': (x[:1], y[:1])}, test, cache_dir=str(tmp_path))
    spec = federated.from_federated_data({'big': (x, y), 'tiny': (x[:2], y[:2])}, test, cache_dir=str(tmp_path))
    assert spec.num_clients == 2
    no_validation = federated.from_federated_data(
        {'big': (x, y), 'tiny': (x[:1], y[:1])}, test, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    assert no_validation.num_clients == 2


def test_initial_client_states_take_the_users_ids_and_refuse_unknown_ones(data, tff_runtime):
    spec, model_fn = data
    process = _fedavg(spec, model_fn)
    by_user = process.initial_client_states(['ben', 'ann'])
    assert [s['client_id'].decode() for s in by_user] == [spec.client_ids[1], spec.client_ids[0]]
    positional = process.initial_client_states(spec.client_ids[1:])
    assert [s['client_id'].decode() for s in positional] == list(spec.client_ids[1:])
    with pytest.raises(ValueError) as raised:
        process.initial_client_states(['ann', 'dan'])
    assert _one_line(raised) == (
        "client_ids: 'dan' is not a client of the partition the process was built for (its ids: "
        f'{", ".join(repr(i) for i in spec.client_ids)}, or your own ids {", ".join(repr(u) for u in USERS)})'
    )
    with pytest.raises(
        TypeError, match=r"^client_ids must be a sequence of ids, got the string 'ann'; pass \['ann'\]$"
    ):
        process.initial_client_states('ann')
    with pytest.raises(ValueError, match='^client_ids must name at least one client$'):
        process.initial_client_states([])
    with pytest.raises(TypeError, match=r'^client_ids must be strings, got 3 \(int\)$'):
        process.initial_client_states([3])


def test_a_round_runs_on_the_states_of_the_users_ids(data, tff_runtime):
    spec, model_fn = data
    process = _fedavg(spec, model_fn)
    state, clients, _ = process.next(process.initialize(), process.initial_client_states(list(USERS)))
    results = federated.by_user_id(spec, process.evaluate(state, clients))
    assert tuple(results) == USERS


class _ZeroLoss(tf.keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(y_pred, axis=-1) * 0.0


def _functional(spec, model_fn, loss):
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    return tff.learning.models.functional_model_from_keras(model_fn(), loss, input_spec)


def _variable_model_fn(spec, model_fn, loss):
    input_spec = (tf.TensorSpec([None, *spec.feature_shape], tf.float32), tf.TensorSpec([None], tf.int32))
    return lambda: tff.learning.models.from_keras_model(model_fn(), loss=loss, input_spec=input_spec)


def test_a_tff_models_own_cross_entropy_on_logits_is_taken(data):
    spec, model_fn = data
    ce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (_functional(spec, model_fn, ce), _variable_model_fn(spec, model_fn, ce)):
        assert _fedavg(spec, model).initialize.type_signature.result.placement is tff.SERVER


@pytest.mark.parametrize('kind', ['FunctionalModel', 'VariableModel'])
def test_a_tff_models_own_loss_that_the_builder_would_drop_is_refused(data, kind):
    spec, model_fn = data
    wrap = _functional if kind == 'FunctionalModel' else _variable_model_fn
    probabilities = wrap(spec, model_fn, tf.keras.losses.SparseCategoricalCrossentropy())  # from_logits=False
    with pytest.raises(ValueError) as raised:
        _fedavg(spec, probabilities)
    assert re.match(
        rf"^model_fn: the {kind}'s own loss gives [0-9.]+ where cross-entropy on its logits gives [0-9.]+ \(a probe "
        r'batch\); the builders train with loss= \(cross-entropy when None\), so pass loss=',
        _one_line(raised),
    )
    zero = wrap(spec, model_fn, _ZeroLoss())
    with pytest.raises(ValueError, match=rf"^model_fn: the {kind}'s own loss gives 0 where"):
        _fedavg(spec, zero)
    focal = functools.partial(tf.keras.losses.sparse_categorical_crossentropy, from_logits=True)
    assert _fedavg(spec, zero, loss=focal).initialize.type_signature.result.placement is tff.SERVER  # loss= wins


def test_a_model_with_batch_normalization_builds_and_a_frozen_random_layer_is_refused_naming_it(data):
    """BatchNormalization's statistics start the same in every build: taken (tests/test_batch_norm.py trains it as
    TFF's FedAvg does). A frozen Dense's random kernel does not: refused, naming the layer."""
    spec, _ = data

    def batch_normalized():
        inputs = tf.keras.Input((6,))
        hidden = tf.keras.layers.BatchNormalization(name='bn')(tf.keras.layers.Dense(8)(inputs))
        return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden), name='user_bn')

    def frozen():
        inputs = tf.keras.Input((6,))
        hidden = tf.keras.layers.Dense(8, trainable=False, name='frozen_dense')(inputs)
        return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden), name='user_frozen')

    assert _fedavg(spec, batch_normalized).initialize.type_signature.result.placement is tff.SERVER
    with pytest.raises(ValueError) as raised:
        _fedavg(spec, frozen)
    assert _one_line(raised) == (
        "model 'user_frozen' has non-trainable weights that differ from build to build (layer 'frozen_dense'): only "
        "trainable weights are averaged or kept, and non-trainable ones are a fresh model's; give them a constant "
        'initializer or make them trainable'
    )


@pytest.mark.parametrize('layer', [tf.keras.layers.Dropout(0.1), tf.keras.layers.LayerNormalization()])
def test_persfls_grid_refuses_a_layer_it_cannot_stack_naming_it(data, layer):
    spec, _ = data

    def with_layer():
        fresh = type(layer).from_config(layer.get_config())
        return tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8), fresh, tf.keras.layers.Dense(3)])

    with pytest.raises(ValueError) as raised:
        persfl.build_persfl_process(spec, with_layer, persfl.PersFLSettings(**LOCAL))
    kind = type(layer).__name__
    assert re.match(
        rf"^model_fn: PersFL's distillation grid cannot train '\w+' \(layer '{layer.name}' of kind {kind} is not "
        r'supported for stacked training\)$',
        _one_line(raised),
    )
