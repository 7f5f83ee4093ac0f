"""From a dataset name to per-client splits on disk, in one call."""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl.data import client_data, partition, sources


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What `prepare` wrote and what reports need.

    Attributes:
      spec: the on-disk partition.
      class_histogram: [clients, classes] counts over all of a client's splits.
      source_name: name of the pooled dataset.
    """

    spec: client_data.ClientDataSpec
    class_histogram: np.ndarray
    source_name: str


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
) -> PreparedData:
    """Loads a dataset, partitions it, splits every client, writes the files.

    Args:
      root: directory to create for the client files (must not exist).
      dataset: a source spec for `sources.load_source` (e.g. `synthetic`,
        `npz:/path/mnist.npz`, `tfds:mnist`).
      partition_name: `natural` (the dataset's own clients, for synthetic
        data) or a name known to `partition.build_partition`.
      num_clients: number of clients (must match a natural partition).
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

    Returns:
      A `PreparedData`.

    Raises:
      sources.DataError, partition.PartitionError: on bad data or an
        impossible partition (nothing is written then).
    """
    pool = sources.load_source(dataset, data_dir=data_dir, download=download, seed=seed, num_clients=num_clients)
    public = None
    labels = pool.y
    x, y = pool.x, pool.y
    if public_examples and public_dataset:
        other = sources.load_source(public_dataset, data_dir=data_dir, download=download, seed=seed)
        if other.x.shape[1:] != pool.x.shape[1:]:
            raise sources.DataError(
                f"public dataset {other.name!r} has examples of shape {other.x.shape[1:]}, the clients'"
                f' {pool.x.shape[1:]}'
            )
        if public_examples > len(other.y):
            raise partition.PartitionError(
                f'public_examples ({public_examples}) exceeds the public dataset ({len(other.y)})'
            )
        drawn = np.sort(np.random.default_rng([seed, 0x9B]).permutation(len(other.y))[:public_examples])
        # Stored after the clients' pool; their labels are never written.
        x = np.concatenate([pool.x, other.x[drawn]])
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
        clients = partition.build_partition(partition_name, labels, num_clients, seed, **dict(partition_params or {}))
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
    spec = client_data.write_client_data(root, x, y, pool.num_classes, splits, public_indices=public)
    histogram = partition.class_histogram(clients, pool.y, pool.num_classes)
    return PreparedData(spec=spec, class_histogram=histogram, source_name=pool.name)
