"""Tests for tff_pfl.data.sources."""

import os

import numpy as np
import pytest

from tff_pfl.data import sources

MNIST_PATH = '/work/shared/data/mnist.npz'


def _arrays(**overrides) -> dict[str, np.ndarray]:
    """Valid tiny Keras-layout arrays, with `overrides` replacing some."""
    rng = np.random.default_rng(0)
    arrays = {
        'x_train': rng.integers(0, 256, (5, 4, 3), dtype=np.uint8),
        'y_train': np.array([0, 1, 2, 1, 0], dtype=np.int64),
        'x_test': rng.integers(0, 256, (3, 4, 3), dtype=np.uint8),
        'y_test': np.array([3, 0, 1], dtype=np.uint8),
    }
    arrays.update(overrides)
    return {key: value for key, value in arrays.items() if value is not None}


def _write(tmp_path, name='data.npz', **overrides) -> str:
    path = os.path.join(tmp_path, name)
    np.savez(path, **_arrays(**overrides))
    return path


def test_npz_round_trip(tmp_path):
    path = _write(tmp_path)
    arrays = _arrays()
    pool = sources.load_npz(path)
    assert pool.x.dtype == np.float32 and pool.y.dtype == np.int32
    assert pool.x.shape == (8, 4, 3, 1)
    expected = np.concatenate([arrays['x_train'], arrays['x_test']]) / 255.0
    np.testing.assert_allclose(pool.x[..., 0], expected, rtol=1e-6)
    np.testing.assert_array_equal(pool.y, [0, 1, 2, 1, 0, 3, 0, 1])
    assert pool.num_classes == 4
    assert pool.name == 'data.npz'
    assert pool.natural_partition is None


def test_npz_float_features_and_column_labels(tmp_path):
    x_train = np.linspace(-1, 1, 12, dtype=np.float64).reshape(3, 4)
    path = _write(
        tmp_path,
        x_train=x_train,
        y_train=np.array([[1], [0], [1]]),
        x_test=np.ones((2, 4)),
        y_test=np.array([[0], [1]]),
    )
    pool = sources.load_npz(path)
    assert pool.x.shape == (5, 4)
    np.testing.assert_allclose(pool.x[:3], x_train)
    np.testing.assert_array_equal(pool.y, [1, 0, 1, 0, 1])
    assert pool.num_classes == 2


def _npz_error_cases():
    nan_x = np.zeros((5, 4, 3), dtype=np.float32)
    nan_x[1, 2, 0] = np.nan
    inf_x = np.zeros((3, 4, 3), dtype=np.float32)
    inf_x[0, 0, 0] = np.inf
    return [
        ('missing_key', {'y_test': None}, 'lacks key.*y_test'),
        ('length', {'y_train': np.array([0, 1, 2])}, 'x_train has 5 examples but y_train has 3'),
        ('float_labels', {'y_train': np.array([0.0, 1, 2, 1, 0])}, 'integer labels'),
        ('negative', {'y_test': np.array([0, -1, 1])}, 'negative label -1'),
        ('nan', {'x_train': nan_x}, 'NaN or infinite'),
        ('inf', {'x_test': inf_x}, 'NaN or infinite'),
        (
            'empty',
            {'x_test': np.zeros((0, 4, 3), dtype=np.uint8), 'y_test': np.zeros(0, dtype=np.int64)},
            "'test' is empty",
        ),
        ('shapes', {'x_test': np.zeros((3, 4, 4), dtype=np.uint8)}, 'feature shape of split .test.'),
        ('strings', {'x_train': np.array(['a'] * 5)}, 'must be numeric'),
    ]


@pytest.mark.parametrize('case, overrides, message', _npz_error_cases())
def test_npz_errors(tmp_path, case, overrides, message):
    path = _write(tmp_path, f'{case}.npz', **overrides)
    with pytest.raises(sources.DataError, match=message) as info:
        sources.load_npz(path)
    assert '\n' not in str(info.value)


@pytest.mark.parametrize(
    'content, message',
    [
        (None, 'not found'),
        (b'', 'cannot read'),
        (b'PK\x03\x04 this is not a zip archive', 'cannot read'),
        (b'garbage bytes', 'cannot read'),
        ('npy', 'not an .npz archive'),
    ],
)
def test_npz_unreadable(tmp_path, content, message):
    path = os.path.join(tmp_path, 'bad.npz')
    if content == 'npy':
        with open(path, 'wb') as f:
            np.save(f, np.zeros(3))
    elif content is not None:
        with open(path, 'wb') as f:
            f.write(content)
    with pytest.raises(sources.DataError, match=message) as info:
        sources.load_npz(path)
    assert '\n' not in str(info.value)


def test_load_source_npz_forms(tmp_path):
    path = _write(tmp_path)
    for spec in (f'npz:{path}', path):
        pool = sources.load_source(spec)
        assert pool.x.shape == (8, 4, 3, 1)


@pytest.mark.parametrize(
    'spec, message',
    [
        ('imagenet', 'unknown data source .* npz:'),
        ('tfds:imagenet', 'unsupported tfds dataset'),
        ('synthetic:1', 'bad synthetic spec'),
        ('synthetic:a,b', 'bad synthetic spec'),
        ('synthetic:-1,1', 'must be >= 0'),
        ('folder:/definitely/not/here', 'image folder not found'),
    ],
)
def test_load_source_errors(spec, message):
    with pytest.raises(sources.DataError, match=message) as info:
        sources.load_source(spec)
    assert '\n' not in str(info.value)


def _reference_synthetic(alpha, beta, num_clients, dim, num_classes, seed):
    """Independent recomputation from the documented draw order."""
    rng = np.random.default_rng(seed)
    sizes = [min(int(s) + 50, 5000) for s in rng.lognormal(mean=4.0, sigma=2.0, size=num_clients)]
    u = rng.normal(0.0, np.sqrt(alpha), size=num_clients)
    big_b = rng.normal(0.0, np.sqrt(beta), size=num_clients)
    sigma = np.diag([j**-1.2 for j in range(1, dim + 1)])
    clients = []
    for k in range(num_clients):
        v = rng.normal(big_b[k], 1.0, size=dim)
        w = rng.normal(u[k], 1.0, size=(dim, num_classes))
        b = rng.normal(u[k], 1.0, size=num_classes)
        noise = rng.standard_normal((sizes[k], dim))
        x = v + noise @ np.sqrt(sigma)
        logits = x @ w + b
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        clients.append((x, np.argmax(probs, axis=1), w, b))
    return clients


def test_synthetic_matches_independent_recomputation():
    pool = sources.synthetic_fedprox(0.5, 0.5, num_clients=6, seed=3)
    reference = _reference_synthetic(0.5, 0.5, 6, 60, 10, seed=3)
    assert len(pool.natural_partition) == 6
    for indices, (x, y, w, b) in zip(pool.natural_partition, reference):
        np.testing.assert_allclose(pool.x[indices], x, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(pool.y[indices], y)
        # Labels are the argmax rule applied to the returned features.
        recomputed = np.argmax(pool.x[indices].astype(np.float64) @ w + b, 1)
        assert np.mean(recomputed == pool.y[indices]) > 0.99


def test_synthetic_shapes_and_ranges():
    pool = sources.synthetic_fedprox(1.0, 1.0, num_clients=20, seed=0)
    sizes = [len(p) for p in pool.natural_partition]
    assert pool.x.dtype == np.float32 and pool.y.dtype == np.int32
    assert pool.x.shape == (sum(sizes), 60)
    assert all(50 <= size <= 5000 for size in sizes)
    assert pool.y.min() >= 0 and pool.y.max() < 10
    assert pool.num_classes == 10
    np.testing.assert_array_equal(np.concatenate(pool.natural_partition), np.arange(len(pool.y)))
    assert np.isfinite(pool.x).all()


def test_synthetic_determinism():
    first = sources.load_source('synthetic', seed=7)
    again = sources.load_source('synthetic:1,1', seed=7)
    other = sources.load_source('synthetic', seed=8)
    np.testing.assert_array_equal(first.x, again.x)
    np.testing.assert_array_equal(first.y, again.y)
    assert first.x.shape != other.x.shape or np.any(first.x != other.x)


def test_synthetic_invalid():
    with pytest.raises(sources.DataError, match='num_classes >= 2'):
        sources.synthetic_fedprox(1.0, 1.0, num_classes=1)


@pytest.mark.skipif(not os.path.exists(MNIST_PATH), reason='no MNIST file')
def test_real_mnist():
    pool = sources.load_source(MNIST_PATH)
    assert pool.x.shape == (70000, 28, 28, 1)
    assert pool.num_classes == 10
    assert pool.x.min() >= 0.0 and pool.x.max() <= 1.0
    assert np.array_equal(np.unique(pool.y), np.arange(10))


@pytest.mark.slow
def test_image_folder(tmp_path):
    image_module = pytest.importorskip('PIL.Image')
    for split in ('train', 'test'):
        for label, value in (('cat', 0), ('dog', 255)):
            os.makedirs(tmp_path / split / label)
            for i in range(2):
                image = np.full((4, 5, 3), value, dtype=np.uint8)
                image_module.fromarray(image).save(tmp_path / split / label / f'{i}.png')
    pool = sources.load_source(f'folder:{tmp_path}')
    assert pool.x.shape == (8, 4, 5, 3)
    assert pool.num_classes == 2
    # Label 1 ('dog', sorted second) images are white, label 0 black.
    np.testing.assert_array_equal(pool.x.reshape(8, -1).max(axis=1), pool.y)
    image_module.fromarray(np.zeros((6, 5, 3), np.uint8)).save(tmp_path / 'test' / 'dog' / 'big.png')
    with pytest.raises(sources.DataError, match='differ in size'):
        sources.load_image_folder(str(tmp_path))


def test_image_folder_empty(tmp_path):
    with pytest.raises(sources.DataError, match='no images found'):
        sources.load_image_folder(str(tmp_path))


def test_synthetic_heterogeneity_one_is_fedprox_draw_for_draw():
    fedprox = sources.synthetic_fedprox(0.5, 0.5, num_clients=6, seed=3)
    again = sources.synthetic_fedprox(0.5, 0.5, num_clients=6, seed=3, heterogeneity=1.0)
    np.testing.assert_array_equal(fedprox.x, again.x)
    np.testing.assert_array_equal(fedprox.y, again.y)
    assert again.name == 'synthetic(0.5,0.5)'


@pytest.mark.parametrize('heterogeneity', [0.0, 0.3])
def test_synthetic_heterogeneity_mixes_one_shared_model_into_each_clients(heterogeneity):
    """Labels are argmax(x W_k + b_k) with W_k = sqrt(1 - h) W_0 + sqrt(h) W_k', recomputed here."""
    pool = sources.synthetic_fedprox(0.0, 0.0, num_clients=5, seed=4, heterogeneity=heterogeneity)
    reference = _reference_synthetic(0.0, 0.0, 5, 60, 10, seed=4)  # the paper's draws: x and W_k'
    shared = np.random.default_rng([4, 0x5EED0])
    w0, b0 = shared.normal(0.0, 1.0, size=(60, 10)), shared.normal(0.0, 1.0, size=10)
    for indices, (x, _, w_own, b_own) in zip(pool.natural_partition, reference):
        w = np.sqrt(1 - heterogeneity) * w0 + np.sqrt(heterogeneity) * w_own
        b = np.sqrt(1 - heterogeneity) * b0 + np.sqrt(heterogeneity) * b_own
        np.testing.assert_allclose(pool.x[indices], x, rtol=1e-5, atol=1e-6)
        assert np.mean(np.argmax(x @ w + b, 1) == pool.y[indices]) > 0.99
    assert pool.name == f'synthetic(0,0,h={heterogeneity:g})'


def test_synthetic_heterogeneity_controls_what_one_model_can_learn():
    """Pooled least squares on one-hot labels: far above chance at h = 0, near it at h = 1."""

    def pooled_accuracy(h):
        clients = list(
            sources.synthetic_fedprox_clients(0.0, 0.0, 300, seed=1, heterogeneity=h, examples_per_client=20)
        )
        x = np.concatenate([c[0] for c in clients]).astype(np.float64)
        y = np.concatenate([c[1] for c in clients])
        features = np.c_[x, np.ones(len(x))]
        train, test = slice(0, 4000), slice(4000, None)
        w = np.linalg.lstsq(features[train], np.eye(10)[y[train]], rcond=None)[0]
        return np.mean(np.argmax(features[test] @ w, 1) == y[test])

    shared, own = pooled_accuracy(0.0), pooled_accuracy(1.0)
    assert shared > 0.4 and own < 0.2, (shared, own)  # measured: 0.50 and 0.11


def test_synthetic_examples_per_client_fixes_sizes_and_keeps_the_other_draws():
    fixed = list(sources.synthetic_fedprox_clients(1.0, 1.0, 4, seed=2, examples_per_client=7))
    assert [len(y) for _, y in fixed] == [7] * 4
    with pytest.raises(sources.DataError, match='examples_per_client'):
        list(sources.synthetic_fedprox_clients(1.0, 1.0, 4, examples_per_client=0))


def test_synthetic_spec_takes_a_heterogeneity():
    assert sources.synthetic_params('synthetic') == (1.0, 1.0, 1.0)
    assert sources.synthetic_params('synthetic:0.5,1') == (0.5, 1.0, 1.0)
    assert sources.synthetic_params('synthetic:0,0,0.1') == (0.0, 0.0, 0.1)
    pool = sources.load_source('synthetic:0,0,0.1', num_clients=3)
    assert pool.name == 'synthetic(0,0,h=0.1)'
    for bad in ('synthetic:0,0,1.5', 'synthetic:0', 'synthetic:0,0,0,0', 'synthetic:a,b'):
        with pytest.raises(sources.DataError, match='synthetic'):
            sources.synthetic_params(bad)
    with pytest.raises(sources.DataError, match='heterogeneity'):
        sources.synthetic_fedprox(0.0, 0.0, num_clients=2, heterogeneity=-0.1)
