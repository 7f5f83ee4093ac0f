"""Naturally federated sources: tff:, sqlite: and clients:, streamed into per-client files."""

import csv
import json
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tff_pfl.data import client_data, natural, pipeline, text
from tff_pfl.data.partition import PartitionError
from tff_pfl.data.sources import DataError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Shakespeare's layout: one snippet per example. 'KENT' has one non-empty training snippet only and
# 'FOOL' no test snippet: neither can give a validation and a test split, so both are left out.
SNIPPETS = {
    'train': {
        'LEAR_LEAR': ['Meantime we shall express our darker purpose.', 'Give me the map there.', 'Know that we have'],
        'LEAR_GONERIL': ['Sir, I love you more than words can wield the matter;', 'Dearer than eyesight.'],
        'LEAR_CORDELIA': ['Nothing, my lord.', 'Nothing.', 'Unhappy that I am, I cannot heave'],
        'LEAR_KENT': ['Royal Lear,', ''],
        'LEAR_FOOL': ['Let me hire him too.', 'Sirrah, you were best take my coxcomb.'],
    },
    'test': {
        'LEAR_LEAR': ['Nothing will come of nothing: speak again.'],
        'LEAR_GONERIL': ['No more; the text is foolish.'],
        'LEAR_CORDELIA': ['My heart into my mouth.'],
        'LEAR_KENT': ['Good my liege.'],
        'LEAR_FOOL': [''],
    },
}


def write_sql_client_data(path, examples):
    """A file in TFF's SqlClientData layout: split -> client -> list of tf.train.Example."""
    connection = sqlite3.connect(path)
    connection.execute('CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)')
    connection.execute('CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)')
    for split, clients in examples.items():
        for client_id, protos in clients.items():
            for proto in protos:
                connection.execute(
                    'INSERT INTO examples VALUES (?, ?, ?)', (split, client_id, proto.SerializeToString())
                )
            connection.execute('INSERT INTO client_metadata VALUES (?, ?, ?)', (client_id, split, len(protos)))
    connection.commit()
    connection.close()


def _snippet(s):
    return tf.train.Example(
        features=tf.train.Features(feature={'snippets': tf.train.Feature(bytes_list=tf.train.BytesList(value=[s]))})
    )


def _image(pixels, label, key='pixels'):
    values = np.asarray(pixels).reshape(-1)
    if key == 'pixels':
        feature = tf.train.Feature(float_list=tf.train.FloatList(value=values.tolist()))
    else:
        feature = tf.train.Feature(int64_list=tf.train.Int64List(value=values.astype(np.int64).tolist()))
    return tf.train.Example(
        features=tf.train.Features(
            feature={key: feature, 'label': tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}
        )
    )


@pytest.fixture(scope='module')
def shakespeare_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp('tff_cache')
    examples = {
        split: {c: [_snippet(s.encode()) for s in snippets] for c, snippets in clients.items()}
        for split, clients in SNIPPETS.items()
    }
    write_sql_client_data(str(cache / 'shakespeare.sqlite'), examples)
    return cache


def _expected_sequences(snippets):
    return text.snippet_examples([s.encode() for s in snippets])


def _prepare(root, dataset, num_clients, **kwargs):
    return pipeline.prepare(
        str(root), dataset=dataset, partition_name='natural', num_clients=num_clients, seed=3, **kwargs
    )


@pytest.mark.parametrize('form', ['tff', 'sqlite'])
def test_shakespeare_layout_through_tffs_loader_and_sqlite(form, shakespeare_cache, tmp_path):
    if form == 'tff':
        prepared = _prepare(tmp_path / 'data', 'tff:shakespeare', 3, data_dir=str(shakespeare_cache))
        assert prepared.source_name == 'tff:shakespeare'
    else:
        prepared = _prepare(tmp_path / 'data', f'sqlite:{shakespeare_cache / "shakespeare.sqlite"}', 3)
    spec = prepared.spec
    assert prepared.note == '2 of its clients have fewer than two training or no test examples and are left out'
    assert spec.source_ids == ('LEAR_CORDELIA', 'LEAR_GONERIL', 'LEAR_LEAR')  # every eligible client, in id order
    assert spec.client_ids == ('client_00000', 'client_00001', 'client_00002')
    assert spec.feature_shape == (80,) and spec.label_shape == (80,) and spec.num_classes == 90
    assert spec.feature_encoding == client_data.INT32
    assert client_data.load_client_data_spec(spec.root) == spec
    for client_id, source_id in zip(spec.client_ids, spec.source_ids):
        x_train, y_train = _expected_sequences(SNIPPETS['train'][source_id])
        x_test, y_test = _expected_sequences(SNIPPETS['test'][source_id])
        got = {split: client_data.read_split_numpy(spec, client_id, split) for split in client_data.SPLITS}
        np.testing.assert_array_equal(got['test'][0], x_test)
        np.testing.assert_array_equal(got['test'][1], y_test)
        # Validation: a quarter (at least one) of the training sequences, the rest stay in order.
        merged = np.concatenate([got['train'][0], got['val'][0]])
        assert sorted(map(tuple, merged)) == sorted(map(tuple, x_train))
        assert len(got['val'][0]) == min(max(round(0.25 * len(x_train)), 1), len(x_train) - 1)
        # The TF reader gives the same arrays.
        split = client_data.read_split(spec, tf.constant(client_id), 'train')
        np.testing.assert_array_equal(split.features.numpy(), got['train'][0])
        np.testing.assert_array_equal(split.labels.numpy(), got['train'][1])
    # The histogram counts scored characters only.
    total = sum(
        (client_data.read_split_numpy(spec, c, s)[1] >= 0).sum() for c in spec.client_ids for s in client_data.SPLITS
    )
    assert prepared.class_histogram.sum() == total and prepared.class_histogram.shape == (3, 90)


def test_a_seeded_subset_of_clients(shakespeare_cache, tmp_path):
    one = _prepare(tmp_path / 'a', 'tff:shakespeare', 2, data_dir=str(shakespeare_cache)).spec
    again = _prepare(tmp_path / 'b', 'tff:shakespeare', 2, data_dir=str(shakespeare_cache)).spec
    assert one.source_ids == again.source_ids and len(set(one.source_ids)) == 2
    assert set(one.source_ids) <= {'LEAR_CORDELIA', 'LEAR_GONERIL', 'LEAR_LEAR'}
    with pytest.raises(PartitionError, match='num_clients=4 but tff:shakespeare has 3 clients'):
        _prepare(tmp_path / 'c', 'tff:shakespeare', 4, data_dir=str(shakespeare_cache))
    assert not (tmp_path / 'c').exists()


def test_image_layouts_emnist_and_cifar(tmp_path):
    rng = np.random.default_rng(0)
    cache = tmp_path / 'cache'
    cache.mkdir()
    emnist = {
        split: {
            f'f{w:04d}_00': [_image(rng.random((28, 28)).astype(np.float32), rng.integers(62)) for _ in range(n)]
            for w, n in enumerate((4, 3, 5))
        }
        for split in ('all_train', 'all_test')
    }
    write_sql_client_data(str(cache / 'emnist_all.sqlite'), emnist)
    spec = _prepare(tmp_path / 'emnist', 'tff:emnist', 3, data_dir=str(cache)).spec
    assert spec.feature_shape == (28, 28, 1) and spec.num_classes == 62 and spec.label_shape == ()
    x, y = client_data.read_split_numpy(spec, 'client_00000', 'test')
    protos = emnist['all_test']['f0000_00']
    expected = np.asarray([p.features.feature['pixels'].float_list.value for p in protos], np.float32)
    np.testing.assert_array_equal(x.reshape(len(x), -1), expected)
    np.testing.assert_array_equal(y, [p.features.feature['label'].int64_list.value[0] for p in protos])
    assert spec.split_sizes['train'] == (3, 2, 4) and spec.split_sizes['val'] == (1, 1, 1)
    # An 8-bit image layout through sqlite: (3 x 16 x 16) int64 values, scaled by 1/255.
    cifar = {
        split: {
            f'c{i}': [_image(rng.integers(0, 256, (16, 16, 3)), rng.integers(5), 'image') for _ in range(3)]
            for i in range(2)
        }
        for split in ('train', 'test')
    }
    write_sql_client_data(str(tmp_path / 'own.sqlite'), cifar)
    spec = _prepare(tmp_path / 'own', f'sqlite:{tmp_path / "own.sqlite"}', 2).spec
    assert spec.feature_shape == (16, 16, 3) and spec.feature_encoding == client_data.UINT8_OVER_255
    x, _ = client_data.read_split_numpy(spec, 'client_00001', 'test')
    raw = np.asarray([p.features.feature['image'].int64_list.value for p in cifar['test']['c1']], np.float32)
    np.testing.assert_array_equal(x.reshape(3, -1), raw / np.float32(255.0))


def test_cifar100_test_clients_are_other_clients(tmp_path):
    """TFF's CIFAR-100 test clients hold other data: each train client is split three ways."""
    rng = np.random.default_rng(4)

    def image(label):
        example = _image(rng.integers(0, 256, (32, 32, 3)), label, 'image')
        example.features.feature['coarse_label'].int64_list.value.append(label // 5)
        return example

    cache = tmp_path / 'cache'
    cache.mkdir()
    write_sql_client_data(
        str(cache / 'cifar100.sqlite'),
        {
            'train': {str(i): [image(int(c)) for c in rng.integers(0, 100, 20)] for i in range(3)},
            'test': {str(i): [image(int(c)) for c in rng.integers(0, 100, 4)] for i in range(2)},
        },
    )
    prepared = _prepare(tmp_path / 'data', 'tff:cifar100', 3, data_dir=str(cache))
    spec = prepared.spec
    assert spec.feature_shape == (32, 32, 3) and spec.num_classes == 100 and prepared.note == ''
    assert all(sum(spec.sizes(split)[c] for split in client_data.SPLITS) == 20 for c in spec.client_ids)
    assert all(min(spec.sizes(split)[c] for split in client_data.SPLITS) >= 1 for c in spec.client_ids)


def _clients_dir(root, clients, task='classification', **manifest):
    root.mkdir()
    for name, arrays in clients.items():
        np.savez(root / f'{name}.npz', **arrays)
    (root / 'manifest.json').write_text(json.dumps({'format': 'npz', 'task': task, **manifest}))
    return root


def test_clients_dir(tmp_path):
    rng = np.random.default_rng(1)

    def client(n_train, n_test, val=0):
        arrays = dict(
            x_train=rng.integers(0, 256, (n_train, 5, 5)).astype(np.uint8),
            y_train=rng.integers(0, 3, n_train),
            x_test=rng.integers(0, 256, (n_test, 5, 5)).astype(np.uint8),
            y_test=rng.integers(0, 3, n_test),
        )
        if val:
            arrays.update(x_val=rng.integers(0, 256, (val, 5, 5)).astype(np.uint8), y_val=rng.integers(0, 3, val))
        return arrays

    clients = {'alice': client(8, 3), 'bob': client(5, 2, val=2), 'carol': client(2, 1)}
    root = _clients_dir(tmp_path / 'mine', clients, num_classes=3)
    prepared = _prepare(tmp_path / 'data', f'clients:{root}', 3)
    spec = prepared.spec
    assert spec.source_ids == ('alice', 'bob', 'carol') and spec.feature_shape == (5, 5, 1)
    assert spec.split_sizes == {'train': (6, 5, 1), 'val': (2, 2, 1), 'test': (3, 2, 1)}
    x, y = client_data.read_split_numpy(spec, 'client_00001', 'val')  # bob brings his own validation split
    np.testing.assert_array_equal(x[..., 0], clients['bob']['x_val'] / np.float32(255.0))
    np.testing.assert_array_equal(y, clients['bob']['y_val'])
    # Text clients: snippets per split.
    snippets = {
        'x': dict(
            snippets_train=np.array(['To be, or not to be', 'that is the question']),
            snippets_test=np.array(['Ay, there is the rub']),
        )
    }
    text_root = _clients_dir(tmp_path / 'text', snippets, task='next_char')
    spec = _prepare(tmp_path / 'text_data', f'clients:{text_root}', 1).spec
    assert spec.label_shape == (80,) and sum(spec.split_sizes['train']) + sum(spec.split_sizes['val']) == 2


@pytest.mark.parametrize(
    'make, message',
    [
        (lambda tmp: f'sqlite:{tmp / "missing.sqlite"}', 'file not found'),
        (lambda tmp: 'tff:shakespeare_typo', 'unknown TFF dataset tff:shakespeare_typo'),
        (lambda tmp: 'tff:stackoverflow', 'tff:stackoverflow: its next-word task'),
        (lambda tmp: f'clients:{tmp / "nothing"}', 'directory not found'),
    ],
)
def test_bad_sources(make, message, tmp_path):
    with pytest.raises(DataError, match=message):
        _prepare(tmp_path / 'data', make(tmp_path), 1)
    assert not (tmp_path / 'data').exists()


def test_bad_source_files(tmp_path, shakespeare_cache):
    not_tff = tmp_path / 'other.sqlite'
    connection = sqlite3.connect(not_tff)
    connection.execute('CREATE TABLE people (name TEXT)')
    connection.commit()
    connection.close()
    with pytest.raises(DataError, match='not a TFF SqlClientData file'):
        _prepare(tmp_path / 'a', f'sqlite:{not_tff}', 1)
    with pytest.raises(DataError, match="no split 'all_train'"):
        _prepare(tmp_path / 'b', f'sqlite:{shakespeare_cache / "shakespeare.sqlite"}#all_train,all_test', 1)
    with pytest.raises(DataError, match='tff:shakespeare: .*not found; pass --data_dir'):
        _prepare(tmp_path / 'c', 'tff:shakespeare', 1, data_dir=str(tmp_path / 'empty'))
    no_test = _clients_dir(
        tmp_path / 'no_test',
        {
            'a': dict(
                x_train=np.zeros((3, 2)), y_train=np.zeros(3, int), x_test=np.zeros((0, 2)), y_test=np.zeros(0, int)
            )
        },
        num_classes=2,
    )
    with pytest.raises(DataError, match="client 'a': no test examples"):
        _prepare(tmp_path / 'd', f'clients:{no_test}', 1)
    schema = _clients_dir(tmp_path / 'schema', {'a': dict(x_train=np.zeros((3, 2)))}, num_classes=2, labels='y')
    with pytest.raises(DataError, match="unknown key 'labels'"):
        _prepare(tmp_path / 'e', f'clients:{schema}', 1)
    with pytest.raises(PartitionError, match='naturally federated'):
        pipeline.prepare(str(tmp_path / 'f'), dataset=f'clients:{no_test}', partition_name='iid', num_clients=1, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['no_test', 'other.sqlite', 'schema']


def test_validation_split():
    x = np.arange(10)[:, None]
    split = natural.validation_split(x, np.arange(10), 0.25, [0, 1])
    assert len(split['val'][1]) == 2 and len(split['train'][1]) == 8
    assert sorted(np.concatenate([split['val'][1], split['train'][1]])) == list(range(10))
    assert list(split['train'][1]) == sorted(split['train'][1])
    assert len(natural.validation_split(x[:2], np.arange(2), 0.9, [0, 1])['train'][1]) == 1
    with pytest.raises(ValueError, match='at least two'):
        natural.validation_split(x[:1], np.arange(1), 0.25, [0, 1])


def _train_offline(*flags):
    """tff-pfl-train in a network namespace of its own, so no machine's network can answer a download."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='3')
    command = ['unshare', '--net', '--map-root-user', sys.executable, '-m', 'tff_pfl.cli.train', *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


@pytest.mark.parametrize(
    'flags, message',
    [
        (['--dataset=sqlite:{tmp}/missing.sqlite'], 'file not found'),
        (['--dataset=tff:nope'], 'unknown TFF dataset tff:nope'),
        (['--dataset=tff:shakespeare', '--data_dir={cache}', '--algorithm=ktpfl'], 'public data'),
    ],
)
def test_train_refuses_bad_natural_input_in_one_line(flags, message, tmp_path, shakespeare_cache, train_in_process):
    """tff-pfl-train's flags and `main`, in this process (the binary's start-up is tested below)."""
    out = tmp_path / 'run'
    flags = [f.format(tmp=tmp_path, cache=shakespeare_cache) for f in flags]
    code, stderr = train_in_process(*flags, f'--output_dir={out}', '--num_clients=2')
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith('tff-pfl-train: error: ') and message in lines[0], lines[0]
    assert not out.exists()


def test_binary_refuses_a_download_without_network_in_one_line(tmp_path):
    """--download with no network (a namespace of its own, whatever the machine has): one line, exit 2."""
    out = tmp_path / 'run'
    flags = ['--dataset=tff:shakespeare', f'--data_dir={tmp_path / "cache"}', '--download']
    run = _train_offline(*flags, f'--output_dir={out}', '--num_clients=2')
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith('tff-pfl-train: error: ') and 'download failed' in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize('algorithm', ['persfl', 'fedper', 'perfedavg_hf', 'kdpdfl'])
def test_algorithms_train_and_score_characters(algorithm, shakespeare_cache, tmp_path, tff_runtime):
    """One round on the tiny Shakespeare layout: each client is scored on its own test characters."""
    from tff_pfl.program import experiment, run_config

    overrides = {'persfl': dict(temperatures=(1.0, 4.0), imitations=(0.0, 0.5), distill_epochs=1)}.get(algorithm, {})
    config = run_config.make_config(
        output_dir=str(tmp_path / 'run'),
        algorithm=algorithm,
        dataset='tff:shakespeare',
        data_dir=str(shakespeare_cache),
        num_clients=3,
        rounds=1,
        eval_every=1,
        batch_size=2,
        **overrides,
    )
    assert config.model_name() == 'char_gru'
    result = experiment.run_experiment(config, log=lambda line: None)
    spec = client_data.load_client_data_spec(str(tmp_path / 'run' / 'client_data'))
    for row in result.clients:
        _, y = client_data.read_split_numpy(spec, row['client_id'], 'test')
        assert row['personalized_model_num_examples'] == (y != client_data.IGNORED_LABEL).sum() > 0
        assert 0.0 <= row['personalized_model_accuracy'] <= 1.0
    assert np.isfinite(result.rounds[-1]['train_loss'])
    # The roles' own names beside the positional ids, in the results and in clients.csv (both run loops).
    assert [row['source_id'] for row in result.clients] == list(spec.source_ids)
    with open(tmp_path / 'run' / 'clients.csv') as f:
        assert [row['source_id'] for row in csv.DictReader(f)] == list(spec.source_ids)
