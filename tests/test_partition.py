"""Tests for tff_pfl.data.partition, paper_partitions and partition_registry."""

import numpy as np
import pytest

from tff_pfl.data import paper_partitions, partition, partition_registry

NUM_CLASSES = 10
PER_CLASS = 60


@pytest.fixture
def labels() -> np.ndarray:
    """600 labels, 60 of each of 10 classes, in a fixed shuffled order."""
    values = np.repeat(np.arange(NUM_CLASSES), PER_CLASS)
    return np.random.default_rng(123).permutation(values)


def assert_valid(parts: list[np.ndarray], num_examples: int) -> None:
    """Asserts sorted, int64, in-range, non-empty and pairwise disjoint."""
    for indices in parts:
        assert indices.dtype == np.int64
        assert indices.size > 0
        assert np.all(np.diff(indices) > 0)
        assert indices.min() >= 0 and indices.max() < num_examples
    merged = np.concatenate(parts)
    assert np.unique(merged).size == merged.size


def sizes(parts: list[np.ndarray]) -> list[int]:
    return [len(p) for p in parts]


def test_iid_splits_evenly_with_extra_to_first_clients(labels):
    parts = partition.iid(labels, 7, seed=0)
    assert_valid(parts, labels.size)
    assert sizes(parts) == [86] * 5 + [85] * 2
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))


def test_iid_fixed_size(labels):
    parts = partition.iid(labels, 10, seed=0, examples_per_client=20)
    assert_valid(parts, labels.size)
    assert sizes(parts) == [20] * 10


def test_ds1_exact_size_and_k_classes(labels):
    parts = paper_partitions.persfl_ds1(labels, 8, seed=0, k=3, examples_per_client=20)
    assert_valid(parts, labels.size)
    assert sizes(parts) == [20] * 8
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    assert np.all((histogram > 0).sum(axis=1) == 3)
    # Dirichlet proportions: per-class counts are not all equal.
    nonzero_rows = [row[row > 0] for row in histogram]
    assert any(len(set(row.tolist())) > 1 for row in nonzero_rows)


def test_ds1_automatic_size_matches_explicit(labels):
    parts = paper_partitions.persfl_ds1(labels, 20, seed=3, k=4)
    size = len(parts[0])
    assert sizes(parts) == [size] * 20
    assert 4 <= size <= labels.size // 20
    explicit = paper_partitions.persfl_ds1(labels, 20, seed=3, k=4, examples_per_client=size)
    for a, b in zip(parts, explicit):
        np.testing.assert_array_equal(a, b)


def test_ds1_all_classes_is_close_to_iid(labels):
    parts = paper_partitions.persfl_ds1(labels, 5, seed=0, k=NUM_CLASSES, examples_per_client=50)
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    assert np.all(histogram > 0)


@pytest.mark.parametrize('partitioner', [paper_partitions.dirichlet_over_clients, paper_partitions.persfl_ds2])
def test_ds2_assigns_every_example(labels, partitioner):
    parts = partitioner(labels, 8, seed=0, min_examples=20)
    assert_valid(parts, labels.size)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    assert min(sizes(parts)) >= 20
    assert len(set(sizes(parts))) > 1


def test_dirichlet_labels_sizes(labels):
    parts = partition.dirichlet_labels(labels, 6, seed=0, alpha=0.5, examples_per_client=25)
    assert_valid(parts, labels.size)
    assert sizes(parts) == [25] * 6
    varied = [5, 10, 15, 20, 25, 30]
    parts = partition.dirichlet_labels(labels, 6, seed=0, alpha=0.5, examples_per_client=varied)
    assert_valid(parts, labels.size)
    assert sizes(parts) == varied


def _pfllib_dir_reference(labels, num_clients, alpha, least_samples, rng):
    """PFLlib's separate_data(partition='dir') loop, written out plainly, drawing from `rng`."""
    n = len(labels)
    min_size = 0
    while min_size < least_samples:
        idx_batch = [[] for _ in range(num_clients)]
        for k in range(int(labels.max()) + 1):
            idx_k = np.where(labels == k)[0]
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.repeat(alpha, num_clients))
            proportions = np.array([p * (len(idx_j) < n / num_clients) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, cuts))]
            min_size = min(len(idx_j) for idx_j in idx_batch)
    return [np.sort(np.array(idx_j, dtype=np.int64)) for idx_j in idx_batch]


@pytest.mark.parametrize('seed', range(5))
def test_dirichlet_per_class_matches_pfllibs_loop_draw_for_draw(seed):
    tiny = np.random.default_rng(7).permutation(np.repeat(np.arange(3), [9, 6, 5]))
    parts = partition.dirichlet_per_class(tiny, 4, seed, alpha=0.5, min_examples=3)
    want = _pfllib_dir_reference(tiny, 4, 0.5, 3, np.random.default_rng(seed))
    for got, expected in zip(parts, want, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_dirichlet_per_class_assigns_every_example_once_and_keeps_the_minimum(labels):
    parts = partition.dirichlet_per_class(labels, 10, seed=0)
    assert_valid(parts, labels.size)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    # PFLlib's least_samples: min(10 / (1 - 0.75), 600 / 10 / 2) = 30.
    assert partition.pfllib_min_examples(labels.size, 10) == 30
    assert min(sizes(parts)) >= 30
    assert partition.pfllib_min_examples(70_000, 20) == 40  # Fashion-MNIST, 20 clients
    assert partition.pfllib_min_examples(10, 20) == 1
    assert min(sizes(partition.dirichlet_per_class(labels, 8, seed=0, min_examples=50))) >= 50


@pytest.mark.parametrize('seed', range(3))
def test_classes_in_turn_deals_two_classes_to_blocks_of_clients(labels, seed):
    """PFLlib's pathological split: 20 clients, 10 classes, 2 each: clients 4j .. 4j + 3 hold classes 2j and 2j + 1,
    every example of every class is given, and all but the last piece of a class are at least the lower bound."""
    parts = partition.classes_in_turn(labels, 20, seed)
    assert_valid(parts, labels.size)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    for client in range(20):
        block = client // 4
        assert set(np.flatnonzero(histogram[client])) == {2 * block, 2 * block + 1}, (client, histogram[client])
    # Lower bound: max(60 / 4 / 10, least_samples / 10) with least_samples = min(40, 600 / 20 / 2) = 15: 1.
    for k in range(NUM_CLASSES):
        pieces = [histogram[c][k] for c in range(20) if histogram[c][k]]
        assert len(pieces) == 4 and sum(pieces) == PER_CLASS and min(pieces[:-1]) >= 1 and max(pieces[:-1]) < 15
    # The class's examples in pool order: the first taker holds the first of them.
    first = np.flatnonzero(labels == 0)
    assert parts[0][np.isin(parts[0], first)][0] == first[0]


def test_classes_in_turn_is_seeded_and_refuses_in_one_line(labels):
    for a, b in zip(partition.classes_in_turn(labels, 20, 3), partition.classes_in_turn(labels, 20, 3), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(partition.classes_in_turn(labels, 20, 3), partition.classes_in_turn(labels, 20, 4))
    )
    with pytest.raises(partition.PartitionError, match=r'^classes_per_client must be in \[1, 10\], got 11$'):
        partition.classes_in_turn(labels, 20, 0, classes_per_client=11)
    # Classes 10 and 11 are empty: dealt to one client each they leave it nothing, to two they cannot be cut.
    with pytest.raises(partition.PartitionError, match=r'^2 of 12 clients get no examples: '):
        partition.classes_in_turn(labels, 12, 0, classes_per_client=1, num_classes=12)
    with pytest.raises(partition.PartitionError, match=r'^class 10 has too few examples \(0\) for 2 clients$'):
        partition.classes_in_turn(labels, 24, 0, classes_per_client=1, num_classes=12)


@pytest.mark.parametrize('seed', range(3))
def test_dirichlet_per_class_closes_a_client_once_it_holds_a_fair_share(labels, seed):
    """PFLlib's rule: a client holding N / num_clients examples gets nothing of the later classes."""
    histogram = partition.class_histogram(partition.dirichlet_per_class(labels, 10, seed), labels, NUM_CLASSES)
    held_before = np.cumsum(histogram, axis=1) - histogram
    assert np.all(held_before[histogram > 0] < labels.size / 10)


def test_dirichlet_per_class_alpha_sets_the_skew(labels):
    skewed = partition.class_histogram(partition.dirichlet_per_class(labels, 10, 0, alpha=0.05), labels, NUM_CLASSES)
    even = partition.class_histogram(partition.dirichlet_per_class(labels, 10, 0, alpha=1e4), labels, NUM_CLASSES)
    largest_share = lambda h: (h.max(axis=1) / h.sum(axis=1)).mean()  # noqa: E731
    assert largest_share(skewed) > 0.5
    assert largest_share(even) < 0.15
    assert np.all((even >= 5) & (even <= 7))  # 6 of each class per client, up to the cuts' rounding


def test_power_law_counts_by_hand():
    # Classes of 20, 16 and 12 examples; three clients of two classes each
    # (client 0: classes 0, 1; client 1: 1, 2; client 2: 2, 0), 2 base examples.
    draws = np.array([[1.0, 3.0], [1.0, 1.0], [2.0, 3.0]])
    counts = paper_partitions.power_law_counts(np.array([20, 16, 12]), 3, draws, base_examples=2)
    # Class 0: 20 - 2 x 2 = 16 left, weights 1 (client 0) : 3 (client 2) -> 4, 12.
    # Class 1: 12 left, weights 3 (client 0) : 1 (client 1) -> 9, 3.
    # Class 2: 8 left, weights 1 (client 1) : 2 (client 2) -> 2.67, 5.33 -> 3, 5
    # (the one left over goes to the larger remainder).
    np.testing.assert_array_equal(counts, [[6, 11, 0], [0, 5, 5], [14, 0, 7]])


def test_power_law_counts_leave_unheld_classes_out():
    counts = paper_partitions.power_law_counts(np.array([7, 7, 7, 7]), 1, np.array([[1.0, 5.0]]), base_examples=3)
    np.testing.assert_array_equal(counts, [[7, 7, 0, 0]])


def test_ds3_is_fedprox_generator(labels):
    parts = paper_partitions.persfl_ds3(labels, 10, seed=3)
    assert_valid(parts, labels.size)
    # Every example of every class is used.
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    np.testing.assert_array_equal(histogram.sum(axis=0), [PER_CLASS] * NUM_CLASSES)
    for u, row in enumerate(histogram):
        held = {u % 10, (u + 1) % 10}
        assert set(np.flatnonzero(row).tolist()) == held
        assert all(row[c] >= 5 for c in held)
    # The counts are the power-law split of the documented draws.
    rng = np.random.default_rng(3)
    for c in range(NUM_CLASSES):
        rng.permutation(np.flatnonzero(labels == c))
    draws = rng.lognormal(0.0, 2.0, size=(10, 2))
    expected = paper_partitions.power_law_counts(np.full(NUM_CLASSES, PER_CLASS), 10, draws, base_examples=5)
    np.testing.assert_array_equal(histogram, expected)


def test_ds3_sizes_span_orders_of_magnitude():
    labels = np.repeat(np.arange(10), 7000)
    clients = paper_partitions.persfl_ds3(labels, 1000, seed=0)
    sizes_ = np.array([len(c) for c in clients])
    assert sizes_.sum() == labels.size and sizes_.min() >= 10
    assert sizes_.max() / np.median(sizes_) > 10


def test_ds3_uneven_holders_and_parameters(labels):
    parts = partition_registry.build_partition('ds3', labels, 13, 1, classes_per_client=3, base_examples=2)
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    np.testing.assert_array_equal(histogram.sum(axis=0), [PER_CLASS] * NUM_CLASSES)
    assert np.all((histogram > 0).sum(axis=1) == 3) and histogram[histogram > 0].min() >= 2


def test_shards_sizes_and_classes(labels):
    parts = partition.shards(labels, 10, seed=0, shards_per_client=2)
    assert_valid(parts, labels.size)
    assert sizes(parts) == [60] * 10
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    # 20 shards of 30 over 10 classes of 60: each shard holds one class.
    assert np.all((histogram > 0).sum(axis=1) <= 2)
    assert np.all(histogram % 30 == 0)


def test_shards_drop_remainder(labels):
    parts = partition.shards(labels[:599], 7, seed=0, shards_per_client=3)
    assert_valid(parts, 599)
    assert sizes(parts) == [3 * (599 // 21)] * 7


def test_natural_validates_and_sorts():
    parts = partition.natural((np.array([3, 1]), np.array([0, 2, 4])))
    assert [p.tolist() for p in parts] == [[1, 3], [0, 2, 4]]
    assert all(p.dtype == np.int64 for p in parts)
    with pytest.raises(partition.PartitionError, match='two clients'):
        partition.natural((np.array([0, 1]), np.array([1, 2])))
    with pytest.raises(partition.PartitionError, match='no natural'):
        partition.natural(None)
    with pytest.raises(partition.PartitionError, match='no examples'):
        partition.natural((np.array([0]), np.array([], dtype=np.int64)))


@pytest.mark.parametrize(
    'name, params',
    [
        ('iid', {}),
        ('ds1', {'k': 2}),
        ('ds2', {}),
        ('ds3', {}),
        ('dirichlet', {'alpha': 0.3, 'examples_per_client': 20}),
        ('dirichlet_clients', {'alpha': 0.5}),
        ('shards', {'shards_per_client': 3}),
        ('dirichlet_per_class', {'alpha': 0.5}),
    ],
)
def test_determinism_and_dispatch(labels, name, params):
    first = partition_registry.build_partition(name, labels, 8, 5, **params)
    again = partition_registry.build_partition(name, labels, 8, 5, **params)
    other = partition_registry.build_partition(name, labels, 8, 6, **params)
    assert_valid(first, labels.size)
    assert len(first) == 8
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(a.shape != b.shape or np.any(a != b) for a, b in zip(first, other))


def _error_cases():
    labels = np.repeat(np.arange(4), 10)
    return [
        (lambda: partition.iid(labels, 0, 0), 'num_clients must be >= 1'),
        (lambda: partition.iid(labels, 41, 0), '41 clients requested'),
        (lambda: partition.iid(labels, 5, 0, examples_per_client=9), 'exceeds'),
        (lambda: partition.iid(np.array([0.5, 1.0]), 1, 0), 'integers'),
        (lambda: partition.iid(np.array([0, -1]), 1, 0), '>= 0'),
        (lambda: paper_partitions.persfl_ds1(labels, 2, 0, k=5), 'k must be in'),
        (lambda: paper_partitions.persfl_ds1(labels, 2, 0, k=0), 'k must be in'),
        (lambda: paper_partitions.persfl_ds1(labels, 2, 0, k=2, examples_per_client=1), '>= k'),
        (lambda: paper_partitions.persfl_ds1(labels, 4, 0, k=4, examples_per_client=12), 'runs out'),
        (lambda: paper_partitions.persfl_ds1(labels, 40, 0, k=4), 'cannot give 40 clients'),
        (lambda: paper_partitions.dirichlet_over_clients(labels, 2, 0, alpha=0), 'alpha must be > 0'),
        (lambda: paper_partitions.dirichlet_over_clients(labels, 4, 0, min_examples=11), 'exceeds'),
        (lambda: paper_partitions.dirichlet_over_clients(labels, 8, 0, alpha=0.01, min_examples=5), 'Dirichlet draws'),
        (lambda: partition.dirichlet_labels(labels, 2, 0, alpha=-1, examples_per_client=5), 'alpha must be > 0'),
        (lambda: partition.dirichlet_labels(labels, 2, 0, alpha=1, examples_per_client=[5]), '1 entries for 2 clients'),
        (lambda: partition.dirichlet_labels(labels, 2, 0, alpha=1, examples_per_client=0), '>= 1'),
        (lambda: partition.dirichlet_labels(labels, 2, 0, alpha=1, examples_per_client=20), 'runs out'),
        (lambda: partition.dirichlet_per_class(labels, 2, 0, alpha=0), 'alpha must be > 0'),
        (lambda: partition.dirichlet_per_class(labels, 2, 0, min_examples=0), 'min_examples must be >= 1'),
        (lambda: partition.dirichlet_per_class(labels, 4, 0, min_examples=11), 'exceeds'),
        (lambda: partition.dirichlet_per_class(labels, 8, 0, alpha=0.01, min_examples=5), '1000 Dirichlet draws'),
        (lambda: paper_partitions.persfl_ds3(labels, 2, 0, classes_per_client=5), 'classes_per_client must be in'),
        (lambda: paper_partitions.persfl_ds3(labels, 2, 0, base_examples=0), 'base examples per class must be >= 1'),
        (lambda: paper_partitions.persfl_ds3(labels, 30, 0, base_examples=21), 'fewer than 21 for each of its'),
        (lambda: partition.shards(labels, 21, 0), '42 shards'),
        (lambda: partition.shards(labels, 2, 0, shards_per_client=0), 'shards_per_client must be >= 1'),
        (lambda: partition_registry.build_partition('nope', labels, 2, 0), 'unknown partition .* iid, ds1'),
        (lambda: partition_registry.build_partition('iid', labels, 2, 0, k=3), 'bad parameters'),
        (lambda: partition.split_client(np.arange(2), labels), 'no test examples'),
        (lambda: partition.split_client(np.arange(9), labels, (0.5, 0.5)), '3 numbers, train and test positive'),
        (lambda: partition.split_client(np.arange(9), labels, (0.8, 0.3, -0.1)), '3 numbers, train and test positive'),
        (lambda: partition.split_client(np.arange(9), labels, (0.5, 0.3, 0.3)), 'sum to 1'),
        (lambda: partition.class_histogram([np.arange(40)], labels, 3), 'outside'),
    ]


@pytest.mark.parametrize('call, message', _error_cases())
def test_errors(call, message):
    with pytest.raises(partition.PartitionError, match=message) as info:
        call()
    assert '\n' not in str(info.value)


@pytest.mark.parametrize('size', [50, 37, 13])
def test_split_client_sizes_disjoint_stratified(labels, size):
    indices = partition.iid(labels, 1, seed=0, examples_per_client=size)[0]
    splits = partition.split_client(indices, labels, seed=4)
    cumulative = np.floor(np.array([0, 0.6, 0.8, 1.0]) * size + 0.5)
    expected = np.diff(cumulative).astype(int).tolist()
    assert [len(splits[k]) for k in ('train', 'val', 'test')] == expected
    merged = np.concatenate(list(splits.values()))
    np.testing.assert_array_equal(np.sort(merged), np.sort(indices))
    for part in splits.values():
        assert np.all(np.diff(part) > 0)
    client_counts = np.bincount(labels[indices], minlength=NUM_CLASSES)
    for key, fraction in zip(('train', 'val', 'test'), (0.6, 0.2, 0.2)):
        counts = np.bincount(labels[splits[key]], minlength=NUM_CLASSES)
        assert np.all(np.abs(counts - fraction * client_counts) <= 1.5)


def test_split_client_small_classes_still_fill_every_split():
    labels = np.repeat(np.arange(10), 3)
    splits = partition.split_client(np.arange(30), labels, seed=0)
    assert [len(splits[k]) for k in ('train', 'val', 'test')] == [18, 6, 6]
    train_counts = np.bincount(labels[splits['train']], minlength=10)
    assert set(train_counts.tolist()) <= {1, 2, 3}


def test_split_client_determinism(labels):
    indices = np.arange(100)
    first = partition.split_client(indices, labels, (0.5, 0.25, 0.25), seed=1)
    again = partition.split_client(indices, labels, (0.5, 0.25, 0.25), seed=1)
    other = partition.split_client(indices, labels, (0.5, 0.25, 0.25), seed=2)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert any(np.any(first[k] != other[k]) for k in first)


def test_class_histogram():
    labels = np.array([0, 1, 1, 2, 2, 2])
    histogram = partition.class_histogram([np.array([0, 1]), np.array([2, 3, 4, 5])], labels, 4)
    assert histogram.dtype == np.int64
    np.testing.assert_array_equal(histogram, [[1, 1, 0, 0], [0, 1, 3, 0]])


def test_ktpfl_case1_two_groups_with_opposite_skews(labels):
    parts = partition_registry.build_partition('kt_case1', labels, 4, seed=0, major=9, minor=3)
    assert_valid(parts, labels.size)
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    first, second = [9] * 5 + [3] * 5, [3] * 5 + [9] * 5
    np.testing.assert_array_equal(histogram, [first, first, second, second])


def test_ktpfl_case2_two_classes_each(labels):
    parts = partition_registry.build_partition('kt_case2', labels, 6, seed=1, examples_per_class=5)
    assert_valid(parts, labels.size)
    histogram = partition.class_histogram(parts, labels, NUM_CLASSES)
    for row in histogram:
        assert sorted(row[row > 0].tolist()) == [5, 5]
    assert len({tuple(np.flatnonzero(r)) for r in histogram}) > 1  # classes differ between clients


def test_ktpfl_cases_fail_clearly(labels):
    with pytest.raises(partition.PartitionError, match='runs out'):
        paper_partitions.ktpfl_case1(labels, 12, seed=0, major=9, minor=3)  # 6 x 9 + 6 x 3 per class > 60
    with pytest.raises(partition.PartitionError, match='classes_per_client'):
        paper_partitions.ktpfl_case2(labels, 3, seed=0, classes_per_client=11)


def test_kdpdfl_dirichlet_splits_follow_one_distribution():
    big = np.random.default_rng(5).permutation(np.repeat(np.arange(NUM_CLASSES), 600))
    parts = partition_registry.build_partition('kd_dirichlet', big, 8, seed=0, alpha=0.1, test_examples=100)
    for client in parts:
        assert 15 <= client['train'].size <= 100 and client['val'].size == 20 and client['test'].size == 100
        merged = np.concatenate(list(client.values()))
        assert np.unique(merged).size == merged.size
        train_classes = set(big[client['train']])
        test_hist = np.bincount(big[client['test']], minlength=NUM_CLASSES)
        # Dirichlet(0.1): a few dominant labels, shared by train and test.
        assert test_hist.max() >= 40 and np.argmax(test_hist) in train_classes
        for split in client.values():  # one to four labels (max_labels=4)
            assert 1 <= np.unique(big[split]).size <= 4
    every = np.concatenate([np.concatenate(list(c.values())) for c in parts])
    assert np.unique(every).size == every.size


def test_split_client_without_a_validation_fraction_keeps_no_validation_split():
    labels = np.repeat(np.arange(2), 5)
    splits = partition.split_client(np.arange(10), labels, (0.9, 0.0, 0.1), seed=3)
    assert [splits[k].size for k in ('train', 'val', 'test')] == [9, 0, 1]
    assert sorted(np.concatenate(list(splits.values())).tolist()) == list(range(10))
    with pytest.raises(partition.PartitionError, match='validation >= 0'):
        partition.split_client(np.arange(10), labels, (0.9, -0.1, 0.2))
