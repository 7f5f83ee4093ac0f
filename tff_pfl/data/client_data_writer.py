"""Writing the on-disk client data that `tff_pfl.data.client_data` reads inside the TFF worker.

`write_client_data` writes a partition of a pooled dataset from the pool;
a `ClientDataWriter` takes clients one at a time (naturally federated
sources, a user's `ClientData`), so a large dataset is never held in memory
whole. Both write the layout `client_data` describes (`SHARDED` by default)
and its manifest, which `client_data.load_client_data_spec` reads back.
"""

import contextlib
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl.data import client_data


def _encoding_for(x: np.ndarray) -> str:
    """client_data.UINT8_OVER_255 when every value is exactly code/255, else client_data.FLOAT32."""
    if x.size == 0 or x.min() < 0.0 or x.max() > 1.0:
        return client_data.FLOAT32
    codes = np.round(x * 255.0).astype(np.uint8)
    decoded = codes.astype(np.float32) / np.float32(255.0)
    return client_data.UINT8_OVER_255 if np.array_equal(decoded, x) else client_data.FLOAT32


def write_client_data(
    root: str,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    client_splits: Sequence[Mapping[str, np.ndarray]],
    public_indices: np.ndarray | None = None,
    *,
    layout: str = client_data.SHARDED,
) -> client_data.ClientDataSpec:
    """Writes every client's splits under `root`, atomically, client by client.

    Args:
      root: target directory; must not exist yet.
      x: pooled features, float32 [N, *feature_shape].
      y: pooled labels, int [N].
      num_classes: number of classes.
      client_splits: for each client, split name -> indices into `x`/`y`;
        every split of `client_data.SPLITS` must be present.
      public_indices: optional indices of the public dataset every client may
        read (features only: it is unlabeled for the algorithms).
      layout: `client_data.SHARDED` (the default) or `client_data.PER_CLIENT` (earlier versions').

    Returns:
      The `client_data.ClientDataSpec` of what was written.

    Raises:
      FileExistsError: if `root` already exists.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.asarray(y, dtype=np.int32)
    encoding = _encoding_for(x)
    stored = np.round(x * 255.0).astype(np.uint8) if encoding == client_data.UINT8_OVER_255 else x
    with ClientDataWriter(
        root, feature_shape=x.shape[1:], encoding=encoding, label_shape=y.shape[1:], layout=layout
    ) as writer:
        for splits in client_splits:
            arrays = {}
            for split in client_data.SPLITS:
                indices = np.asarray(splits[split], dtype=np.int64)
                arrays[split] = (stored[indices], y[indices])
            writer.add_client(arrays, stored=True)
        public = None if public_indices is None else stored[np.asarray(public_indices, np.int64)]
        return writer.finish(num_classes, public=public, stored=True)


class _ShardAppender:
    """Appends arrays to open files on one thread, in the order given.

    The caller (generating, splitting, encoding the next client) and the
    disk then work at the same time: writes block once the kernel's dirty
    page limit is reached, which would otherwise stall the caller. At most
    `depth` writes wait in the queue.
    """

    def __init__(self, depth: int = 64):
        self._queue = queue.Queue(maxsize=depth)
        self._error = None
        self._thread = threading.Thread(target=self._run, name='client-data-shards', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                f, array = item
                try:
                    f.write(array.data)
                except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                    self._error = e

    def check(self) -> None:
        """Re-raises, in the caller's thread, an error of an earlier write."""
        if self._error is not None:
            raise self._error

    def append(self, f, array: np.ndarray) -> None:
        """Queues `array`'s bytes for `f` (the array must not change afterwards)."""
        self.check()
        self._queue.put((f, array))

    def close(self) -> None:
        """Waits for the queued writes; raises the first error."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.check()


class ClientDataWriter:
    """Writes a partition client by client; the directory appears only when complete.

    Use as a context manager: `add_client` once per client, in order, then
    `finish`. Files go to a staging directory beside `root`, renamed to
    `root` by `finish` after the index and the manifest are written;
    leaving the block without `finish` (an error) removes them, and a
    crash leaves only a hidden `.client_data.*` staging directory, never
    `root`. Only one client's arrays are in memory at a time: with the
    `client_data.SHARDED` layout each client's splits are appended to the six shard
    files, which stay open until `finish`, by a background thread (at most
    64 writes queued), so the caller prepares the next client meanwhile.
    """

    def __init__(
        self,
        root: str,
        *,
        feature_shape: Sequence[int],
        encoding: str = client_data.FLOAT32,
        label_shape: Sequence[int] = (),
        layout: str = client_data.SHARDED,
    ):
        """Creates the staging directory.

        Args:
          root: target directory; must not exist yet.
          feature_shape: shape of one example's features.
          encoding: how features are stored (`client_data.ENCODINGS`); `add_client`
            takes them decoded (float32 in [0, 1] for `client_data.UINT8_OVER_255`) unless
            told they are stored already.
          label_shape: shape of one example's labels (() for a class).
          layout: `client_data.SHARDED` (the default) or `client_data.PER_CLIENT` (one directory per
            client, as earlier versions wrote).

        Raises:
          FileExistsError: if `root` already exists.
          ValueError: an unknown encoding or layout.
        """
        if encoding not in client_data.ENCODINGS:
            raise ValueError(f'feature encoding must be one of {client_data.ENCODINGS}, got {encoding!r}')
        if layout not in client_data.LAYOUTS:
            raise ValueError(f'client data layout must be one of {client_data.LAYOUTS}, got {layout!r}')
        if os.path.exists(root):
            raise FileExistsError(f'client data directory already exists: {root}')
        self._root = root
        self._feature_shape = tuple(int(d) for d in feature_shape)
        self._label_shape = tuple(int(d) for d in label_shape)
        self._encoding = encoding
        self._layout = layout
        self._client_ids, self._source_ids = [], []
        self._split_sizes = {split: [] for split in client_data.SPLITS}
        parent = os.path.dirname(os.path.abspath(root))
        os.makedirs(parent, exist_ok=True)
        self._staging = tempfile.mkdtemp(prefix='.client_data.', dir=parent)
        self._shards, self._appender = {}, None
        if layout == client_data.SHARDED:
            self._appender = _ShardAppender()
            for split in client_data.SPLITS:
                for part in ('x', 'y'):
                    self._shards[split, part] = open(
                        os.path.join(self._staging, client_data.shard_name(split, part)), 'wb'
                    )

    def __enter__(self) -> 'ClientDataWriter':
        return self

    def _close_shards(self) -> None:
        try:
            if self._appender is not None:
                appender, self._appender = self._appender, None
                appender.close()
        finally:
            for f in self._shards.values():
                f.close()
            self._shards = {}

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):  # the files are removed anyway
            self._close_shards()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _stored(self, x: np.ndarray, stored: bool, what: str) -> np.ndarray:
        x = np.asarray(x)
        if tuple(x.shape[1:]) != self._feature_shape:
            raise ValueError(f'{what}: features of shape {tuple(x.shape[1:])}, expected {self._feature_shape}')
        if self._encoding == client_data.UINT8_OVER_255 and not stored:
            x = np.round(np.asarray(x, np.float32) * 255.0).astype(np.uint8)
        return np.ascontiguousarray(x, dtype=client_data.STORED_DTYPES[self._encoding])

    def add_client(
        self, splits: Mapping[str, tuple[np.ndarray, np.ndarray]], *, source_id: str | None = None, stored: bool = False
    ) -> str:
        """Writes the next client's splits.

        Args:
          splits: split name -> `(x, y)` for every split of `client_data.SPLITS`; `x` of
            shape `[n, *feature_shape]`, `y` int `[n, *label_shape]`.
          source_id: the client's own id in a naturally federated source.
          stored: `x` is in stored form already (uint8 codes).

        Returns:
          The client's id in the partition (`client_data.client_id_for` its position).

        Raises:
          ValueError: a missing split, or arrays of the wrong shape.
        """
        client_id = client_data.client_id_for(len(self._client_ids))
        arrays = {}
        for split in client_data.SPLITS:  # every split is checked before anything is written
            if split not in splits:
                raise ValueError(f'{client_id}: split {split!r} is missing')
            x, y = splits[split]
            x = self._stored(x, stored, f'{client_id} {split}')
            y = np.ascontiguousarray(y, dtype=np.int32)
            if y.shape != (len(x),) + self._label_shape:
                raise ValueError(
                    f'{client_id} {split}: labels of shape {y.shape}, expected {(len(x),) + self._label_shape}'
                )
            arrays[split] = (x, y)
        if self._layout == client_data.SHARDED:
            for split, (x, y) in arrays.items():
                for part, array, given in (('x', x, splits[split][0]), ('y', y, splits[split][1])):
                    if np.may_share_memory(array, given):  # the caller's own array: it may change it later
                        array = array.copy()
                    self._appender.append(self._shards[split, part], array)
        else:
            client_dir = os.path.join(self._staging, client_id)
            os.mkdir(client_dir)
            for split, (x, y) in arrays.items():
                x.tofile(os.path.join(client_dir, client_data.shard_name(split, 'x')))
                y.tofile(os.path.join(client_dir, client_data.shard_name(split, 'y')))
        for split, (x, _) in arrays.items():
            self._split_sizes[split].append(int(len(x)))
        self._client_ids.append(client_id)
        self._source_ids.append(source_id)
        return client_id

    def finish(
        self, num_classes: int, *, public: np.ndarray | None = None, stored: bool = False
    ) -> client_data.ClientDataSpec:
        """Writes the index, the manifest (and the public examples) and moves the partition to `root`.

        The manifest is written last and the directory renamed into place
        after it: `root` exists only complete.

        Args:
          num_classes: number of label classes.
          public: optional features of the public dataset every client may
            read (unlabeled for the algorithms).
          stored: `public` is in stored form already.

        Returns:
          The `client_data.ClientDataSpec` of what was written.
        """
        self._close_shards()
        if self._layout == client_data.SHARDED:
            index = client_data.client_index_table({split: self._split_sizes[split] for split in client_data.SPLITS})
            index.astype('<i8').tofile(os.path.join(self._staging, client_data.INDEX))
        public_size = 0
        if public is not None:
            os.mkdir(os.path.join(self._staging, 'public'))
            self._stored(public, stored, 'public').tofile(os.path.join(self._staging, 'public', 'x.bin'))
            public_size = int(len(public))
        natural = any(source_id is not None for source_id in self._source_ids)
        spec = client_data.ClientDataSpec(
            root=os.path.abspath(self._root),
            client_ids=tuple(self._client_ids),
            feature_shape=self._feature_shape,
            num_classes=int(num_classes),
            split_sizes={k: tuple(v) for k, v in self._split_sizes.items()},
            feature_encoding=self._encoding,
            public_size=public_size,
            label_shape=self._label_shape,
            source_ids=tuple(str(s) for s in self._source_ids) if natural else None,
            layout=self._layout,
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
        if spec.layout == client_data.SHARDED:  # absent: the per-client layout of earlier versions
            manifest['layout'] = client_data.SHARDED
        with open(os.path.join(self._staging, client_data.MANIFEST), 'w') as f:
            json.dump(manifest, f, indent=1)
        os.rename(self._staging, self._root)
        self._staging = None
        return spec
