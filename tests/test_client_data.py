"""Client files: exact round trip in numpy and inside TF, both encodings."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tff_pfl.data import client_data, client_data_writer


def _write(root, x, num_clients=3):
    y = np.arange(len(x)) % 5
    idx = np.arange(len(x))
    splits = [
        {'train': c[: len(c) // 2], 'val': c[len(c) // 2 : 3 * len(c) // 4], 'test': c[3 * len(c) // 4 :]}
        for c in np.array_split(idx, num_clients)
    ]
    return client_data_writer.write_client_data(str(root), x, y, 5, splits), y, splits


@pytest.mark.parametrize(
    'make_x, encoding',
    [
        (
            lambda rng: rng.integers(0, 256, (48, 3, 3, 1)).astype(np.float32) / np.float32(255.0),
            client_data.UINT8_OVER_255,
        ),
        (lambda rng: rng.normal(size=(48, 7)).astype(np.float32), client_data.FLOAT32),
        (lambda rng: rng.random((48, 7), dtype=np.float32), client_data.FLOAT32),
    ],
)
def test_round_trip_is_exact(tmp_path, make_x, encoding):
    x = make_x(np.random.default_rng(0))
    spec, y, splits = _write(tmp_path / 'data', x)
    assert spec.feature_encoding == encoding
    assert spec == client_data.load_client_data_spec(str(tmp_path / 'data'))
    for client_id, client_splits in zip(spec.client_ids, splits):
        for split, indices in client_splits.items():
            got_x, got_y = client_data.read_split_numpy(spec, client_id, split)
            np.testing.assert_array_equal(got_x, x[indices])
            np.testing.assert_array_equal(got_y, y[indices])
            data = client_data.read_split(spec, tf.constant(client_id), split)
            assert int(data.num_examples) == len(indices)
            tf_x, tf_y = data.slice(0, len(indices))
            np.testing.assert_array_equal(tf_x.numpy(), x[indices])  # bit-exact decode
            gathered_x, gathered_y = data.gather(tf.constant([len(indices) - 1, 0]))
            np.testing.assert_array_equal(gathered_x.numpy(), x[indices][[-1, 0]])
            np.testing.assert_array_equal(gathered_y.numpy(), y[indices][[-1, 0]])
    assert spec.sizes('train') == {c: len(s['train']) for c, s in zip(spec.client_ids, splits)}


def test_uint8_storage_is_a_quarter(tmp_path):
    x = np.random.default_rng(1).integers(0, 256, (40, 10)).astype(np.float32) / np.float32(255.0)
    spec, _, _ = _write(tmp_path / 'data', x, num_clients=1)
    size = (tmp_path / 'data' / 'train_x.bin').stat().st_size  # the train shard of the one client
    assert size == 20 * 10  # 20 training examples x 10 features x 1 byte


def test_existing_directory_is_refused_and_failed_write_leaves_nothing(tmp_path):
    x = np.zeros((12, 2), np.float32)
    _write(tmp_path / 'data', x)
    with pytest.raises(FileExistsError):
        _write(tmp_path / 'data', x)
    with pytest.raises(KeyError):  # a client without a 'test' split
        client_data_writer.write_client_data(str(tmp_path / 'other'), x, np.zeros(12), 2, [{'train': [0], 'val': [1]}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['data']
    assert json.load(open(tmp_path / 'data' / 'manifest.json'))['client_ids'][0] == 'client_00000'


def _prepare_iid(root, npz, **public):
    """The tiny npz source, 4 IID clients (seed 1), with the given public-data arguments."""
    from tff_pfl.data import pipeline

    return pipeline.prepare(str(root), dataset=f'npz:{npz}', partition_name='iid', num_clients=4, seed=1, **public)


def test_public_data_is_set_aside_before_partitioning(tiny_npz, tmp_path):
    from tff_pfl.data import sources

    prepared = _prepare_iid(tmp_path / 'data', tiny_npz, public_examples=50)
    spec = prepared.spec
    assert spec.public_size == 50 and prepared.class_histogram.sum() == 320 - 50
    pool = sources.load_npz(str(tiny_npz))
    public = client_data.read_public(spec)
    public_x = public.slice(0, 50)[0].numpy().reshape(50, -1)
    pool_rows = {row.tobytes() for row in pool.x.reshape(len(pool.x), -1)}
    assert all(row.tobytes() in pool_rows for row in public_x)
    client_rows = set()
    for client_id in spec.client_ids:
        for split in client_data.SPLITS:
            x, _ = client_data.read_split_numpy(spec, client_id, split)
            client_rows |= {row.tobytes() for row in x.reshape(len(x), -1)}
    assert not client_rows & {row.tobytes() for row in public_x}  # no client holds a public example
    assert client_data.load_client_data_spec(str(tmp_path / 'data')).public_size == 50


def test_public_data_from_another_source(tiny_npz, tmp_path):
    from tff_pfl.data import sources

    other = tmp_path / 'other.npz'
    rng = np.random.default_rng(5)
    x_other = rng.integers(200, 256, size=(30, 6, 6)).astype(np.uint8)
    y_other = (np.arange(30) % 7).astype(np.uint8)
    np.savez(other, x_train=x_other[:20], y_train=y_other[:20], x_test=x_other[20:], y_test=y_other[20:])
    prepared = _prepare_iid(tmp_path / 'data', tiny_npz, public_examples=12, public_dataset=f'npz:{other}')
    spec = prepared.spec
    # The clients keep every example of their own source.
    assert spec.public_size == 12 and prepared.class_histogram.sum() == 320
    public_x = client_data.read_public(spec).slice(0, 12)[0].numpy().reshape(12, -1)
    drawn = np.sort(np.random.default_rng([1, 0x9B]).permutation(30)[:12])
    np.testing.assert_array_equal(public_x, sources.load_npz(str(other)).x[drawn].reshape(12, -1))
    bad = tmp_path / 'bad.npz'
    np.savez(
        bad,
        x_train=np.zeros((30, 5, 5), np.uint8),
        y_train=np.zeros(30, np.uint8),
        x_test=np.zeros((3, 5, 5), np.uint8),
        y_test=np.zeros(3, np.uint8),
    )
    with pytest.raises(sources.DataError, match=r'public dataset .* has examples of shape \(5, 5, 1\)'):
        _prepare_iid(tmp_path / 'bad', tiny_npz, public_examples=12, public_dataset=f'npz:{bad}')
    assert not (tmp_path / 'bad').exists()
