"""Tests for tff_pfl.metrics against hand-computed closed-form values."""

import collections
import math

import numpy as np
import pytest

from tff_pfl import metrics

# 0.1, 0.2, ..., 1.0 in a fixed shuffled order.
TEN = [0.5, 0.9, 0.1, 0.7, 0.3, 0.2, 0.8, 0.4, 1.0, 0.6]
# 1, 2, ..., 25 in a fixed shuffled order.
TWENTY_FIVE = [
    13,
    7,
    25,
    1,
    19,
    4,
    22,
    10,
    16,
    2,
    24,
    8,
    14,
    20,
    3,
    11,
    23,
    6,
    17,
    9,
    21,
    5,
    12,
    18,
    15,
]


def test_summarize_ten_clients():
    summary = metrics.summarize(TEN)
    assert isinstance(summary, collections.OrderedDict)
    assert list(summary) == [
        'mean',
        'weighted_mean',
        'std',
        'worst_10',
        'best_10',
        'min',
        'max',
        'num_clients',
    ]
    assert summary['mean'] == pytest.approx(0.55)
    assert summary['weighted_mean'] == pytest.approx(0.55)
    # Population variance of 1..n is (n^2 - 1) / 12; values are 0.1 * (1..10).
    assert summary['std'] == pytest.approx(0.1 * math.sqrt(99 / 12))
    # ceil(0.1 * 10) = 1 client in each tail.
    assert summary['worst_10'] == pytest.approx(0.1)
    assert summary['best_10'] == pytest.approx(1.0)
    assert summary['min'] == pytest.approx(0.1)
    assert summary['max'] == pytest.approx(1.0)
    assert summary['num_clients'] == 10
    assert type(summary['num_clients']) is int
    for key in ('mean', 'weighted_mean', 'std', 'worst_10', 'best_10'):
        assert type(summary[key]) is float


def test_summarize_twenty_five_clients_uses_three_per_tail():
    summary = metrics.summarize(np.asarray(TWENTY_FIVE))
    assert summary['mean'] == pytest.approx(13.0)
    assert summary['std'] == pytest.approx(math.sqrt((25**2 - 1) / 12))
    # ceil(0.1 * 25) = 3: (1 + 2 + 3) / 3 and (23 + 24 + 25) / 3.
    assert summary['worst_10'] == pytest.approx(2.0)
    assert summary['best_10'] == pytest.approx(24.0)
    assert summary['min'] == 1.0
    assert summary['max'] == 25.0
    assert summary['num_clients'] == 25


def test_summarize_std_is_population_std():
    summary = metrics.summarize([1.0, 3.0])
    # ddof=0: sqrt(((1 - 2)^2 + (3 - 2)^2) / 2) = 1, not sqrt(2).
    assert summary['std'] == pytest.approx(1.0)


@pytest.mark.parametrize(
    'n, k',
    [(1, 1), (5, 1), (10, 1), (11, 2), (20, 2), (21, 3), (30, 3), (31, 4)],
)
def test_summarize_tail_size(n, k):
    summary = metrics.summarize(np.arange(1, n + 1))
    assert summary['worst_10'] == pytest.approx((k + 1) / 2)
    assert summary['best_10'] == pytest.approx(n - (k - 1) / 2)


def test_summarize_single_client():
    summary = metrics.summarize([0.75])
    assert summary['mean'] == summary['worst_10'] == summary['best_10'] == 0.75
    assert summary['std'] == 0.0
    assert summary['num_clients'] == 1


def test_summarize_weighted_mean():
    weights = [1] * 10
    weights[TEN.index(1.0)] = 2
    summary = metrics.summarize(TEN, weights)
    # (5.5 + 1.0) / 11: the client with value 1.0 counts twice.
    assert summary['weighted_mean'] == pytest.approx(6.5 / 11)
    assert summary['mean'] == pytest.approx(0.55)


def test_summarize_weighted_mean_with_zero_weights():
    summary = metrics.summarize([0.2, 0.4, 0.9], np.array([3, 1, 0]))
    assert summary['weighted_mean'] == pytest.approx((0.6 + 0.4) / 4)


@pytest.mark.parametrize(
    'values, weights, match',
    [
        ([], None, 'empty'),
        (np.array([]), None, 'empty'),
        ([0.1, float('nan')], None, 'NaN'),
        ([[0.1, 0.2]], None, 'vector'),
        ([0.1, 0.2], [1.0], 'length'),
        ([0.1, 0.2], [1.0, 2.0, 3.0], 'length'),
        ([0.1, 0.2], [1.0, -1.0], 'non-negative'),
        ([0.1, 0.2], [0.0, 0.0], 'all be zero'),
        ([0.1, 0.2], [1.0, float('nan')], 'NaN'),
    ],
)
def test_summarize_errors(values, weights, match):
    with pytest.raises(ValueError, match=match):
        metrics.summarize(values, weights)


VALUES = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
WEIGHTS = [5, 1, 9, 3, 9, 2, 7, 4, 6, 8]


def test_top_by_weight_mean_breaks_ties_by_index():
    # k = 1; weight 9 is shared by indices 2 and 4, index 2 wins.
    assert metrics.top_by_weight_mean(VALUES, WEIGHTS) == pytest.approx(30.0)
    assert metrics.top_by_weight_mean(VALUES, [1] * 10, fraction=0.1) == pytest.approx(10.0)


def test_top_by_weight_mean_larger_fractions():
    # k = 2: indices 2 and 4, (9 * 30 + 9 * 50) / 18.
    assert metrics.top_by_weight_mean(VALUES, WEIGHTS, fraction=0.2) == pytest.approx(40.0)
    # k = 3: adds index 9 (weight 8), (270 + 450 + 800) / 26.
    assert metrics.top_by_weight_mean(VALUES, WEIGHTS, fraction=0.3) == pytest.approx(1520 / 26)
    # k = ceil(0.25 * 10) = 3 as well.
    assert metrics.top_by_weight_mean(VALUES, WEIGHTS, fraction=0.25) == pytest.approx(1520 / 26)
    # All clients: the plain weighted mean.
    expected = np.dot(VALUES, WEIGHTS) / np.sum(WEIGHTS)
    assert metrics.top_by_weight_mean(np.array(VALUES), np.array(WEIGHTS), fraction=1.0) == pytest.approx(expected)


def test_top_by_weight_mean_count_is_exact_for_decimal_fractions():
    # 0.1 * 30 is 3.0000000000000004 in binary floating point; k must be 3.
    values = np.arange(30, dtype=float)
    weights = np.arange(30, 0, -1)  # Client 0 has the most samples.
    expected = (30 * 0 + 29 * 1 + 28 * 2) / (30 + 29 + 28)
    assert metrics.top_by_weight_mean(values, weights) == pytest.approx(expected)


def test_top_by_weight_mean_tiny_fraction_keeps_one_client():
    assert metrics.top_by_weight_mean(VALUES, WEIGHTS, fraction=1e-9) == pytest.approx(30.0)


@pytest.mark.parametrize(
    'values, weights, fraction, match',
    [
        ([], [], 0.1, 'empty'),
        ([0.1, float('nan')], [1, 1], 0.1, 'NaN'),
        ([0.1, 0.2], [1], 0.1, 'length'),
        ([0.1, 0.2], [1, -2], 0.1, 'non-negative'),
        ([0.1, 0.2], [0, 0], 0.1, 'all be zero'),
        ([0.1, 0.2], [1, 2], 0.0, 'fraction'),
        ([0.1, 0.2], [1, 2], 1.5, 'fraction'),
        ([0.1, 0.2], [1, 2], -0.1, 'fraction'),
    ],
)
def test_top_by_weight_mean_errors(values, weights, fraction, match):
    with pytest.raises(ValueError, match=match):
        metrics.top_by_weight_mean(values, weights, fraction=fraction)


def test_sample_mean_interval_closed_form_and_edges():
    values = [0.5, 0.7, 0.9, 0.6]
    # s = std(ddof=1) = 0.1708, n = 4, N = 20: 1.96 * s / 2 * sqrt(0.8).
    assert metrics.sample_mean_interval(values, 20) == pytest.approx(1.959964 * 0.170783 / 2 * 0.894427, rel=1e-5)
    assert metrics.sample_mean_interval(values, 4) == 0.0  # the whole population: no sampling error
    assert metrics.sample_mean_interval([0.3], 100) == 0.0
    with pytest.raises(ValueError, match=r'population \(3\) is smaller than the sample \(4\)'):
        metrics.sample_mean_interval(values, 3)
