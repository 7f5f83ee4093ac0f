"""The partitions of the papers reproduced here: PersFL's, KT-pFL's and KD-PDFL's.

PersFL's DS-1 (`persfl_ds1`), DS-2 (`persfl_ds2`, `dirichlet_over_clients`)
and DS-3 (`persfl_ds3`, FedProx's power-law generator, with
`power_law_counts`); KT-pFL's non-IID cases 1 and 2 (`ktpfl_case1`,
`ktpfl_case2`); KD-PDFL's Dirichlet setting (`kdpdfl_dirichlet`). They keep
the contract of `tff_pfl.data.partition` (sorted, disjoint int64 index
arrays, deterministic by seed, `partition.PartitionError` when impossible)
and draw from its class pools.
"""

import numpy as np

from tff_pfl.data import partition

_DS1_SHRINK_FACTOR = 0.9
_DS2_MAX_DRAWS = 100


def _fits(demand: np.ndarray, pools: list[np.ndarray]) -> bool:
    """Returns whether every class pool can supply its demand."""
    return all(d <= len(pool) for d, pool in zip(demand, pools))


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
      partition.PartitionError: If `k` is not in `[1, num_classes]`,
        `examples_per_client < k`, or the class pools cannot supply the
        demand (for `None`: not even with `k` examples per client).
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if not 1 <= k <= num_classes:
        raise partition.PartitionError(f'k must be in [1, {num_classes}], got {k}')
    if examples_per_client is not None and examples_per_client < k:
        raise partition.PartitionError(f'examples_per_client ({examples_per_client}) must be >= k ({k})')
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    classes = _random_class_sets(rng, num_clients, num_classes, k)
    proportions = rng.dirichlet(np.ones(k), size=num_clients)
    counts_seed = int(rng.integers(2**32))

    def counts_for(size: int) -> np.ndarray:
        extra = np.random.default_rng(counts_seed).multinomial(size - k, proportions)
        return 1 + extra

    if examples_per_client is None:
        size = labels.size // num_clients
        while size < k or not _fits(partition.class_demand(classes, counts_for(size), num_classes), pools):
            if size <= k:
                raise partition.PartitionError(
                    f'class pools cannot give {num_clients} clients {k} classes each; use fewer clients or a smaller k'
                )
            size = max(k, min(size - 1, int(size * _DS1_SHRINK_FACTOR)))
        examples_per_client = size
    return partition.draw_from_pools(pools, classes, counts_for(examples_per_client))


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
      partition.PartitionError: If `alpha <= 0`, `min_examples < 1`, or no draw gives
        every client `min_examples` examples.
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise partition.PartitionError(f'alpha must be > 0, got {alpha}')
    if min_examples < 1:
        raise partition.PartitionError(f'min_examples must be >= 1, got {min_examples}')
    if num_clients * min_examples > labels.size:
        raise partition.PartitionError(
            f'{num_clients} clients x {min_examples} min_examples exceeds the {labels.size} examples available'
        )
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    for _ in range(_DS2_MAX_DRAWS):
        parts = [[] for _ in range(num_clients)]
        for pool in pools:
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(pool)).astype(np.int64)
            for client, chunk in enumerate(np.split(pool, cuts)):
                parts[client].append(chunk)
        drawn = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in drawn) >= min_examples:
            return drawn
    raise partition.PartitionError(
        f'no client split with >= {min_examples} examples each in'
        f' {_DS2_MAX_DRAWS} Dirichlet draws (alpha={alpha}); raise alpha,'
        ' lower min_examples or use fewer clients'
    )


# PersFL DS-2 uses alpha = 0.9, the default of `dirichlet_over_clients`.
persfl_ds2 = dirichlet_over_clients


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
      partition.PartitionError: If a class cannot give `base_examples` to each holder.
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
            raise partition.PartitionError(
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
      partition.PartitionError: If `classes_per_client` is not in `[1, num_classes]`,
        `base_examples < 1`, or a class cannot give `base_examples` to each of
        its clients.
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if not 1 <= classes_per_client <= num_classes:
        raise partition.PartitionError(f'classes_per_client must be in [1, {num_classes}], got {classes_per_client}')
    if base_examples < 1:
        raise partition.PartitionError(f'base examples per class must be >= 1, got {base_examples}')
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    draws = rng.lognormal(mu, sigma, size=(num_clients, classes_per_client))
    counts = power_law_counts(np.array([len(pool) for pool in pools]), num_clients, draws, base_examples)
    all_classes = np.broadcast_to(np.arange(num_classes), counts.shape)
    return partition.draw_from_pools(pools, all_classes, counts)


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
      partition.PartitionError: If a count is not positive or a class runs out.
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if major < 1 or minor < 1:
        raise partition.PartitionError(f'major and minor must be >= 1, got {major} and {minor}')
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    first_half = np.arange(num_classes) < (num_classes + 1) // 2
    group = np.arange(num_clients) >= (num_clients + 1) // 2
    counts = np.where(first_half[np.newaxis, :] != group[:, np.newaxis], major, minor)
    classes = np.tile(np.arange(num_classes), (num_clients, 1))
    return partition.draw_from_pools(pools, classes, counts)


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
      partition.PartitionError: If `classes_per_client` is not in `[1, num_classes]`,
        `examples_per_class < 1`, or a class runs out.
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if not 1 <= classes_per_client <= num_classes:
        raise partition.PartitionError(f'classes_per_client must be in [1, {num_classes}], got {classes_per_client}')
    if examples_per_class < 1:
        raise partition.PartitionError(f'examples_per_class must be >= 1, got {examples_per_class}')
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    classes = _random_class_sets(rng, num_clients, num_classes, classes_per_client)
    return partition.draw_from_pools(pools, classes, np.full(classes.shape, examples_per_class))


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
      partition.PartitionError: on bad sizes or when a class runs out.
    """
    labels, num_classes = partition.check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise partition.PartitionError(f'alpha must be > 0, got {alpha}')
    if not 1 <= min_train <= max_train:
        raise partition.PartitionError(f'need 1 <= min_train <= max_train, got {min_train} and {max_train}')
    if val_examples < 1 or test_examples < 1:
        raise partition.PartitionError('val_examples and test_examples must be >= 1')
    rng = np.random.default_rng(seed)
    pools = partition.class_pools(labels, num_classes, rng)
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    if max_labels is not None and max_labels < num_classes:
        if max_labels < 1:
            raise partition.PartitionError(f'max_labels must be >= 1, got {max_labels}')
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
    drawn = partition.draw_from_pools(pools, classes, stacked)
    return [
        {'train': drawn[k], 'val': drawn[num_clients + k], 'test': drawn[2 * num_clients + k]}
        for k in range(num_clients)
    ]
