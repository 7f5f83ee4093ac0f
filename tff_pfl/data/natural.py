"""Naturally federated sources: data that arrive already split by client.

Three forms of `--dataset` (docs/data.md, "Naturally federated sources"):

- `tff:<name>`: TFF's own simulation datasets, loaded by TFF's own loaders
  (`tff.simulation.datasets.<name>.load_data(cache_dir=data_dir)`):
  `shakespeare` (next-character prediction, one client per speaking role),
  `emnist` (62 classes, one client per writer), `emnist_digits` (10
  classes), `cifar100` (100 classes, clients of TFF's Pachinko split).
  Offline, the cache directory must hold the dataset's SQLite file; with
  `--download` TFF fetches it.
- `sqlite:PATH`: any file in TFF's `SqlClientData` layout (tables
  `examples(split_name, client_id, serialized_example_proto)` and
  `client_metadata(client_id, split_name, num_examples)`), with splits
  named `train` and `test`, or named in the spec: `sqlite:PATH#TRAIN,TEST`.
  Each example is a `tf.train.Example`; what it holds is read from the
  first one (`_ExampleLayout`).
- `clients:DIR`: your own per-client files, one `<client>.npz` per client
  plus `DIR/manifest.json` (`_read_clients_manifest`).

A source gives its eligible clients' ids and reads one client at a time
(`NaturalSource.read_client`): the pipeline streams clients into the
project's per-client files and never holds the whole dataset. A client is
eligible when it has at least two training examples (one can go to
validation) and one test example (for text: non-empty snippets, each of
which gives at least one sequence); the others are counted and left out.
"""

import dataclasses
import json
import os
import sqlite3
from collections.abc import Callable, Mapping

import numpy as np

from tff_pfl.data import client_data, sources, text
from tff_pfl.data.sources import DataError

# TFF's datasets: the cached file, the split names in it, the task.
TFF_DATASETS = {
    'shakespeare': dict(file='shakespeare.sqlite', splits=('train', 'test'), task='next_char'),
    'emnist': dict(file='emnist_all.sqlite', splits=('all_train', 'all_test'), num_classes=62),
    'emnist_digits': dict(file='emnist_all.sqlite', splits=('digits_only_train', 'digits_only_test'), num_classes=10),
    # CIFAR-100's 100 test clients are other clients than its 500 train clients: each train client's
    # examples are split into train, validation and test (`own_test`).
    'cifar100': dict(file='cifar100.sqlite', splits=('train', 'test'), num_classes=100, own_test=False),
}
# TFF datasets the project does not read, and why (one line each).
TFF_UNSUPPORTED = {
    'stackoverflow': (
        'its next-word task needs a word vocabulary built from the 135M-example corpus and a 3.4 GB '
        'download, beyond these machines; not supported'
    ),
    'gldv2': 'Google Landmarks v2 images must be downloaded from the web per client; not supported',
    'inaturalist': 'iNaturalist images must be downloaded from the web per client; not supported',
    'celeba': 'not supported yet',
    'flair': 'not supported yet',
}
NATURAL_KINDS = ('tff', 'sqlite', 'clients')
TASKS = ('classification', 'next_char')
CLIENTS_MANIFEST = 'manifest.json'
# feature shape, label shape, classes and encoding of next-character prediction.
_TEXT_TASK = ((text.SEQUENCE_LENGTH,), (text.SEQUENCE_LENGTH,), text.VOCAB_SIZE, client_data.INT32)


def is_natural(dataset: str) -> bool:
    """Whether a `--dataset` spec names a naturally federated source.

    Args:
      dataset: the spec.

    Returns:
      True for `tff:`, `sqlite:` and `clients:` specs.
    """
    return dataset.partition(':')[0] in NATURAL_KINDS


@dataclasses.dataclass(frozen=True)
class NaturalSource:
    """A naturally federated source, read one client at a time.

    Attributes:
      name: e.g. `tff:shakespeare`.
      client_ids: the source's ids of its eligible clients, sorted.
      excluded: how many of the source's clients are not eligible.
      task: one of `TASKS`.
      feature_shape: one example's features.
      label_shape: one example's labels (() for a class).
      num_classes: number of label values (the vocabulary for text).
      encoding: how `client_data` stores the features.
      read_client: source id -> split name -> `(x, y)`: `train`, `test`
        unless the source's test examples belong to other clients (TFF's
        CIFAR-100: the client's examples are then split three ways), and
        `val` when the source has its own.
    """

    name: str
    client_ids: tuple[str, ...]
    excluded: int
    task: str
    feature_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    num_classes: int
    encoding: str
    read_client: Callable[[str], Mapping[str, tuple[np.ndarray, np.ndarray]]]


def default_model(dataset: str) -> str | None:
    """The model a natural source is run with unless `--model` says otherwise.

    `char_gru` for text; for classification `persfl_cnn` on images and
    `mnist_dnn` on vectors. A `sqlite:` file or `clients:` directory is
    peeked at (its first example, its manifest); one that cannot be read
    gives None, and reading the data later says why.

    Args:
      dataset: a natural `--dataset` spec.

    Returns:
      A registry name, or None.
    """
    kind, _, arg = dataset.partition(':')
    if kind == 'tff':
        return 'char_gru' if TFF_DATASETS.get(arg, {}).get('task') == 'next_char' else 'persfl_cnn'
    try:
        if kind == 'clients':
            if _read_clients_manifest(arg)['task'] == 'next_char':
                return 'char_gru'
            return None
        if kind == 'sqlite':
            path, splits = parse_sqlite_spec(arg)
            train_split = (splits or ('train', 'test'))[0]
            with sqlite3.connect(f'file:{path}?mode=ro', uri=True) as connection:
                row = connection.execute(
                    'SELECT serialized_example_proto FROM examples WHERE split_name = ? LIMIT 1', (train_split,)
                ).fetchone()
            if row is None:
                return None
            layout = _ExampleLayout.of(bytes(row[0]), dataset)
            if layout.task == 'next_char':
                return 'char_gru'
            return 'persfl_cnn' if len(layout.feature_shape) == 3 else 'mnist_dnn'
    except (DataError, sqlite3.Error, OSError):
        return None
    return None


# ----------------------------------------------------------------------------
# SQLite (TFF's SqlClientData layout).


def _split_counts(path: str, splits: tuple[str, str]) -> dict[str, dict[str, int]]:
    """client id -> split -> number of examples, from `client_metadata`."""
    try:
        with sqlite3.connect(f'file:{path}?mode=ro', uri=True) as connection:
            rows = connection.execute('SELECT client_id, split_name, num_examples FROM client_metadata').fetchall()
    except sqlite3.Error as e:
        raise DataError(f'{path}: not a TFF SqlClientData file ({e})') from None
    counts: dict[str, dict[str, int]] = {}
    for client_id, split, num in rows:
        if split in splits:
            counts.setdefault(client_id, {})[split] = int(num)
    return counts


def _snippet_counts(path: str, splits: tuple[str, str]) -> dict[str, dict[str, int]]:
    """client id -> split -> number of non-empty snippets (text: an empty snippet gives no example)."""
    import tensorflow as tf

    counts: dict[str, dict[str, int]] = {}
    with sqlite3.connect(f'file:{path}?mode=ro', uri=True) as connection:
        rows = connection.execute(
            'SELECT client_id, split_name, serialized_example_proto FROM examples WHERE split_name IN (?, ?)', splits
        )
        for client_id, split, serialized in rows:
            feature = tf.train.Example.FromString(bytes(serialized)).features.feature.get('snippets')
            non_empty = feature is not None and any(feature.bytes_list.value)
            per_client = counts.setdefault(client_id, {})
            per_client[split] = per_client.get(split, 0) + int(non_empty)
    return counts


def _split_names(path: str) -> list[str]:
    try:
        with sqlite3.connect(f'file:{path}?mode=ro', uri=True) as connection:
            tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {'examples', 'client_metadata'} <= tables:
                raise DataError(
                    f'{path}: not a TFF SqlClientData file (it needs tables examples and client_metadata, '
                    f'has {", ".join(sorted(tables)) or "none"})'
                )
            return sorted(r[0] for r in connection.execute('SELECT DISTINCT split_name FROM client_metadata'))
    except sqlite3.Error as e:
        raise DataError(f'{path}: not a TFF SqlClientData file ({e})') from None


def _eligible(
    counts: Mapping[str, Mapping[str, int]], splits: tuple[str, str], own_test: bool = True
) -> tuple[tuple[str, ...], int]:
    train, test = splits
    ids = sorted(counts)
    if own_test:
        good = tuple(c for c in ids if counts[c].get(train, 0) >= 2 and counts[c].get(test, 0) >= 1)
    else:  # train, validation and test all come from the training examples
        good = tuple(c for c in ids if counts[c].get(train, 0) >= 3)
    return good, len(ids) - len(good)


def _text_eligible(path, splits, name, client_ids=None) -> tuple[tuple[str, ...], int]:
    """`_eligible` counting non-empty snippets: an empty one gives no example."""
    counts = _snippet_counts(path, splits)
    if client_ids is not None:
        counts = {c: counts.get(c, {}) for c in client_ids}
    ids, excluded = _eligible(counts, splits)
    if not ids:
        raise DataError(f'{name}: no client has two non-empty training snippets and a non-empty test snippet')
    return ids, excluded


@dataclasses.dataclass(frozen=True)
class _ExampleLayout:
    """What a `tf.train.Example` of a SqlClientData file holds, read from the first one.

    Text: a bytes feature `snippets` (Shakespeare's layout), one snippet per
    example. Classification: an int64 feature `label` (one value) and one
    numeric feature of the same length in every example, the pixels or the
    vector: float features are used as they are, int64 features as 8-bit
    values scaled by 1/255; n values are shaped `[s, s, 1]` when n = s^2,
    `[s, s, 3]` when n = 3 s^2 (s >= 8), else `[n]`.
    """

    task: str
    key: str = ''
    kind: str = ''  # 'float_list' | 'int64_list'
    feature_shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, serialized: bytes, where: str) -> '_ExampleLayout':
        import tensorflow as tf

        try:
            example = tf.train.Example.FromString(serialized)
        except Exception as e:  # a protobuf DecodeError
            raise DataError(f'{where}: an example is not a serialized tf.train.Example ({e})') from None
        feature = example.features.feature
        if 'snippets' in feature and feature['snippets'].WhichOneof('kind') == 'bytes_list':
            return cls('next_char')
        if 'label' not in feature or feature['label'].WhichOneof('kind') != 'int64_list':
            raise DataError(
                f'{where}: examples hold {", ".join(sorted(feature)) or "nothing"}; expected a bytes feature '
                '"snippets" (text) or an int64 feature "label" and one numeric feature'
            )
        others = [k for k in sorted(feature) if k != 'label' and feature[k].WhichOneof('kind') != 'bytes_list']
        others = [k for k in others if k not in ('coarse_label',)]
        if len(others) != 1:
            raise DataError(
                f'{where}: examples hold numeric features {", ".join(others) or "none"} beside "label"; expected one'
            )
        key = others[0]
        kind = feature[key].WhichOneof('kind')
        n = len(getattr(feature[key], kind).value)
        side = int(round(np.sqrt(n)))
        side3 = int(round(np.sqrt(n / 3)))
        if side * side == n and side >= 2:
            shape = (side, side, 1)
        elif 3 * side3 * side3 == n and side3 >= 8:
            shape = (side3, side3, 3)
        else:
            shape = (n,)
        return cls('classification', key, kind, shape)

    def arrays(self, serialized: list[bytes], where: str) -> tuple[np.ndarray, np.ndarray]:
        import tensorflow as tf

        if self.task == 'next_char':
            examples = [tf.train.Example.FromString(s).features.feature for s in serialized]
            return text.snippet_examples([e['snippets'].bytes_list.value[0] for e in examples])
        xs, ys = [], []
        for s in serialized:
            feature = tf.train.Example.FromString(s).features.feature
            if self.key not in feature or 'label' not in feature:
                raise DataError(f'{where}: an example lacks "{self.key}" or "label"')
            values = getattr(feature[self.key], self.kind).value
            if len(values) != int(np.prod(self.feature_shape)):
                raise DataError(f'{where}: an example of {len(values)} values; expected {self.feature_shape}')
            xs.append(values)
            ys.append(feature['label'].int64_list.value[0])
        x = np.asarray(xs, np.float32).reshape((-1,) + self.feature_shape)
        if self.kind == 'int64_list':
            x /= np.float32(255.0)
        return x, np.asarray(ys, np.int32)


def _client_serialized(path: str, split: str, client_id: str) -> list[bytes]:
    with sqlite3.connect(f'file:{path}?mode=ro', uri=True) as connection:
        rows = connection.execute(
            'SELECT serialized_example_proto FROM examples WHERE split_name = ? AND client_id = ? ORDER BY rowid',
            (split, client_id),
        ).fetchall()
    return [bytes(r[0]) for r in rows]


def load_sqlite(path: str, splits: tuple[str, str] | None = None, *, name: str | None = None, num_classes=None):
    """A `NaturalSource` over a file in TFF's SqlClientData layout.

    Args:
      path: the SQLite file.
      splits: the names of the train and test splits; None: `train` and
        `test`.
      name: the source's name (default `sqlite:<path>`).
      num_classes: the number of classes, when known (TFF's datasets);
        None: inferred as the largest label of the first client + 1, raised
        to every later client's largest label.

    Returns:
      The source.

    Raises:
      DataError: a missing or malformed file, missing splits, or no
        eligible client.
    """
    name = name or f'sqlite:{path}'
    if not os.path.isfile(path):
        raise DataError(f'{name}: file not found: {path}')
    available = _split_names(path)
    train_split, test_split = splits or ('train', 'test')
    missing = [s for s in (train_split, test_split) if s not in available]
    if missing:
        raise DataError(
            f'{name}: no split {missing[0]!r}; the file has {", ".join(available) or "none"} '
            '(name them: sqlite:PATH#TRAIN,TEST)'
        )
    counts = _split_counts(path, (train_split, test_split))
    ids, excluded = _eligible(counts, (train_split, test_split))
    if not ids:
        raise DataError(f'{name}: no client has two training examples and a test example')
    first = _client_serialized(path, train_split, ids[0])
    if not first:
        raise DataError(f'{name}: client {ids[0]!r} has no examples in split {train_split!r}')
    layout = _ExampleLayout.of(first[0], name)
    if layout.task == 'next_char':
        ids, excluded = _text_eligible(path, (train_split, test_split), name)
        shape, label_shape, classes, encoding = _TEXT_TASK
    else:
        shape, label_shape = layout.feature_shape, ()
        classes = num_classes
        encoding = client_data.UINT8_OVER_255 if layout.kind == 'int64_list' else client_data.FLOAT32
        if classes is None:
            _, y = layout.arrays(first, name)
            classes = int(y.max()) + 1

    def read_client(client_id: str):
        where = f'{name}, client {client_id!r}'
        out = {}
        for split, source_split in (('train', train_split), ('test', test_split)):
            x, y = layout.arrays(_client_serialized(path, source_split, client_id), where)
            if layout.task == 'classification' and len(y) and (y.min() < 0 or y.max() >= classes):
                raise DataError(f'{where}: label {int(y.max())} out of range for {classes} classes')
            out[split] = (x, y)
        return out

    return NaturalSource(name, ids, excluded, layout.task, shape, label_shape, classes, encoding, read_client)


def parse_sqlite_spec(arg: str) -> tuple[str, tuple[str, str] | None]:
    """`PATH` or `PATH#TRAIN,TEST` -> (path, split names or None).

    Args:
      arg: what follows `sqlite:`.

    Returns:
      The path and the split names.

    Raises:
      DataError: a `#` part that is not two names.
    """
    path, hash_, names = arg.partition('#')
    if not hash_:
        return path, None
    parts = names.split(',')
    if len(parts) != 2 or not all(parts):
        raise DataError(f'bad sqlite spec sqlite:{arg}; expected sqlite:PATH or sqlite:PATH#TRAIN,TEST')
    return path, (parts[0], parts[1])


# ----------------------------------------------------------------------------
# TFF's datasets.


def tff_cache_file(name: str, data_dir: str | None) -> str:
    """Where TFF's loader keeps dataset `name` (its `cache_dir`, default ~/.tff).

    Args:
      name: a key of `TFF_DATASETS`.
      data_dir: the cache directory, or None for TFF's default.

    Returns:
      The path of the SQLite file.
    """
    cache_dir = data_dir or os.path.join(os.path.expanduser('~'), '.tff')
    return os.path.join(cache_dir, TFF_DATASETS[name]['file'])


def _tff_arrays(task: str, elements: list, feature_shape) -> tuple[np.ndarray, np.ndarray]:
    """TFF's parsed examples (OrderedDicts of numpy values) -> `(x, y)`."""
    if task == 'next_char':
        return text.snippet_examples([e['snippets'] for e in elements])
    key = 'pixels' if elements and 'pixels' in elements[0] else 'image'
    x = np.asarray([e[key] for e in elements], np.float32).reshape((-1,) + tuple(feature_shape))
    if key == 'image':  # CIFAR-100: 8-bit values
        x /= np.float32(255.0)
    return x, np.asarray([e['label'] for e in elements], np.int32).reshape(-1)


def load_tff(name: str, data_dir: str | None = None, download: bool = False) -> NaturalSource:
    """One of TFF's simulation datasets, through TFF's own loader.

    `tff.simulation.datasets.<name>.load_data(cache_dir=data_dir)` gives the
    train and test `ClientData`; a client's examples are those of its
    `create_tf_dataset_for_client`, parsed by TFF. Which clients are
    eligible is read from the file's `client_metadata` counts.

    Args:
      name: a key of `TFF_DATASETS`.
      data_dir: TFF's `cache_dir` (None: ~/.tff).
      download: let TFF fetch the file when the cache does not hold it.

    Returns:
      The source.

    Raises:
      DataError: an unknown or unsupported name, a file the cache does not
        hold (without `download`), or a failed download.
    """
    if name in TFF_UNSUPPORTED:
        raise DataError(f'tff:{name}: {TFF_UNSUPPORTED[name]}')
    if name not in TFF_DATASETS:
        raise DataError(f'unknown TFF dataset tff:{name}; known: {", ".join(sorted(TFF_DATASETS))}')
    entry = TFF_DATASETS[name]
    path = tff_cache_file(name, data_dir)
    if not os.path.isfile(path) and not download:
        raise DataError(
            f'tff:{name}: {path} not found; pass --data_dir=<the directory that holds {entry["file"]}> or --download'
        )
    import tensorflow_federated as tff

    datasets = tff.simulation.datasets
    loader = {
        'shakespeare': lambda: datasets.shakespeare.load_data(cache_dir=data_dir),
        'emnist': lambda: datasets.emnist.load_data(only_digits=False, cache_dir=data_dir),
        'emnist_digits': lambda: datasets.emnist.load_data(only_digits=True, cache_dir=data_dir),
        'cifar100': lambda: datasets.cifar100.load_data(cache_dir=data_dir),
    }[name]
    try:
        train_data, test_data = loader()
    except Exception as e:  # urllib, sqlite3 and TFF raise many types
        what = 'download failed' if download else 'cannot read it'
        raise DataError(f'tff:{name}: {what} ({" ".join(str(e).split())[:200]})') from None
    own_test = entry.get('own_test', True)
    counts = _split_counts(path, entry['splits'])
    ids, excluded = _eligible({c: counts.get(c, {}) for c in train_data.client_ids}, entry['splits'], own_test)
    if not ids:
        raise DataError(f'tff:{name}: no client has enough examples for train, validation and test splits')
    task = entry.get('task', 'classification')
    if task == 'next_char':
        ids, excluded = _text_eligible(path, entry['splits'], f'tff:{name}', train_data.client_ids)
        shape, label_shape, classes, encoding = _TEXT_TASK
    else:
        spec = train_data.element_type_structure
        key = 'pixels' if 'pixels' in spec else 'image'
        shape = tuple(spec[key].shape) + ((1,) if len(spec[key].shape) == 2 else ())
        label_shape, classes = (), entry['num_classes']
        encoding = client_data.FLOAT32 if key == 'pixels' else client_data.UINT8_OVER_255

    def read_client(client_id: str):
        out = {}
        for split, data in (('train', train_data), ('test', test_data))[: 2 if own_test else 1]:
            elements = list(data.create_tf_dataset_for_client(client_id).as_numpy_iterator())
            out[split] = _tff_arrays(task, elements, shape)
        return out

    return NaturalSource(f'tff:{name}', ids, excluded, task, shape, label_shape, classes, encoding, read_client)


# ----------------------------------------------------------------------------
# clients:DIR (your own per-client files).


def _read_clients_manifest(root: str) -> dict:
    """`DIR/manifest.json`, checked.

    Schema (docs/data.md): `{"format": "npz", "task": "classification" |
    "next_char", "num_classes": int (classification), "clients": [ids]
    (optional: every `*.npz` of DIR, sorted)}`. Each `<id>.npz` holds
    `x_train`, `y_train`, `x_test`, `y_test` and optionally `x_val`, `y_val`
    (classification: features `[n, ...]`, integer labels `[n]`; uint8
    features are scaled by 1/255), or `snippets_train`, `snippets_test` and
    optionally `snippets_val` (next_char: arrays of str).
    """
    path = os.path.join(root, CLIENTS_MANIFEST)
    if not os.path.isdir(root):
        raise DataError(f'clients:{root}: directory not found')
    try:
        with open(path, encoding='utf-8') as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST} not found (docs/data.md, "clients:DIR")') from None
    except (OSError, ValueError) as e:
        raise DataError(f'clients:{root}: cannot read {CLIENTS_MANIFEST}: {" ".join(str(e).split())}') from None
    if not isinstance(manifest, dict):
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST} must hold a JSON object')
    unknown = sorted(set(manifest) - {'format', 'task', 'num_classes', 'clients', 'description'})
    if unknown:
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: unknown key {unknown[0]!r}')
    if manifest.get('format', 'npz') != 'npz':
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: format must be "npz", got {manifest["format"]!r}')
    task = manifest.get('task', 'classification')
    if task not in TASKS:
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: task must be one of {", ".join(TASKS)}, got {task!r}')
    if task == 'classification':
        classes = manifest.get('num_classes')
        if not isinstance(classes, int) or isinstance(classes, bool) or classes < 2:
            raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: num_classes must be an integer >= 2')
    clients = manifest.get('clients')
    if clients is None:
        clients = sorted(n[:-4] for n in os.listdir(root) if n.endswith('.npz'))
    if not isinstance(clients, list) or not all(isinstance(c, str) and c for c in clients):
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: clients must be a list of non-empty strings')
    if not clients:
        raise DataError(f'clients:{root}: no client files (<id>.npz)')
    if len(set(clients)) != len(clients):
        raise DataError(f'clients:{root}: {CLIENTS_MANIFEST}: a client id repeats')
    for client in clients:
        if not os.path.isfile(os.path.join(root, f'{client}.npz')):
            raise DataError(f'clients:{root}: client file {client}.npz not found')
    return dict(task=task, num_classes=manifest.get('num_classes'), clients=sorted(clients))


def _npz_client(root: str, client: str, task: str, num_classes: int | None):
    where = f'clients:{root}, client {client!r}'
    path = os.path.join(root, f'{client}.npz')
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as e:  # zipfile and numpy raise many types
        raise DataError(f'{where}: cannot read {client}.npz ({" ".join(str(e).split())})') from None
    with archive:
        files = set(archive.files)
        prefix = ('snippets',) if task == 'next_char' else ('x', 'y')
        out = {}
        for split in ('train', 'val', 'test'):
            keys = [f'{p}_{split}' for p in prefix]
            present = [k for k in keys if k in files]
            if split == 'val' and not present:
                continue
            if len(present) != len(keys):
                missing = sorted(set(keys) - set(present))
                raise DataError(f'{where}: {client}.npz lacks {", ".join(missing)}')
            if task == 'next_char':
                snippets = archive[keys[0]]
                if snippets.dtype.kind not in 'US' or snippets.ndim != 1:
                    raise DataError(f'{where}: {keys[0]} must be a 1-D array of strings')
                out[split] = text.snippet_examples(snippets.tolist())
                continue
            x = sources.as_features(archive[keys[0]], f'{where}: x_{split}')
            y = archive[keys[1]]
            if not np.issubdtype(y.dtype, np.integer) or y.shape != (len(x),):
                raise DataError(f'{where}: y_{split} must be {len(x)} integer labels, got {y.dtype} {y.shape}')
            if len(y) and (y.min() < 0 or y.max() >= num_classes):
                raise DataError(f'{where}: label {int(y.max() if y.max() >= num_classes else y.min())} out of range')
            out[split] = (x, y.astype(np.int32))
    return out


def load_clients_dir(root: str) -> NaturalSource:
    """A `NaturalSource` over `DIR/manifest.json` and one `<client>.npz` per client.

    Every client listed must be usable: at least one test example, and two
    training examples unless it brings its own validation split; shapes are
    checked client by client against the first one as clients are read.

    Args:
      root: the directory.

    Returns:
      The source.

    Raises:
      DataError: a missing or malformed manifest or client file.
    """
    manifest = _read_clients_manifest(root)
    task, num_classes, clients = manifest['task'], manifest['num_classes'], manifest['clients']
    first = _npz_client(root, clients[0], task, num_classes)
    x0 = first['train'][0]
    if task == 'next_char':
        shape, label_shape, classes, encoding = _TEXT_TASK
    else:
        shape, label_shape, classes = x0.shape[1:], (), num_classes
        encoding = client_data.FLOAT32

    def read_client(client: str):
        arrays = first if client == clients[0] else _npz_client(root, client, task, num_classes)
        where = f'clients:{root}, client {client!r}'
        for split, (x, _) in arrays.items():
            if tuple(x.shape[1:]) != tuple(shape):
                raise DataError(f'{where}: {split} features of shape {tuple(x.shape[1:])}, expected {tuple(shape)}')
        if len(arrays['test'][1]) == 0:
            raise DataError(f'{where}: no test examples')
        if 'val' not in arrays and len(arrays['train'][1]) < 2:
            raise DataError(f'{where}: fewer than two training examples and no validation split')
        if 'val' in arrays and (len(arrays['val'][1]) == 0 or len(arrays['train'][1]) == 0):
            raise DataError(f'{where}: an empty training or validation split')
        return arrays

    return NaturalSource(
        name=f'clients:{root}',
        client_ids=tuple(clients),
        excluded=0,
        task=task,
        feature_shape=tuple(shape),
        label_shape=tuple(label_shape),
        num_classes=int(classes),
        encoding=encoding,
        read_client=read_client,
    )


# ----------------------------------------------------------------------------


def load_natural(dataset: str, *, data_dir: str | None = None, download: bool = False) -> NaturalSource:
    """The natural source a `--dataset` spec names.

    Args:
      dataset: `tff:NAME`, `sqlite:PATH[#TRAIN,TEST]` or `clients:DIR`.
      data_dir: TFF's cache directory (`tff:` only).
      download: let TFF download (`tff:` only).

    Returns:
      The source.

    Raises:
      DataError: a spec of another kind, or a source that cannot be read.
    """
    kind, _, arg = dataset.partition(':')
    if kind == 'tff':
        return load_tff(arg, data_dir=data_dir, download=download)
    if kind == 'sqlite':
        path, splits = parse_sqlite_spec(arg)
        return load_sqlite(path, splits)
    if kind == 'clients':
        return load_clients_dir(arg)
    raise DataError(f'{dataset!r} is not a naturally federated source ({", ".join(k + ":" for k in NATURAL_KINDS)})')


def validation_split(x: np.ndarray, y: np.ndarray, fraction: float, seed) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A client's training examples split into train and validation.

    The validation split takes `round(fraction * n)` of the n examples, at
    least one and at most n - 1, drawn by a seeded permutation; both keep
    their original order.

    Args:
      x: the client's training features.
      y: its labels.
      fraction: the share that goes to validation, in (0, 1).
      seed: seed of the permutation (e.g. `[run seed, client index]`).

    Returns:
      `{'train': (x, y), 'val': (x, y)}`.

    Raises:
      ValueError: fewer than two examples.
    """
    n = len(y)
    if n < 2:
        raise ValueError(f'{n} training example(s): at least two are needed to set one aside for validation')
    num_val = min(max(int(round(fraction * n)), 1), n - 1)
    chosen = np.zeros(n, bool)
    chosen[np.random.default_rng(seed).permutation(n)[:num_val]] = True
    return {'train': (x[~chosen], y[~chosen]), 'val': (x[chosen], y[chosen])}
