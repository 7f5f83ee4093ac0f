"""Deterministic partitioners that assign pooled examples to clients.

Every partitioner takes the pool's label vector and returns one int64 index
array per client. The arrays are sorted ascending and pairwise disjoint: no
example is given to two clients. All randomness comes from
`np.random.default_rng(seed)`, so equal arguments give equal partitions.
Impossible requests raise `PartitionError` with a one-line message.

This module holds that error, the input checks and class-pool draws every
partitioner shares, the generic partitioners (`iid`, `dirichlet_labels`,
`dirichlet_per_class` and `classes_in_turn` (PFLlib's), `shards`,
`natural`) and what is done with a
partition: `split_client` and `class_histogram`. The papers' own partitions
(PersFL's DS-1 to DS-3, KT-pFL's and KD-PDFL's) are in `paper_partitions`;
`partition_registry.build_partition` builds any of them by its `--partition`
name.
"""

from collections.abc import Sequence

import numpy as np

_SPLIT_NAMES = ('train', 'val', 'test')
_SPLIT_DESCRIPTIONS = ('training', 'validation', 'test')


class PartitionError(ValueError):
    """Raised when a requested partition cannot be built."""


def check_labels(labels: np.ndarray, num_clients: int, num_classes: int | None = None) -> tuple[np.ndarray, int]:
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


def class_pools(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Returns each class's example indices in a random order.

    Args:
      labels: Integer labels of shape `[N]`.
      num_classes: Number of classes.
      rng: The generator that shuffles each class's indices.

    Returns:
      One index array per class, its examples in `rng`'s order.
    """
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def class_demand(client_classes: np.ndarray, client_counts: np.ndarray, num_classes: int) -> np.ndarray:
    """Returns the total number of examples requested from each class.

    Args:
      client_classes: `[num_clients, m]` class ids requested by each client.
      client_counts: `[num_clients, m]` number of examples per requested class.
      num_classes: Number of classes.

    Returns:
      An int64 array of shape `[num_classes]`.
    """
    return np.bincount(
        client_classes.ravel(),
        weights=client_counts.ravel(),
        minlength=num_classes,
    ).astype(np.int64)


def draw_from_pools(
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
    demand = class_demand(client_classes, client_counts, len(pools))
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
    labels, _ = check_labels(labels, num_clients)
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
    labels, num_classes = check_labels(labels, num_clients, num_classes)
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
    pools = class_pools(labels, num_classes, rng)
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    counts = rng.multinomial(sizes, proportions)
    classes = np.broadcast_to(np.arange(num_classes), counts.shape)
    return draw_from_pools(pools, classes, counts)


# PFLlib's dataset_utils.py: batch_size = 10, train_ratio = 0.75 (the 75/25 split of each client).
_PFLLIB_BATCH_SIZE = 10
_PFLLIB_TRAIN_FRACTION = 0.75
# PFLlib redraws without end; we stop after this many draws.
_PER_CLASS_MAX_DRAWS = 1000


def pfllib_min_examples(num_examples: int, num_clients: int) -> int:
    """PFLlib's `least_samples`: one test batch per client, at most half a fair share.

    `int(min(batch_size / (1 - train_ratio), N / num_clients / 2))` with
    PFLlib's batch size 10 and training fraction 0.75, i.e.
    `min(40, N // (2 * num_clients))`, and at least 1.

    Args:
      num_examples: `N`, the examples of the pool.
      num_clients: Number of clients.

    Returns:
      The minimum number of examples per client.
    """
    least = min(_PFLLIB_BATCH_SIZE / (1 - _PFLLIB_TRAIN_FRACTION), num_examples / num_clients / 2)
    return max(1, int(least))


def dirichlet_per_class(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 0.1,
    min_examples: int | None = None,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's Dirichlet partition (`separate_data`, partition='dir').

    One draw, with `rng = default_rng(seed)`: for each class `k` in turn, the
    class's example indices are shuffled (`rng.shuffle`), proportions
    `q_k ~ Dirichlet(alpha * ones(num_clients))` are drawn, every client
    already holding at least `N / num_clients` examples gets proportion 0,
    the rest are renormalised, and the shuffled indices are cut at
    `int(cumsum(q_k) * n_k)` (the last cut left out), client `j` taking the
    `j`-th piece. Every example is assigned. The whole draw, shuffles
    included, is repeated until every client holds at least `min_examples`
    examples. PFLlib's `balance` flag does not touch this partition.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed.
      alpha: Dirichlet concentration; smaller is more heterogeneous (PFLlib: 0.1).
      min_examples: Minimum number of examples per client, or `None` for
        PFLlib's `least_samples` (`pfllib_min_examples`: 40 unless clients
        are smaller than 80 examples on average).
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `alpha <= 0`, `min_examples < 1`, the clients cannot
        all hold `min_examples`, or 1000 draws give none where they do.
    """
    labels, num_classes = check_labels(labels, num_clients, num_classes)
    if alpha <= 0:
        raise PartitionError(f'alpha must be > 0, got {alpha}')
    n = labels.size
    if min_examples is None:
        min_examples = pfllib_min_examples(n, num_clients)
    if min_examples < 1:
        raise PartitionError(f'min_examples must be >= 1, got {min_examples}')
    if num_clients * min_examples > n:
        raise PartitionError(f'{num_clients} clients x {min_examples} min_examples exceeds the {n} examples available')
    rng = np.random.default_rng(seed)
    members = [np.flatnonzero(labels == k) for k in range(num_classes)]
    for _ in range(_PER_CLASS_MAX_DRAWS):
        parts = [[] for _ in range(num_clients)]
        held = np.zeros(num_clients, dtype=np.int64)
        for indices in members:
            shuffled = indices.copy()
            rng.shuffle(shuffled)
            q = rng.dirichlet(np.full(num_clients, alpha))
            q = q * (held < n / num_clients)  # PFLlib's cap: a client at a fair share takes no more
            if q.sum() == 0:  # every open client drew 0 (underflow at tiny alpha): draw again
                break
            cuts = (np.cumsum(q / q.sum()) * shuffled.size).astype(np.int64)[:-1]
            for client, piece in enumerate(np.split(shuffled, cuts)):
                parts[client].append(piece)
                held[client] += piece.size
        else:
            if held.min() >= min_examples:
                return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    raise PartitionError(
        f'no client split with >= {min_examples} examples each in {_PER_CLASS_MAX_DRAWS} Dirichlet'
        f' draws (alpha={alpha}); raise alpha, lower min_examples or use fewer clients'
    )


def classes_in_turn(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    classes_per_client: int = 2,
    min_examples: int | None = None,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's pathological partition (`separate_data`, partition='pat', balance=False).

    Classes are dealt in turn: for each class `k` in order, the first
    `ceil(num_clients / num_classes * classes_per_client)` clients that still
    lack classes (each wants `classes_per_client`) take it, in client order.
    The class's examples, in their pooled order, are cut into one piece per
    taker: all but the last of sizes drawn uniformly from
    `[max(n_k / s / 10, min_examples / num_classes), n_k / s)` (integer
    bounds; `s` takers), the last the rest. So with 20 clients, 10 classes and
    2 classes each, clients 0-3 hold classes 0 and 1, clients 4-7 classes 2
    and 3, and so on; only the sizes are random. A class no client still
    wants is left out, as in PFLlib.

    Args:
      labels: Integer labels of shape `[N]`.
      num_clients: Number of clients.
      seed: Random seed (the piece sizes).
      classes_per_client: Classes each client takes (PFLlib: 2).
      min_examples: PFLlib's `least_samples` in the lower bound, or `None`
        for `pfllib_min_examples`.
      num_classes: Number of classes, or `None` for max label + 1.

    Returns:
      One sorted int64 index array per client.

    Raises:
      PartitionError: If `classes_per_client` is not in `[1, num_classes]`,
        a class has too few examples for its takers, or a client is left
        without examples (its classes are empty).
    """
    labels, num_classes = check_labels(labels, num_clients, num_classes)
    if not 1 <= classes_per_client <= num_classes:
        raise PartitionError(f'classes_per_client must be in [1, {num_classes}], got {classes_per_client}')
    if min_examples is None:
        min_examples = pfllib_min_examples(labels.size, num_clients)
    rng = np.random.default_rng(seed)
    wants = np.full(num_clients, classes_per_client)
    parts = [[] for _ in range(num_clients)]
    takers_per_class = int(np.ceil(num_clients / num_classes * classes_per_client))
    for k in range(num_classes):
        takers = np.flatnonzero(wants > 0)[:takers_per_class]
        if takers.size == 0:
            break
        members = np.flatnonzero(labels == k)
        share = members.size / takers.size
        low, high = int(max(share / 10, min_examples / num_classes)), int(share)
        if takers.size > 1 and low >= high:
            raise PartitionError(f'class {k} has too few examples ({members.size}) for {takers.size} clients')
        sizes = rng.integers(low, high, takers.size - 1).tolist() if takers.size > 1 else []
        sizes.append(members.size - sum(sizes))
        start = 0
        for client, size in zip(takers, sizes):
            parts[client].append(members[start : start + size])
            start += size
            wants[client] -= 1
    empty = [c for c in range(num_clients) if not parts[c] or not sum(p.size for p in parts[c])]
    if empty:
        raise PartitionError(
            f'{len(empty)} of {num_clients} clients get no examples: the classes dealt to them '
            f'({takers_per_class} clients a class) have none'
        )
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


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
    labels, _ = check_labels(labels, num_clients)
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
      fractions: Train, validation and test fractions summing to 1: train
        and test positive, validation positive or 0 (no validation split).
      seed: Random seed.

    Returns:
      A dict with keys `train`, `val` and `test`, each a sorted int64 index
      array; together they are disjoint and cover `indices`.

    Raises:
      PartitionError: If `fractions` is invalid, `indices` is empty or a
        split of positive fraction ends up empty.
    """
    fractions = np.asarray(fractions, dtype=np.float64)
    if fractions.shape != (3,) or fractions[0] <= 0 or fractions[1] < 0 or fractions[2] <= 0:
        raise PartitionError(
            f'split fractions must be 3 numbers, train and test positive, validation >= 0, got {fractions.tolist()}'
        )
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
        if splits[key].size == 0 and fractions[s] > 0:
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
