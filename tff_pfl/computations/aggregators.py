"""Custom `tff.aggregators` factories.

`PrecisionWeightedMeanFactory` is Self-FL's server step (Chen et al. 2022):
the mean of client values weighted by their precision (sigma_0^2 +
sigma_m^2)^-1 (Eq. 11), where each client sends its intra-client variance
sigma_m^2 as the "weight" and the inter-client variance sigma_0^2 is
estimated from the same values (Eq. 14) through federated sums only (sum,
sum of squares, count), so it composes with secure aggregation. With
user-level DP (`dp=`), every client's contribution is one bounded record
whose sum is clipped and noised at SERVER by TFF's
`DifferentiallyPrivateFactory` (docs/privacy.md, "Self-FL").
"""

import collections
import math

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp

from tff_pfl.computations import privacy

# Self-FL under DP: the scalar parts of a client's record are bounded by this share of the clip
# (the two vector parts by the clip itself), and a client weighs at most this many times a client
# of the typical sigma_m^2 (docs/privacy.md, "Self-FL").
DP_SCALAR_SHARE = 0.5
DP_PRECISION_CAP = 2.0


class PrecisionWeightedMeanFactory(tff.aggregators.WeightedAggregationFactory):
    """Precision-weighted mean with an online inter-client variance estimate.

    State (at SERVER): `<sigma0_sq, total_precision, mean_sigma_m_sq>`.
    `sigma0_sq <= 0` means "not estimated yet"; then every client gets weight
    1 (a plain mean). `mean_sigma_m_sq` is the mean of the positive
    sigma_m^2 the clients sent (0 if none): a typical client's uncertainty.

    `next(state, value@CLIENTS, sigma_m_sq@CLIENTS)`:
      * broadcasts `sigma0_sq`; each client forms p_m = 1 / (sigma0_sq +
        sigma_m_sq) (Eq. 11's weight);
      * sums p_m * value, p_m, value, the sum of squared entries of value, and
        1 over the clients;
      * returns sum(p_m value) / sum(p_m);
      * new state: sigma0_sq = the empirical variance of the clients' values,
        summed over entries (the trace; Eq. 14), with `ddof`; it is kept when
        fewer than `ddof + 1` clients took part, and never changed when
        `fixed_sigma0_sq` is given. total_precision = sum(p_m) * num_clients /
        (number of clients that took part): this round's precisions scaled to
        the whole population (0 while sigma0_sq was unknown).
    Measurements: `<sigma0_sq, total_precision, num_clients>` after the update.

    With `dp` (user-level DP, a fixed clip C), each client sends one record:
    w_m v~ and v~ (L2 norm at most C), and b w_m, b |v~|^2 / C^2 and
    b min(sigma_m^2, C^2) / C^2 (at most b = C / 2 each), where v~ is the
    value clipped to norm C and w_m = min(p_m / (2 p_typ), 1) its precision
    relative to twice that of a client of the typical sigma_m^2 (the state's
    `mean_sigma_m_sq`, broadcast with sigma0_sq), so that sum w_m stays near
    half the clients whatever the scale of the variances. The record's norm
    is at most C sqrt(2.75); TFF's `DifferentiallyPrivateFactory` with a
    Gaussian sum query of that clip adds N(0, (z C sqrt(2.75))^2) to every
    coordinate of the sum, at SERVER (after a secure sum with `secure`).
    The server divides by the expected clients per round n instead of the
    count (which is not released), and removes the noise's expected energy
    d (z C sqrt(2.75))^2 from |sum v~|^2 before estimating sigma0_sq (d: the
    value's entries); an estimate <= 0 keeps the previous sigma0_sq.
    Everything after the noise is post-processing, so the round is the
    Gaussian mechanism of multiplier z: `DPConfig.round_event`.

    The variance is shift-invariant, so clients may send their model updates
    (theta_m - theta) instead of their parameters, which keeps the sums of
    squares small.
    """

    def __init__(
        self,
        num_clients: int,
        *,
        fixed_sigma0_sq: float | None = None,
        ddof: int = 1,
        dp: 'privacy.DPConfig | None' = None,
        secure: bool = False,
    ):
        """Configures the factory.

        Args:
          num_clients: the population size M (for total_precision).
          fixed_sigma0_sq: a known inter-client variance (no estimation).
          ddof: delta degrees of freedom of the variance estimate (1:
            unbiased sample variance).
          dp: user-level DP with a fixed clip (class docstring); None: none.
          secure: sum the DP records with TFF's `SecureSumFactory` (every
            coordinate of a record lies in [-C, C]); needs `dp`.

        Raises:
          ValueError: a bad `num_clients` or `fixed_sigma0_sq`, adaptive
            clipping, or `secure` without `dp`.
        """
        if num_clients < 1:
            raise ValueError(f'num_clients must be >= 1, got {num_clients}')
        if fixed_sigma0_sq is not None and fixed_sigma0_sq <= 0:
            raise ValueError(f'fixed_sigma0_sq must be > 0, got {fixed_sigma0_sq}')
        if dp is not None and dp.adaptive:
            raise ValueError(
                "dp: Self-FL's DP record bounds its scalar parts by the clip, which the clients must know: give it a "
                'fixed clip, not an adaptive one'
            )
        if secure and dp is None:
            raise ValueError("secure=True needs dp: Self-FL's sums need a bounded range, which its DP record gives")
        self._num_clients = num_clients
        self._fixed = fixed_sigma0_sq
        self._ddof = ddof
        self._dp = dp
        self._secure = secure

    def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
        """Creates the precision-weighted mean `AggregationProcess`.

        Args:
          value_type: the `tff.Type` of the values to average (a tensor or a
            structure of float32 tensors).
          weight_type: the `tff.Type` of each client's sigma_m^2; a scalar
            `tff.TensorType`.

        Returns:
          A `tff.templates.AggregationProcess` whose state, result and
          measurements are described in the class docstring.

        Raises:
          TypeError: if `weight_type` is not a scalar tensor type.
        """
        if not (isinstance(weight_type, tff.TensorType) and weight_type.shape == ()):
            raise TypeError(f'the weight (sigma_m^2) must be a scalar, got {weight_type}')
        if self._dp is not None:
            return self._create_private(value_type, weight_type)
        num_clients, fixed, ddof = self._num_clients, self._fixed, self._ddof

        init_state = _initial_state(fixed)

        state_type = init_state.type_signature.result

        @tff.federated_computation
        def initialize():
            return tff.federated_eval(init_state, tff.SERVER)

        @tff.tensorflow.computation(value_type, weight_type, np.float32)
        def client_sums(value, sigma_m_sq, sigma0_sq):
            precision = tf.where(sigma0_sq > 0.0, 1.0 / (sigma0_sq + sigma_m_sq), 1.0)
            values = tf.nest.flatten(value)
            return collections.OrderedDict(
                weighted=tf.nest.map_structure(lambda v: precision * v, value),
                precision=precision,
                value=value,
                square=tf.add_n([tf.reduce_sum(tf.square(v)) for v in values]),
                count=tf.constant(1.0),
                sigma_sum=tf.maximum(sigma_m_sq, 0.0),
                sigma_count=tf.cast(sigma_m_sq > 0.0, tf.float32),
            )

        sums_type = client_sums.type_signature.result

        @tff.tensorflow.computation(state_type, sums_type)
        def server_step(state, sums):
            count = sums['count']
            mean = tf.nest.map_structure(lambda w: w / sums['precision'], sums['weighted'])
            squared_mean_sum = tf.add_n(
                [tf.reduce_sum(tf.square(v)) for v in tf.nest.flatten(sums['value'])]
            ) / tf.maximum(count, 1.0)
            variance = tf.maximum(sums['square'] - squared_mean_sum, 0.0) / tf.maximum(count - ddof, 1.0)
            if fixed is not None:
                sigma0_sq = state['sigma0_sq']
            else:
                sigma0_sq = tf.where(count > ddof, variance, state['sigma0_sq'])
            # Precisions are only defined once sigma0_sq was known when weighting.
            total_precision = tf.where(
                state['sigma0_sq'] > 0.0, sums['precision'] * num_clients / tf.maximum(count, 1.0), 0.0
            )
            new_state = collections.OrderedDict(
                sigma0_sq=sigma0_sq,
                total_precision=total_precision,
                mean_sigma_m_sq=sums['sigma_sum'] / tf.maximum(sums['sigma_count'], 1.0),
            )
            measurements = collections.OrderedDict(
                sigma0_sq=sigma0_sq, total_precision=new_state['total_precision'], num_clients=count
            )
            return collections.OrderedDict(state=new_state, result=mean, measurements=measurements)

        @tff.federated_computation(
            tff.FederatedType(state_type, tff.SERVER),
            tff.FederatedType(value_type, tff.CLIENTS),
            tff.FederatedType(weight_type, tff.CLIENTS),
        )
        def next_fn(state, value, sigma_m_sq):
            sigma0_sq = tff.federated_broadcast(tff.federated_map(_select_sigma0(state_type), state))
            sums = tff.federated_sum(tff.federated_map(client_sums, (value, sigma_m_sq, sigma0_sq)))
            out = tff.federated_map(server_step, (state, sums))
            return tff.templates.MeasuredProcessOutput(out.state, out.result, out.measurements)

        return tff.templates.AggregationProcess(initialize, next_fn)

    def _create_private(self, value_type, weight_type) -> tff.templates.AggregationProcess:
        num_clients, fixed, ddof, dp = self._num_clients, self._fixed, self._ddof, self._dp
        clip = float(dp.clip)
        scalar_clip = DP_SCALAR_SHARE * clip
        record_clip = clip * math.sqrt(2.0 + 3.0 * DP_SCALAR_SHARE**2)
        noise_stddev = float(dp.noise_multiplier) * record_clip
        expected = float(dp.clients_per_round)
        pair_type = tff.StructType([('sigma0_sq', np.float32), ('typical', np.float32)])

        @tff.tensorflow.computation(value_type, weight_type, pair_type)
        def client_record(value, sigma_m_sq, broadcast):
            sigma0_sq, typical = broadcast['sigma0_sq'], broadcast['typical']
            values = tf.nest.flatten(value)
            clipped, _ = tf.clip_by_global_norm(values, clip)
            clipped = tf.nest.pack_sequence_as(value, clipped)
            # p_m / (cap p_typ) = (sigma0^2 + typical) / (cap (sigma0^2 + sigma_m^2)), at most 1.
            relative = tf.where(
                sigma0_sq > 0.0,
                tf.minimum((sigma0_sq + typical) / (DP_PRECISION_CAP * (sigma0_sq + tf.maximum(sigma_m_sq, 0.0))), 1.0),
                1.0,
            )
            square = tf.add_n([tf.reduce_sum(tf.square(v)) for v in tf.nest.flatten(clipped)])
            return collections.OrderedDict(
                weighted=tf.nest.map_structure(lambda v: relative * v, clipped),
                value=clipped,
                precision=scalar_clip * relative,
                square=scalar_clip * square / (clip * clip),
                sigma_sum=scalar_clip * tf.minimum(tf.maximum(sigma_m_sq, 0.0), clip * clip) / (clip * clip),
            )

        record_type = client_record.type_signature.result
        query = tfp.GaussianSumQuery(l2_norm_clip=record_clip, stddev=noise_stddev)
        records = tff.aggregators.SecureSumFactory(clip) if self._secure else None
        dp_process = tff.aggregators.DifferentiallyPrivateFactory(query, records).create(record_type)

        init_own = _initial_state(fixed)

        dp_state_type = dp_process.initialize.type_signature.result.member

        @tff.tensorflow.computation(init_own.type_signature.result, dp_state_type)
        def with_dp(own, dp_state):
            return collections.OrderedDict(**own, dp=dp_state)

        @tff.federated_computation
        def initialize():
            return tff.federated_map(with_dp, (tff.federated_eval(init_own, tff.SERVER), dp_process.initialize()))

        state_type = initialize.type_signature.result.member

        @tff.tensorflow.computation(state_type)
        def select_dp(state):
            return state['dp']

        @tff.tensorflow.computation(state_type)
        def select_broadcast(state):
            return collections.OrderedDict(sigma0_sq=state['sigma0_sq'], typical=state['mean_sigma_m_sq'])

        @tff.tensorflow.computation(state_type, record_type, dp_state_type)
        def server_step(state, sums, dp_state):
            # Noise could make the sum of weights tiny or negative: floor it at 5 % of the expected clients
            # (a typical client weighs 1/2; its noise has stddev 3.3 z).
            relative_sum = tf.maximum(sums['precision'] / scalar_clip, 0.05 * expected)
            mean = tf.nest.map_structure(lambda w: w / relative_sum, sums['weighted'])
            summed = tf.nest.flatten(sums['value'])
            sum_norm_sq = tf.add_n([tf.reduce_sum(tf.square(v)) for v in summed])
            entries = float(sum(v.shape.num_elements() for v in summed))
            noise_energy = entries * noise_stddev**2  # E |noise|^2 over the summed values
            squared_mean_sum = (sum_norm_sq - noise_energy) / expected
            square_sum = sums['square'] * clip * clip / scalar_clip
            variance = (square_sum - squared_mean_sum) / max(expected - ddof, 1.0)
            previous = state['sigma0_sq']
            sigma0_sq = previous if fixed is not None else tf.where(variance > 0.0, variance, previous)
            # sum p_m = cap p_typ sum w_m for the round's weighting (no client over the cap), scaled to the
            # population; 0 while sigma0_sq was unknown.
            typical_precision = 1.0 / (tf.where(previous > 0.0, previous, 1.0) + state['mean_sigma_m_sq'])
            total_precision = tf.where(
                previous > 0.0, DP_PRECISION_CAP * typical_precision * relative_sum * (num_clients / expected), 0.0
            )
            new_state = collections.OrderedDict(
                sigma0_sq=sigma0_sq,
                total_precision=total_precision,
                mean_sigma_m_sq=tf.maximum(sums['sigma_sum'] * clip * clip / scalar_clip, 0.0) / expected,
                dp=dp_state,
            )
            measurements = collections.OrderedDict(
                sigma0_sq=sigma0_sq, total_precision=total_precision, num_clients=tf.constant(expected)
            )
            return collections.OrderedDict(state=new_state, result=mean, measurements=measurements)

        step_type = server_step.type_signature.result

        @tff.tensorflow.computation(
            step_type['measurements'], dp_process.next.type_signature.result.measurements.member
        )
        def merge(own, dp_measurements):
            return collections.OrderedDict(**own, dp=dp_measurements)

        @tff.federated_computation(
            tff.FederatedType(state_type, tff.SERVER),
            tff.FederatedType(value_type, tff.CLIENTS),
            tff.FederatedType(weight_type, tff.CLIENTS),
        )
        def next_fn(state, value, sigma_m_sq):
            broadcast = tff.federated_broadcast(tff.federated_map(select_broadcast, state))
            records_out = tff.federated_map(client_record, (value, sigma_m_sq, broadcast))
            noised = dp_process.next(tff.federated_map(select_dp, state), records_out)
            out = tff.federated_map(server_step, (state, noised.result, noised.state))
            measurements = tff.federated_map(merge, (out.measurements, noised.measurements))
            return tff.templates.MeasuredProcessOutput(out.state, out.result, measurements)

        return tff.templates.AggregationProcess(initialize, next_fn)


def _initial_state(fixed_sigma0_sq):
    """The state before any round: sigma0_sq unknown (-1) unless fixed, no precision, no typical sigma_m^2."""

    @tff.tensorflow.computation
    def init_state():
        return collections.OrderedDict(
            sigma0_sq=tf.constant(fixed_sigma0_sq if fixed_sigma0_sq is not None else -1.0, tf.float32),
            total_precision=tf.constant(0.0),
            mean_sigma_m_sq=tf.constant(0.0),
        )

    return init_state


def _select_sigma0(state_type):
    @tff.tensorflow.computation(state_type)
    def select(state):
        return state['sigma0_sq']

    return select
