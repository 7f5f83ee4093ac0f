"""Client data as TFF users hold it, written once into the project's on-disk format.

`from_federated_data` takes a `tff.simulation.datasets.ClientData`, a mapping
`client id -> tf.data.Dataset`, or a mapping `client id -> (x, y)` arrays, and
optionally a second one of the same kinds with the test examples (TFF's
loaders return such train / test pairs). It streams the clients, one at a
time, into the sharded, memory-mapped layout of `client_data` (nothing is
shipped into rounds; DESIGN.md §3) inside a cache directory it manages:

* the directory is named by a SHA-256 of what was written (ids, shapes,
  bytes of every example, the split settings), so a second call with the same
  data and settings finds it and writes nothing (it reads the data once to
  hash them);
* the user's client ids are kept (`ClientDataSpec.source_ids`, and
  `user_ids` / `user_id_of` below); the positional ids the computations use
  (`client_00000`, ...) follow the user's order;
* the validation split is made here (a seeded `val_fraction` of each
  client's training examples), and without test data a seeded
  `test_fraction` as well, so that every client has train / val / test.

Errors name the Python arguments (`train`, `test`, `feature_key`, ...).
"""

import collections
import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tff_pfl.data import client_data, client_data_writer

_DEFAULT_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'tff_pfl', 'client_data')
_DEFAULT_LIMIT_GB = 10.0
# (features, labels) key pairs TFF's own datasets use, tried in order.
_KNOWN_KEYS = (('x', 'y'), ('pixels', 'label'), ('image', 'label'), ('features', 'label'))
_FORMAT = 1  # bump when what is written for the same input changes


def default_cache_dir() -> str:
    """The cache directory used when none is given.

    Returns:
      `$TFF_PFL_CACHE`, else `~/.cache/tff_pfl/client_data`.
    """
    return os.environ.get('TFF_PFL_CACHE', _DEFAULT_CACHE)


def _partitions(cache_dir: str) -> list[tuple[str, int, float]]:
    """(path, bytes, last used) of each complete partition in `cache_dir`, least recently used first."""
    found = []
    for entry in os.scandir(cache_dir) if os.path.isdir(cache_dir) else ():
        if entry.is_dir(follow_symlinks=False) and os.path.exists(os.path.join(entry.path, client_data.MANIFEST)):
            size = sum(
                os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(entry.path) for name in names
            )
            found.append((entry.path, size, entry.stat().st_mtime))
    return sorted(found, key=lambda partition: partition[2])


def clear_cache(cache_dir: str | None = None, *, keep_gb: float = 0.0, keep: Sequence[str] = ()) -> list[str]:
    """Removes the least recently used partitions until the rest take at most `keep_gb`.

    Only complete partitions this module wrote (directories with a manifest)
    are removed, and writes abandoned over a day ago (`.incoming-*`); other
    files in `cache_dir` are left alone. `from_federated_data` calls it after
    each call with its `cache_limit_gb`, keeping the partition it returns.

    Args:
      cache_dir: the cache; None: `default_cache_dir()`.
      keep_gb: the size, in GiB, the kept partitions may take (0: remove all).
      keep: partition directories never removed.

    Returns:
      The removed partition directories, least recently used first.
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    if not os.path.isdir(cache_dir):
        return []
    for entry in os.scandir(cache_dir):
        if entry.name.startswith('.incoming-') and time.time() - entry.stat().st_mtime > 86400:
            shutil.rmtree(entry.path, ignore_errors=True)
    kept = {os.path.abspath(path) for path in keep}
    partitions = _partitions(cache_dir)
    total, removed = sum(size for _, size, _ in partitions), []
    for path, size, _ in partitions:
        if total <= keep_gb * 2**30:
            break
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed.append(path)
    return removed


def default_cache_limit_gb() -> float:
    """The cache's default size bound, in GiB.

    Returns:
      `$TFF_PFL_CACHE_LIMIT_GB`, else 10.
    """
    return float(os.environ.get('TFF_PFL_CACHE_LIMIT_GB', _DEFAULT_LIMIT_GB))


def _is_client_data(value) -> bool:
    return hasattr(value, 'client_ids') and hasattr(value, 'create_tf_dataset_for_client')


def _client_ids(value, name: str) -> list[str]:
    if _is_client_data(value):
        ids = list(value.client_ids)
    elif isinstance(value, Mapping):
        ids = list(value)
    else:
        raise TypeError(
            f'{name} must be a tff.simulation.datasets.ClientData or a mapping client id -> tf.data.Dataset '
            f'or (x, y) arrays, got {type(value).__name__}'
        )
    if not ids:
        raise ValueError(f'{name} has no clients')
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise TypeError(f'{name}: client ids must be strings, got {bad[0]!r}')
    return ids


def _pair(element, feature_key, label_key, name: str):
    """(features, labels) of one element (a batch or an example) of a client's dataset."""
    if isinstance(element, Mapping):
        keys = (feature_key, label_key)
        if None in keys:
            found = [pair for pair in _KNOWN_KEYS if pair[0] in element and pair[1] in element]
            if feature_key is None and label_key is None and len(found) == 1:
                keys = found[0]
            else:
                raise ValueError(
                    f'{name}: elements are mappings with keys {sorted(element)}; pass feature_key= and label_key='
                )
        missing = [k for k in keys if k not in element]
        if missing:
            raise ValueError(f'{name}: elements have no key {missing[0]!r} (keys {sorted(element)})')
        return element[keys[0]], element[keys[1]]
    if isinstance(element, (tuple, list)) and len(element) == 2:
        return element[0], element[1]
    raise ValueError(
        f'{name}: each element must be (features, labels) or a mapping of them, got {type(element).__name__}'
    )


def _client_arrays(value, client_id: str, feature_key, label_key, name: str):
    """All of one client's examples as numpy `(x, y)`."""
    where = f'{name}[{client_id!r}]'
    if _is_client_data(value):
        data = value.create_tf_dataset_for_client(client_id)
    else:
        data = value[client_id]
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        xs, ys = [], []
        for element in data.as_numpy_iterator():
            x, y = _pair(element, feature_key, label_key, where)
            xs.append(np.asarray(x))
            ys.append(np.asarray(y))
        if not xs:
            return None
        features, labels = _pair(spec, feature_key, label_key, where)
        batched = features.shape.rank is not None and features.shape.rank >= 1 and features.shape[0] is None
        if batched:
            x, y = np.concatenate(xs), np.concatenate(ys)
        else:
            x, y = np.stack(xs), np.stack(ys)
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = np.asarray(data[0]), np.asarray(data[1])
    else:
        raise TypeError(f'{where} must be a tf.data.Dataset or (x, y) arrays, got {type(data).__name__}')
    if len(x) != len(y):
        raise ValueError(f'{where}: {len(x)} feature rows but {len(y)} labels')
    if len(x) == 0:
        return None
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f'{where}: labels must be integer classes, got {y.dtype}')
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f'{where}: features must be numbers, got {x.dtype}')
    _check_labels(x, y, where)
    return x, y.astype(np.int32)


def _check_labels(x: np.ndarray, y: np.ndarray, where: str) -> None:
    """Refuses labels the computations would misread: one-hot rows, a negative class (below -1 in a sequence).

    Labels are one class index per example (shape ()), or one per position of
    a sequence, shaped like the features' leading axes (e.g. (80,) for 80
    tokens), where `client_data.IGNORED_LABEL` (-1) marks a position that
    does not count.
    """
    label_shape, feature_shape = tuple(y.shape[1:]), tuple(x.shape[1:])
    if label_shape and feature_shape[: len(label_shape)] != label_shape:
        rows = y.reshape(len(y), -1)
        one_hot = bool(np.isin(rows, (0, 1)).all() and (rows.sum(axis=1) == 1).all())
        hint = '; they look one-hot: pass the class indices, y.argmax(-1)' if one_hot else ''
        raise ValueError(
            f'{where}: labels of shape {label_shape} per example with features of shape {feature_shape}; labels are '
            f"one class index per example, or one per sequence position shaped like the features' leading axes{hint}"
        )
    lowest = client_data.IGNORED_LABEL if label_shape else 0  # -1 only marks an ignored sequence position
    if len(y) and int(y.min()) < lowest:
        raise ValueError(
            f'{where}: label {int(y.min())}; a label is a class 0, 1, ..., num_classes - 1 '
            f'({client_data.IGNORED_LABEL} marks an ignored position only in per-position sequence labels)'
        )


def _split_indices(n: int, fractions: Sequence[float], rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded permutation of `n` cut by `fractions` (largest remainder), every part >= 1 where n allows."""
    order = rng.permutation(n)
    counts = np.floor(np.asarray(fractions) * n).astype(int)
    remainder = n - counts.sum()
    for i in np.argsort(-(np.asarray(fractions) * n - counts))[:remainder]:
        counts[i] += 1
    for i in range(len(counts)):  # a part left empty borrows from the largest, where there are enough
        if counts[i] == 0 and fractions[i] > 0 and counts.max() > 1:
            counts[np.argmax(counts)] -= 1
            counts[i] += 1
    return np.split(order, np.cumsum(counts)[:-1])


def _clients(train, test, ids, feature_key, label_key, val_fraction, test_fraction, seed) -> Iterator:
    """(user id, {split: (x, y)}) per client, in `ids` order."""
    for index, client_id in enumerate(ids):
        rng = np.random.default_rng([seed, index])
        got = _client_arrays(train, client_id, feature_key, label_key, 'train')
        if got is None:
            raise ValueError(f'train[{client_id!r}] has no examples')
        x, y = got
        if test is None:
            fractions = (1.0 - val_fraction - test_fraction, val_fraction, test_fraction)
            parts = _split_indices(len(x), fractions, rng)
            splits = {split: (x[p], y[p]) for split, p in zip(client_data.SPLITS, parts)}
        else:
            parts = _split_indices(len(x), (1.0 - val_fraction, val_fraction), rng)
            held = _client_arrays(test, client_id, feature_key, label_key, 'test')
            if held is None:
                raise ValueError(f'test[{client_id!r}] has no examples')
            splits = {'train': (x[parts[0]], y[parts[0]]), 'val': (x[parts[1]], y[parts[1]]), 'test': held}
        _check_split_sizes(client_id, splits, len(x), val_fraction, cut_test=test is None)
        yield client_id, splits


def _check_split_sizes(client_id: str, splits: Mapping, n: int, val_fraction: float, *, cut_test: bool) -> None:
    """Refuses a client whose training, validation or test split came out empty (it would be scored 0)."""
    wanted = [split for split in client_data.SPLITS if split != 'val' or val_fraction > 0]
    empty = [split for split in wanted if not len(splits[split][1])]
    if empty:
        needed = 1 + (val_fraction > 0) + cut_test
        raise ValueError(
            f'train[{client_id!r}] has {n} example{"s" * (n != 1)}: its {" and ".join(empty)} split'
            f'{"s are" if len(empty) > 1 else " is"} empty (an empty split can neither score nor choose); '
            f'give each client at least {needed} examples, or leave it out'
        )


class _Hasher:
    def __init__(self, settings: Mapping):
        self._sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())

    def client(self, client_id: str, splits: Mapping) -> None:
        self._sha.update(client_id.encode() + b'\0')
        for split in client_data.SPLITS:
            for array in splits[split]:
                self._sha.update(f'{split}{array.dtype.str}{array.shape}'.encode())
                self._sha.update(np.ascontiguousarray(array).tobytes())

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def from_federated_data(
    train,
    test=None,
    *,
    cache_dir: str | None = None,
    num_classes: int | None = None,
    feature_key: str | None = None,
    label_key: str | None = None,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    seed: int = 0,
    public: np.ndarray | None = None,
    cache_limit_gb: float | None = None,
) -> client_data.ClientDataSpec:
    """Writes (or finds) client data given as TFF users hold it; returns its spec.

    Args:
      train: the clients' (training) examples: a
        `tff.simulation.datasets.ClientData`, or a mapping client id ->
        `tf.data.Dataset` (batched or not) or `(x, y)` numpy arrays. Elements
        are `(features, labels)` pairs or mappings (see `feature_key`).
      test: optional; the clients' test examples, of one of the same kinds,
        with every client of `train` (TFF's loaders return train / test
        pairs). None: each client's test split is cut from its `train`
        examples (`test_fraction`).
      cache_dir: where partitions are kept, one directory per content hash;
        None: `default_cache_dir()`.
      num_classes: the number of label classes; None: the largest label
        seen, plus one.
      feature_key: for elements that are mappings, the key of the features
        (default: the one pair of `x`/`y`, `pixels`/`label`, `image`/`label`,
        `features`/`label` present).
      label_key: the key of the labels, likewise.
      val_fraction: the share of each client's training examples held out
        for validation (seeded), in [0, 1).
      test_fraction: without `test`, the share of each client's examples
        held out for testing (seeded).
      seed: the seed of the per-client splits.
      public: optional unlabeled features every client may read (KT-pFL,
        FedDF), `[n, *feature_shape]`.
      cache_limit_gb: after the call, the least recently used other
        partitions in `cache_dir` are removed until all take at most this
        many GiB (`clear_cache`); None: `default_cache_limit_gb()` (10 GiB unless
        `$TFF_PFL_CACHE_LIMIT_GB` says otherwise).

    Returns:
      The `client_data.ClientDataSpec` of the partition; its `source_ids`
      are the user's client ids, in the order given.

    Raises:
      TypeError: `train` or `test` of an unsupported kind, or non-string ids.
      ValueError: a bad fraction, a client without examples or with too
        few to give every split one (1-2 examples without `test`), clients of
        `test` that differ from `train`'s, mismatched shapes, labels that are
        not integer classes or exceed `num_classes`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f'val_fraction must be in [0, 1), got {val_fraction}')
    if test is None and not (test_fraction > 0.0 and val_fraction + test_fraction < 1.0):
        raise ValueError(
            f'test_fraction must be > 0 with val_fraction + test_fraction < 1, got {test_fraction} and {val_fraction}'
        )
    limit = default_cache_limit_gb() if cache_limit_gb is None else cache_limit_gb
    if isinstance(limit, bool) or not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f'cache_limit_gb must be a size in GiB > 0, got {limit!r}')
    ids = _client_ids(train, 'train')
    if len(set(ids)) != len(ids):
        raise ValueError('train: client ids repeat')
    if test is not None:
        test_ids = _client_ids(test, 'test')
        missing = sorted(set(ids) - set(test_ids))
        if missing:
            raise ValueError(f'test has no client {missing[0]!r} of train ({len(missing)} missing)')
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    os.makedirs(cache_dir, exist_ok=True)
    settings = dict(
        format=_FORMAT,
        num_classes=num_classes,
        val_fraction=val_fraction,
        test_fraction=None if test is not None else test_fraction,
        with_test=test is not None,
        seed=seed,
    )
    hasher = _Hasher(settings)
    incoming = os.path.join(cache_dir, f'.incoming-{uuid.uuid4().hex}')
    clients = _clients(train, test, ids, feature_key, label_key, val_fraction, test_fraction, seed)
    first_id, first = next(clients)
    x0 = first['train'][0]
    feature_shape, label_shape = x0.shape[1:], first['train'][1].shape[1:]
    encoding = client_data.INT32 if np.issubdtype(x0.dtype, np.integer) else client_data.FLOAT32
    largest = -1
    try:
        with client_data_writer.ClientDataWriter(
            incoming, feature_shape=feature_shape, encoding=encoding, label_shape=label_shape
        ) as writer:
            for client_id, splits in itertools.chain([(first_id, first)], clients):
                for split, (x, y) in splits.items():
                    if x.shape[1:] != feature_shape:
                        raise ValueError(
                            f'client {client_id!r} {split}: features of shape {x.shape[1:]}, the first client '
                            f'{first_id!r} has {feature_shape}'
                        )
                    if len(y):
                        largest = max(largest, int(y.max()))
                if encoding == client_data.FLOAT32:
                    splits = {s: (x.astype(np.float32), y) for s, (x, y) in splits.items()}
                hasher.client(client_id, splits)
                writer.add_client(splits, source_id=client_id)
            classes = largest + 1 if num_classes is None else int(num_classes)
            if largest >= classes:
                raise ValueError(f'a label is {largest}, but num_classes is {classes}')
            if public is not None:
                public = np.asarray(public, np.float32 if encoding == client_data.FLOAT32 else np.int32)
                hasher.client('\0public', {s: (public, np.zeros(0, np.int32)) for s in client_data.SPLITS})
            writer.finish(classes, public=public)
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    target = os.path.join(cache_dir, hasher.hexdigest()[:32])
    if os.path.exists(os.path.join(target, client_data.MANIFEST)):
        shutil.rmtree(incoming, ignore_errors=True)  # written before: keep that one
    else:
        shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier attempt
        os.rename(incoming, target)
    os.utime(target)  # its last use, for clear_cache
    clear_cache(cache_dir, keep_gb=limit, keep=(target,))
    return client_data.load_client_data_spec(target)


def user_ids(spec: client_data.ClientDataSpec) -> tuple[str, ...]:
    """The ids a user sees: the source's own ids where it has them, else the positional ones.

    Args:
      spec: a partition.

    Returns:
      One id per client, in `spec.client_ids` order.
    """
    return tuple(spec.source_ids) if spec.source_ids is not None else tuple(spec.client_ids)


def by_user_id(spec: client_data.ClientDataSpec, per_client: Sequence) -> collections.OrderedDict:
    """Keys per-client results (in `spec.client_ids` order) by the user's ids.

    Args:
      spec: the partition the results are of.
      per_client: one value per client, e.g. `process.evaluate(...)`'s list.

    Returns:
      An `OrderedDict` user id -> value.

    Raises:
      ValueError: if `per_client` does not have one value per client.
    """
    values = list(per_client)
    if len(values) != spec.num_clients:
        raise ValueError(f'per_client has {len(values)} values for {spec.num_clients} clients')
    return collections.OrderedDict(zip(user_ids(spec), values))
