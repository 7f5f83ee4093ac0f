"""Per-client splits on disk, read by client id inside the TFF worker.

A partition is written once: every client gets a directory holding one raw
feature file and one raw int32 label file per split. The client
computation receives only the client id (a `tf.string`) and reads its own
arrays with `tf.io.read_file` + `tf.io.decode_raw` inside the worker, so no
dataset is shipped into a round and raw data never leave the client
computation. (Measured on the project's machines: faster than passing
datasets into rounds, and worker memory stays flat; see docs/architecture.md.)

Layout of `root`:

    manifest.json                 ClientDataSpec as JSON
    <client_id>/<split>_x.bin     features, C order, shape [n, *feature_shape]
    <client_id>/<split>_y.i32     int32 labels, shape [n, *label_shape]

Features are stored as float32, or, when every value is exactly k/255 for an
integer k (images scaled from 8 bits, e.g. MNIST), losslessly as uint8 codes:
a quarter of the bytes to read each round. Training code does not see the
difference: a `ClientSplit` decodes only the examples it gathers, to the same
float32 values (`code / 255` rounds exactly as the source's scaling did).
Token sequences (text) are stored as int32 ids and reach the model as int32.

Labels are one class per example (`label_shape` = ()), or one per position
of a sequence (next-character prediction: `label_shape` = (80,)). A label of
`IGNORED_LABEL` (-1) marks a position that is neither trained on nor scored
(padding, end of sequence): `count_labels` counts the others, and losses and
accuracies are means over them (`tff_pfl.computations.local_training`).

Clients are numbered `client_00000`, ... in partition order; a naturally
federated source keeps its own ids beside them (`source_ids`). Partitions of
a pooled dataset are written at once (`write_client_data`); natural sources
stream client by client through a `ClientDataWriter`, so a large dataset is
never held in memory whole.
"""

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf

SPLITS = ('train', 'val', 'test')
MANIFEST = 'manifest.json'
FLOAT32 = 'float32'
UINT8_OVER_255 = 'uint8/255'
INT32 = 'int32'
ENCODINGS = (FLOAT32, UINT8_OVER_255, INT32)
IGNORED_LABEL = -1
_STORED_DTYPES = {FLOAT32: np.float32, UINT8_OVER_255: np.uint8, INT32: np.int32}


@dataclasses.dataclass(frozen=True)
class ClientDataSpec:
    """What is on disk: where, which clients, shapes and per-split sizes.

    Attributes:
      root: directory that holds the manifest and one directory per client.
      client_ids: ids in partition order.
      feature_shape: shape of one example's features.
      num_classes: number of label classes.
      split_sizes: split name -> number of examples of each client, in
        `client_ids` order.
      feature_encoding: `FLOAT32`, `UINT8_OVER_255` or `INT32` (see module
        docstring).
      public_size: number of public (shared, unlabeled) examples, stored in
        `public/x.bin`; 0 if none.
      label_shape: shape of one example's labels: () for a class, (T,) for
        one label per position of a sequence.
      source_ids: a naturally federated source's own id of each client, in
        `client_ids` order; None for a partition made by the project.
    """

    root: str
    client_ids: tuple[str, ...]
    feature_shape: tuple[int, ...]
    num_classes: int
    split_sizes: Mapping[str, tuple[int, ...]]
    feature_encoding: str = FLOAT32
    public_size: int = 0
    label_shape: tuple[int, ...] = ()
    source_ids: tuple[str, ...] | None = None

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return len(self.client_ids)

    def sizes(self, split: str) -> dict[str, int]:
        """Returns client id -> number of examples in `split`.

        Args:
          split: one of `SPLITS`.

        Returns:
          A dict from client id to the client's number of examples in `split`.
        """
        return dict(zip(self.client_ids, self.split_sizes[split]))


def client_id_for(index: int) -> str:
    """The id of the client at position `index` of a partition.

    Args:
      index: the client's position (>= 0).

    Returns:
      The id, e.g. `client_00007`.
    """
    return f'client_{index:05d}'


def client_index(client_id: tf.Tensor) -> tf.Tensor:
    """`client_00007` -> 7 as int32 (TF code; the inverse of `client_id_for`).

    Args:
      client_id: a scalar `tf.string` id made by `client_id_for`.

    Returns:
      The client's position, an int32 scalar.
    """
    return tf.strings.to_number(tf.strings.split(client_id, '_')[-1], tf.int32)


def _encoding_for(x: np.ndarray) -> str:
    """UINT8_OVER_255 when every value is exactly code/255, else FLOAT32."""
    if x.size == 0 or x.min() < 0.0 or x.max() > 1.0:
        return FLOAT32
    codes = np.round(x * 255.0).astype(np.uint8)
    decoded = codes.astype(np.float32) / np.float32(255.0)
    return UINT8_OVER_255 if np.array_equal(decoded, x) else FLOAT32


def write_client_data(
    root: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    client_splits: Sequence[Mapping[str, np.ndarray]],
    public_indices: np.ndarray | None = None,
) -> ClientDataSpec:
    """Writes every client's splits under `root`, atomically.

    Args:
      root: target directory; must not exist yet.
      x: pooled features, float32 [N, *feature_shape].
      y: pooled labels, int [N].
      num_classes: number of classes.
      client_splits: for each client, split name -> indices into `x`/`y`;
        every split of `SPLITS` must be present.
      public_indices: optional indices of the public dataset every client may
        read (features only: it is unlabeled for the algorithms).

    Returns:
      The `ClientDataSpec` of what was written.

    Raises:
      FileExistsError: if `root` already exists.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int32)
    encoding = _encoding_for(x)
    stored = np.round(x * 255.0).astype(np.uint8) if encoding == UINT8_OVER_255 else x
    with ClientDataWriter(root, feature_shape=x.shape[1:], encoding=encoding, label_shape=y.shape[1:]) as writer:
        for splits in client_splits:
            arrays = {}
            for split in SPLITS:
                indices = np.asarray(splits[split], dtype=np.int64)
                arrays[split] = (stored[indices], y[indices])
            writer.add_client(arrays, stored=True)
        public = None if public_indices is None else stored[np.asarray(public_indices, np.int64)]
        return writer.finish(num_classes, public=public, stored=True)


class ClientDataWriter:
    """Writes a partition client by client; the directory appears only when complete.

    Use as a context manager: `add_client` once per client, in order, then
    `finish`. Files go to a staging directory beside `root`, renamed to
    `root` by `finish`; leaving the block without `finish` (an error)
    removes them. Only one client's arrays are in memory at a time.
    """

    def __init__(
        self,
        root: str,
        *,
        feature_shape: Sequence[int],
        encoding: str = FLOAT32,
        label_shape: Sequence[int] = (),
    ):
        """Creates the staging directory.

        Args:
          root: target directory; must not exist yet.
          feature_shape: shape of one example's features.
          encoding: how features are stored (`ENCODINGS`); `add_client`
            takes them decoded (float32 in [0, 1] for `UINT8_OVER_255`) unless
            told they are stored already.
          label_shape: shape of one example's labels (() for a class).

        Raises:
          FileExistsError: if `root` already exists.
          ValueError: an unknown encoding.
        """
        if encoding not in ENCODINGS:
            raise ValueError(f'feature encoding must be one of {ENCODINGS}, got {encoding!r}')
        if os.path.exists(root):
            raise FileExistsError(f'client data directory already exists: {root}')
        self._root = root
        self._feature_shape = tuple(int(d) for d in feature_shape)
        self._label_shape = tuple(int(d) for d in label_shape)
        self._encoding = encoding
        self._client_ids, self._source_ids = [], []
        self._split_sizes = {split: [] for split in SPLITS}
        parent = os.path.dirname(os.path.abspath(root))
        os.makedirs(parent, exist_ok=True)
        self._staging = tempfile.mkdtemp(prefix='.client_data.', dir=parent)

    def __enter__(self) -> 'ClientDataWriter':
        return self

    def __exit__(self, *exc) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _stored(self, x: np.ndarray, stored: bool, what: str) -> np.ndarray:
        x = np.asarray(x)
        if tuple(x.shape[1:]) != self._feature_shape:
            raise ValueError(f'{what}: features of shape {tuple(x.shape[1:])}, expected {self._feature_shape}')
        if self._encoding == UINT8_OVER_255 and not stored:
            x = np.round(np.asarray(x, np.float32) * 255.0).astype(np.uint8)
        return np.ascontiguousarray(x, dtype=_STORED_DTYPES[self._encoding])

    def add_client(
        self, splits: Mapping[str, tuple[np.ndarray, np.ndarray]], *, source_id: str | None = None, stored: bool = False
    ) -> str:
        """Writes the next client's splits.

        Args:
          splits: split name -> `(x, y)` for every split of `SPLITS`; `x` of
            shape `[n, *feature_shape]`, `y` int `[n, *label_shape]`.
          source_id: the client's own id in a naturally federated source.
          stored: `x` is in stored form already (uint8 codes).

        Returns:
          The client's id in the partition (`client_id_for` its position).

        Raises:
          ValueError: a missing split, or arrays of the wrong shape.
        """
        client_id = client_id_for(len(self._client_ids))
        client_dir = os.path.join(self._staging, client_id)
        os.mkdir(client_dir)
        for split in SPLITS:
            if split not in splits:
                raise ValueError(f'{client_id}: split {split!r} is missing')
            x, y = splits[split]
            x = self._stored(x, stored, f'{client_id} {split}')
            y = np.ascontiguousarray(y, dtype=np.int32)
            if y.shape != (len(x),) + self._label_shape:
                raise ValueError(
                    f'{client_id} {split}: labels of shape {y.shape}, expected {(len(x),) + self._label_shape}'
                )
            x.tofile(os.path.join(client_dir, f'{split}_x.bin'))
            y.tofile(os.path.join(client_dir, f'{split}_y.i32'))
            self._split_sizes[split].append(int(len(x)))
        self._client_ids.append(client_id)
        self._source_ids.append(source_id)
        return client_id

    def finish(self, num_classes: int, *, public: np.ndarray | None = None, stored: bool = False) -> ClientDataSpec:
        """Writes the manifest (and the public examples) and moves the partition to `root`.

        Args:
          num_classes: number of label classes.
          public: optional features of the public dataset every client may
            read (unlabeled for the algorithms).
          stored: `public` is in stored form already.

        Returns:
          The `ClientDataSpec` of what was written.
        """
        public_size = 0
        if public is not None:
            os.mkdir(os.path.join(self._staging, 'public'))
            self._stored(public, stored, 'public').tofile(os.path.join(self._staging, 'public', 'x.bin'))
            public_size = int(len(public))
        natural = any(source_id is not None for source_id in self._source_ids)
        spec = ClientDataSpec(
            root=os.path.abspath(self._root),
            client_ids=tuple(self._client_ids),
            feature_shape=self._feature_shape,
            num_classes=int(num_classes),
            split_sizes={k: tuple(v) for k, v in self._split_sizes.items()},
            feature_encoding=self._encoding,
            public_size=public_size,
            label_shape=self._label_shape,
            source_ids=tuple(str(s) for s in self._source_ids) if natural else None,
        )
        manifest = {
            'client_ids': list(spec.client_ids),
            'feature_shape': list(spec.feature_shape),
            'num_classes': spec.num_classes,
            'split_sizes': {k: list(v) for k, v in spec.split_sizes.items()},
            'feature_encoding': spec.feature_encoding,
            'public_size': spec.public_size,
        }
        if spec.label_shape:
            manifest['label_shape'] = list(spec.label_shape)
        if spec.source_ids is not None:
            manifest['source_ids'] = list(spec.source_ids)
        with open(os.path.join(self._staging, MANIFEST), 'w') as f:
            json.dump(manifest, f, indent=1)
        os.rename(self._staging, self._root)
        self._staging = None
        return spec


def load_client_data_manifest(root: str) -> dict:
    """The manifest written by `write_client_data` or a `ClientDataWriter`, as a dict.

    Args:
      root: the client data directory.

    Returns:
      The parsed `manifest.json`.
    """
    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f)


def load_client_data_spec(root: str) -> ClientDataSpec:
    """Reads the manifest written by `write_client_data`.

    Args:
      root: the directory given to `write_client_data`.

    Returns:
      The `ClientDataSpec`.
    """
    manifest = load_client_data_manifest(root)
    return ClientDataSpec(
        root=os.path.abspath(root),
        client_ids=tuple(manifest['client_ids']),
        feature_shape=tuple(manifest['feature_shape']),
        num_classes=int(manifest['num_classes']),
        split_sizes={k: tuple(v) for k, v in manifest['split_sizes'].items()},
        feature_encoding=manifest.get('feature_encoding', FLOAT32),
        public_size=int(manifest.get('public_size', 0)),
        label_shape=tuple(manifest.get('label_shape', ())),
        source_ids=tuple(manifest['source_ids']) if 'source_ids' in manifest else None,
    )


def read_split_numpy(spec: ClientDataSpec, client_id: str, split: str):
    """Reads one client's split in plain numpy (for reports and tests).

    Args:
      spec: the partition on disk.
      client_id: the client's id.
      split: one of `SPLITS`.

    Returns:
      A tuple `(x, y)`: features (decoded: float32, or int32 token ids) and
      int32 labels `[n, *label_shape]`.
    """
    client_dir = os.path.join(spec.root, client_id)
    x = np.fromfile(os.path.join(client_dir, f'{split}_x.bin'), dtype=_STORED_DTYPES[spec.feature_encoding])
    if spec.feature_encoding == UINT8_OVER_255:
        x = x.astype(np.float32) / np.float32(255.0)
    y = np.fromfile(os.path.join(client_dir, f'{split}_y.i32'), dtype=np.int32)
    return x.reshape((-1,) + tuple(spec.feature_shape)), y.reshape((-1,) + tuple(spec.label_shape))


def count_labels(y: tf.Tensor) -> tf.Tensor:
    """The number of labels that count (not `IGNORED_LABEL`), float32 (TF code).

    For one class per example this is the number of examples.

    Args:
      y: int32 labels `[n, *label_shape]`.

    Returns:
      A float32 scalar.
    """
    return tf.reduce_sum(tf.cast(tf.not_equal(y, IGNORED_LABEL), tf.float32))


@dataclasses.dataclass(frozen=True)
class ClientSplit:
    """One client's split as whole tensors, features still in stored form.

    Attributes:
      features: [n, *feature_shape], float32, uint8 codes or int32 token ids.
      labels: int32 [n, *label_shape].
      encoding: how `features` are stored.
    """

    features: tf.Tensor
    labels: tf.Tensor
    encoding: str = FLOAT32

    @property
    def num_examples(self) -> tf.Tensor:
        """The number of examples, an int32 scalar tensor."""
        return tf.shape(self.labels)[0]

    def decode(self, features: tf.Tensor) -> tf.Tensor:
        """Stored features (any subset) -> float32 model inputs.

        Args:
          features: features in this split's stored form.

        Returns:
          The features as the model takes them: float32 (uint8 codes divided
          by 255), or int32 token ids as stored.
        """
        if self.encoding == UINT8_OVER_255:
            return tf.cast(features, tf.float32) / 255.0
        return features

    def gather(self, indices: tf.Tensor):
        """`(x, y)` of the examples at `indices`, x decoded to float32.

        Args:
          indices: int tensor `[k]` of example positions.

        Returns:
          `(x, y)`: float32 features `[k, *feature_shape]` and int32 labels `[k]`.
        """
        return self.decode(tf.gather(self.features, indices)), tf.gather(self.labels, indices)

    def slice(self, start, stop):
        """`(x, y)` of examples `start:stop`, x decoded to float32.

        Args:
          start: the first example (int or scalar tensor).
          stop: one past the last example (int or scalar tensor).

        Returns:
          `(x, y)`: float32 features and int32 labels of those examples.
        """
        return self.decode(self.features[start:stop]), self.labels[start:stop]

    def with_tensors(self, features: tf.Tensor, labels: tf.Tensor) -> 'ClientSplit':
        """The same encoding over other tensors (e.g. inside a tf.function).

        Args:
          features: features `[n, *feature_shape]` in this split's stored form.
          labels: int32 labels `[n]`.

        Returns:
          A new `ClientSplit` of `features` and `labels` with this encoding.
        """
        return ClientSplit(features, labels, self.encoding)


def read_split(spec: ClientDataSpec, client_id: tf.Tensor, split: str) -> ClientSplit:
    """Reads one client's split as whole tensors; TF graph code.

    Meant to run inside a client's `tff.tensorflow.computation`: the client id
    is the only input, and the arrays are read from the client's own files.

    Args:
      spec: the partition on disk (its root is baked into the graph).
      client_id: scalar `tf.string`.
      split: one of `SPLITS`.

    Returns:
      A `ClientSplit`.
    """
    prefix = tf.strings.join([spec.root, client_id, split], separator='/')
    stored_dtype = tf.as_dtype(_STORED_DTYPES[spec.feature_encoding])
    x = tf.io.decode_raw(tf.io.read_file(prefix + '_x.bin'), stored_dtype)
    y = tf.io.decode_raw(tf.io.read_file(prefix + '_y.i32'), tf.int32)
    x = tf.reshape(x, (-1,) + tuple(spec.feature_shape))
    if spec.label_shape:
        y = tf.reshape(y, (-1,) + tuple(spec.label_shape))
    return ClientSplit(x, y, spec.feature_encoding)


def read_public(spec: ClientDataSpec) -> ClientSplit:
    """The public dataset as a `ClientSplit` (labels are zeros); TF graph code.

    Args:
      spec: the partition on disk, with public data.

    Returns:
      A `ClientSplit` of the `spec.public_size` public examples.

    Raises:
      ValueError: if the partition has no public data.
    """
    if not spec.public_size:
        raise ValueError('this partition has no public data; prepare it with public examples')
    stored_dtype = tf.as_dtype(_STORED_DTYPES[spec.feature_encoding])
    x = tf.io.decode_raw(tf.io.read_file(spec.root + '/public/x.bin'), stored_dtype)
    x = tf.reshape(x, (-1,) + tuple(spec.feature_shape))
    return ClientSplit(x, tf.zeros([spec.public_size], tf.int32), spec.feature_encoding)


def read_public_batch(spec: ClientDataSpec, size: int, seed: int, round_num: tf.Tensor) -> tf.Tensor:
    """This round's public batch, decoded to float32; TF graph code.

    `size` examples drawn without replacement from the public data by a
    stateless permutation seeded with `(seed, round_num)`: every client (and
    the server) that asks in the same round gets the same batch, and the
    batch changes every round.

    Args:
      spec: the partition on disk, with public data.
      size: the number of examples to draw; at most `spec.public_size` are
        returned.
      seed: the run seed.
      round_num: the round number, an integer scalar tensor.

    Returns:
      float32 `[size, *feature_shape]`.
    """
    public = read_public(spec)
    noise = tf.random.stateless_uniform([spec.public_size], seed=tf.stack([seed, round_num]))
    indices = tf.argsort(noise)[:size]
    return public.decode(tf.gather(public.features, indices))
