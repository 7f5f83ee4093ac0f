"""User-level differential privacy of what clients upload: clipping, Gaussian noise, accounting.

DP-FedAvg (McMahan et al., 2018, https://arxiv.org/abs/1710.06963): each
client's upload is clipped to L2 norm C, the clipped uploads are summed, the
server adds N(0, (z C)^2) noise to the sum and divides by the expected number
of clients per round. Every client counts once, whatever its number of
examples: one user's contribution is bounded by C, which is what user-level
DP needs. C is either fixed or adapted each round towards a quantile of the
clients' norms (Andrew et al., 2021, https://arxiv.org/abs/1905.03871),
privately: the count of unclipped clients is noised too, and the value noise
is raised so that the pair costs what noise multiplier z alone would.

Both are TFF's own `tff.aggregators.DifferentiallyPrivateFactory` with the
queries of its `gaussian_fixed` and `gaussian_adaptive`; the noise is added
at SERVER, after the sum (central DP), which may be a secure sum
(`SecureSumFactory`). Without DP, `secure_mean_factory` is the
example-weighted mean through secure sums. The noise is drawn from TensorFlow's unseeded
generator, as in a deployment: a noise anyone could regenerate from a seed
would void the guarantee. So a DP run is not bit-for-bit reproducible, and a
resumed DP run continues with fresh noise.

Accounting (`epsilon`) uses `dp_accounting`'s RDP accountant on the event
the aggregator itself reports each round (`round_event` builds the same
event), amplified by Poisson sampling of clients with probability q when
q < 1, composed over the rounds.
"""

import dataclasses
import math

import dp_accounting
import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp

# Adaptive clipping's other parameters: TFF's defaults (Andrew et al.: an
# initial clip that starts small, a geometric learning rate of 0.2, and the
# unclipped count noised with stddev 0.05 x the expected clients per round).
ADAPTIVE_LEARNING_RATE = 0.2
DEFAULT_INITIAL_CLIP = 0.1


class PrivacyError(ValueError):
    """A differential-privacy configuration that cannot run."""


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """User-level DP of the uploads.

    Attributes:
      noise_multiplier: z, the noise standard deviation over the clip (>= 0).
      clients_per_round: the expected number of clients per round (q N); the
        noised sum is divided by it.
      clip: a fixed clipping norm C; None: adaptive clipping.
      target_quantile: adaptive clipping's target share of unclipped clients,
        in (0, 1); None with a fixed clip.
      initial_clip: adaptive clipping's initial norm.
    """

    noise_multiplier: float
    clients_per_round: float
    clip: float | None = None
    target_quantile: float | None = None
    initial_clip: float = DEFAULT_INITIAL_CLIP

    def __post_init__(self):
        problems = [
            (self.noise_multiplier >= 0, f'dp_noise_multiplier must be >= 0, got {self.noise_multiplier}'),
            (self.clients_per_round > 0, f'the expected clients per round must be > 0, got {self.clients_per_round}'),
            (
                (self.clip is None) != (self.target_quantile is None),
                'give --dp_clip (fixed clipping) or --dp_target_quantile (adaptive clipping), one of them',
            ),
            (self.clip is None or self.clip > 0, f'dp_clip must be > 0, got {self.clip}'),
            (
                self.target_quantile is None or 0 < self.target_quantile < 1,
                f'dp_target_quantile must be in (0, 1), got {self.target_quantile}',
            ),
            (self.initial_clip > 0, f'dp_initial_clip must be > 0, got {self.initial_clip}'),
        ]
        for ok, message in problems:
            if not ok:
                raise PrivacyError(message)
        if self.adaptive and self.noise_multiplier > 0:
            try:
                _adaptive_split(self.noise_multiplier, self.clients_per_round)
            except ValueError:
                raise PrivacyError(
                    f'adaptive clipping cannot reach noise multiplier {self.noise_multiplier:g} with '
                    f'{self.clients_per_round:g} expected clients per round (the unclipped count is noised with '
                    f'stddev 0.05 x clients per round, which must exceed half the multiplier); sample more clients '
                    'or use --dp_clip'
                ) from None

    @property
    def adaptive(self) -> bool:
        """Whether the clip adapts to a quantile of the clients' norms."""
        return self.clip is None

    def noise_parameters(self) -> tuple[float, float]:
        """The noise multiplier of the values and the stddev of the unclipped count.

        Returns:
          `(z_values, count_stddev)`: with a fixed clip `(z, 0)`; adaptive,
          TFF's split (`adaptive_clip_noise_params`), in which the two
          Gaussian releases together cost what one with multiplier z would.
        """
        if not self.adaptive:
            return self.noise_multiplier, 0.0
        return _adaptive_split(self.noise_multiplier, self.clients_per_round)

    def factory(self, *, secure: bool = False) -> tff.aggregators.UnweightedAggregationFactory:
        """The aggregation of the uploads: clip, sum, noise at SERVER, divide by `clients_per_round`.

        Args:
          secure: sum the clipped records with TFF's `SecureSumFactory`
            (`federated_secure_sum_bitwidth`) instead of a plain sum; the
            noise is still added at SERVER, after the secure sum. With a
            fixed clip C every coordinate of a record lies in [-C, C], the
            secure sum's range; with adaptive clipping the range adapts
            (`secure_range`). Clipping coordinates never raises a record's
            L2 norm, so the DP guarantee is unchanged.

        Returns:
          TFF's `DifferentiallyPrivateFactory` (its `gaussian_fixed` or
          `gaussian_adaptive` query).
        """
        z, cpr = float(self.noise_multiplier), float(self.clients_per_round)
        if self.adaptive:
            values_z, count_stddev = self.noise_parameters()
            query = tfp.QuantileAdaptiveClipSumQuery(
                initial_l2_norm_clip=float(self.initial_clip),
                noise_multiplier=values_z,
                target_unclipped_quantile=float(self.target_quantile),
                learning_rate=ADAPTIVE_LEARNING_RATE,
                clipped_count_stddev=count_stddev,
                expected_num_records=cpr,
                geometric_update=True,
            )
            records = tff.aggregators.SecureSumFactory(secure_range()) if secure else None
        else:
            clip = float(self.clip)
            query = tfp.GaussianSumQuery(l2_norm_clip=clip, stddev=clip * z)
            records = tff.aggregators.SecureSumFactory(clip) if secure else None
        return tff.aggregators.DifferentiallyPrivateFactory(tfp.NormalizedQuery(query, denominator=cpr), records)

    def round_event(self) -> dp_accounting.DpEvent:
        """What one round releases, before client sampling (the event the aggregator reports).

        Returns:
          `GaussianDpEvent(z)` with a fixed clip; adaptive, the composition of
          the values' and the unclipped count's Gaussian releases (the count
          has sensitivity 1/2).
        """
        if not self.adaptive:
            return dp_accounting.GaussianDpEvent(self.noise_multiplier)
        values, count_stddev = self.noise_parameters()
        count = count_stddev / 0.5 if count_stddev > 0 else 0.0
        return dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(values), dp_accounting.GaussianDpEvent(count)]
        )


def local_gaussian(value, clip: float, noise_multiplier: float):
    """A client's own Gaussian mechanism (local DP): clip to L2 norm C, add N(0, (2 z C)^2) (TF code).

    The server sees this value alone (a slot of its own), so the noise is
    added on the client. Two datasets of one user give values within the
    ball of radius C, at most 2C apart: the noise of stddev 2 z C makes one
    upload the Gaussian mechanism of multiplier z (`GaussianDpEvent(z)`),
    with no amplification by sampling, since the server knows who sent it.
    The noise comes from TensorFlow's unseeded generator, fresh for every
    client and every call.

    Args:
      value: a float32 tensor (soft predictions `[P, C]`, parameters `[D]`).
      clip: C > 0, the bound on the value's L2 norm.
      noise_multiplier: z >= 0.

    Returns:
      The clipped, noised tensor.
    """
    clipped = tf.clip_by_norm(value, clip)
    if noise_multiplier == 0:
        return clipped
    return clipped + tf.random_normal_initializer(stddev=2.0 * noise_multiplier * clip)(tf.shape(value))


def secure_range() -> tff.templates.EstimationProcess:
    """The adaptive range of a secure sum: TFF's own (`tff.learning.secure_aggregator`).

    The bound on |value| starts at 50 and follows twice the 0.95 quantile of
    the clients' largest absolute coordinates, estimated through secure sums
    of indicators; values beyond it are clipped to it and counted
    (`secure_upper_clipped_count`, `secure_lower_clipped_count`).

    Returns:
      A `tff.aggregators.PrivateQuantileEstimationProcess` without noise.
    """
    return tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
        initial_estimate=50.0, target_quantile=0.95, learning_rate=1.0, multiplier=2.0, secure_estimation=True
    )


# The range of the secure sum of the weights (examples) in `secure_mean_factory`: TFF's.
SECURE_WEIGHT_LIMIT = 2**20 - 1


def secure_mean_factory(max_weight: float) -> tff.aggregators.WeightedAggregationFactory:
    """The example-weighted mean through secure sums (without DP).

    TFF's `tff.learning.secure_aggregator` without its robustness options
    (zeroing, norm clipping), which would change the algorithms: the weighted
    values are summed in `secure_range`, the weights in [0, 2^20 - 1].

    Args:
      max_weight: the largest weight a client can send (its training
        examples).

    Returns:
      A weighted `tff.aggregators.MeanFactory` over `SecureSumFactory`s.

    Raises:
      PrivacyError: `max_weight` does not fit the weights' range (it would be
        clipped, and the mean silently wrong).
    """
    if max_weight > SECURE_WEIGHT_LIMIT:
        raise PrivacyError(
            f'secure aggregation: a client weighs {max_weight:g} (its training examples), more than the secure '
            f'sum of weights holds ({SECURE_WEIGHT_LIMIT})'
        )
    return tff.learning.secure_aggregator(zeroing=False, clipping=False, weighted=True)


def _adaptive_split(noise_multiplier: float, clients_per_round: float) -> tuple[float, float]:
    from tensorflow_federated.python.aggregators import differential_privacy

    return differential_privacy.adaptive_clip_noise_params(float(noise_multiplier), float(clients_per_round))


def default_delta(num_clients: int) -> float:
    """delta = 1 / N^1.1: below 1/N, so that no single user's data may leak with that probability.

    Args:
      num_clients: N, the population (users).

    Returns:
      The delta of the reported (epsilon, delta).
    """
    return float(num_clients) ** -1.1


def sampled_event(event: dp_accounting.DpEvent, sampling_probability: float) -> dp_accounting.DpEvent:
    """One round's event with its client sampling: Poisson with probability q, or everyone.

    Args:
      event: the round's release (`DPConfig.round_event`).
      sampling_probability: q in (0, 1].

    Returns:
      `PoissonSampledDpEvent(q, event)`, or `event` itself when q = 1.
    """
    if sampling_probability >= 1.0:
        return event
    return dp_accounting.PoissonSampledDpEvent(sampling_probability, event)


def epsilon(dp: DPConfig, sampling_probability: float, rounds: int, delta: float) -> float:
    """epsilon after `rounds` rounds at `delta`, by the RDP accountant.

    Args:
      dp: the mechanism.
      sampling_probability: q, each client's chance to take part in a round.
      rounds: rounds run so far (>= 0).
      delta: the delta of (epsilon, delta).

    Returns:
      epsilon; 0 before any round, inf without noise.
    """
    if rounds <= 0:
        return 0.0
    if dp.noise_multiplier == 0:
        return math.inf
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(sampled_event(dp.round_event(), sampling_probability), rounds)
    return float(accountant.get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float, sampling_probability: float, rounds: int, delta: float, **mechanism
) -> float:
    """The smallest noise multiplier whose epsilon after `rounds` rounds is at most `target_epsilon`.

    `dp_accounting.calibrate_dp_mechanism` over `epsilon`'s schedule (for a
    suite's rows at chosen epsilons: `benchmarks/dp_noise.py`).

    Args:
      target_epsilon: epsilon to reach (> 0).
      sampling_probability: q.
      rounds: rounds of the run.
      delta: the delta of (epsilon, delta).
      **mechanism: `DPConfig` fields besides the noise multiplier (default:
        a fixed clip; adaptive clipping's event depends on
        `clients_per_round`).

    Returns:
      z, within 1e-4 above the exact calibration.
    """
    fields = {'clients_per_round': 1.0, 'clip': 1.0, **mechanism}

    def event(z: float) -> dp_accounting.DpEvent:
        release = DPConfig(noise_multiplier=z, **fields).round_event()
        return dp_accounting.SelfComposedDpEvent(sampled_event(release, sampling_probability), rounds)

    return float(
        dp_accounting.calibrate_dp_mechanism(
            dp_accounting.rdp.RdpAccountant,
            event,
            target_epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )
