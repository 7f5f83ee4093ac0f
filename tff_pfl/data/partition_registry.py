"""The partitions `--partition` names, and `build_partition`, which builds one by name.

The generic partitioners are in `tff_pfl.data.partition`, the papers' own in
`tff_pfl.data.paper_partitions`.
"""

import inspect

import numpy as np

from tff_pfl.data import paper_partitions, partition

_PARTITIONERS = {
    'iid': partition.iid,
    'ds1': paper_partitions.persfl_ds1,
    'ds2': paper_partitions.persfl_ds2,
    'ds3': paper_partitions.persfl_ds3,
    'dirichlet': partition.dirichlet_labels,
    'dirichlet_clients': paper_partitions.dirichlet_over_clients,
    'shards': partition.shards,
    'kt_case1': paper_partitions.ktpfl_case1,
    'kt_case2': paper_partitions.ktpfl_case2,
    'kd_dirichlet': paper_partitions.kdpdfl_dirichlet,
    'dirichlet_per_class': partition.dirichlet_per_class,
    'classes_in_turn': partition.classes_in_turn,
}


def partitioner(name: str):
    """The partitioner function of the partition `name`.

    Args:
      name: a partition name (`--partition`), not `natural`.

    Returns:
      Its function, `(labels, num_clients, seed, **params) -> clients`.

    Raises:
      partition.PartitionError: an unknown name.
    """
    if name not in _PARTITIONERS:
        raise partition.PartitionError(f'unknown partition {name!r}; choose one of ' + ', '.join(_PARTITIONERS))
    return _PARTITIONERS[name]


def build_partition(name: str, labels: np.ndarray, num_clients: int, seed: int, **params) -> list[np.ndarray]:
    """Builds the partition named `name`.

    Names: `iid` (`partition.iid`), `ds1` (`paper_partitions.persfl_ds1`),
    `ds2` (`paper_partitions.persfl_ds2`), `ds3`
    (`paper_partitions.persfl_ds3`), `dirichlet` (`partition.dirichlet_labels`;
    needs `alpha` and `examples_per_client`), `dirichlet_clients`
    (`paper_partitions.dirichlet_over_clients`), `shards` (`partition.shards`),
    `kt_case1` (`paper_partitions.ktpfl_case1`), `kt_case2`
    (`paper_partitions.ktpfl_case2`), `kd_dirichlet`
    (`paper_partitions.kdpdfl_dirichlet`, which returns each client already
    split), `dirichlet_per_class` (`partition.dirichlet_per_class`,
    PFLlib's Dirichlet) and `classes_in_turn` (`partition.classes_in_turn`,
    PFLlib's pathological).

    Args:
      name: The partition name.
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      **params: Keyword arguments of the chosen partitioner.

    Returns:
      One sorted int64 index array per client (or, for `kd_dirichlet`, one
      dict of splits).

    Raises:
      partition.PartitionError: If `name` is unknown, `params` do not match the
        partitioner, or the partitioner fails.
    """
    function = partitioner(name)
    try:
        inspect.signature(function).bind(labels, num_clients, seed, **params)
    except TypeError as e:
        raise partition.PartitionError(f'bad parameters for partition {name!r}: {e}') from e
    return function(labels, num_clients, seed, **params)
