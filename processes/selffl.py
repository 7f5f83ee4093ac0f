"""Self-FL: uncertainty-driven initialization, local steps and aggregation.

H. Chen, J. Ding, E. Tramel, S. Wu, A. K. Sahu, S. Avestimehr, T. Zhang,
"Self-Aware Personalized Federated Learning" (NeurIPS 2022), Algorithm 1.

Per round t and sampled client m, with sigma_0^2 the inter-client and
sigma_m^2 the intra-client uncertainty, p_k = (sigma_0^2 + sigma_k^2)^-1 and
S_-m = sum_{k != m} p_k:

* sigma_m^2 (Eq. 13): empirical variance of the client's personal parameters
  over the rounds it took part in, summed over entries, kept online (Welford)
  in its state; or, for the Gaussian model, the known s^2 / N_m;
* theta_m^INIT = theta^{t-1} - (p_m / S_-m)(theta_m^{t-1} - theta^{t-1})
  (Eq. 10); the server broadcasts sum_k p_k and each client removes its own;
* l_m from Eq. 8, (1 - eta / sigma_m^2)^l = S_-m / (1/sigma_m^2 + S_-m), capped
  at l_max, for the quadratic model; for other losses a rule that keeps Eq.
  8's log-contraction, calibrated on a typical client (`local_steps`);
* theta_m^t = l_m steps of (minibatch) gradient descent from theta_m^INIT;
* the server's precision-weighted mean (Eq. 11) and sigma_0^2 (Eq. 14), both
  from federated sums (`aggregators.PrecisionWeightedMeanFactory`), and the
  smoothing average theta^t = (1 - C) theta^{t-1} + C theta_hat^t (§4.1).

Choices where the paper is silent: docs/algorithms/selffl.md.
"""

import collections
import dataclasses
import math
import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, client_plots, reports
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    aggregators,
    averaging,
    builder_inputs,
    building_blocks,
    local_training,
    model_weights,
    privacy,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_selffl_process', 'SelfFLSettings']

GAUSSIAN = 'gaussian'  # `loss=GAUSSIAN`: the two-level Gaussian model of Chen et al. (2022), §2

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class SelfFLSettings(settings_lib.ClientSGD):
    """Self-FL's settings: client SGD, the cap on local steps and the warm start.

    Self-FL chooses each client's local steps (Eq. 8), so it takes neither
    `local_epochs` nor `local_steps`. Defaults and where they come from:
    docs/algorithms/selffl.md, "Settings".
    """

    client_learning_rate: float = _setting(0.03, 'eta, the client SGD learning rate.')
    selffl_max_steps: int = _setting(40, "l_max, Self-FL: the cap on a client's local steps (Eq. 8).")
    selffl_default_steps: int = _setting(
        20,
        'Self-FL: local steps while the uncertainties are unknown (warm-up, first rounds); '
        "a typical client's steps afterwards (networks).",
    )
    warmup_rounds: int = _setting(0, 'Self-FL: plain FedAvg rounds (uniform mean) before Self-FL starts (warm start).')
    selffl_smoothing: float = _setting(
        0.0,
        "Self-FL: w in the server's smoothing average theta^t = (1 - w) theta^{t-1} + w theta_hat^t; "
        '0: the activity rate C (--client_fraction), as in the paper; at cross-device rates C barely moves '
        'the model: set 1 (docs/algorithms/selffl.md).',
    )

    def _checks(self):
        return super()._checks() + [
            (self.selffl_max_steps >= 1, f'selffl_max_steps must be >= 1, got {self.selffl_max_steps}'),
            (self.selffl_default_steps >= 1, f'selffl_default_steps must be >= 1, got {self.selffl_default_steps}'),
            (
                self.selffl_default_steps <= self.selffl_max_steps,
                f'selffl_default_steps must be <= selffl_max_steps ({self.selffl_max_steps}), '
                f'got {self.selffl_default_steps}',
            ),
            (self.warmup_rounds >= 0, f'warmup_rounds must be >= 0, got {self.warmup_rounds}'),
            (
                0.0 <= self.selffl_smoothing <= 1.0,
                f'selffl_smoothing must be in [0, 1] (0: the activity rate), got {self.selffl_smoothing}',
            ),
        ]


def local_steps(
    eta,
    sigma_m_sq,
    others_precision,
    l_max: int,
    *,
    quadratic: bool = True,
    typical_rho=None,
    default_steps: int | None = None,
):
    """Number of local steps (Eq. 8) and the step size to use (TF code).

    Eq. 8 sets l so that l gradient steps contract the distance to the local
    optimum by rho = S_-m / (1/sigma_m^2 + S_-m): the weight the FL-optimal
    posterior mean (Eq. 3) keeps on everyone else. It is derived for the
    quadratic loss of Eq. 4, where one step contracts by exactly
    (1 - eta / sigma_m^2), and is defined only when 0 < eta / sigma_m^2 < 1.

    * Quadratic loss, Eq. 8 defined: l = round(log rho / log(1 - eta /
      sigma_m^2)), clipped to [1, l_max].
    * Quadratic loss, eta / sigma_m^2 >= 1 (one step reaches or passes the
      optimum): l = ceil(l_max (1 - rho)), clipped to [1, l_max].
    * Any other loss (networks): a step's contraction is not eta /
      sigma_m^2, so Eq. 8's premise fails whatever the numbers. The rule
      keeps its log-contraction and calibrates it on the population: a
      client with the typical contraction `typical_rho` does
      `default_steps` (the baseline's local steps), others in proportion,
      l = round(default_steps log rho / log typical_rho), clipped to
      [1, l_max]. For rho near 1 this is default_steps (1 - rho) / (1 -
      typical_rho): clients whose personal models fluctuate less (more or
      cleaner data) train longer, noisier ones shorter, as the paper intends
      (§3.2), and the count does not shrink with the number of clients.

    Args:
      eta: learning rate.
      sigma_m_sq: the client's intra-client variance (> 0).
      others_precision: S_-m (> 0).
      l_max: the cap.
      quadratic: whether the loss is Eq. 4's quadratic.
      typical_rho: the contraction of a client with the population's mean
        sigma_m^2 (non-quadratic losses).
      default_steps: the calibration's step count (non-quadratic losses;
        `selffl_default_steps`).

    Returns:
      `(steps, exact_eta, eq8_defined)`: int32 steps; the step size for
      which `steps` quadratic steps contract by exactly rho,
      sigma_m^2 (1 - rho^(1/steps)) (used for the Gaussian model, where
      rounding l would otherwise miss Eq. 8's target); and whether Eq. 8 was
      used.

    Raises:
      ValueError: if the loss is not quadratic and `typical_rho` or
        `default_steps` is missing.
    """
    if not quadratic and (typical_rho is None or default_steps is None):
        raise ValueError('the network rule needs typical_rho and default_steps')
    eta = tf.cast(eta, tf.float32)
    rho = others_precision / (1.0 / sigma_m_sq + others_precision)
    if quadratic:
        kappa = eta / sigma_m_sq
        defined = tf.logical_and(kappa > 0.0, kappa < 1.0)
        safe_kappa = tf.where(defined, kappa, 0.5)
        eq8 = tf.math.log(rho) / tf.math.log(1.0 - safe_kappa)
        raw = tf.where(defined, tf.round(eq8), tf.math.ceil(l_max * (1.0 - rho)))
    else:
        defined = tf.constant(False)
        typical = tf.clip_by_value(typical_rho, 1e-12, 1.0 - 1e-7)
        raw = tf.round(default_steps * tf.math.log(rho) / tf.math.log(typical))
    steps = tf.clip_by_value(raw, 1.0, float(l_max))
    exact_eta = sigma_m_sq * (1.0 - tf.pow(rho, 1.0 / steps))
    return tf.cast(steps, tf.int32), exact_eta, defined


def initialization(global_weights, personal_weights, own_precision, others_precision):
    """theta_m^INIT of Eq. 10 (TF code).

    Args:
      global_weights: theta^{t-1}, a list of tensors.
      personal_weights: theta_m^{t-1}, tensors matching `global_weights`.
      own_precision: p_m, a float32 scalar.
      others_precision: S_-m (> 0), a float32 scalar.

    Returns:
      The list of theta^{t-1} - (p_m / S_-m)(theta_m^{t-1} - theta^{t-1}).
    """
    shift = own_precision / others_precision
    return [g - shift * (p - g) for g, p in zip(global_weights, personal_weights)]


def welford_update(count, mean, m2, weights):
    """Adds one observation to an online variance summed over entries (TF code).

    Args:
      count: the number of observations so far (float32 scalar).
      mean: their running mean, a list of tensors.
      m2: the sum of squared deviations from the mean, summed over entries
        (float32 scalar).
      weights: the new observation, tensors matching `mean`.

    Returns:
      `(count, mean, m2)`; the empirical variance is m2 / (count - 1).
    """
    count = count + 1.0
    deltas = [w - m for w, m in zip(weights, mean)]
    mean = [m + d / count for m, d in zip(mean, deltas)]
    m2 = m2 + tf.add_n([tf.reduce_sum(d * (w - m)) for d, w, m in zip(deltas, weights, mean)])
    return count, mean, m2


def _gaussian_loss(noise_var):
    def loss_fn(model, x, y):
        del y
        theta = model(x)
        # Negative log-likelihood of the batch (a sum, not a mean): its gradient
        # is (theta - z_m) / sigma_m^2 with sigma_m^2 = s^2 / N_m (Eq. 4-5).
        return tf.reduce_sum(tf.square(x - theta)) / (2.0 * noise_var), theta

    return loss_fn


@builder_inputs.checked
def build_selffl_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: SelfFLSettings | None = None,
    *,
    activity_rate: float = 1.0,
    loss: local_training.Loss | str | None = None,
    metrics: local_training.MetricsArg | None = None,
    known_sigma0_sq: float | None = None,
    gaussian_noise_var: float | None = None,
    dp: privacy.DPConfig | None = None,
    secure: bool = False,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: tff.aggregators.WeightedAggregationFactory
    | tff.aggregators.UnweightedAggregationFactory
    | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds Self-FL.

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras model.
      settings: a `SelfFLSettings` (eta, B, l_max, the warm-up steps and
        rounds); None: `SelfFLSettings()`.
      activity_rate: C, the share of clients sampled per round (the run's
        `client_fraction`); the server smooths theta^t = (1 - C) theta^{t-1}
        + C theta_hat^t, or with `settings.selffl_smoothing` in place of C
        if that is not 0.
      loss: the clients' training loss, as every builder takes it: None
        (cross-entropy), a `tf.keras.losses.Loss` on logits or a function
        `(labels, logits) -> one value per label` (`local_training.loss_from`);
        or 'gaussian', the paper's problem: the two-level Gaussian model of §2 (sum of squared errors
        / 2 s^2, full-batch steps (`batch_size` unused), sigma_m^2 = s^2 / N_m
        known, and the step size corrected so that the rounded number of steps
        contracts exactly as Eq. 8 asks).
      known_sigma0_sq: a known inter-client variance (no estimation).
      gaussian_noise_var: s^2, required with loss='gaussian'.
      dp: user-level DP of everything the clients upload, with a fixed clip
        (`aggregators.PrecisionWeightedMeanFactory`); None: none.
      secure: sum the DP records through secure sums (needs `dp`).
      server_optimizer: applied to the aggregated update; None: SGD at
        the smoothing weight w (`settings.selffl_smoothing`, or the activity rate).
      client_optimizer: not taken (ValueError if given): Self-FL sets each client's number of local
        SGD steps from its uncertainty (Chen et al., 2022, Eq. 8), derived for SGD.
      model_aggregator: not taken (ValueError if given): Self-FL's server sums one bounded record
        per client (update, precision weight, variance statistics) with its own aggregator; pass dp=
        and secure= for DP and secure aggregation.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess`. Client state: `<client_id,
      num_participations, last_round, personal, var_count, var_mean, var_m2,
      sigma_m_sq, local_steps>`; `evaluate` reports the global model and
      each client's personal model on its test split; the round metric
      `mean_local_steps` is the mean of the SGD steps the clients took.

    Raises:
      TypeError: if `settings` is not a `SelfFLSettings`.
      SettingsError: on a bad setting (`settings.validate()`).
      ValueError: on a bad `activity_rate`, `loss` or `gaussian_noise_var`,
        adaptive clipping, or `secure` without `dp`.
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = SelfFLSettings() if settings is None else settings
    if not isinstance(settings, SelfFLSettings):
        raise TypeError(f'build_selffl_process takes SelfFLSettings, got {type(settings).__name__}')
    settings.validate()
    building_blocks.refuse_unused(
        'build_selffl_process',
        dict(
            client_optimizer=(
                "Self-FL sets each client's number of local SGD steps from its uncertainty (Chen et al., "
                '2022, Eq. 8), derived for SGD'
            ),
            model_aggregator=(
                "Self-FL's server sums one bounded record per client (update, precision weight, variance "
                'statistics) with its own aggregator; pass dp= and secure= for DP and secure aggregation'
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=None if isinstance(loss, str) else loss,
        metrics=metrics,
    )
    gaussian = isinstance(loss, str) and loss == GAUSSIAN
    if isinstance(loss, str) and not gaussian:
        raise ValueError(f"loss must be 'gaussian', a Keras loss on logits, a function or None, got {loss!r}")
    if gaussian and not (gaussian_noise_var and gaussian_noise_var > 0):
        raise ValueError("loss='gaussian' needs gaussian_noise_var > 0")
    if not 0.0 < activity_rate <= 1.0:
        raise ValueError(f'activity_rate (--client_fraction) must be in (0, 1], got {activity_rate}')
    learning_rate = settings.client_learning_rate
    batch_size = settings.batch_size
    l_max = settings.selffl_max_steps
    default_steps = settings.selffl_default_steps
    warmup_rounds = settings.warmup_rounds
    smoothing = settings.selffl_smoothing or activity_rate

    loss_fn = _gaussian_loss(gaussian_noise_var) if gaussian else local_training.loss_from(loss, spec)
    weights_type = model_weights.weights_type(model_fn)
    test_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )
    aggregator = aggregators.PrecisionWeightedMeanFactory(
        spec.num_clients, fixed_sigma0_sq=known_sigma0_sq, dp=dp, secure=secure
    )

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        zeros = [tf.zeros(t.shape, t.dtype) for t in weights_type]
        return building_blocks.participation_state(
            client_id,
            personal=zeros,  # theta_m; a first participation starts from the global model
            var_count=tf.constant(0.0),
            var_mean=zeros,
            var_m2=tf.constant(0.0),
            sigma_m_sq=tf.constant(0.0),
            local_steps=tf.constant(0, tf.int32),
        )

    client_state_type = initial_client_state.type_signature.result

    def server_info(aggregator_state_type):
        @tff.tensorflow.computation(aggregator_state_type)
        def info(state):
            return collections.OrderedDict(
                sigma0_sq=state['sigma0_sq'],
                total_precision=state['total_precision'],
                mean_sigma_m_sq=state['mean_sigma_m_sq'],
            )

        return info

    info_type = tff.to_type(
        collections.OrderedDict(sigma0_sq=np.float32, total_precision=np.float32, mean_sigma_m_sq=np.float32)
    )

    @tff.tensorflow.computation(weights_type, np.int32, info_type, client_state_type)
    def client_work(weights, round_num, info, state):
        client_id = state['client_id']
        data = client_data.read_split(spec, client_id, 'train')
        sigma0_sq = info['sigma0_sq']
        if gaussian:
            sigma_m_sq = tf.constant(gaussian_noise_var, tf.float32) / tf.cast(data.num_examples, tf.float32)
        else:
            # Eq. 13; before two observations, the inter-client variance stands in.
            sigma_m_sq = tf.where(
                state['var_count'] >= 2.0, state['var_m2'] / tf.maximum(state['var_count'] - 1.0, 1.0), sigma0_sq
            )
        total_precision = info['total_precision']
        active = tf.logical_and(
            tf.logical_and(sigma0_sq > 0.0, sigma_m_sq > 0.0),
            tf.logical_and(total_precision > 0.0, round_num >= warmup_rounds),
        )
        safe_sigma_m_sq = tf.where(active, sigma_m_sq, 1.0)
        own_precision = 1.0 / (tf.where(active, sigma0_sq, 1.0) + safe_sigma_m_sq)
        # S_-m = S - p_m. S is last round's (scaled) sum, so with estimated
        # variances it can fall below p_m; then the others are taken to weigh
        # like an average client: S (M - 1) / M.
        others_precision = tf.where(
            total_precision - own_precision > 0.0,
            total_precision - own_precision,
            total_precision * (spec.num_clients - 1) / spec.num_clients,
        )
        others_precision = tf.maximum(others_precision, 1e-12)
        previous = [tf.where(state['num_participations'] > 0, p, g) for p, g in zip(state['personal'], weights)]
        init = initialization(weights, previous, own_precision, others_precision)
        typical_sigma_sq = tf.where(info['mean_sigma_m_sq'] > 0.0, info['mean_sigma_m_sq'], safe_sigma_m_sq)
        typical_others = tf.maximum(total_precision - 1.0 / (sigma0_sq + typical_sigma_sq), 1e-12)
        typical_rho = typical_others / (1.0 / typical_sigma_sq + typical_others)
        steps, exact_eta, _ = local_steps(
            learning_rate,
            safe_sigma_m_sq,
            others_precision,
            l_max,
            quadratic=gaussian,
            typical_rho=typical_rho,
            default_steps=default_steps,
        )
        eta = exact_eta if gaussian else tf.constant(learning_rate, tf.float32)
        steps = tf.where(active, steps, default_steps)
        eta = tf.where(active, eta, learning_rate)
        init = [tf.where(active, i, w) for i, w in zip(init, weights)]

        model = model_fn()
        with tf.control_dependencies(model_weights.fresh_weights(model, init)):
            stats = local_training.train(
                model,
                data,
                epochs=steps,  # at least one step per epoch, so `steps` epochs suffice
                batch_size=data.num_examples if gaussian else batch_size,
                learning_rate=eta,
                seed=local_training.client_seed(seed, round_num, client_id),
                loss_fn=loss_fn,
                max_steps=steps,
            )
        with tf.control_dependencies(list(stats)):
            personal = model_weights.get_weights(model)
        count, mean, m2 = state['var_count'], state['var_mean'], state['var_m2']
        if not gaussian:
            recorded = welford_update(count, mean, m2, personal)
            keep = round_num >= warmup_rounds
            count = tf.where(keep, recorded[0], count)
            mean = [tf.where(keep, r, m) for r, m in zip(recorded[1], mean)]
            m2 = tf.where(keep, recorded[2], m2)
        sums = building_blocks.training_metric_sums(stats)  # local_steps: the SGD steps counted in training
        sums['sigma_m_sq'] = sigma_m_sq
        sums['active'] = tf.cast(active, tf.float32)
        return collections.OrderedDict(
            update=[w - p for w, p in zip(weights, personal)],
            # sigma_m^2 for the precision weight whenever there is one (known, or
            # the stand-in); 0 (equal weights) during warm-up and before any
            # variance is known.
            weight=tf.where(tf.logical_and(sigma_m_sq > 0.0, round_num >= warmup_rounds), sigma_m_sq, 0.0),
            metric_sums=sums,
            client_state=building_blocks.participated(
                state,
                round_num,
                personal=personal,
                var_count=count,
                var_mean=mean,
                var_m2=m2,
                sigma_m_sq=sigma_m_sq,
                local_steps=steps,
            ),
        )

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, state):
        personal = [tf.where(state['num_participations'] > 0, p, g) for p, g in zip(state['personal'], weights)]
        return collections.OrderedDict(
            global_model=test_evaluation(weights, state['client_id']),
            personalized_model=test_evaluation(personal, state['client_id']),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        # theta^t = theta^{t-1} - w * mean(theta^{t-1} - theta_m^t): the smoothing average (w = C by default).
        server_optimizer=server_optimizer or tff.learning.optimizers.build_sgdm(learning_rate=smoothing),
        model_aggregator=aggregator,
        server_info=server_info,
        seed=seed,
    )


def _build(settings, spec, model_fn, run):
    return build_selffl_process(
        spec, model_fn, settings, activity_rate=run.client_fraction, dp=run.dp, secure=run.secure, seed=run.seed
    )


def _columns(state):
    return collections.OrderedDict(
        num_participations=int(state['num_participations']),
        local_steps=int(state['local_steps']),
        sigma_m_sq=float(state['sigma_m_sq']),
    )


def _plots(out, result, process):
    del process
    client_ids, fields = client_plots.client_fields(result.client_states, ('sigma_m_sq', 'local_steps'))
    short = client_plots.short_ids(client_ids)
    sigma_m_sq, steps = fields['sigma_m_sq'], fields['local_steps']
    order = sorted(range(len(client_ids)), key=lambda i: float(sigma_m_sq[i]))
    if len(order) > 60:  # a readable sample of clients, spread over the range
        order = [order[int(i)] for i in np.linspace(0, len(order) - 1, 60)]
    reports.plot_client_bars(
        [short[i] for i in order],
        {'local steps (last round)': [int(steps[i]) for i in order]},
        os.path.join(out, 'local_steps.png'),
        'Self-FL local steps per client (sorted by sigma_m^2)',
        'steps',
    )
    reports.plot_client_bars(
        [short[i] for i in order],
        {'sigma_m^2': [float(sigma_m_sq[i]) for i in order]},
        os.path.join(out, 'intra_client_variance.png'),
        'Intra-client uncertainty sigma_m^2',
        'sigma_m^2',
    )
    return [('Local steps per client', 'local_steps.png'), ('Intra-client uncertainty', 'intra_client_variance.png')]


# Under DP each client's record (two vector parts of norm <= C, three scalars of <= C/2) has norm
# <= C sqrt(2.75) and gets that noise scale; the precision-weighted mean divides the noised sum by
# sum(w_m), about n / 2 (docs/privacy.md): noise 2 sqrt(2.75) z C / n = sqrt(11) z C / n.
DP_NOISE_FACTOR = math.sqrt(11.0)
# Why Self-FL's DP takes a fixed clip and no secure aggregation without DP (one line each).
ADAPTIVE_CLIP_REFUSED = (
    "Self-FL's DP record bounds its scalar parts by the clip, which the clients must know: give --dp_clip, "
    'not --dp_target_quantile'
)
SECURE_NEEDS_DP = (
    "--secure_aggregation: Self-FL's sums need a bounded range, which its DP record gives: "
    'use it with --dp_noise_multiplier and --dp_clip'
)

ALGORITHMS = (
    algorithm.Algorithm(
        'selffl',
        'Self-FL (Chen et al., 2022): uncertainty-driven starting points, local steps and aggregation',
        SelfFLSettings,
        _build,
        _columns,
        _plots,
        privacy=algorithm.Privacy(
            'the sums of updates, precision weights and variance statistics, as one record per client '
            '(personal models stay on the clients)',
            noise_factor=DP_NOISE_FACTOR,
            fixed_clip_only=ADAPTIVE_CLIP_REFUSED,
            secure_needs_dp=SECURE_NEEDS_DP,
        ),
        family='model interpolation',
    ),
)
