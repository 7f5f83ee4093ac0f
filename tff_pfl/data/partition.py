"""Deterministic partitioners that assign pooled examples to clients.

Every partitioner takes the pool's label vector and returns one int64 index
array per client. The arrays are sorted ascending and pairwise disjoint: no
example is given to two clients. All randomness comes from
`np.random.default_rng(seed)`, so equal arguments give equal partitions.
Impossible requests raise `PartitionError` with a one-line message.
"""

import inspect
from collections.abc import Sequence

import numpy as np

_DS1_SHRINK_FACTOR = 0.9
_DS2_MAX_DRAWS = 100
_SPLIT_NAMES = ('train', 'val', 'test')
_SPLIT_DESCRIPTIONS = ('training', 'validation', 'test')


class PartitionError(ValueError):
    """Raised when a requested partition cannot be built."""


def _check_labels(labels: np.ndarray, num_clients: int, num_classes: int | None = None) -> tuple[np.ndarray, int]:
    """Validates partitioner inputs.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: The requested number of clients.
      num_classes: The number of classes, or `None` for max label + 1.

    Returns:
      The labels as int64 and the number of classes.

    Raises:
      PartitionError: If the labels are not a non-empty vector of integers in
        `[0, num_classes)`, or `num_clients` is not in `[1, N]`.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise PartitionError(f'labels must be a non-empty vector, got shape {labels.shape}')
    if not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(f'labels must be integers, got dtype {labels.dtype}')
    if labels.min() < 0:
        raise PartitionError(f'labels must be >= 0, got {labels.min()}')
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    elif labels.max() >= num_classes:
        raise PartitionError(f'label {labels.max()} out of range for {num_classes} classes')
    if num_clients < 1:
        raise PartitionError(f'num_clients must be >= 1, got {num_clients}')
    if num_clients > labels.size:
        raise PartitionError(f'{num_clients} clients requested but only {labels.size} examples')
    return labels.astype(np.int64), num_classes


def _class_pools(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Returns each class's example indices in a random order."""
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def _class_demand(client_classes: np.ndarray, client_counts: np.ndarray, num_classes: int) -> np.ndarray:
    """Returns the total number of examples requested from each class."""
    return np.bincount(
        client_classes.ravel(),
        weights=client_counts.ravel(),
        minlength=num_classes,
    ).astype(np.int64)


def _fits(demand: np.ndarray, pools: list[np.ndarray]) -> bool:
    """Returns whether every class pool can supply its demand."""
    return all(d <= len(pool) for d, pool in zip(demand, pools))


def _draw_from_pools(
    pools: list[np.ndarray],
    client_classes: np.ndarray,
    client_counts: np.ndarray,
) -> list[np.ndarray]:
    """Draws examples for each client from the class pools without replacement.

    Args:
      pools: Shuffled example indices of each class.
      client_classes: `[num_clients, m]` class ids requested by each client.
      client_counts: `[num_clients, m]` number of examples per requested class.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If a class pool runs out.
    """
    demand = _class_demand(client_classes, client_counts, len(pools))
    for c, pool in enumerate(pools):
        if demand[c] > len(pool):
            raise PartitionError(
                f'class {c} runs out: clients need {demand[c]} examples but it'
                f' has {len(pool)}; use fewer examples per client or clients'
            )
    taken = np.zeros(len(pools), dtype=np.int64)
    partition = []
    for classes, counts in zip(client_classes, client_counts):
        parts = []
        for c, n in zip(classes, counts):
            parts.append(pools[c][taken[c] : taken[c] + n])
            taken[c] += n
        partition.append(np.sort(np.concatenate(parts)).astype(np.int64))
    return partition


def _random_class_sets(rng: np.random.Generator, num_clients: int, num_classes: int, k: int) -> np.ndarray:
    """Returns `[num_clients, k]` distinct random classes for each client."""
    return np.argsort(rng.random((num_clients, num_classes)), axis=1)[:, :k]


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Splits `total` into integers proportional to `weights`.

    Uses largest-remainder rounding.

    Args:
      total: A non-negative integer to split.
      weights: Non-negative weights with a positive sum.

    Returns:
      An int64 array with the shape of `weights`, summing exactly to `total`.
    """
    shares = total * weights / weights.sum()
    counts = np.floor(shares).astype(np.int64)
    remainder = total - counts.sum()
    counts[np.argsort(counts - shares, kind='stable')[:remainder]] += 1
    return counts


def iid(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    examples_per_client: int | None = None,
) -> list[np.ndarray]:
    """Partitions examples uniformly at random.

    Args:
      labels: Integer labels of shape `[N]`; only their number is used.
      num_clients: Number of clients.
      seed: Random seed.
      examples_per_client: Examples per client; `None` splits all `N` examples
        as evenly as possible, the first `N mod num_clients` clients getting
        one extra.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If the inputs are invalid or fewer than
        `num_clients * examples_per_client` examples exist.
    """
    labels, _ = _check_labels(labels, num_clients)
    n = labels.size
    if examples_per_client is None:
        sizes = np.full(num_clients, n // num_clients)
        sizes[: n % num_clients] += 1
    else:
        if examples_per_client < 1:
            raise PartitionError(f'examples_per_client must be >= 1, got {examples_per_client}')
        if num_clients * examples_per_client > n:
            raise PartitionError(
                f'{num_clients} clients x {examples_per_client} examples exceeds the {n} examples available'
            )
        sizes = np.full(num_clients, examples_per_client)
    order = np.random.default_rng(seed).permutation(n)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.sort(order[start:end]).astype(np.int64) for start, end in zip(bounds[:-1], bounds[1:])]


def persfl_ds1(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    k: int = 4,
    examples_per_client: int | None = None,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """PersFL DS-1 (from FedPer): equal sizes, `k` random classes per client.

    Each client picks `k` distinct classes uniformly at random and receives
    exactly `examples_per_client` examples: one from each of its classes plus
    a multinomial split of the remaining `examples_per_client - k` over its
    classes with proportions drawn from Dirichlet(1, ..., 1). Every client
    therefore holds exactly `k` classes, in different amounts. Examples are
    drawn without replacement from shuffled class pools. With
    `k = num_classes` the partition is close to IID.

    When `examples_per_client` is `None`, the size starts at
    `floor(N / num_clients)` and shrinks by a factor of 0.9 (at least by one,
    at most down to `k`) until every class pool covers its demand. Classes
    and proportions do not depend on the size, so the result equals passing
    the final size explicitly.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      k: Number of classes per client.
      examples_per_client: Examples per client (at least `k`), or `None`.
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `k` is not in `[1, num_classes]`,
        `examples_per_client < k`, or the class pools cannot supply the
        demand (for `None`: not even with `k` examples per client).
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if not 1 <= k <= num_classes:
        raise PartitionError(f'k must be in [1, {num_classes}], got {k}')
    if examples_per_client is not None and examples_per_client < k:
        raise PartitionError(f'examples_per_client ({examples_per_client}) must be >= k ({k})')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    classes = _random_class_sets(rng, num_clients, num_classes, k)
    proportions = rng.dirichlet(np.ones(k), size=num_clients)
    counts_seed = int(rng.integers(2**32))

    def counts_for(size: int) -> np.ndarray:
        extra = np.random.default_rng(counts_seed).multinomial(size - k, proportions)
        return 1 + extra

    if examples_per_client is None:
        size = labels.size // num_clients
        while size < k or not _fits(_class_demand(classes, counts_for(size), num_classes), pools):
            if size <= k:
                raise PartitionError(
                    f'class pools cannot give {num_clients} clients {k} classes each; use fewer clients or a smaller k'
                )
            size = max(k, min(size - 1, int(size * _DS1_SHRINK_FACTOR)))
        examples_per_client = size
    return _draw_from_pools(pools, classes, counts_for(examples_per_client))


def dirichlet_over_clients(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 0.9,
    num_classes: int | None = None,
    min_examples: int = 10,
) -> list[np.ndarray]:
    """PersFL DS-2: each class is split over clients by Dirichlet proportions.

    For each class `c`, proportions `q_c ~ Dirichlet(alpha * ones(num_clients))`
    are drawn and the class's shuffled examples are cut at the cumulative
    proportions, so every example is assigned and client sizes differ. If a
    client ends with fewer than `min_examples` examples, all proportions are
    redrawn, up to 100 times.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      alpha: Dirichlet concentration; smaller is more heterogeneous.
      num_classes: Number of classes, or `None` for max label + 1.
      min_examples: Minimum number of examples per client (at least 1).

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `alpha <= 0`, `min_examples < 1`, or no draw gives
        every client `min_examples` examples.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise PartitionError(f'alpha must be > 0, got {alpha}')
    if min_examples < 1:
        raise PartitionError(f'min_examples must be >= 1, got {min_examples}')
    if num_clients * min_examples > labels.size:
        raise PartitionError(
            f'{num_clients} clients x {min_examples} min_examples exceeds the {labels.size} examples available'
        )
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    for _ in range(_DS2_MAX_DRAWS):
        parts = [[] for _ in range(num_clients)]
        for pool in pools:
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(pool)).astype(np.int64)
            for client, chunk in enumerate(np.split(pool, cuts)):
                parts[client].append(chunk)
        partition = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in partition) >= min_examples:
            return partition
    raise PartitionError(
        f'no client split with >= {min_examples} examples each in'
        f' {_DS2_MAX_DRAWS} Dirichlet draws (alpha={alpha}); raise alpha,'
        ' lower min_examples or use fewer clients'
    )


# PersFL DS-2 uses alpha = 0.9, the default of `dirichlet_over_clients`.
persfl_ds2 = dirichlet_over_clients


def dirichlet_labels(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float,
    examples_per_client: int | Sequence[int],
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Gives each client a Dirichlet-distributed label mix of a fixed size.

    Client `k` draws `p_k ~ Dirichlet(alpha * ones(num_classes))` and then
    per-class counts `~ Multinomial(examples_per_client[k], p_k)`, which are
    drawn without replacement from shuffled class pools.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      alpha: Dirichlet concentration; smaller is more heterogeneous.
      examples_per_client: Examples per client, one int for all clients or one
        per client; each at least 1.
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `alpha <= 0`, `examples_per_client` has the wrong
        length or a value below 1, or a class pool runs out.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise PartitionError(f'alpha must be > 0, got {alpha}')
    sizes = np.asarray(examples_per_client, dtype=np.int64)
    if sizes.ndim == 0:
        sizes = np.full(num_clients, sizes)
    if sizes.shape != (num_clients,):
        raise PartitionError(f'examples_per_client has {sizes.size} entries for {num_clients} clients')
    if sizes.min() < 1:
        raise PartitionError(f'examples_per_client must be >= 1, got {sizes.min()}')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    counts = rng.multinomial(sizes, proportions)
    classes = np.broadcast_to(np.arange(num_classes), counts.shape)
    return _draw_from_pools(pools, classes, counts)


def power_law_counts(
    class_sizes: np.ndarray,
    num_clients: int,
    draws: np.ndarray,
    base_examples: int,
) -> np.ndarray:
    """Per-client, per-class counts of the FedProx power-law split.

    Client u holds classes `(u + j) mod C` for `j < J` (`J = draws.shape[1]`).
    Every (client, class) slot first gets `base_examples`; the remaining
    examples of each class are then divided among the slots holding it in
    proportion to their `draws` (largest-remainder rounding), so every example
    of every held class is used.

    Args:
      class_sizes: `[C]` number of examples of each class.
      num_clients: Number of clients.
      draws: `[num_clients, J]` positive weights, one per (client, held class).
      base_examples: Examples of each held class every client gets first.

    Returns:
      An int64 `[num_clients, C]` count matrix; column c sums to `class_sizes[c]`
      for every class held by some client, and to 0 otherwise.

    Raises:
      PartitionError: If a class cannot give `base_examples` to each holder.
    """
    class_sizes = np.asarray(class_sizes, dtype=np.int64)
    num_classes = class_sizes.size
    per_client = draws.shape[1]
    classes = (np.arange(num_clients)[:, np.newaxis] + np.arange(per_client)) % num_classes
    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    for c in range(num_classes):
        holders = np.nonzero(classes == c)
        if holders[0].size == 0:
            continue
        remaining = class_sizes[c] - base_examples * holders[0].size
        if remaining < 0:
            raise PartitionError(
                f'class {c} has {class_sizes[c]} examples, fewer than {base_examples} for each of its'
                f' {holders[0].size} clients; use fewer clients or a smaller base'
            )
        counts[holders[0], c] = base_examples + _apportion(remaining, draws[holders])
    return counts


def persfl_ds3(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    classes_per_client: int = 2,
    base_examples: int = 5,
    mu: float = 0.0,
    sigma: float = 2.0,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """PersFL DS-3: FedProx's power-law MNIST generator (as pFedMe uses it).

    Client u holds the `classes_per_client` classes `u, u + 1, ... mod C`.
    Every client first gets `base_examples` of each of its classes; the
    remaining examples of each class are then divided among the clients
    holding it in proportion to `lognormal(mu, sigma)` draws, one draw per
    (client, held class) (`power_law_counts`). Every example of a held class
    is used, so no class is starved, while client sizes span orders of
    magnitude. Classes held by no client (fewer than C clients times
    classes per client) are left out.

    The draws are `rng.lognormal(mu, sigma, (num_clients, classes_per_client))`
    taken after the class pools are shuffled, `rng = default_rng(seed)`.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      classes_per_client: Number of classes per client (FedProx: 2).
      base_examples: Examples of each of its classes a client gets before the
        power-law split (FedProx: 5).
      mu: Mean of the underlying normal of the log-normal draws.
      sigma: Standard deviation of the underlying normal (FedProx: 2).
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `classes_per_client` is not in `[1, num_classes]`,
        `base_examples < 1`, or a class cannot give `base_examples` to each of
        its clients.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(f'classes_per_client must be in [1, {num_classes}], got {classes_per_client}')
    if base_examples < 1:
        raise PartitionError(f'base examples per class must be >= 1, got {base_examples}')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    draws = rng.lognormal(mu, sigma, size=(num_clients, classes_per_client))
    counts = power_law_counts(np.array([len(pool) for pool in pools]), num_clients, draws, base_examples)
    all_classes = np.broadcast_to(np.arange(num_classes), counts.shape)
    return _draw_from_pools(pools, all_classes, counts)


def shards(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """Pathological non-IID shards (McMahan et al., 2017).

    Examples are shuffled, stably sorted by label, and cut into
    `num_clients * shards_per_client` equal shards of
    `floor(N / num_shards)` examples (the last `N mod num_shards` sorted
    examples are left out). Shards are assigned to clients at random.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      shards_per_client: Number of shards per client.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `shards_per_client < 1` or there are more shards
        than examples.
    """
    labels, _ = _check_labels(labels, num_clients)
    if shards_per_client < 1:
        raise PartitionError(f'shards_per_client must be >= 1, got {shards_per_client}')
    num_shards = num_clients * shards_per_client
    if num_shards > labels.size:
        raise PartitionError(f'{num_shards} shards requested but only {labels.size} examples')
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(labels.size)
    ordered = shuffled[np.argsort(labels[shuffled], kind='stable')]
    shard_size = labels.size // num_shards
    shard_list = ordered[: num_shards * shard_size].reshape(num_shards, -1)
    assignment = rng.permutation(num_shards).reshape(num_clients, -1)
    return [np.sort(shard_list[ids].ravel()).astype(np.int64) for ids in assignment]


def natural(
    pool_natural_partition: Sequence[np.ndarray] | None,
) -> list[np.ndarray]:
    """Returns a dataset's own client partition after validating it.

    Args:
      pool_natural_partition: Per-client index arrays, e.g.
        `Pool.natural_partition`.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If there is no partition, or it has no clients, an
        empty or non-integer client, negative indices, or shared examples.
    """
    if not pool_natural_partition:
        raise PartitionError('the data source has no natural client partition')
    partition = []
    for client, indices in enumerate(pool_natural_partition):
        indices = np.asarray(indices)
        if indices.ndim != 1 or indices.size == 0:
            raise PartitionError(f'natural client {client} has no examples')
        if not np.issubdtype(indices.dtype, np.integer) or indices.min() < 0:
            raise PartitionError(f'natural client {client} has invalid indices; expected non-negative integers')
        partition.append(np.sort(indices).astype(np.int64))
    merged = np.concatenate(partition)
    if np.unique(merged).size != merged.size:
        raise PartitionError('natural partition gives an example to two clients')
    return partition


def ktpfl_case1(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    major: int = 450,
    minor: int = 150,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """KT-pFL's non-IID case 1: two groups of clients, every class, opposite skews.

    The first half of the clients (indices `< ceil(num_clients / 2)`) holds
    `major` examples of each class in the first half of the classes and
    `minor` of each other class; the second half of the clients the reverse
    (the paper: [450] * 5 + [150] * 5 and [150] * 5 + [450] * 5).

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      major: Examples per class of the group's own half of the classes.
      minor: Examples per class of the other half.
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If a count is not positive or a class runs out.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if major < 1 or minor < 1:
        raise PartitionError(f'major and minor must be >= 1, got {major} and {minor}')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    first_half = np.arange(num_classes) < (num_classes + 1) // 2
    group = np.arange(num_clients) >= (num_clients + 1) // 2
    counts = np.where(first_half[np.newaxis, :] != group[:, np.newaxis], major, minor)
    classes = np.tile(np.arange(num_classes), (num_clients, 1))
    return _draw_from_pools(pools, classes, counts)


def ktpfl_case2(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    classes_per_client: int = 2,
    examples_per_class: int = 300,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """KT-pFL's non-IID case 2: each client draws two random classes, 300 examples each.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      classes_per_client: Distinct classes per client, drawn uniformly.
      examples_per_class: Examples of each of them.
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `classes_per_client` is not in `[1, num_classes]`,
        `examples_per_class < 1`, or a class runs out.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(f'classes_per_client must be in [1, {num_classes}], got {classes_per_client}')
    if examples_per_class < 1:
        raise PartitionError(f'examples_per_class must be >= 1, got {examples_per_class}')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    classes = _random_class_sets(rng, num_clients, num_classes, classes_per_client)
    return _draw_from_pools(pools, classes, np.full(classes.shape, examples_per_class))


def kdpdfl_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 0.1,
    min_train: int = 15,
    max_train: int = 100,
    val_examples: int = 20,
    test_examples: int = 100,
    max_labels: int | None = 4,
    num_classes: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """KD-PDFL's setting: Dirichlet(alpha) labels, small training sets, fixed test sets.

    Client k draws p_k ~ Dirichlet(alpha * ones(C)) and a training size
    uniform in [min_train, max_train]; its training, validation and test
    splits draw their class counts from Multinomial(size, p_k) each, so all
    three follow the client's own label distribution (the paper: alpha = 0.1,
    one to four labels per client, 15-100 training and 100 test examples).
    With `max_labels`, p_k keeps only its `max_labels` largest entries
    (renormalised): Dirichlet(0.1) over 10 classes gives a fifth label of
    noticeable weight to some clients, where the paper reports one to four.
    The splits come out of the partition itself (`--split_fractions` does
    not apply).

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      alpha: Concentration of the Dirichlet prior over each client's labels.
      min_train: Smallest training split.
      max_train: Largest training split (inclusive).
      val_examples: Size of every client's validation split.
      test_examples: Size of every client's test split.
      max_labels: Number of classes each p_k keeps, or `None` to keep all.
      num_classes: The number of classes, or `None` for max label + 1.

    Returns:
      One dict per client with sorted int64 index arrays `train`, `val`,
      `test`.

    Raises:
      PartitionError: on bad sizes or when a class runs out.
    """
    labels, num_classes = _check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise PartitionError(f'alpha must be > 0, got {alpha}')
    if not 1 <= min_train <= max_train:
        raise PartitionError(f'need 1 <= min_train <= max_train, got {min_train} and {max_train}')
    if val_examples < 1 or test_examples < 1:
        raise PartitionError('val_examples and test_examples must be >= 1')
    rng = np.random.default_rng(seed)
    pools = _class_pools(labels, num_classes, rng)
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    if max_labels is not None and max_labels < num_classes:
        if max_labels < 1:
            raise PartitionError(f'max_labels must be >= 1, got {max_labels}')
        smallest = np.argsort(proportions, axis=1)[:, : num_classes - max_labels]
        np.put_along_axis(proportions, smallest, 0.0, axis=1)
        proportions /= proportions.sum(axis=1, keepdims=True)
    train_sizes = rng.integers(min_train, max_train + 1, size=num_clients)
    counts = {
        'train': rng.multinomial(train_sizes, proportions),
        'val': rng.multinomial(np.full(num_clients, val_examples), proportions),
        'test': rng.multinomial(np.full(num_clients, test_examples), proportions),
    }
    classes = np.broadcast_to(np.arange(num_classes), (num_clients * 3, num_classes))
    stacked = np.concatenate([counts['train'], counts['val'], counts['test']])
    drawn = _draw_from_pools(pools, classes, stacked)
    return [
        {'train': drawn[k], 'val': drawn[num_clients + k], 'test': drawn[2 * num_clients + k]}
        for k in range(num_clients)
    ]


_PARTITIONERS = {
    'iid': iid,
    'ds1': persfl_ds1,
    'ds2': persfl_ds2,
    'ds3': persfl_ds3,
    'dirichlet': dirichlet_labels,
    'dirichlet_clients': dirichlet_over_clients,
    'shards': shards,
    'kt_case1': ktpfl_case1,
    'kt_case2': ktpfl_case2,
    'kd_dirichlet': kdpdfl_dirichlet,
}


def build_partition(name: str, labels: np.ndarray, num_clients: int, seed: int, **params) -> list[np.ndarray]:
    """Builds the partition named `name`.

    Names: `iid` (`iid`), `ds1` (`persfl_ds1`), `ds2` (`persfl_ds2`), `ds3`
    (`persfl_ds3`), `dirichlet` (`dirichlet_labels`; needs `alpha` and
    `examples_per_client`), `dirichlet_clients` (`dirichlet_over_clients`),
    `shards` (`shards`), `kt_case1` (`ktpfl_case1`), `kt_case2`
    (`ktpfl_case2`) and `kd_dirichlet` (`kdpdfl_dirichlet`, which returns
    each client already split).

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
      PartitionError: If `name` is unknown, `params` do not match the
        partitioner, or the partitioner fails.
    """
    if name not in _PARTITIONERS:
        raise PartitionError(f'unknown partition {name!r}; choose one of ' + ', '.join(_PARTITIONERS))
    partitioner = _PARTITIONERS[name]
    try:
        inspect.signature(partitioner).bind(labels, num_clients, seed, **params)
    except TypeError as e:
        raise PartitionError(f'bad parameters for partition {name!r}: {e}') from e
    return partitioner(labels, num_clients, seed, **params)


def split_client(
    indices: np.ndarray,
    labels: np.ndarray,
    fractions: Sequence[float] = (0.6, 0.2, 0.2),
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Splits one client's examples into train, validation and test sets.

    The split is stratified by class: each class's indices are shuffled and
    the `j`-th of a class's `n_c` examples gets the quantile
    `(j + 0.5) / n_c`. All examples are ordered by quantile (ties broken at
    random) and the order is cut at `round(F_s * N)`, with `F_s` the
    cumulative fractions and `N` the client's number of examples. Each class
    is thereby cut into consecutive runs of its shuffled indices whose sizes
    follow the fractions up to rounding, so every split follows the client's
    label distribution, while split sizes are exactly
    `round(F_s * N) - round(F_{s-1} * N)` and sum to `N`. Classes too small
    to appear in every split (e.g. a single example) go to some splits only.

    Args:
      indices: The client's example indices into the pool.
      labels: Integer labels of the whole pool.
      fractions: Train, validation and test fractions: three positive numbers
        summing to 1.
      seed: Random seed.

    Returns:
      A dict with keys `train`, `val` and `test`, each a sorted int64 index
      array; together they are disjoint and cover `indices`.

    Raises:
      PartitionError: If `fractions` is invalid, `indices` is empty or a
        split ends up empty.
    """
    fractions = np.asarray(fractions, dtype=np.float64)
    if fractions.shape != (3,) or fractions.min() <= 0:
        raise PartitionError(f'split fractions must be 3 positive numbers, got {fractions.tolist()}')
    if abs(fractions.sum() - 1.0) > 1e-6:
        raise PartitionError(f'split fractions must sum to 1, got {fractions.sum():.6g}')
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size == 0:
        raise PartitionError('client has no examples to split')
    rng = np.random.default_rng(seed)
    client_labels = np.asarray(labels)[indices]
    members = [rng.permutation(indices[client_labels == c]) for c in np.unique(client_labels)]
    quantiles = np.concatenate([(np.arange(m.size) + 0.5) / m.size for m in members])
    tie_breaks = rng.random(indices.size)
    ordered = np.concatenate(members)[np.lexsort((tie_breaks, quantiles))]
    cumulative = np.concatenate([[0.0], np.cumsum(fractions)])
    cumulative[-1] = 1.0
    cuts = np.floor(cumulative * indices.size + 0.5).astype(np.int64)
    splits = {}
    for s, (key, description) in enumerate(zip(_SPLIT_NAMES, _SPLIT_DESCRIPTIONS)):
        splits[key] = np.sort(ordered[cuts[s] : cuts[s + 1]])
        if splits[key].size == 0:
            raise PartitionError(f'client has no {description} examples; give it more data or change --split_fractions')
    return splits


def class_histogram(partition: Sequence[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts each client's examples per class.

    Args:
      partition: One index array per client.
      labels: Integer labels of the whole pool, in `[0, num_classes)`.
      num_classes: Number of classes.

    Returns:
      An int64 array of shape `[num_clients, num_classes]`.

    Raises:
      PartitionError: If a client holds a label outside `[0, num_classes)`.
    """
    labels = np.asarray(labels)
    histogram = np.zeros((len(partition), num_classes), dtype=np.int64)
    for client, indices in enumerate(partition):
        client_labels = labels[np.asarray(indices, dtype=np.int64)]
        if client_labels.size and (client_labels.min() < 0 or client_labels.max() >= num_classes):
            raise PartitionError(f'client {client} holds labels outside [0, {num_classes})')
        histogram[client] = np.bincount(client_labels, minlength=num_classes)
    return histogram
