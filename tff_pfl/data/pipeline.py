"""From a dataset name to per-client splits on disk, in one call."""

import dataclasses
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl.data import client_data, client_data_writer, natural, partition, partition_registry, sources


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What `prepare` wrote and what reports need.

    Attributes:
      spec: the on-disk partition.
      class_histogram: [clients, classes] counts over all of a client's splits
        (of the labels that count: characters, for text).
      source_name: name of the pooled dataset.
      note: what a naturally federated source left out, or ''.
    """

    spec: client_data.ClientDataSpec
    class_histogram: np.ndarray
    source_name: str
    note: str = ''


def prepare(
    root: str,
    *,
    dataset: str,
    partition_name: str,
    num_clients: int,
    seed: int,
    split_fractions: Sequence[float] = (0.6, 0.2, 0.2),
    partition_params: Mapping[str, object] | None = None,
    data_dir: str | None = None,
    download: bool = False,
    public_examples: int = 0,
    public_dataset: str | None = None,
    layout: str = client_data.SHARDED,
) -> PreparedData:
    """Loads a dataset, partitions it, splits every client, writes the files.

    Args:
      root: directory to create for the client files (must not exist).
      dataset: a source spec for `sources.load_source` (e.g. `synthetic`,
        `npz:/path/mnist.npz`, `tfds:mnist`), or a naturally federated
        source for `natural.load_natural` (`tff:shakespeare`,
        `sqlite:PATH`, `clients:DIR`; see `prepare_natural`).
      partition_name: `natural` (the dataset's own clients, for synthetic
        data and natural sources) or a name known to
        `partition_registry.build_partition`.
      num_clients: number of clients (must match a natural partition of a
        pooled source; a seeded subset of a natural source's clients).
      seed: fixes the partition and the splits.
      split_fractions: train/validation/test fractions of each client.
      partition_params: extra keyword arguments of the partitioner.
      data_dir: TFDS data directory.
      download: whether TFDS may download.
      public_examples: examples set aside, before partitioning, as the
        public dataset every client may read (unlabeled; used by KT-pFL and
        the distillation baselines); no client holds them. From a natural
        partition, each client gives up those of its examples that were
        drawn (drawn uniformly from the whole pool).
      public_dataset: a source spec to draw the public examples from instead
        (KT-pFL's Fashion-MNIST clients use MNIST as public data); its
        examples must have the clients' shape, and the clients keep every
        example of `dataset`.
      layout: how the client files are laid out (`client_data.LAYOUTS`):
        shards and an index (the default), or one directory per client as
        earlier versions wrote (for comparisons and older exports).

    Returns:
      A `PreparedData`.

    Raises:
      sources.DataError, partition.PartitionError: on bad data or an
        impossible partition (nothing is written then).
    """
    if natural.is_natural(dataset):
        return prepare_natural(
            root,
            dataset=dataset,
            partition_name=partition_name,
            num_clients=num_clients,
            seed=seed,
            split_fractions=split_fractions,
            data_dir=data_dir,
            download=download,
            public_examples=public_examples,
            public_dataset=public_dataset,
            layout=layout,
        )
    synthetic = sources.synthetic_params(dataset)
    if synthetic is not None and partition_name == 'natural' and not public_examples:
        return _prepare_synthetic(root, synthetic, num_clients, seed, split_fractions, layout)
    pool = sources.load_source(dataset, data_dir=data_dir, download=download, seed=seed, num_clients=num_clients)
    public = None
    labels = pool.y
    x, y = pool.x, pool.y
    if public_examples and public_dataset:
        drawn = _public_from(public_dataset, pool.x.shape[1:], public_examples, seed, data_dir, download)
        # Stored after the clients' pool; their labels are never written.
        x = np.concatenate([pool.x, drawn])
        y = np.concatenate([pool.y, np.zeros(public_examples, pool.y.dtype)])
        public = np.arange(len(pool.y), len(y))
    elif public_examples:
        if public_examples >= len(pool.y):
            raise partition.PartitionError(
                f'public_examples ({public_examples}) must be smaller than the dataset ({len(pool.y)})'
            )
        order = np.random.default_rng([seed, 0x9B]).permutation(len(pool.y))
        public = np.sort(order[:public_examples])
        # Clients are partitioned from the rest only.
        keep = np.sort(order[public_examples:])
        labels = pool.y[keep]
    if partition_name == 'natural':
        if pool.natural_partition is None:
            raise partition.PartitionError(f'dataset {pool.name!r} has no natural client partition; choose --partition')
        clients = partition.natural(pool.natural_partition)
        if len(clients) != num_clients:
            raise partition.PartitionError(
                f'dataset {pool.name!r} has {len(clients)} natural clients, not {num_clients}'
            )
        if public is not None and not public_dataset:
            # Each natural client keeps its own examples but the public ones.
            clients = [np.setdiff1d(c, public) for c in clients]
    else:
        clients = partition_registry.build_partition(
            partition_name, labels, num_clients, seed, **dict(partition_params or {})
        )
        if public is not None and not public_dataset:
            clients = [{k: keep[v] for k, v in c.items()} if isinstance(c, dict) else keep[c] for c in clients]
    splits = []
    for index, indices in enumerate(clients):
        if isinstance(indices, dict):  # the partition split the client itself
            splits.append(indices)
            clients[index] = np.sort(np.concatenate(list(indices.values())))
            continue
        try:
            splits.append(partition.split_client(indices, pool.y, split_fractions, seed=seed + index))
        except partition.PartitionError as e:
            raise partition.PartitionError(f'{client_data.client_id_for(index)}: {e}') from None
    spec = client_data_writer.write_client_data(
        root, x, y, pool.num_classes, splits, public_indices=public, layout=layout
    )
    histogram = partition.class_histogram(clients, pool.y, pool.num_classes)
    return PreparedData(spec=spec, class_histogram=histogram, source_name=pool.name)


def _prepare_synthetic(root, alpha_beta, num_clients, seed, split_fractions, layout) -> PreparedData:
    """Synthetic(alpha, beta[, heterogeneity]), natural partition, streamed: one client in memory at a time.

    Writes what the pooled path (`sources.synthetic_fedprox`, then
    `partition.split_client` with seed `seed + k` and `write_client_data`)
    writes, byte for byte: the generator draws in the same order, and a
    client's split of its own positions is its split of the pool's indices
    shifted by its offset. Features are stored as float32 (Gaussian
    features are never all exact k/255 in [0, 1]), as the pooled path
    decides for them.
    """
    num_classes, histogram = 10, []
    alpha, beta, heterogeneity = alpha_beta
    clients = sources.synthetic_fedprox_clients(
        alpha, beta, num_clients=num_clients, num_classes=num_classes, seed=seed, heterogeneity=heterogeneity
    )
    with client_data_writer.ClientDataWriter(
        root, feature_shape=(60,), encoding=client_data.FLOAT32, layout=layout
    ) as writer:
        for index, (x, y) in enumerate(clients):
            try:
                parts = partition.split_client(np.arange(len(y)), y, split_fractions, seed=seed + index)
            except partition.PartitionError as e:
                raise partition.PartitionError(f'{client_data.client_id_for(index)}: {e}') from None
            writer.add_client({split: (x[indices], y[indices]) for split, indices in parts.items()})
            histogram.append(np.bincount(y, minlength=num_classes))
        spec = writer.finish(num_classes)
    return PreparedData(
        spec=spec,
        class_histogram=np.asarray(histogram, np.int64),
        source_name=sources.synthetic_name(alpha, beta, heterogeneity),
    )


def _public_from(
    public_dataset: str, feature_shape: Sequence[int], count: int, seed: int, data_dir, download
) -> np.ndarray:
    """`count` examples drawn (seeded, uniformly, kept in order) from `public_dataset`'s pool.

    Raises:
      sources.DataError: its examples are not of `feature_shape`.
      partition.PartitionError: it has fewer than `count` examples.
    """
    other = sources.load_source(public_dataset, data_dir=data_dir, download=download, seed=seed)
    if other.x.shape[1:] != tuple(feature_shape):
        raise sources.DataError(
            f"public dataset {other.name!r} has examples of shape {other.x.shape[1:]}, the clients' "
            f'{tuple(feature_shape)}'
        )
    if count > len(other.y):
        raise partition.PartitionError(f'public_examples ({count}) exceeds the public dataset ({len(other.y)})')
    return other.x[np.sort(np.random.default_rng([seed, 0x9B]).permutation(len(other.y))[:count])]


def prepare_natural(
    root: str,
    *,
    dataset: str,
    partition_name: str,
    num_clients: int,
    seed: int,
    split_fractions: Sequence[float] = (0.6, 0.2, 0.2),
    data_dir: str | None = None,
    download: bool = False,
    public_examples: int = 0,
    public_dataset: str | None = None,
    layout: str = client_data.SHARDED,
) -> PreparedData:
    """Streams a naturally federated source's clients into the client files.

    The partition is the source's own: `num_clients` of its eligible
    clients (`natural.NaturalSource`), drawn without replacement with the
    seed and kept in id order (all of them when `num_clients` is their
    number), each with its own training and test examples. The validation
    split is set aside from each client's training examples: the share
    `f_val / (f_train + f_val)` of `split_fractions` (1/4 by default), at
    least one example, drawn with the seed (`natural.validation_split`); a
    source's own validation split is used as it is. A source whose test
    examples belong to other clients (TFF's CIFAR-100) has each client's
    examples split three ways by `split_fractions` (`partition.split_client`,
    stratified by class). One client is in memory at a time.

    Args:
      root: directory to create (must not exist).
      dataset: `tff:NAME`, `sqlite:PATH[#TRAIN,TEST]` or `clients:DIR`.
      partition_name: must be `natural`.
      num_clients: how many of the source's clients.
      seed: draws the clients and the validation examples.
      split_fractions: train, validation, test fractions; only the ratio
        of the first two is used when the test split is the source's.
      data_dir: TFF's cache directory (`tff:` sources).
      download: let TFF download (`tff:` sources).
      public_examples: public examples for the algorithm; they must come
        from `public_dataset` (a pooled source of the clients' feature
        shape): a natural source keeps all its clients' examples.
      public_dataset: the public examples' source.
      layout: how the client files are laid out (`client_data.LAYOUTS`).

    Returns:
      A `PreparedData`, with a note on the clients left out.

    Raises:
      sources.DataError: the source cannot be read, or a client cannot be
        split.
      partition.PartitionError: another partition, more clients than the
        source has, or public data without a `public_dataset`.
    """
    if partition_name != 'natural':
        raise partition.PartitionError(
            f'{dataset} is naturally federated: its clients are its own (--partition=natural), not {partition_name}'
        )
    source = natural.load_natural(dataset, data_dir=data_dir, download=download)
    available = len(source.client_ids)
    if num_clients > available:
        left_out = f' ({source.excluded} more lack two training or a test example)' if source.excluded else ''
        raise partition.PartitionError(f'num_clients={num_clients} but {source.name} has {available} clients{left_out}')
    public = None
    if public_examples:
        if source.task == 'next_char':
            raise partition.PartitionError(
                f'{source.name} is text: public data for distillation between clients (KT-pFL, FedMD, FedDF, '
                "pFedDF: unlabeled examples of the clients' task) are not supported on text"
            )
        if not public_dataset:
            raise partition.PartitionError(
                f"{source.name} is naturally federated and gives no examples away: take the algorithm's public "
                'data from --public_dataset'
            )
        public = _public_from(public_dataset, source.feature_shape, public_examples, seed, data_dir, download)
    rng = np.random.default_rng([seed, 0x5A])
    chosen = np.sort(rng.choice(available, size=num_clients, replace=False))
    histogram = []
    with client_data_writer.ClientDataWriter(
        root,
        feature_shape=source.feature_shape,
        encoding=source.encoding,
        label_shape=source.label_shape,
        layout=layout,
    ) as writer:
        for position in chosen:
            source_id = source.client_ids[position]
            arrays = natural_client_splits(source, source_id, seed=seed, split_fractions=split_fractions)
            writer.add_client(arrays, source_id=str(source_id))
            labels = np.concatenate([arrays[split][1].reshape(-1) for split in client_data.SPLITS])
            labels = labels[labels != client_data.IGNORED_LABEL]
            histogram.append(np.bincount(labels, minlength=source.num_classes)[: source.num_classes])
            del arrays
        spec = writer.finish(source.num_classes, public=public)
    note = ''
    if source.excluded:
        note = f'{source.excluded} of its clients have fewer than two training or no test examples and are left out'
    return PreparedData(spec=spec, class_histogram=np.asarray(histogram), source_name=source.name, note=note)


def natural_client_splits(
    source: natural.NaturalSource, source_id: str, *, seed: int, split_fractions: Sequence[float]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One client of a natural source, split into train, validation and test.

    Depends only on the client's own examples, its source id, the seed and
    the fractions, never on the other clients: a device holding only its
    own file (`deploy/loader.py --clients_dir`) derives the same splits as
    the run that partitioned all of them. The validation examples are drawn
    by `natural.validation_split` seeded with `[seed, crc32(source id)]`;
    a source without its own test split is split three ways by
    `partition.split_client` with the same seed.

    Args:
      source: the natural source.
      source_id: the client's id in the source.
      seed: the run's seed.
      split_fractions: train, validation, test fractions.

    Returns:
      Split name (`train`, `val`, `test`) -> `(x, y)`.

    Raises:
      sources.DataError: the client cannot be split, or has no test example.
    """
    arrays = dict(source.read_client(source_id))
    client_seed = [seed, zlib.crc32(str(source_id).encode())]
    if 'test' not in arrays:  # the source's test examples are other clients': split this one's three ways
        x, y = arrays.pop('train')
        try:
            parts = partition.split_client(np.arange(len(y)), y, split_fractions, seed=client_seed)
        except partition.PartitionError as e:
            raise sources.DataError(f'{source.name}, client {source_id!r}: {e}') from None
        arrays = {split: (x[indices], y[indices]) for split, indices in parts.items()}
    if 'val' not in arrays:
        val_fraction = split_fractions[1] / (split_fractions[0] + split_fractions[1])
        try:
            arrays.update(natural.validation_split(*arrays['train'], val_fraction, client_seed))
        except ValueError as e:
            raise sources.DataError(f'{source.name}, client {source_id!r}: {e}') from None
    if len(arrays['test'][1]) == 0:
        raise sources.DataError(f'{source.name}, client {source_id!r}: no test examples')
    return arrays
