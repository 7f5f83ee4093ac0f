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
    <client_id>/<split>_y.i32     labels, shape [n]

Features are stored as float32, or, when every value is exactly k/255 for an
integer k (images scaled from 8 bits, e.g. MNIST), losslessly as uint8 codes:
a quarter of the bytes to read each round. Training code does not see the
difference: a `ClientSplit` decodes only the examples it gathers, to the same
float32 values (`code / 255` rounds exactly as the source's scaling did).
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
      feature_encoding: `FLOAT32` or `UINT8_OVER_255` (see module docstring).
      public_size: number of public (shared, unlabeled) examples, stored in
        `public/x.bin`; 0 if none.
    """

    root: str
    client_ids: tuple[str, ...]
    feature_shape: tuple[int, ...]
    num_classes: int
    split_sizes: Mapping[str, tuple[int, ...]]
    feature_encoding: str = FLOAT32
    public_size: int = 0

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
    if os.path.exists(root):
        raise FileExistsError(f'client data directory already exists: {root}')
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix='.client_data.', dir=parent)
    try:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.asarray(y, dtype=np.int32)
        encoding = _encoding_for(x)
        stored = np.round(x * 255.0).astype(np.uint8) if encoding == UINT8_OVER_255 else x
        client_ids = tuple(client_id_for(i) for i in range(len(client_splits)))
        split_sizes = {split: [] for split in SPLITS}
        for client_id, splits in zip(client_ids, client_splits):
            client_dir = os.path.join(staging, client_id)
            os.mkdir(client_dir)
            for split in SPLITS:
                indices = np.asarray(splits[split], dtype=np.int64)
                stored[indices].tofile(os.path.join(client_dir, f'{split}_x.bin'))
                y[indices].tofile(os.path.join(client_dir, f'{split}_y.i32'))
                split_sizes[split].append(int(indices.size))
        public_size = 0
        if public_indices is not None:
            os.mkdir(os.path.join(staging, 'public'))
            stored[np.asarray(public_indices, np.int64)].tofile(os.path.join(staging, 'public', 'x.bin'))
            public_size = int(len(public_indices))
        spec = ClientDataSpec(
            root=os.path.abspath(root),
            client_ids=client_ids,
            feature_shape=tuple(int(d) for d in x.shape[1:]),
            num_classes=int(num_classes),
            split_sizes={k: tuple(v) for k, v in split_sizes.items()},
            feature_encoding=encoding,
            public_size=public_size,
        )
        with open(os.path.join(staging, MANIFEST), 'w') as f:
            json.dump(
                {
                    'client_ids': list(spec.client_ids),
                    'feature_shape': list(spec.feature_shape),
                    'num_classes': spec.num_classes,
                    'split_sizes': {k: list(v) for k, v in spec.split_sizes.items()},
                    'feature_encoding': spec.feature_encoding,
                    'public_size': spec.public_size,
                },
                f,
                indent=1,
            )
        os.rename(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return spec


def load_client_data_spec(root: str) -> ClientDataSpec:
    """Reads the manifest written by `write_client_data`.

    Args:
      root: the directory given to `write_client_data`.

    Returns:
      The `ClientDataSpec`.
    """
    with open(os.path.join(root, MANIFEST)) as f:
        manifest = json.load(f)
    return ClientDataSpec(
        root=os.path.abspath(root),
        client_ids=tuple(manifest['client_ids']),
        feature_shape=tuple(manifest['feature_shape']),
        num_classes=int(manifest['num_classes']),
        split_sizes={k: tuple(v) for k, v in manifest['split_sizes'].items()},
        feature_encoding=manifest.get('feature_encoding', FLOAT32),
        public_size=int(manifest.get('public_size', 0)),
    )


def read_split_numpy(spec: ClientDataSpec, client_id: str, split: str):
    """Reads one client's split in plain numpy (for reports and tests).

    Args:
      spec: the partition on disk.
      client_id: the client's id.
      split: one of `SPLITS`.

    Returns:
      A tuple `(x, y)`: float32 features (decoded) and int32 labels.
    """
    client_dir = os.path.join(spec.root, client_id)
    stored_dtype = np.uint8 if spec.feature_encoding == UINT8_OVER_255 else np.float32
    x = np.fromfile(os.path.join(client_dir, f'{split}_x.bin'), dtype=stored_dtype)
    if spec.feature_encoding == UINT8_OVER_255:
        x = x.astype(np.float32) / np.float32(255.0)
    y = np.fromfile(os.path.join(client_dir, f'{split}_y.i32'), dtype=np.int32)
    return x.reshape((-1,) + spec.feature_shape), y


@dataclasses.dataclass(frozen=True)
class ClientSplit:
    """One client's split as whole tensors, features still in stored form.

    Attributes:
      features: [n, *feature_shape], float32 or uint8 codes.
      labels: int32 [n].
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
          The features as float32 (uint8 codes divided by 255).
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
    stored_dtype = tf.uint8 if spec.feature_encoding == UINT8_OVER_255 else tf.float32
    x = tf.io.decode_raw(tf.io.read_file(prefix + '_x.bin'), stored_dtype)
    y = tf.io.decode_raw(tf.io.read_file(prefix + '_y.i32'), tf.int32)
    x = tf.reshape(x, (-1,) + tuple(spec.feature_shape))
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
    stored_dtype = tf.uint8 if spec.feature_encoding == UINT8_OVER_255 else tf.float32
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
