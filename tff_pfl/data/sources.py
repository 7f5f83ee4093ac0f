"""Loaders that read whole datasets into memory as numpy arrays.

Every loader returns a `Pool`: all examples of a dataset (train and test
splits pooled), ready to be partitioned across simulated clients by
`tff_pfl.data.partition`. Failures are reported as `DataError` with a
one-line message suitable for a command-line tool.
"""

import dataclasses
import os
import zipfile

import numpy as np
import tensorflow_datasets as tfds

from tff_pfl.data import client_data

_TFDS_NAMES = ('mnist', 'fashion_mnist', 'cifar10', 'cifar100', 'emnist')
_NPZ_KEYS = ('x_train', 'y_train', 'x_test', 'y_test')
_SYNTHETIC_MAX_CLIENT_SIZE = 5000
_SOURCE_FORMS = (
    'npz:/path/file.npz, /path/file.npz, tfds:<name> (name in '
    + ', '.join(_TFDS_NAMES)
    + '), folder:/path, synthetic, synthetic:<alpha>,<beta>[,<heterogeneity>]'
)


# Raised when a data source is missing, unreadable or malformed; client data
# that cannot be read raise it too (defined beside them, without TFDS).
DataError = client_data.DataError


@dataclasses.dataclass(frozen=True)
class Pool:
    """All examples of a dataset, pooled.

    Attributes:
      x: float32 features of shape `[N, *feature_shape]`; images are scaled
        to `[0, 1]` and carry a trailing channel axis.
      y: int32 labels of shape `[N]`, in `[0, num_classes)`.
      num_classes: The number of classes.
      name: A human-readable name of the source.
      natural_partition: For naturally federated data, one int64 index array
        into `x`/`y` per client; `None` otherwise.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    natural_partition: tuple[np.ndarray, ...] | None = None


def _one_line(error: BaseException) -> str:
    """Returns the message of `error` collapsed to one short line."""
    text = ' '.join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + '...'


def as_features(x: np.ndarray, what: str) -> np.ndarray:
    """Converts raw features to float32, scaling uint8 images to `[0, 1]`.

    Args:
      x: Raw features of shape `[N, ...]`.
      what: Name of the array, used in error messages.

    Returns:
      A float32 array; 3-D arrays `[N, H, W]` get a trailing channel axis.

    Raises:
      DataError: If `x` is not numeric, has fewer than 2 dimensions, or
        contains NaN or infinite values.
    """
    if not np.issubdtype(x.dtype, np.number):
        raise DataError(f'{what} must be numeric, got dtype {x.dtype}')
    if x.ndim < 2:
        raise DataError(f'{what} must have shape [N, ...], got shape {x.shape}')
    scale = x.dtype == np.uint8
    x = x.astype(np.float32)
    if scale:
        x /= 255.0
    if not np.isfinite(x).all():
        raise DataError(f'{what} contains NaN or infinite values')
    if x.ndim == 3:
        x = x[..., np.newaxis]
    return x


def _as_labels(y: np.ndarray, what: str) -> np.ndarray:
    """Validates labels and returns them as an int32 vector.

    Args:
      y: Non-empty labels of shape `[N]` or `[N, 1]`.
      what: Name of the array, used in error messages.

    Returns:
      An int32 array of shape `[N]`.

    Raises:
      DataError: If `y` is not an integer vector or holds negative values.
    """
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f'{what} must hold integer labels, got dtype {y.dtype}')
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f'{what} must have shape [N], got shape {y.shape}')
    if y.min() < 0:
        raise DataError(f'{what} holds negative label {y.min()}')
    return y.astype(np.int32)


def _pool_splits(
    splits: list[tuple[str, np.ndarray, np.ndarray]],
    num_classes: int | None,
    name: str,
) -> Pool:
    """Validates split arrays and concatenates them, in order, into a `Pool`.

    Args:
      splits: `(split_name, x, y)` triples, pooled in the given order.
      num_classes: The number of classes, or `None` for max label + 1.
      name: The name of the resulting pool.

    Returns:
      A `Pool` holding all examples of `splits`.

    Raises:
      DataError: If a split is empty, its `x` and `y` lengths differ, feature
        shapes differ between splits, or a label is out of range.
    """
    xs, ys = [], []
    for split, x, y in splits:
        if x.size == 0 or y.size == 0:
            raise DataError(f'{name}: split {split!r} is empty')
        x = as_features(x, f'{name}: x_{split}')
        y = _as_labels(y, f'{name}: y_{split}')
        if len(x) != len(y):
            raise DataError(f'{name}: x_{split} has {len(x)} examples but y_{split} has {len(y)}')
        if xs and x.shape[1:] != xs[0].shape[1:]:
            raise DataError(
                f'{name}: feature shape of split {split!r} {x.shape[1:]}'
                f' differs from {xs[0].shape[1:]} of split {splits[0][0]!r}'
            )
        xs.append(x)
        ys.append(y)
    y = np.concatenate(ys)
    if num_classes is None:
        num_classes = int(y.max()) + 1
    elif y.max() >= num_classes:
        raise DataError(f'{name}: label {y.max()} out of range for {num_classes} classes')
    return Pool(x=np.concatenate(xs), y=y, num_classes=int(num_classes), name=name)


def load_npz(path: str) -> Pool:
    """Loads a Keras-layout `.npz` file into a `Pool`.

    The file must hold `x_train`, `y_train`, `x_test` and `y_test` (as written
    by e.g. `keras.datasets.mnist`). Train and test examples are concatenated
    into one pool, train first. uint8 features are scaled by 1/255 to float32;
    other numeric features are cast to float32 unchanged. 3-D feature arrays
    `[N, H, W]` get a trailing channel axis, giving `[N, H, W, 1]`. Labels of
    shape `[N]` or `[N, 1]` are accepted.

    Args:
      path: Path of the `.npz` file.

    Returns:
      A `Pool` with `num_classes` equal to the largest label plus one.

    Raises:
      DataError: If the file is missing, unreadable or not an `.npz` archive,
        lacks one of the four keys, or its arrays fail validation (empty,
        length mismatch between x and y, non-integer or negative labels, NaN
        or infinite features, train and test feature shapes differing).
    """
    if not os.path.isfile(path):
        raise DataError(f'npz file not found: {path}')
    try:
        archive = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise DataError(f'cannot read npz file {path}: {_one_line(e)}') from e
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f'{path} is not an .npz archive')
    with archive:
        missing = [key for key in _NPZ_KEYS if key not in archive.files]
        if missing:
            raise DataError(f'{path} lacks key(s) {", ".join(missing)}; expected {", ".join(_NPZ_KEYS)}')
        try:
            arrays = {key: archive[key] for key in _NPZ_KEYS}
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise DataError(f'cannot read npz file {path}: {_one_line(e)}') from e
    return _pool_splits(
        [
            ('train', arrays['x_train'], arrays['y_train']),
            ('test', arrays['x_test'], arrays['y_test']),
        ],
        num_classes=None,
        name=os.path.basename(path),
    )


def load_tfds(name: str, data_dir: str | None = None, download: bool = False) -> Pool:
    """Loads the train and test splits of a TFDS dataset into a `Pool`.

    Supported names are `mnist`, `fashion_mnist`, `cifar10`, `cifar100` and
    `emnist`, optionally with a builder config (e.g. `emnist/balanced`).
    Plain `emnist` is TFDS's default config, `emnist/byclass` (62 classes).
    Train and test are pooled, train first; uint8 images are scaled to
    `[0, 1]`.

    Args:
      name: TFDS dataset name, optionally `name/config`.
      data_dir: TFDS data directory; `None` for the TFDS default.
      download: Whether TFDS may download and prepare the dataset.

    Returns:
      A `Pool` whose `num_classes` comes from the dataset's label feature.

    Raises:
      DataError: If `name` is not supported or the dataset cannot be loaded.
    """
    if name.split('/')[0] not in _TFDS_NAMES:
        raise DataError(f'unsupported tfds dataset {name!r}; supported: ' + ', '.join(_TFDS_NAMES))
    try:
        (train, test), info = tfds.load(
            name,
            split=['train', 'test'],
            as_supervised=True,
            batch_size=-1,
            data_dir=data_dir,
            download=download,
            with_info=True,
        )
        (x_train, y_train), (x_test, y_test) = tfds.as_numpy((train, test))
    except Exception as e:  # TFDS raises many unrelated exception types.
        where = data_dir or 'the default TFDS data_dir'
        hint = '' if download else '; pass --download or a data_dir that holds it'
        raise DataError(f'cannot load tfds dataset {name!r} from {where}{hint} ({_one_line(e)})') from e
    return _pool_splits(
        [('train', x_train, y_train), ('test', x_test, y_test)],
        num_classes=info.features['label'].num_classes,
        name=name,
    )


def load_image_folder(root: str) -> Pool:
    """Loads a `root/<split>/<label>/*.png|jpg` image tree into a `Pool`.

    Images are read with `tfds.folder_dataset.ImageFolder`, which decodes
    them as 3-channel RGB and maps label directory names, sorted, to integer
    labels. All splits are pooled, in sorted split-name order. Pixel values
    are scaled to `[0, 1]`.

    Args:
      root: The root directory of the image tree.

    Returns:
      A `Pool` whose `num_classes` is the number of distinct label
      directories.

    Raises:
      DataError: If `root` is missing or holds no images, an image cannot be
        decoded, or images differ in size.
    """
    if not os.path.isdir(root):
        raise DataError(f'image folder not found: {root}')
    try:
        builder = tfds.folder_dataset.ImageFolder(root)
        loaded = []
        for split in sorted(builder.info.splits.keys()):
            dataset = builder.as_dataset(split=split, as_supervised=True)
            loaded.append((split, list(tfds.as_numpy(dataset))))
    except Exception as e:  # Decoding errors surface as many exception types.
        raise DataError(f'cannot read image folder {root}: {_one_line(e)}') from e
    loaded = [(split, examples) for split, examples in loaded if examples]
    if not loaded:
        raise DataError(f'no images found under {root}; expected root/<split>/<label>/*.png|jpg')
    shapes = {image.shape for _, examples in loaded for image, _ in examples}
    if len(shapes) > 1:
        raise DataError(f'images under {root} differ in size: ' + ', '.join(str(shape) for shape in sorted(shapes)))
    splits = [
        (
            split,
            np.stack([image for image, _ in examples]),
            np.array([label for _, label in examples]),
        )
        for split, examples in loaded
    ]
    return _pool_splits(
        splits,
        num_classes=builder.info.features['label'].num_classes,
        name=os.path.basename(os.path.normpath(root)),
    )


def synthetic_fedprox(
    alpha: float,
    beta: float,
    num_clients: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    heterogeneity: float = 1.0,
) -> Pool:
    """Generates the Synthetic(alpha, beta) benchmark of FedProx.

    Follows Li et al., "Federated Optimization in Heterogeneous Networks"
    (MLSys 2020). For client k: `u_k ~ N(0, alpha)` and `B_k ~ N(0, beta)`,
    where alpha and beta are variances (as in the paper; the reference
    generator uses them as standard deviations); `W_k ~ N(u_k, 1)` of shape
    `[dim, num_classes]`, `b_k ~ N(u_k, 1)`, `v_k ~ N(B_k, 1)` of shape
    `[dim]`; features `x ~ N(v_k, Sigma)` with diagonal
    `Sigma_jj = j^-1.2`; labels `y = argmax(softmax(x W_k + b_k))`.

    Client sizes follow the reference generator's power law,
    `n_k = int(lognormal(mean=4, sigma=2)) + 50`, capped at 5000 examples so
    a single heavy-tailed draw cannot dominate memory.

    Draw order, from `np.random.default_rng(seed)`: the `num_clients` sizes,
    then all `u_k`, then all `B_k`, then per client `v_k`, `W_k`, `b_k` and
    the standard-normal noise of `x`.

    `heterogeneity` h in [0, 1] (a project extension, docs/data.md) mixes a
    model shared by every client into each client's labelling model:
    `W_k = sqrt(1 - h) W_0 + sqrt(h) W_k'`, `b_k = sqrt(1 - h) b_0 + sqrt(h) b_k'`
    with `W_0, b_0 ~ N(0, 1)` drawn once (from their own generator, seeded
    by `seed`) and `W_k', b_k'` the paper's draws above. h = 1 is FedProx's
    generator, draw for draw; h = 0 labels every client's data with one
    model (only the feature means differ, by beta), which a single model
    can learn. With alpha = 0 two clients' models have correlation 1 - h.

    Args:
      alpha: Variance of the model means `u_k`; controls how much local
        models differ. Must be >= 0.
      beta: Variance of the feature means `B_k`; controls how much local
        feature distributions differ. Must be >= 0.
      num_clients: Number of clients.
      dim: Feature dimension.
      num_classes: Number of classes.
      seed: Random seed; equal seeds give equal pools.
      heterogeneity: h, the share of each client's labelling model that is
        its own (0: one model for all; 1: FedProx's per-client `W_k`).

    Returns:
      A `Pool` with float32 `x` of shape `[N, dim]` and `natural_partition`
      holding each client's consecutive index range.

    Raises:
      DataError: If `alpha` or `beta` is negative, `heterogeneity` is
        outside [0, 1], or `num_clients`, `dim` or `num_classes` is too
        small.
    """
    xs, ys = [], []
    for x, y in synthetic_fedprox_clients(alpha, beta, num_clients, dim, num_classes, seed, heterogeneity):
        xs.append(x)
        ys.append(y)
    bounds = np.concatenate([[0], np.cumsum([len(y) for y in ys])])
    return Pool(
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        num_classes=num_classes,
        name=synthetic_name(alpha, beta, heterogeneity),
        natural_partition=tuple(np.arange(start, end, dtype=np.int64) for start, end in zip(bounds[:-1], bounds[1:])),
    )


def synthetic_name(alpha: float, beta: float, heterogeneity: float = 1.0) -> str:
    """The name of a Synthetic(alpha, beta) pool, e.g. `synthetic(1,1)` or `synthetic(0,0,h=0.1)`.

    Args:
      alpha: variance of the model means.
      beta: variance of the feature means.
      heterogeneity: the share of each client's model that is its own (1:
        FedProx's generator, not written in the name).

    Returns:
      The pool's name.
    """
    if heterogeneity == 1.0:
        return f'synthetic({alpha:g},{beta:g})'
    return f'synthetic({alpha:g},{beta:g},h={heterogeneity:g})'


def synthetic_fedprox_clients(
    alpha: float,
    beta: float,
    num_clients: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    heterogeneity: float = 1.0,
    examples_per_client: int | None = None,
):
    """Generates the clients of `synthetic_fedprox` one at a time.

    The same draws in the same order as `synthetic_fedprox`, which
    concatenates what this yields: one client's examples are in memory at a
    time, so 100,000 clients (35 M examples, 8.4 GB as float32) can be
    written without holding the pool.

    Args:
      alpha: Variance of the model means (>= 0).
      beta: Variance of the feature means (>= 0).
      num_clients: Number of clients.
      dim: Feature dimension.
      num_classes: Number of classes.
      seed: Random seed.
      heterogeneity: h in [0, 1], the share of each client's labelling
        model that is its own (`synthetic_fedprox`).
      examples_per_client: every client's size instead of the power law
        (the size draws are still made, so the other draws do not move):
        a cross-device population of many small clients.

    Yields:
      `(x, y)` of each client in turn: float32 `[n_k, dim]`, int32 `[n_k]`.

    Raises:
      DataError: If `alpha` or `beta` is negative, or `num_clients`, `dim`
        or `num_classes` is too small.
    """
    if alpha < 0 or beta < 0:
        raise DataError(f'synthetic alpha and beta must be >= 0, got {alpha}, {beta}')
    if not 0.0 <= heterogeneity <= 1.0:
        raise DataError(f'synthetic heterogeneity must be in [0, 1], got {heterogeneity}')
    if num_clients < 1 or dim < 1 or num_classes < 2:
        raise DataError(
            f'synthetic needs num_clients >= 1, dim >= 1 and num_classes >= 2, got {num_clients}, {dim}, {num_classes}'
        )
    if examples_per_client is not None and examples_per_client < 1:
        raise DataError(f'synthetic examples_per_client must be >= 1, got {examples_per_client}')
    rng = np.random.default_rng(seed)
    sizes = np.minimum(
        rng.lognormal(mean=4.0, sigma=2.0, size=num_clients).astype(np.int64) + 50,
        _SYNTHETIC_MAX_CLIENT_SIZE,
    )
    if examples_per_client is not None:
        sizes = np.full(num_clients, examples_per_client, np.int64)
    model_means = rng.normal(0.0, np.sqrt(alpha), size=num_clients)
    feature_means = rng.normal(0.0, np.sqrt(beta), size=num_clients)
    feature_std = np.arange(1, dim + 1, dtype=np.float64) ** -0.6
    # The shared model, from a generator of its own: h = 1 draws what FedProx's does.
    shared_rng = np.random.default_rng([seed, 0x5EED0])
    shared_w = shared_rng.normal(0.0, 1.0, size=(dim, num_classes))
    shared_b = shared_rng.normal(0.0, 1.0, size=num_classes)
    own, common = np.sqrt(heterogeneity), np.sqrt(1.0 - heterogeneity)
    for k in range(num_clients):
        v = rng.normal(feature_means[k], 1.0, size=dim)
        w = rng.normal(model_means[k], 1.0, size=(dim, num_classes))
        b = rng.normal(model_means[k], 1.0, size=num_classes)
        if heterogeneity != 1.0:
            w = common * shared_w + own * w
            b = common * shared_b + own * b
        x = v + rng.standard_normal((sizes[k], dim)) * feature_std
        yield x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int32)


def synthetic_params(spec: str) -> tuple[float, float, float] | None:
    """`(alpha, beta, heterogeneity)` of a `synthetic`, `synthetic:<alpha>,<beta>` or
    `synthetic:<alpha>,<beta>,<heterogeneity>` source spec.

    Args:
      spec: a source spec.

    Returns:
      `(alpha, beta, heterogeneity)` (heterogeneity 1 where the spec gives
      none: FedProx's generator), or None when `spec` names another source.

    Raises:
      DataError: a malformed `synthetic:` spec.
    """
    if spec == 'synthetic':
        return 1.0, 1.0, 1.0
    kind, _, arg = spec.partition(':')
    if kind != 'synthetic':
        return None
    try:
        values = [float(v) for v in arg.split(',')]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise DataError(f'bad synthetic spec {spec!r}; expected synthetic:<alpha>,<beta>[,<heterogeneity>]')
    alpha, beta, heterogeneity = (*values, 1.0)[:3]
    if not 0.0 <= heterogeneity <= 1.0:
        raise DataError(f'bad synthetic spec {spec!r}: heterogeneity must be in [0, 1]')
    return alpha, beta, heterogeneity


def load_source(
    spec: str,
    *,
    data_dir: str | None = None,
    download: bool = False,
    seed: int = 0,
    num_clients: int = 30,
) -> Pool:
    """Loads the data source described by `spec`.

    Accepted forms: `npz:/path/file.npz` (or a bare path ending in `.npz`),
    `tfds:<name>`, `folder:/path`, `synthetic` (alpha = beta = 1),
    `synthetic:<alpha>,<beta>` (e.g. `synthetic:0.5,0.5`) and
    `synthetic:<alpha>,<beta>,<heterogeneity>` (e.g. `synthetic:0,0,0.1`:
    clients sharing nine tenths of one labelling model).

    Args:
      spec: The source specification.
      data_dir: TFDS data directory; used by `tfds:` sources only.
      download: Whether TFDS may download; used by `tfds:` sources only.
      seed: Random seed; used by `synthetic` sources only.
      num_clients: Number of clients of `synthetic` sources.

    Returns:
      The loaded `Pool`.

    Raises:
      DataError: If `spec` has none of the accepted forms or loading fails.
    """
    kind, _, arg = spec.partition(':')
    if kind == 'npz':
        return load_npz(arg)
    if kind == 'tfds':
        return load_tfds(arg, data_dir=data_dir, download=download)
    if kind == 'folder':
        return load_image_folder(arg)
    synthetic = synthetic_params(spec)
    if synthetic is not None:
        alpha, beta, heterogeneity = synthetic
        return synthetic_fedprox(alpha, beta, num_clients=num_clients, seed=seed, heterogeneity=heterogeneity)
    if spec.endswith('.npz'):
        return load_npz(spec)
    raise DataError(f'unknown data source {spec!r}; accepted: {_SOURCE_FORMS}')
