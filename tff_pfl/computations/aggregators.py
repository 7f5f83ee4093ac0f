"""Custom `tff.aggregators` factories.

`PrecisionWeightedMeanFactory` is Self-FL's server step (Chen et al. 2022):
the mean of client values weighted by their precision (sigma_0^2 +
sigma_m^2)^-1 (Eq. 11), where each client sends its intra-client variance
sigma_m^2 as the "weight" and the inter-client variance sigma_0^2 is
estimated from the same values (Eq. 14) through federated sums only (sum,
sum of squares, count), so it composes with secure aggregation.
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


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

    The variance is shift-invariant, so clients may send their model updates
    (theta_m - theta) instead of their parameters, which keeps the sums of
    squares small.
    """

    def __init__(self, num_clients: int, *, fixed_sigma0_sq: float | None = None, ddof: int = 1):
        """Configures the factory.

        Args:
          num_clients: the population size M (for total_precision).
          fixed_sigma0_sq: a known inter-client variance (no estimation).
          ddof: delta degrees of freedom of the variance estimate (1:
            unbiased sample variance).
        """
        if num_clients < 1:
            raise ValueError(f'num_clients must be >= 1, got {num_clients}')
        if fixed_sigma0_sq is not None and fixed_sigma0_sq <= 0:
            raise ValueError(f'fixed_sigma0_sq must be > 0, got {fixed_sigma0_sq}')
        self._num_clients = num_clients
        self._fixed = fixed_sigma0_sq
        self._ddof = ddof

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
        num_clients, fixed, ddof = self._num_clients, self._fixed, self._ddof

        @tff.tensorflow.computation
        def init_state():
            return collections.OrderedDict(
                sigma0_sq=tf.constant(fixed if fixed is not None else -1.0, tf.float32),
                total_precision=tf.constant(0.0),
                mean_sigma_m_sq=tf.constant(0.0),
            )

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


def _select_sigma0(state_type):
    @tff.tensorflow.computation(state_type)
    def select(state):
        return state['sigma0_sq']

    return select
