"""Client data as TFF users hold it: ClientData, tf.data and arrays in, written once, ids kept."""

import collections
import functools
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from processes import fedavg
from tff_pfl import models
from tff_pfl.data import client_data, federated

IDS = ('alice', 'bob', 'carol')


def _arrays(seed=0, sizes=(30, 41, 25), dim=5, classes=3):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(dim, classes))
    out = {}
    for client_id, n in zip(IDS, sizes):
        x = rng.normal(size=(n, dim)).astype(np.float32)
        out[client_id] = (x, np.argmax(x @ w, axis=1).astype(np.int64))
    return out


def _test_client_data(arrays):
    return tff.simulation.datasets.TestClientData(
        {k: collections.OrderedDict(x=x, y=y) for k, (x, y) in arrays.items()}
    )


def _rows(x, y):
    """The set of (features, label) rows, to compare splits regardless of order."""
    return sorted(tuple(np.round(row, 6)) + (int(label),) for row, label in zip(x.reshape(len(x), -1), y))


def test_a_train_test_pair_of_client_data_is_written_with_the_users_ids_and_a_validation_split(tmp_path):
    train, test = _arrays(0), _arrays(1, sizes=(10, 12, 8))
    spec = federated.from_federated_data(
        _test_client_data(train), _test_client_data(test), cache_dir=str(tmp_path), val_fraction=0.2
    )
    assert spec.source_ids == IDS
    assert federated.user_ids(spec) == IDS
    assert spec.feature_shape == (5,) and spec.num_classes == 3
    for position, client_id in enumerate(IDS):
        inner = spec.client_ids[position]
        got = {s: client_data.read_split_numpy(spec, inner, s) for s in client_data.SPLITS}
        x, y = train[client_id]
        assert len(got['val'][0]) == round(0.2 * len(x))
        both = (np.concatenate([got['train'][0], got['val'][0]]), np.concatenate([got['train'][1], got['val'][1]]))
        assert _rows(*both) == _rows(x, y)  # train + val are the client's training examples, none lost
        assert _rows(*got['test']) == _rows(*test[client_id])


def test_a_second_call_reuses_the_partition_and_other_data_get_another(tmp_path):
    arrays = _arrays(0)
    first = federated.from_federated_data(_test_client_data(arrays), cache_dir=str(tmp_path))
    written = os.path.getmtime(os.path.join(first.root, client_data.MANIFEST))
    again = federated.from_federated_data(_test_client_data(arrays), cache_dir=str(tmp_path))
    assert again.root == first.root
    assert os.path.getmtime(os.path.join(again.root, client_data.MANIFEST)) == written
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(first.root)]  # nothing left behind
    changed = dict(arrays, bob=(arrays['bob'][0] + 1.0, arrays['bob'][1]))
    other = federated.from_federated_data(_test_client_data(changed), cache_dir=str(tmp_path))
    assert other.root != first.root
    seeded = federated.from_federated_data(_test_client_data(arrays), cache_dir=str(tmp_path), seed=1)
    assert seeded.root not in (first.root, other.root)


def test_the_cache_keeps_the_most_recently_used_partitions_within_its_bound(tmp_path):
    cache = str(tmp_path)
    specs = [federated.from_federated_data(_arrays(seed), cache_dir=cache) for seed in range(3)]
    roots = [spec.root for spec in specs]
    for age, root in zip((300, 200, 100), roots):  # used 300, 200, 100 s ago
        os.utime(root, (os.path.getatime(root), os.path.getmtime(root) - age))
    sizes = [sum(os.path.getsize(os.path.join(root, name)) for name in os.listdir(root)) for root in roots]
    os.makedirs(os.path.join(cache, 'notes'))  # not a partition: never removed
    stale = os.path.join(cache, '.incoming-abandoned')
    os.makedirs(stale)
    os.utime(stale, (0, 0))
    removed = federated.clear_cache(cache, keep_gb=(sizes[1] + sizes[2]) / 2**30)
    assert removed == [roots[0]]  # the least recently used goes first, until the rest fit
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(roots[1]), os.path.basename(roots[2]), 'notes'])
    again = federated.from_federated_data(_arrays(1), cache_dir=cache, cache_limit_gb=1e-9)
    assert again.root == roots[1]  # reused, and kept although it alone exceeds the bound
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(roots[1]), 'notes'])
    assert federated.clear_cache(cache) == [roots[1]]
    assert os.listdir(cache) == ['notes']


@pytest.mark.parametrize('limit', [0, -1.0, True, '5'])
def test_a_cache_limit_that_is_not_a_positive_size_is_refused(tmp_path, limit):
    with pytest.raises(ValueError, match='^cache_limit_gb must be a size in GiB > 0, got '):
        federated.from_federated_data(_arrays(0), cache_dir=str(tmp_path), cache_limit_gb=limit)
    assert os.listdir(tmp_path) == []


def test_client_data_datasets_and_arrays_of_the_same_examples_are_the_same_partition(tmp_path):
    arrays = _arrays(0)
    from_arrays = federated.from_federated_data(arrays, cache_dir=str(tmp_path))
    batched = {k: tf.data.Dataset.from_tensor_slices((x, y)).batch(7) for k, (x, y) in arrays.items()}
    from_datasets = federated.from_federated_data(batched, cache_dir=str(tmp_path))
    unbatched = {
        k: tf.data.Dataset.from_tensor_slices(collections.OrderedDict(pixels=x, label=y))
        for k, (x, y) in arrays.items()
    }
    from_examples = federated.from_federated_data(unbatched, cache_dir=str(tmp_path))
    from_client_data = federated.from_federated_data(_test_client_data(arrays), cache_dir=str(tmp_path))
    assert from_arrays.root == from_datasets.root == from_examples.root == from_client_data.root
    # Without test data every client gets train / val / test from its own examples (60 / 20 / 20).
    assert [sum(from_arrays.split_sizes[s][i] for s in client_data.SPLITS) for i in range(3)] == [30, 41, 25]
    assert from_arrays.split_sizes['test'] == (6, 8, 5)


@pytest.mark.parametrize(
    'call, error, message',
    [
        (lambda d: federated.from_federated_data([1, 2], cache_dir=d), TypeError, '^train must be a tff.simulation'),
        (
            lambda d: federated.from_federated_data(_arrays(0), {'alice': _arrays(0)['alice']}, cache_dir=d),
            ValueError,
            "^test has no client 'bob' of train",
        ),
        (
            lambda d: federated.from_federated_data(
                {'a': tf.data.Dataset.from_tensor_slices({'u': [[1.0]], 'v': [0], 'w': [0]})}, cache_dir=d
            ),
            ValueError,
            r"^train\['a'\]: elements are mappings with keys \['u', 'v', 'w'\]; pass feature_key= and label_key=",
        ),
        (lambda d: federated.from_federated_data(_arrays(0), cache_dir=d, num_classes=2), ValueError, '^a label is 2'),
        (
            lambda d: federated.from_federated_data(_arrays(0), cache_dir=d, val_fraction=1.0),
            ValueError,
            '^val_fraction',
        ),
        (
            lambda d: federated.from_federated_data({'a': (np.zeros((3, 2)), np.zeros(3) + 0.5)}, cache_dir=d),
            ValueError,
            r"^train\['a'\]: labels must be integer classes",
        ),
        (
            lambda d: federated.from_federated_data(
                {'a': _arrays(0)['alice'], 'b': (np.zeros((3, 4)), np.zeros(3, int))}, cache_dir=d
            ),
            ValueError,
            "^client 'b' train: features of shape",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_python_argument(tmp_path, call, error, message):
    with pytest.raises(error, match=message) as raised:
        call(str(tmp_path))
    assert '\n' not in str(raised.value)
    assert [p for p in os.listdir(tmp_path) if not p.startswith('.')] == []
    assert [p for p in os.listdir(tmp_path) if p.startswith('.')] == []  # no staging left behind


def test_fedavg_trains_on_a_users_client_data_and_reports_by_their_ids(tmp_path, tff_runtime):
    spec = federated.from_federated_data(_test_client_data(_arrays(0)), cache_dir=str(tmp_path))
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    process = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(batch_size=8, client_learning_rate=0.5))
    state = process.initialize()
    clients = process.initial_client_states(spec.client_ids)
    for _ in range(5):
        state, clients, _ = process.next(state, clients)
    results = federated.by_user_id(spec, process.evaluate(state, clients))
    assert list(results) == list(IDS)
    assert np.mean([float(r['global_model']['accuracy']) for r in results.values()]) > 0.6  # chance 1/3


def test_the_training_loop_reports_the_users_ids(tmp_path, tff_runtime):
    from tff_pfl.program import evaluation, training_loop

    spec = federated.from_federated_data(_test_client_data(_arrays(0)), cache_dir=str(tmp_path))
    model_fn = functools.partial(models.logistic_regression, spec.feature_shape, spec.num_classes)
    process = fedavg.build_fedavg_process(spec, model_fn, fedavg.FedAvgSettings(batch_size=8))
    result = training_loop.run(
        process,
        spec.client_ids,
        rounds=1,
        client_fraction=1.0,
        seed=0,
        log=lambda line: None,
        source_ids=spec.source_ids,
    )
    assert [(row['client_id'], row['source_id']) for row in result.clients] == list(zip(spec.client_ids, IDS))
    # One result shape: the user's own evaluate gives the loop's rows.
    states = [result.client_states[c] for c in spec.client_ids]
    rows = evaluation.client_rows(spec, process.evaluate(result.state, states))
    assert rows == result.clients
    assert 'global_model_accuracy' in rows[0]
    with pytest.raises(ValueError, match=r'^evaluations has 2 results for 3 clients$'):
        evaluation.client_rows(spec, process.evaluate(result.state, states)[:2])
    with pytest.raises(ValueError, match=r'^source_ids has 2 ids for 3 clients$'):
        training_loop.run(process, spec.client_ids, rounds=1, client_fraction=1.0, seed=0, source_ids=IDS[:2])
