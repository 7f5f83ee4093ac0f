"""Per-client splits on disk, read by client id inside the TFF worker.

A partition is written once, in one streaming pass: every split's features
and labels go to one shard file each, clients one after another in
partition order, and a small index says where each client's examples
start. The client computation receives only the client id (a `tf.string`)
and reads its own examples inside the worker: the index and the shards are
memory-mapped by a graph op (`ImmutableConst`) and sliced, so only the
pages of this client's bytes are read. No dataset is shipped into a round
and raw data never leave the client computation. (Measured on the
project's machines: faster than passing datasets into rounds, and worker
memory stays flat; see docs/architecture.md and docs/data.md.)

Layout of `root` (`SHARDED`, what this version writes):

    manifest.json           ClientDataSpec as JSON, with "layout": "sharded"
    index.i64               int64 [len(SPLITS), num_clients + 1]: row s holds
                            the cumulative example counts of split s, so
                            client k's examples are rows
                            index[s, k] : index[s, k + 1] of the shards
    <split>_x.bin           features of every client, C order,
                            shape [total, *feature_shape]
    <split>_y.i32           int32 labels of every client, [total, *label_shape]

A client's byte offset in a shard is `index[s, k]` times the bytes of one
example. The per-client layout of earlier versions (`PER_CLIENT`: a
manifest without "layout", and `<client_id>/<split>_x.bin`,
`<client_id>/<split>_y.i32`) is still read, so runs and exports made with
it keep working, and is written only on request (`layout=PER_CLIENT`: an
export made with it, benchmarks, tests).

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
a pooled dataset are written from the pool (`write_client_data`); natural
sources stream client by client through a `ClientDataWriter`, so a large
dataset is never held in memory whole. Either way one client's arrays are
in memory at a time besides the pool.
"""

import dataclasses
import json
import os
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
SHARDED = 'sharded'
PER_CLIENT = 'per_client'
LAYOUTS = (SHARDED, PER_CLIENT)
INDEX = 'index.i64'
STORED_DTYPES = {FLOAT32: np.float32, UINT8_OVER_255: np.uint8, INT32: np.int32}


class DataError(ValueError):
    """Raised when a data source is missing, unreadable or malformed.

    `sources.DataError` is this class: client data that cannot be read
    (a missing or truncated shard, an index that disagrees with the
    manifest) are reported like a bad source, in one line.
    """


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
      layout: `SHARDED` (shard files and an index) or `PER_CLIENT` (one
        directory per client, written by earlier versions).
      evaluation_split: the split the processes built on this spec score in
        `evaluate`: 'test', or 'val' for a run's validation curve (a second
        process built on `dataclasses.replace(spec, evaluation_split='val')`
        scores the same states on the validation splits). Not stored in
        the manifest: a view of the data, not the data.
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
    layout: str = SHARDED
    evaluation_split: str = 'test'

    def __post_init__(self):
        if self.evaluation_split not in ('test', 'val'):
            raise ValueError(f"evaluation_split must be 'test' or 'val', got {self.evaluation_split!r}")

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

    def split_total(self, split: str) -> int:
        """The number of examples of `split` over all clients (the rows of its shards).

        Args:
          split: one of `SPLITS`.

        Returns:
          The sum of the clients' sizes of `split`.
        """
        return int(sum(self.split_sizes[split]))


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


def shard_name(split: str, part: str) -> str:
    """A split's shard (or, in the per-client layout, file) name.

    Args:
      split: one of `SPLITS`.
      part: 'x' (features) or 'y' (labels).

    Returns:
      `<split>_x.bin` or `<split>_y.i32`.
    """
    return f'{split}_x.bin' if part == 'x' else f'{split}_y.i32'


def client_index_table(split_sizes: Mapping[str, Sequence[int]]) -> np.ndarray:
    """The index of a sharded partition: where each client's examples start.

    Args:
      split_sizes: split name -> every client's number of examples, in
        partition order, for every split of `SPLITS`.

    Returns:
      int64 `[len(SPLITS), num_clients + 1]`: row `s` is 0 followed by the
      cumulative sums of split `SPLITS[s]`'s sizes, so client `k`'s examples
      are rows `index[s, k]` to `index[s, k + 1]` of the split's shards.
    """
    rows = [np.concatenate([[0], np.cumsum(np.asarray(split_sizes[split], np.int64))]) for split in SPLITS]
    return np.stack(rows).astype(np.int64)


def load_client_data_manifest(root: str) -> dict:
    """The manifest written by `write_client_data` or a `ClientDataWriter`, as a dict.

    Args:
      root: the client data directory.

    Returns:
      The parsed `manifest.json`.
    """
    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f)


def _example_bytes(spec: ClientDataSpec, part: str) -> int:
    """Bytes of one example's features (`x`) or labels (`y`) as stored."""
    if part == 'x':
        itemsize = np.dtype(STORED_DTYPES[spec.feature_encoding]).itemsize
        return int(np.prod(spec.feature_shape, dtype=np.int64)) * itemsize
    return int(np.prod(spec.label_shape, dtype=np.int64)) * 4


def require_validation(spec: ClientDataSpec, who: str) -> None:
    """Refuses a partition in which some client has no validation examples.

    Args:
      spec: the partition on disk.
      who: what reads the validation split, for the message (e.g. 'persfl's
        teacher selection').

    Raises:
      ValueError: one line naming `who`, the clients without validation
        examples (the first few) and the fix.
    """
    empty = [c for c, n in zip(spec.client_ids, spec.split_sizes['val']) if n == 0]
    if empty:
        shown = ', '.join(empty[:3]) + (f' and {len(empty) - 3} more' if len(empty) > 3 else '')
        raise ValueError(
            f"{who} reads each client's validation split, and {shown} have none; "
            'give split_fractions a positive validation fraction'
        )


def check_client_data(spec: ClientDataSpec) -> None:
    """Checks that a sharded partition's index and shards are whole and agree with the manifest.

    Reads the index (a few MB for 100,000 clients) and the shards' sizes,
    not the shards.

    Args:
      spec: the partition on disk.

    Raises:
      DataError: a missing or truncated shard or index, or an index that
        disagrees with the manifest's split sizes, in one line.
    """
    if spec.layout != SHARDED:
        return
    where = f'client data {spec.root}'
    expected = client_index_table(spec.split_sizes)
    path = os.path.join(spec.root, INDEX)
    if not os.path.isfile(path):
        raise DataError(f'{where}: the index {INDEX} is missing; delete the directory to have it rewritten')
    index = np.fromfile(path, dtype='<i8')
    if index.shape != (expected.size,) or not np.array_equal(index.reshape(expected.shape), expected):
        raise DataError(
            f"{where}: the index {INDEX} disagrees with the manifest's split sizes (corrupt); "
            'delete the directory to have it rewritten'
        )
    for split in SPLITS:
        for part in ('x', 'y'):
            name = shard_name(split, part)
            path = os.path.join(spec.root, name)
            want = spec.split_total(split) * _example_bytes(spec, part)
            if not os.path.isfile(path):
                raise DataError(f'{where}: the shard {name} is missing; delete the directory to have it rewritten')
            have = os.path.getsize(path)
            if have != want:
                raise DataError(
                    f'{where}: the shard {name} has {have} bytes, the index says {want} (truncated or corrupt); '
                    'delete the directory to have it rewritten'
                )


def load_client_data_spec(root: str) -> ClientDataSpec:
    """Reads the manifest written by `write_client_data` and checks the files.

    Both layouts are read: `SHARDED`, and `PER_CLIENT` for a manifest of an
    earlier version (no "layout" key). A sharded partition's index and shard
    sizes are checked against the manifest (`check_client_data`).

    Args:
      root: the directory given to `write_client_data`.

    Returns:
      The `ClientDataSpec`.

    Raises:
      DataError: an unknown layout, or a missing or truncated shard or index.
    """
    manifest = load_client_data_manifest(root)
    layout = manifest.get('layout', PER_CLIENT)
    if layout not in LAYOUTS:
        raise DataError(f'client data {root}: unknown layout {layout!r} (written by a newer version?)')
    spec = ClientDataSpec(
        root=os.path.abspath(root),
        client_ids=tuple(manifest['client_ids']),
        feature_shape=tuple(manifest['feature_shape']),
        num_classes=int(manifest['num_classes']),
        split_sizes={k: tuple(v) for k, v in manifest['split_sizes'].items()},
        feature_encoding=manifest.get('feature_encoding', FLOAT32),
        public_size=int(manifest.get('public_size', 0)),
        label_shape=tuple(manifest.get('label_shape', ())),
        source_ids=tuple(manifest['source_ids']) if 'source_ids' in manifest else None,
        layout=layout,
    )
    check_client_data(spec)
    return spec


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
    stored_dtype = STORED_DTYPES[spec.feature_encoding]
    if spec.layout == SHARDED:
        s, k = SPLITS.index(split), int(client_id.rsplit('_', 1)[-1])
        if not 0 <= k < spec.num_clients or spec.client_ids[k] != client_id:
            raise KeyError(f'no client {client_id!r} in {spec.root}')
        index = np.memmap(os.path.join(spec.root, INDEX), dtype='<i8', mode='r').reshape(len(SPLITS), -1)
        start, stop = int(index[s, k]), int(index[s, k + 1])
        del index

        def rows(part, dtype):
            width = _example_bytes(spec, part) // np.dtype(dtype).itemsize
            with open(os.path.join(spec.root, shard_name(split, part)), 'rb') as f:
                f.seek(start * width * np.dtype(dtype).itemsize)
                return np.fromfile(f, dtype=dtype, count=(stop - start) * width)

        x, y = rows('x', stored_dtype), rows('y', np.int32)
    else:
        client_dir = os.path.join(spec.root, client_id)
        x = np.fromfile(os.path.join(client_dir, shard_name(split, 'x')), dtype=stored_dtype)
        y = np.fromfile(os.path.join(client_dir, shard_name(split, 'y')), dtype=np.int32)
    if spec.feature_encoding == UINT8_OVER_255:
        x = x.astype(np.float32) / np.float32(255.0)
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


def _mapped(path: str, dtype: tf.DType, shape: Sequence[int]) -> tf.Tensor:
    """A whole file as a tensor, memory-mapped (TF graph code): pages are read only when touched.

    `ImmutableConst` maps the file when the op runs (the path and shape are
    attributes of the graph); slicing the result copies, and so reads, only
    the rows asked for.
    """
    if int(np.prod(shape, dtype=np.int64)) == 0:  # nothing to map (an empty file cannot be mapped)
        return tf.zeros(shape, dtype)
    # Named after the file, so an error (a shard cut short since it was checked) names it.
    name = 'client_data_' + os.path.basename(path)
    return tf.raw_ops.ImmutableConst(dtype=dtype, shape=list(shape), memory_region_name=path, name=name)


def read_split(spec: ClientDataSpec, client_id: tf.Tensor, split: str) -> ClientSplit:
    """Reads one client's split as whole tensors; TF graph code.

    Meant to run inside a client's `tff.tensorflow.computation`: the client id
    is the only input, and the arrays are read from the partition's files.
    In the `SHARDED` layout the client's position (`client_index` of its id)
    selects its two rows of the memory-mapped index, and those bound the
    rows taken from the memory-mapped shards: only this client's bytes (and
    16 bytes of the index) are read, whatever the number of clients. In the
    `PER_CLIENT` layout of earlier versions, the client's two files are
    read whole.

    Args:
      spec: the partition on disk (its root, the number of clients and the
        split's total size are baked into the graph).
      client_id: scalar `tf.string`.
      split: one of `SPLITS`.

    Returns:
      A `ClientSplit`.
    """
    stored_dtype = tf.as_dtype(STORED_DTYPES[spec.feature_encoding])
    if spec.layout == SHARDED:
        index = _mapped(os.path.join(spec.root, INDEX), tf.int64, [len(SPLITS), spec.num_clients + 1])
        row = index[SPLITS.index(split)]
        k = client_index(client_id)
        start, stop = row[k], row[k + 1]
        total = spec.split_total(split)
        x = _mapped(os.path.join(spec.root, shard_name(split, 'x')), stored_dtype, (total,) + spec.feature_shape)
        y = _mapped(os.path.join(spec.root, shard_name(split, 'y')), tf.int32, (total,) + spec.label_shape)
        # Copies, never views of the mapping: TF lets a slice that starts aligned (the first
        # client's, at offset 0) share the mapped pages, which are read-only, and an op that
        # reuses its input's buffer for its output (`tf.maximum` of the labels in the loss)
        # then writes into them: the worker died with SIGSEGV (Per-FedAvg's adaptation step,
        # tests/test_client_data_shards.py).
        return ClientSplit(
            tf.raw_ops.DeepCopy(x=x[start:stop]), tf.raw_ops.DeepCopy(x=y[start:stop]), spec.feature_encoding
        )
    prefix = tf.strings.join([spec.root, client_id, split], separator='/')
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
    stored_dtype = tf.as_dtype(STORED_DTYPES[spec.feature_encoding])
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
