"""Summaries of per-client metric values (accuracy, loss, ...).

Personalized federated learning is judged on the distribution of a metric over
clients, not only on its average. `summarize` reports the usual statistics of
that distribution:

* `mean`: the unweighted mean over clients (every client counts once);
* `weighted_mean`: the mean weighted by, e.g., each client's number of test
    examples (equal to `mean` when no weights are given);
* `std`: the population standard deviation over clients (`ddof=0`), the
    fairness measure of PersFL (Section 5.2): the clients evaluated are the
    whole population of interest, not a sample of it;
* `worst_10` / `best_10`: the mean over the lowest / highest 10% of clients;
* `min`, `max` and `num_clients`.

`top_by_weight_mean` gives the weighted mean over the clients holding the most
data (the top 10% by number of samples, as reported in Self-FL, Table 1).

The "top fraction" of `n` clients is `k = max(1, ceil(fraction * n))`
clients. The product is computed exactly on the decimal value of `fraction`
(so `0.1 * 30` gives 3 clients, not the 4 that binary floating point would
give).
"""

import collections
import fractions
import math
from collections.abc import Sequence

import numpy as np

ArrayLike = Sequence[float] | np.ndarray

_TAIL_FRACTION = 0.1


def _top_count(n: int, fraction: float) -> int:
    """Returns how many of `n` clients make up the top `fraction`.

    Args:
      n: The number of clients, at least 1.
      fraction: A number in `(0, 1]`.

    Returns:
      `max(1, ceil(fraction * n))`, computed on the shortest decimal
      representation of `fraction` so that, e.g., `0.1 * 30` is exactly 3.
    """
    exact = fractions.Fraction(repr(float(fraction))) * n
    return max(1, math.ceil(exact))


def _as_vector(values: ArrayLike, name: str) -> np.ndarray:
    """Converts `values` to a float64 vector and validates it.

    Args:
      values: A list or array of numbers.
      name: The argument name used in error messages.

    Returns:
      A 1-D float64 numpy array.

    Raises:
      ValueError: If `values` is not 1-D, is empty, or contains NaN.
    """
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f'{name} must be numbers: {e}') from e
    if array.ndim != 1:
        raise ValueError(f'{name} must be a vector (one value per client), got shape {array.shape}')
    if array.size == 0:
        raise ValueError(f'{name} must not be empty')
    if np.isnan(array).any():
        raise ValueError(f'{name} must not contain NaN')
    return array


def _as_weights(weights: ArrayLike, num_values: int) -> np.ndarray:
    """Converts `weights` to a float64 vector and validates it.

    Args:
      weights: One non-negative weight per client.
      num_values: The number of clients the weights must match.

    Returns:
      A 1-D float64 numpy array of length `num_values`.

    Raises:
      ValueError: If the weights are not a NaN-free vector of length
        `num_values`, any weight is negative or infinite, or all are zero.
    """
    array = _as_vector(weights, 'weights')
    if array.size != num_values:
        raise ValueError(f'weights has length {array.size}, but there are {num_values} values')
    if not np.isfinite(array).all():
        raise ValueError('weights must be finite')
    if (array < 0).any():
        raise ValueError(f'weights must be non-negative, got {array.min()}')
    if not (array > 0).any():
        raise ValueError('weights must not all be zero')
    return array


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float:
    """Returns `sum(weights * values) / sum(weights)` as a Python float."""
    return float(np.sum(weights * values) / np.sum(weights))


def summarize(values: ArrayLike, weights: ArrayLike | None = None) -> collections.OrderedDict:
    """Summarizes one metric's per-client values.

    Args:
      values: One value per client, as a list or 1-D array.
      weights: Optional non-negative weight per client (for example its
        number of test examples), used only for `weighted_mean`.

    Returns:
      An `OrderedDict` with keys, in this order:
        `mean`: the unweighted mean over clients.
        `weighted_mean`: the `weights`-weighted mean; equal to `mean` when
          `weights` is `None`.
        `std`: the population standard deviation over clients (`ddof=0`),
          the fairness measure of PersFL (Section 5.2).
        `worst_10`: the mean of the `k` lowest values, where
          `k = max(1, ceil(0.1 * n))` for `n` clients.
        `best_10`: the mean of the `k` highest values, same `k`.
        `min`, `max`: the extreme values.
        `num_clients`: `n`, an `int`.
      All other entries are Python floats.

    Raises:
      ValueError: If `values` is empty or contains NaN, or `weights` has a
        different length, contains negative values, or is all zero.
    """
    array = _as_vector(values, 'values')
    mean = float(np.mean(array))
    if weights is None:
        weighted_mean = mean
    else:
        weighted_mean = _weighted_mean(array, _as_weights(weights, array.size))
    ordered = np.sort(array)
    k = _top_count(array.size, _TAIL_FRACTION)
    return collections.OrderedDict(
        mean=mean,
        weighted_mean=weighted_mean,
        std=float(np.std(array, ddof=0)),
        worst_10=float(np.mean(ordered[:k])),
        best_10=float(np.mean(ordered[-k:])),
        min=float(ordered[0]),
        max=float(ordered[-1]),
        num_clients=int(array.size),
    )


def top_by_weight_mean(values: ArrayLike, weights: ArrayLike, fraction: float = 0.1) -> float:
    """The weighted mean over the clients with the largest weights.

    With `weights` the clients' numbers of samples, this is the metric over
    the top 10% of clients by data size (Self-FL, Table 1).

    Args:
      values: One value per client, as a list or 1-D array.
      weights: One non-negative weight per client.
      fraction: The fraction of clients to keep, in `(0, 1]`. The
        `k = max(1, ceil(fraction * n))` clients with the largest weights are
        kept; ties are broken by index order (lower index first).

    Returns:
      The mean of the kept clients' values, weighted by their weights, as a
      Python float.

    Raises:
      ValueError: If `values` is empty or contains NaN, `weights` has a
        different length, contains negative values or is all zero, or
        `fraction` is not in `(0, 1]`.
    """
    array = _as_vector(values, 'values')
    weight_array = _as_weights(weights, array.size)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f'fraction must be in (0, 1], got {fraction}')
    k = _top_count(array.size, fraction)
    # A stable sort of the negated weights orders by weight descending and
    # keeps equal weights in index order.
    order = np.argsort(-weight_array, kind='stable')[:k]
    # The largest weight is positive (not all weights are zero), so the kept
    # weights never sum to zero.
    return _weighted_mean(array[order], weight_array[order])


# Two-sided 95 % quantile of the standard normal distribution.
_Z_95 = 1.959963984540054


def sample_mean_interval(values: ArrayLike, population: int) -> float:
    """Half-width of the 95 % confidence interval of the population's mean from a simple random sample.

    The sample is `n` clients drawn without replacement from `population`;
    the standard error is `s / sqrt(n) * sqrt(1 - n / population)` (sample
    standard deviation `s`, `ddof=1`, with the finite-population correction),
    and the interval is the mean +- 1.96 standard errors (normal
    approximation). A sample of the whole population has width 0.

    Args:
      values: One value per sampled client.
      population: The number of clients the sample was drawn from.

    Returns:
      The half-width, a Python float (0 for one value, as no spread can be
      estimated from it).

    Raises:
      ValueError: If `values` is empty or contains NaN, or `population` is
        smaller than the sample.
    """
    array = _as_vector(values, 'values')
    n = array.size
    if population < n:
        raise ValueError(f'population ({population}) is smaller than the sample ({n})')
    if n < 2:
        return 0.0
    standard_error = float(np.std(array, ddof=1)) / math.sqrt(n) * math.sqrt(1.0 - n / population)
    return _Z_95 * standard_error
