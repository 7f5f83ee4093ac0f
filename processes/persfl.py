"""PersFL and PersFL-GD: optimal teachers from FedAvg, then local distillation.

S. Divi, H. Farrukh, Z. B. Celik, "Unifying Distillation with Personalization
in Federated Learning" (arXiv 2105.15191), Algorithm 1.

Stage 1 (lines 1-11, Eq. 2) is FedAvg in which every participating client, on
receiving the round's global model G_e and before training, computes G_e's
cross-entropy on its own validation split; if it is the lowest so far, G_e
becomes the client's optimal teacher O_k (kept in the client state with its
round and loss; it never leaves the client). Clients not sampled in a round
keep their teacher.

Stage 2 (lines 12-25, Eq. 3) is `personalize`, on clients only: each client
initialises its personalized model A_k with O_k and trains it on its training
split with (1 - lambda) CE(y, A_k) + lambda T^2 KL(softmax(O_k/T) ||
softmax(A_k/T)) for every (T, lambda) of a grid at once, keeping the candidate
with the best validation accuracy. PersFL-GD (Eq. 7) replaces the KL term by
the cross-entropy between the softened teacher and student.

Choices where the paper is silent are listed in docs/algorithms/persfl.md.
"""

import collections
import dataclasses
import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_pfl import algorithm, client_plots, losses, reports
from tff_pfl import settings as settings_lib
from tff_pfl.computations import (
    averaging,
    builder_inputs,
    building_blocks,
    distillation,
    local_training,
    model_weights,
    template,
)
from tff_pfl.data import client_data
from tff_pfl.models import adapters, stacked

# The module's public API (docs/api.md): its builder, its settings and what a user calls beside them.
__all__ = ['build_persfl_process', 'PersFLSettings', 'PersFLGDSettings']

TEACHERS = ('optimal', 'final')
SEARCHES = ('grid', 'halving')
REDUCTIONS = ('examples', 'elements')

_setting = settings_lib.setting


@dataclasses.dataclass(frozen=True)
class PersFLSettings(settings_lib.LocalTraining, settings_lib.ServerSGD):
    """PersFL's settings: stage 1 is FedAvg (local SGD, server step); stage 2 the distillation grid.

    PersFL-GD's are `PersFLGDSettings`, the same fields (the soft loss is the
    algorithm, given by the settings type, not a setting). Defaults and where they come from: docs/algorithms/persfl.md,
    "Settings".
    """

    distill_epochs: int = _setting(5, 'E, PersFL stage 2: distillation epochs of every (T, lambda) candidate.')
    distill_batch_size: int = _setting(32, 'PersFL stage 2: distillation mini-batch size.')
    distill_learning_rate: float = _setting(0.01, 'PersFL stage 2: distillation SGD learning rate.')
    temperatures: tuple[float, ...] = _setting(
        (1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0), '|T|_C, PersFL stage 2: the grid of distillation temperatures T.'
    )
    imitations: tuple[float, ...] = _setting(
        (0.0, 0.25, 0.5, 0.75, 1.0), '|lambda|_C, PersFL stage 2: the grid of imitation parameters lambda, in [0, 1].'
    )
    distill_search: str = _setting(
        'grid',
        "PersFL stage 2: 'grid' trains every (T, lambda) candidate for all distill_epochs; 'halving' ranks them "
        'on validation after 1/9 and 1/3 of the steps and keeps the best third each time (successive halving: '
        'the default 23 candidates cost 6.3 full trainings instead of 23).',
    )
    soft_reduction: str = _setting(
        'examples',
        "PersFL stage 2: the soft term's reduction. 'examples': summed over the C classes of an example, "
        "averaged over examples (Eq. 3's KL per example); 'elements': averaged over every logit, C times "
        "smaller (PyTorch's KLDivLoss() under its default reduction 'mean').",
    )
    teacher: str = _setting(
        'optimal',
        "PersFL stage 2: distil from each client's optimal teacher O_k ('optimal', Alg. 1) "
        "or the final global model ('final', the Table 4 ablation).",
    )

    def _checks(self):
        return super()._checks() + [
            (self.distill_epochs >= 1, f'distill_epochs must be >= 1, got {self.distill_epochs}'),
            (self.distill_batch_size >= 1, f'distill_batch_size must be >= 1, got {self.distill_batch_size}'),
            (self.distill_learning_rate > 0, f'distill_learning_rate must be > 0, got {self.distill_learning_rate}'),
            (
                len(self.temperatures) >= 1 and all(t > 0 for t in self.temperatures),
                f'temperatures must be positive numbers, got {list(self.temperatures)}',
            ),
            (
                len(self.imitations) >= 1 and all(0 <= i <= 1 for i in self.imitations),
                f'imitations must be numbers in [0, 1], got {list(self.imitations)}',
            ),
            (
                self.soft_reduction in REDUCTIONS,
                f"soft_reduction must be 'examples' or 'elements', got {self.soft_reduction!r}",
            ),
            (self.teacher in TEACHERS, f"teacher must be 'optimal' or 'final', got {self.teacher!r}"),
            (
                self.distill_search in SEARCHES,
                f"distill_search must be 'grid' or 'halving', got {self.distill_search!r}",
            ),
        ]

    def distill_config(self) -> settings_lib.TrainingConfig:
        """Stage 2's local SGD as a `TrainingConfig`.

        Returns:
          `distill_epochs` epochs of batch `distill_batch_size` at
          `distill_learning_rate`.
        """
        return settings_lib.TrainingConfig(self.distill_epochs, self.distill_batch_size, self.distill_learning_rate)

    @property
    def soft_loss(self) -> str:
        """Stage 2's soft loss, a `losses.SOFT_LOSSES` name: 'kl' (PersFL, Eq. 3), 'ce' for `PersFLGDSettings`.

        With `soft_reduction='elements'`: 'kl_elements' ('ce_elements').
        """
        return self._soft + ('' if self.soft_reduction == 'examples' else losses.ELEMENTS_SUFFIX)

    _soft = 'kl'


@dataclasses.dataclass(frozen=True)
class PersFLGDSettings(PersFLSettings):
    """PersFL-GD: PersFL's settings, with cross-entropy instead of KL as stage 2's soft loss (Eq. 7).

    The variant is the settings type, as for every algorithm with variants.
    """

    # Cross-entropy to the teacher's tempered predictions (Eq. 7).
    _soft = 'ce'


@builder_inputs.checked
def build_persfl_process(
    spec: client_data.ClientDataSpec,
    model_fn: Callable[[], tf.keras.Model],
    settings: PersFLSettings | None = None,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer | None = None,
    server_optimizer: tff.learning.optimizers.Optimizer | None = None,
    model_aggregator: averaging.Aggregator | None = None,
    loss: local_training.Loss | None = None,
    metrics: local_training.MetricsArg | None = None,
    seed: int = 0,
) -> template.PersonalizedProcess:
    """Builds PersFL (`PersFLSettings`) or PersFL-GD (`PersFLGDSettings`).

    Args:
      spec: the client partition on disk.
      model_fn: no-arg function returning a fresh Keras Sequential model
        (logits out) of layers `tff_pfl.models.stacked` supports.
      settings: a `PersFLSettings` (PersFL, KL, Eq. 3) or a
        `PersFLGDSettings` (PersFL-GD, cross-entropy, Eq. 7); None:
        `PersFLSettings()`.
      client_optimizer: the clients' local optimizer, a
        `tff.learning.optimizers.Optimizer` started fresh for each client's
        local training; None: SGD at `settings.client_learning_rate`.
      server_optimizer: applied to the aggregated update; None: SGD at
        `settings.server_learning_rate`.
      model_aggregator: aggregation of the uploaded updates (`averaging.build_averaging_process`);
        default the example-weighted mean. The program passes `privacy.DPConfig.factory()` under DP.
      loss: not taken (ValueError if given): PersFL's distillation objective
        is cross-entropy plus T^2 times a soft loss (Eq. 3), trained for every
        (T, lambda) of its grid at once.
      metrics: extra per-client test metrics, as the builder contract takes
        them (`local_training.metrics_from`).
      seed: run seed.

    Returns:
      A `template.PersonalizedProcess` with `personalize: (S@SERVER,
      {C}@CLIENTS) -> {C}@CLIENTS` and `grid_candidates`, the distinct
      `(T, lambda)` of the grid in the order of `grid_val_accuracy`. Client
      state: `<client_id, num_participations, last_round, teacher,
      teacher_loss, teacher_round, personalized, temperature, imitation,
      personalized_val_accuracy, grid_val_accuracy>`; `personalized` holds
      O_k until stage 2 has run. Metrics: FedAvg's, with `mean_local_steps`.

    Raises:
      TypeError: if `settings` is not a `PersFLSettings`.
      SettingsError: on a bad setting (`settings.validate()`).
      ValueError: a model with layers the stacked grid
        cannot run.
    """
    model_fn = adapters.keras_model_fn(model_fn)
    settings = PersFLSettings() if settings is None else settings
    if not isinstance(settings, PersFLSettings):
        raise TypeError(f'build_persfl_process takes PersFLSettings, got {type(settings).__name__}')
    settings.validate()
    client_data.require_validation(spec, "PersFL's teacher selection and distillation grid")
    building_blocks.refuse_unused(
        'build_persfl_process',
        dict(
            loss=(
                "PersFL's distillation objective is cross-entropy plus T^2 times a soft loss (Divi et al., 2021, "
                'Eq. 3), trained for every (T, lambda) of its grid at once; the teacher selection scores '
                'accuracy'
            ),
        ),
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        model_aggregator=model_aggregator,
        loss=loss,
        metrics=metrics,
    )
    soft_loss = settings.soft_loss
    local_config = settings.training_config()
    distill_config = settings.distill_config()
    candidates = distillation.grid_candidates(settings.temperatures, settings.imitations)
    grid_temperatures, grid_imitations = distillation.candidate_arrays(candidates)
    with tf.Graph().as_default():
        model = model_fn()
        try:
            layers = stacked.plan(model)
        except ValueError as e:
            raise ValueError(f"model_fn: PersFL's distillation grid cannot train {model.name!r} ({e})") from None

    weights_type = model_weights.weights_type(model_fn)
    client_training = building_blocks.build_client_training(
        spec, model_fn, local_config, seed=seed, optimizer=client_optimizer
    )
    test_evaluation = building_blocks.build_client_evaluation(
        spec, model_fn, metrics=local_training.metrics_from(metrics, spec)
    )
    val_evaluation = building_blocks.build_client_evaluation(spec, model_fn, 'val')

    @tff.tensorflow.computation(np.str_)
    def initial_client_state(client_id):
        zeros = [tf.zeros(t.shape, t.dtype) for t in weights_type]
        return building_blocks.participation_state(
            client_id,
            teacher=zeros,
            teacher_loss=tf.constant(np.inf, tf.float32),  # l_k', "arbitrarily large"
            teacher_round=tf.constant(-1, tf.int32),
            personalized=zeros,
            temperature=tf.constant(0.0),  # T chosen in stage 2 (0: not yet)
            imitation=tf.constant(0.0),  # lambda chosen in stage 2
            personalized_val_accuracy=tf.constant(0.0),
            grid_val_accuracy=tf.zeros([len(candidates)]),
        )

    client_state_type = initial_client_state.type_signature.result

    def consider_teacher(client_state, weights, round_num):
        """Algorithm 1 lines 5-9: keep G_e if its validation loss is lowest."""
        val_loss = val_evaluation(weights, client_state['client_id'])['loss']
        better = tf.less(val_loss, client_state['teacher_loss'])
        if settings.teacher == 'final':
            better = tf.constant(True)
        pick = lambda new, old: tf.where(better, new, old)  # noqa: E731
        new_teacher = [pick(w, t) for w, t in zip(weights, client_state['teacher'])]
        return dict(
            teacher=new_teacher,
            teacher_loss=pick(val_loss, client_state['teacher_loss']),
            teacher_round=pick(round_num, client_state['teacher_round']),
            personalized=new_teacher,  # A_k is initialised with O_k
        )

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_work(weights, round_num, client_state):
        updates = consider_teacher(client_state, weights, round_num)
        # Not behind a control dependency on the teacher's score (the two are independent): with one, a
        # BatchNormalization model's round failed now and then as TFF initialized this nested computation
        # ("Could not find variable .../moving_variance": 3 of 9 runs with it, none of 6 without).
        result = client_training(weights, round_num, client_state['client_id'])
        return collections.OrderedDict(
            update=result['update'],
            weight=result['weight'],
            metric_sums=result['metric_sums'],
            client_state=building_blocks.participated(client_state, round_num, **updates),
        )

    @tff.tensorflow.computation(weights_type, np.int32, client_state_type)
    def client_personalize(weights, round_num, client_state):
        # The final global model is a teacher candidate too (see docs).
        updates = consider_teacher(client_state, weights, round_num)
        train = client_data.read_split(spec, client_state['client_id'], 'train')
        val = client_data.read_split(spec, client_state['client_id'], 'val')
        search = distillation.distill_halving if settings.distill_search == 'halving' else distillation.distill_grid
        grid = search(
            layers,
            updates['teacher'],
            train,
            val,
            temperatures=tf.constant(grid_temperatures),
            imitations=tf.constant(grid_imitations),
            config=distill_config,
            seed=local_training.client_seed(seed, round_num, client_state['client_id'], salt=1),
            soft=soft_loss,
        )
        state = collections.OrderedDict((k, client_state[k]) for k in client_state)
        state.update(updates)
        state['personalized'] = [w[grid.best] for w in grid.weights]
        state['temperature'] = tf.gather(grid_temperatures, grid.best)
        state['imitation'] = tf.gather(grid_imitations, grid.best)
        state['personalized_val_accuracy'] = grid.val_accuracy[grid.best]
        state['grid_val_accuracy'] = grid.val_accuracy
        return state

    @tff.tensorflow.computation(weights_type, client_state_type)
    def evaluate_client(weights, client_state):
        client_id = client_state['client_id']
        return collections.OrderedDict(
            global_model=test_evaluation(weights, client_id),
            personalized_model=test_evaluation(client_state['personalized'], client_id),
        )

    return averaging.build_averaging_process(
        model_fn,
        client_work=client_work,
        initial_client_state=initial_client_state,
        evaluate_client=evaluate_client,
        server_optimizer=server_optimizer or settings.server_optimizer(),
        personalize_builder=averaging.broadcast_personalize(client_personalize),
        model_aggregator=model_aggregator,
        seed=seed,
        extras={'grid_candidates': tuple((float(t), float(lam)) for t, lam in candidates)},
    )


def _columns(state):
    return collections.OrderedDict(
        teacher_round=int(state['teacher_round']),
        teacher_val_loss=float(state['teacher_loss']),
        temperature=float(state['temperature']),
        imitation=float(state['imitation']),
        personalized_val_accuracy=float(state['personalized_val_accuracy']),
    )


def _plots(out, result, process):
    # One pass over the client states for every field the plots show (a store's view reads them from disk).
    client_ids, fields = client_plots.client_fields(
        result.client_states, ('teacher_round', 'temperature', 'imitation', 'grid_val_accuracy')
    )
    for field, file, label, title, ylabel, kind in (
        (
            'teacher_round',
            'teacher_rounds.png',
            'teacher round',
            "Round of each client's optimal teacher",
            'round',
            int,
        ),
        ('temperature', 'chosen_temperature.png', 'T (temperature)', 'Chosen temperature T per client', 'T', float),
        (
            'imitation',
            'chosen_imitation.png',
            'lambda (imitation)',
            'Chosen imitation lambda per client',
            'lambda',
            float,
        ),
    ):
        client_plots.plot_client_field(out, client_ids, fields[field], file, label, title, ylabel, kind=kind)
    short = client_plots.short_ids(client_ids)
    grid = fields['grid_val_accuracy']
    labels = [f'T={t:g}, λ={lam:g}' for t, lam in process.extras['grid_candidates']]
    reports.plot_heatmap(
        grid,
        os.path.join(out, 'distillation_grid.png'),
        'Validation accuracy of each (T, lambda) candidate',
        row_labels=short,
        col_labels=labels,
    )
    header = ['client_id'] + labels
    rows = [dict(zip(header, [c] + [float(v) for v in row])) for c, row in zip(client_ids, grid)]
    reports.write_csv(os.path.join(out, 'distillation_grid.csv'), rows)
    return [
        ('Teacher round per client', 'teacher_rounds.png'),
        ('Chosen temperature per client', 'chosen_temperature.png'),
        ('Chosen imitation per client', 'chosen_imitation.png'),
        ('Validation accuracy over the (T, lambda) grid', 'distillation_grid.png'),
    ]


def _declare(name, title, settings_cls):
    """PersFL and PersFL-GD: the soft loss of stage 2 (Eq. 3 KL or Eq. 7 cross-entropy) is the settings type."""
    return algorithm.Algorithm(
        name,
        title,
        settings_cls,
        algorithm.model_update_builder(build_persfl_process),
        _columns,
        _plots,
        privacy=algorithm.Privacy("stage 1's model updates (stage 2 stays on the clients)"),
        family='knowledge distillation',
    )


ALGORITHMS = (
    _declare(
        'persfl', 'PersFL (Divi et al., 2021): optimal teachers, then a per-client distillation grid', PersFLSettings
    ),
    _declare('persfl_gd', 'PersFL-GD (Divi et al., 2021): PersFL with cross-entropy instead of KL', PersFLGDSettings),
)
