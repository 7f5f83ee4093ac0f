"""The sharded client-data layout: same arrays as the per-client layout, its index, atomicity, bad shards."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tff_pfl.data import client_data, client_data_writer, partition, pipeline, sources


def _partition(rng, x, sizes):
    """Consecutive clients of the given sizes, each split by thirds, in shuffled pool order."""
    order = rng.permutation(len(x))
    splits, start = [], 0
    for n in sizes:
        c = order[start : start + n]
        splits.append({'train': c[: n // 3], 'val': c[n // 3 : 2 * n // 3], 'test': c[2 * n // 3 :]})
        start += n
    return splits


CASES = {
    'float32': lambda rng: rng.normal(size=(60, 7)).astype(np.float32),
    'uint8/255': lambda rng: rng.integers(0, 256, (60, 3, 3, 1)).astype(np.float32) / np.float32(255.0),
}


def _read_all(spec, split):
    """What read_split yields for every client, in a graph with a string input (as in the TFF worker)."""

    @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
    def read(client_id):
        data = client_data.read_split(spec, client_id, split)
        x, y = data.slice(0, data.num_examples)
        gx, gy = data.gather(tf.reverse(tf.range(data.num_examples), [0]))
        return x, y, gx, gy, client_data.count_labels(data.labels), data.features

    return [tuple(t.numpy() for t in read(tf.constant(c))) for c in spec.client_ids]


@pytest.mark.parametrize('case', sorted(CASES))
def test_both_layouts_yield_identical_arrays(tmp_path, case):
    rng = np.random.default_rng(3)
    x = CASES[case](rng)
    y = rng.integers(0, 5, len(x)).astype(np.int32)
    splits = _partition(rng, x, [9, 20, 7, 24])
    old = client_data_writer.write_client_data(str(tmp_path / 'old'), x, y, 5, splits, layout=client_data.PER_CLIENT)
    new = client_data_writer.write_client_data(str(tmp_path / 'new'), x, y, 5, splits)
    assert (old.layout, new.layout) == (client_data.PER_CLIENT, client_data.SHARDED)
    assert new.feature_encoding == old.feature_encoding == case
    assert client_data.load_client_data_spec(str(tmp_path / 'new')) == new
    assert client_data.load_client_data_spec(str(tmp_path / 'old')) == old
    for split in client_data.SPLITS:
        for client, got_old, got_new, s in zip(new.client_ids, _read_all(old, split), _read_all(new, split), splits):
            for a, b in zip(got_old, got_new):
                assert a.dtype == b.dtype and a.shape == b.shape, (client, split)
                assert a.tobytes() == b.tobytes(), (client, split)  # bit for bit
            if case == client_data.FLOAT32:  # (uint8 codes: decoded in a graph, see the note in the docs)
                np.testing.assert_array_equal(got_new[0], x[s[split]])
            np.testing.assert_array_equal(got_new[1], y[s[split]])
            np_old = client_data.read_split_numpy(old, client, split)
            np_new = client_data.read_split_numpy(new, client, split)
            for a, b in zip(np_old, np_new):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_sequence_labels_and_int32_features(tmp_path):
    rng = np.random.default_rng(4)
    arrays = [
        {s: (rng.integers(0, 90, (n, 5)), rng.integers(-1, 90, (n, 5))) for s, n in zip(client_data.SPLITS, sizes)}
        for sizes in [(3, 1, 2), (5, 2, 1)]
    ]
    specs = {}
    for layout in client_data.LAYOUTS:
        with client_data_writer.ClientDataWriter(
            str(tmp_path / layout), feature_shape=(5,), encoding=client_data.INT32, label_shape=(5,), layout=layout
        ) as writer:
            for a in arrays:
                writer.add_client(a)
            specs[layout] = writer.finish(90)
    for split in client_data.SPLITS:
        old, new = _read_all(specs[client_data.PER_CLIENT], split), _read_all(specs[client_data.SHARDED], split)
        for k, (a, b) in enumerate(zip(old, new)):
            for u, v in zip(a, b):
                assert u.dtype == v.dtype and u.tobytes() == v.tobytes()
            np.testing.assert_array_equal(b[1], arrays[k][split][1])
            assert b[4] == np.sum(arrays[k][split][1] != client_data.IGNORED_LABEL)


def test_index_and_shards_match_a_hand_computation(tmp_path):
    x = np.arange(2 * 12, dtype=np.float32).reshape(12, 2) - 5.0  # float32 storage, 8 bytes an example
    y = np.arange(12, dtype=np.int32)
    splits = [
        {'train': [0, 1, 2], 'val': [3], 'test': [4, 5]},
        {'train': [6], 'val': [7, 8], 'test': [9]},
        {'train': [10], 'val': [11], 'test': []},
    ]
    spec = client_data_writer.write_client_data(str(tmp_path / 'd'), x, y, 12, splits)
    assert sorted(os.listdir(tmp_path / 'd')) == sorted(
        ['manifest.json', 'index.i64'] + [f'{s}_{p}' for s in client_data.SPLITS for p in ('x.bin', 'y.i32')]
    )
    index = np.fromfile(tmp_path / 'd' / 'index.i64', dtype='<i8')
    # rows train, val, test; client k's examples are index[s, k]:index[s, k + 1]
    assert index.tolist() == [0, 3, 4, 5] + [0, 1, 3, 4] + [0, 2, 3, 3]
    np.testing.assert_array_equal(client_data.client_index_table(spec.split_sizes), index.reshape(3, 4))
    # byte offset of client 1's train examples: 3 examples x 8 bytes
    shard = (tmp_path / 'd' / 'train_x.bin').read_bytes()
    assert shard[3 * 8 : 4 * 8] == x[6].tobytes()
    assert (tmp_path / 'd' / 'test_y.i32').read_bytes() == y[[4, 5, 9]].tobytes()
    assert json.loads((tmp_path / 'd' / 'manifest.json').read_text())['layout'] == 'sharded'
    empty = client_data.read_split(spec, tf.constant('client_00002'), 'test')  # a client with no examples
    assert empty.features.shape.as_list() == [0, 2] and int(empty.num_examples) == 0


def test_interrupted_write_leaves_no_complete_looking_directory(tmp_path):
    root = tmp_path / 'data'
    good = {s: (np.zeros((2, 3), np.float32), np.zeros(2, np.int32)) for s in client_data.SPLITS}
    writer = client_data_writer.ClientDataWriter(str(root), feature_shape=(3,))
    writer.add_client(good)
    # Mid-write (as after a crash): only a hidden staging directory, and no manifest anywhere.
    assert not root.exists()
    (staging,) = [p for p in tmp_path.iterdir()]
    assert staging.name.startswith('.client_data.') and not (staging / 'manifest.json').exists()
    writer.__exit__(None, None, None)
    with (
        pytest.raises(ValueError, match='features of shape'),
        client_data_writer.ClientDataWriter(str(root), feature_shape=(3,)) as writer,
    ):
        writer.add_client(good)
        writer.add_client({**good, 'val': (np.zeros((1, 4), np.float32), np.zeros(1, np.int32))})
    assert list(tmp_path.iterdir()) == []
    # A client refused on its last split wrote nothing of its earlier ones.
    with client_data_writer.ClientDataWriter(str(root), feature_shape=(3,)) as writer:
        writer.add_client(good)
        with pytest.raises(ValueError):
            writer.add_client({**good, 'test': (np.zeros((1, 3), np.float32), np.zeros(2, np.int32))})
        spec = writer.finish(2)
    assert spec.split_sizes['train'] == (2,) and (root / 'train_x.bin').stat().st_size == 2 * 3 * 4


def test_a_failed_shard_write_is_raised_and_leaves_nothing(tmp_path):
    class FullDisk:
        def write(self, data):
            raise OSError(28, 'No space left on device')

        def close(self):
            pass

    good = {s: (np.zeros((2, 3), np.float32), np.zeros(2, np.int32)) for s in client_data.SPLITS}
    with (
        pytest.raises(OSError, match='No space left'),
        client_data_writer.ClientDataWriter(str(tmp_path / 'data'), feature_shape=(3,)) as writer,
    ):
        writer._shards['val', 'y'] = FullDisk()  # the writes happen on the writer's own thread
        for _ in range(100):
            writer.add_client(good)
        writer.finish(2)
    assert list(tmp_path.iterdir()) == []


def _tiny(root):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    return client_data_writer.write_client_data(str(root), x, rng.integers(0, 3, 30), 3, _partition(rng, x, [12, 18]))


@pytest.mark.parametrize(
    'damage, message',
    [
        (lambda d: os.remove(d / 'val_y.i32'), 'the shard val_y.i32 is missing'),
        (lambda d: os.truncate(d / 'train_x.bin', 20), r'the shard train_x.bin has 20 bytes, the index says 160'),
        (lambda d: os.remove(d / 'index.i64'), 'the index index.i64 is missing'),
        (lambda d: (d / 'index.i64').write_bytes(b'\0' * 24), "disagrees with the manifest's split sizes"),
    ],
)
def test_missing_or_corrupt_shard_is_one_clear_line(tmp_path, damage, message):
    _tiny(tmp_path / 'd')
    damage(tmp_path / 'd')
    with pytest.raises(sources.DataError, match=message) as e:
        client_data.load_client_data_spec(str(tmp_path / 'd'))
    assert '\n' not in str(e.value) and 'delete the directory' in str(e.value)


def test_shard_damaged_after_loading_fails_in_the_graph(tmp_path):
    spec = _tiny(tmp_path / 'd')
    os.truncate(tmp_path / 'd' / 'train_x.bin', 20)
    with pytest.raises(tf.errors.OpError, match=r'(?s)wrong length \(20\).*client_data_train_x.bin'):
        client_data.read_split(spec, tf.constant('client_00001'), 'train').features.numpy()
    read = tf.function(lambda c: client_data.read_split(spec, c, 'train').features)
    with pytest.raises(tf.errors.OpError, match=r'(?s)wrong length \(20\).*client_data_train_x.bin'):
        read(tf.constant('client_00001'))


def test_old_layout_from_an_earlier_version_is_read(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    y = rng.integers(0, 3, 30)
    spec = client_data_writer.write_client_data(
        str(tmp_path / 'd'), x, y, 3, _partition(rng, x, [12, 18]), layout=client_data.PER_CLIENT
    )
    manifest = json.loads((tmp_path / 'd' / 'manifest.json').read_text())
    assert 'layout' not in manifest  # exactly what earlier versions wrote
    assert sorted(os.listdir(tmp_path / 'd' / 'client_00000')) == sorted(
        f'{s}_{p}' for s in client_data.SPLITS for p in ('x.bin', 'y.i32')
    )
    assert client_data.load_client_data_spec(str(tmp_path / 'd')) == spec
    (tmp_path / 'd' / 'manifest.json').write_text(json.dumps({**manifest, 'layout': 'columnar'}))
    with pytest.raises(sources.DataError, match="unknown layout 'columnar'"):
        client_data.load_client_data_spec(str(tmp_path / 'd'))


def test_streamed_synthetic_is_the_pooled_partition_byte_for_byte(tmp_path):
    prepared = pipeline.prepare(
        str(tmp_path / 'streamed'), dataset='synthetic:0.5,1', partition_name='natural', num_clients=6, seed=2
    )
    # The pooled path, as prepare() took it before streaming.
    pool = sources.synthetic_fedprox(0.5, 1.0, num_clients=6, seed=2)
    splits = [
        partition.split_client(c, pool.y, (0.6, 0.2, 0.2), seed=2 + k) for k, c in enumerate(pool.natural_partition)
    ]
    pooled = client_data_writer.write_client_data(str(tmp_path / 'pooled'), pool.x, pool.y, 10, splits)
    assert dataclasses_equal_but_root(prepared.spec, pooled)
    for name in sorted(os.listdir(tmp_path / 'pooled')):
        assert (tmp_path / 'streamed' / name).read_bytes() == (tmp_path / 'pooled' / name).read_bytes(), name
    np.testing.assert_array_equal(
        prepared.class_histogram, partition.class_histogram(pool.natural_partition, pool.y, 10)
    )
    assert prepared.source_name == pool.name == 'synthetic(0.5,1)'


def dataclasses_equal_but_root(a, b):
    """Two specs equal in everything but their root."""
    import dataclasses

    return dataclasses.replace(a, root='') == dataclasses.replace(b, root='')


def test_ops_that_reuse_their_input_never_write_into_the_mapped_shards(tmp_path, tff_runtime):
    # The first client's split starts at offset 0, so TF may let its slice share the mapped
    # (read-only) pages; `tf.maximum` of labels (the loss's first op) and `x + 1` may then write
    # their output into their input's buffer. The worker died with SIGSEGV in Per-FedAvg's
    # adaptation step until read_split copied.
    import tensorflow_federated as tff

    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.integers(0, 5, len(x)).astype(np.int32)
    splits = [{'train': np.arange(0, 32), 'val': np.arange(32, 36), 'test': np.arange(36, 40)}]
    splits.append({'train': np.arange(40, 56), 'val': np.arange(56, 60), 'test': np.arange(60, 64)})
    spec = client_data_writer.write_client_data(str(tmp_path / 'data'), x, y, 5, splits)
    before = {name: (tmp_path / 'data' / name).read_bytes() for name in os.listdir(tmp_path / 'data')}

    @tff.tensorflow.computation(np.str_)
    def reuse(client_id):
        data = client_data.read_split(spec, client_id, 'train')
        features, labels = data.slice(0, data.num_examples)
        return tf.maximum(labels, 3), features + 1.0, tf.maximum(data.labels, 3), data.features * 2.0

    for client, split in zip(spec.client_ids, splits):
        labels_max, plus_one, all_max, doubled = reuse(client)
        np.testing.assert_array_equal(labels_max, np.maximum(y[split['train']], 3))
        np.testing.assert_array_equal(all_max, np.maximum(y[split['train']], 3))
        np.testing.assert_array_equal(plus_one, x[split['train']] + 1.0)
        np.testing.assert_array_equal(doubled, x[split['train']] * 2.0)
    assert before == {name: (tmp_path / 'data' / name).read_bytes() for name in os.listdir(tmp_path / 'data')}
