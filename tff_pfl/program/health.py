"""No silent stall, no silent divergence: warnings about runs that will not, or do not, learn.

Two kinds of check (docs/reliability.md, "Warnings: a run that will not or does not learn"):

* **Before round 1**, `pre_run_warnings(config, ...)`: settings that imply a model that barely
  moves. Pure functions of the configuration (and, for DP, of the size of an upload and the
  number of clients a round averages), so they are tested without TFF:
  - a server step that moves the global model by a share w of each round's estimate (Self-FL's
    smoothing weight, `selffl_smoothing`, whose default is the activity rate `client_fraction`;
    `server_learning_rate`; pFedMe's `pfedme_beta`): after R rounds the model has covered
    1 - (1 - w)^R of the way; below `MIN_SHARE_MOVED` it warns;
  - a learning rate below `MIN_LEARNING_RATE` (every setting named `*learning_rate` but the
    server's, which the rule above covers);
  - DP noise whose norm on the round's noised mean exceeds the clip, the largest norm the mean
    of clipped uploads can have (`dp_noise_ratio`).
* **During the run**, `RunMonitor.observe(row)` on each round's metrics row returns the tags
  the progress line ends with, and keeps the first finding of each kind for `RunResult.warnings`
  and report.md:
  - `STALLED`: at an evaluation at or after `STALL_SHARE` of the rounds, the global model's mean
    test accuracy is below chance + `stall_margin(num_classes)` (chance = 1 / num_classes);
  - `DIVERGING`: the round's mean training loss is NaN, or above `DIVERGE_GROWTH` times the first
    round's, or above `DIVERGE_UNIFORM` times ln(num_classes) (the cross-entropy of a uniform
    guess).

Neither stops a run (a non-finite loss still does, `--stop_on_divergence`); the exit code of
`tff-pfl-train` stays 0.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence

from tff_pfl import algorithm, models
from tff_pfl.program import algorithms

# A server step of weight w per round covers 1 - (1 - w)^R of the way to a fixed target in R
# rounds; a run whose settings cover less than half of it in all its rounds barely moves.
MIN_SHARE_MOVED = 0.5
# SGD with a smaller step size moves a weight by under 1e-6 x its gradient per step: with
# gradients of order 1, 10,000 steps (e.g. 100 rounds of 100 local steps) move it by under 0.01.
MIN_LEARNING_RATE = 1e-6
# Server steps of this form: setting -> what it weighs.
SERVER_STEPS = {
    'server_learning_rate': "the clients' mean update",
    'pfedme_beta': "the step towards the clients' mean",
}
# Local DP (`Privacy.local`): noise of stddev 2 z C on every coordinate of each upload.
LOCAL_DP_NOISE_FACTOR = 2.0

# The stall check: from the first evaluation at or after this share of the rounds on.
STALL_SHARE = 0.25
STALL_MARGIN = 0.05
# The divergence check.
DIVERGE_GROWTH = 100.0
DIVERGE_UNIFORM = 1000.0


def share_moved(weight: float, rounds: int) -> float:
    """The share of the way to a fixed target that steps of weight `weight` cover in `rounds` rounds.

    Args:
      weight: w, the step's weight, > 0 (values above 1 count as 1).
      rounds: R.

    Returns:
      1 - (1 - w)^R, in [0, 1].
    """
    weight = min(float(weight), 1.0)
    if weight >= 1.0:
        return 1.0
    return -math.expm1(rounds * math.log1p(-weight))


def smoothing_weight(config) -> float | None:
    """Self-FL's server smoothing weight w: `selffl_smoothing`, or the activity rate when it is 0.

    Args:
      config: a `run_config.ExperimentConfig`.

    Returns:
      w, or None for another algorithm.
    """
    value = getattr(config.settings, 'selffl_smoothing', None)
    if value is None:
        return None
    return value or config.schedule.client_fraction


def _server_step_warnings(config) -> list[str]:
    found = []
    rounds = config.schedule.rounds
    w = smoothing_weight(config)
    if w is not None:
        share = share_moved(w, rounds)
        if share < MIN_SHARE_MOVED:
            source = (
                f'selffl_smoothing {config.settings.selffl_smoothing:g}'
                if config.settings.selffl_smoothing
                else f'selffl_smoothing 0 = the activity rate client_fraction {config.schedule.client_fraction:g}'
            )
            found.append(
                f"selffl_smoothing: the global model moves by w = {w:g} ({source}) of each round's estimate, "
                f'1 - (1 - w)^{rounds} = {100 * share:.3g} % of the way in {rounds} rounds '
                f'(below {100 * MIN_SHARE_MOVED:g} %): it will barely move; set selffl_smoothing, e.g. 1 '
                "(the round's estimate as it is)"
            )
    for name, what in SERVER_STEPS.items():
        value = getattr(config.settings, name, None)
        if value is None:
            continue
        share = share_moved(value, rounds)
        if share < MIN_SHARE_MOVED:
            found.append(
                f'{name} {value:g}: the global model moves by {value:g} x {what} per round, '
                f'1 - (1 - {value:g})^{rounds} = {100 * share:.3g} % of the way in {rounds} rounds '
                f'(below {100 * MIN_SHARE_MOVED:g} %): it will barely move; raise {name}'
            )
    return found


def _learning_rate_warnings(config) -> list[str]:
    found = []
    for field in dataclasses.fields(config.settings):
        name = field.name
        if not name.endswith('learning_rate') or name in SERVER_STEPS:
            continue
        value = getattr(config.settings, name)
        if isinstance(value, int | float) and value < MIN_LEARNING_RATE:
            found.append(
                f'{name} {value:g} is effectively zero (below {MIN_LEARNING_RATE:g}): each step moves a weight by '
                f'{value:g} x its gradient, so the models it trains will barely move; raise {name}'
            )
    return found


def dp_noise_ratio(config, upload: algorithm.Upload) -> float:
    """The norm of the DP noise on a round's noised mean over the clip: above 1 the noise swamps the mean.

    Central DP (DP-FedAvg): the sum of n clipped uploads gets N(0, (z C)^2) per coordinate and is
    divided by n, so the mean's noise has stddev z C / n per coordinate and norm about
    z C sqrt(d) / n, while the mean of uploads clipped to C has norm at most C: the ratio is
    z sqrt(d) / n, whatever C (also under adaptive clipping); an algorithm whose mean is formed
    otherwise declares its factor (`Privacy.noise_factor`, e.g. Self-FL's record). Local DP
    (`Privacy.local`): each upload gets 2 z C per coordinate, the mean of n of them 2 z C / sqrt(n):
    2 z sqrt(d / n).

    Args:
      config: a `run_config.ExperimentConfig` with `dp_noise_multiplier` set.
      upload: the mean's `tff_pfl.algorithm.Upload` (d and n).

    Returns:
      The ratio (0 without noise).
    """
    z = float(config.privacy.dp_noise_multiplier or 0.0)
    d, n = float(upload.dimension), float(upload.clients)
    modes = algorithms.get(config.algorithm).privacy
    if modes.local:
        return LOCAL_DP_NOISE_FACTOR * z * math.sqrt(d / n)
    return modes.noise_factor * z * math.sqrt(d) / n


def _dp_warnings(config, uploads: Sequence[algorithm.Upload] | None) -> list[str]:
    z = config.privacy.dp_noise_multiplier
    if z is None or not z > 0 or not uploads:
        return []
    ratio, worst = max((dp_noise_ratio(config, u), u) for u in uploads)
    if ratio <= 1.0:
        return []
    what = f' ({worst.label})' if worst.label else ''
    return [
        f"dp_noise_multiplier {z:g}: the DP noise on the mean of a round's uploads{what} "
        f'has {ratio:.3g} x the norm of the clip, the largest norm that mean can carry (d = {worst.dimension:,} '
        f'coordinates, n = {worst.clients:g} expected clients per round): the model follows the noise; lower '
        'dp_noise_multiplier or average more clients (client_fraction, num_clients)'
    ]


def pre_run_warnings(config, uploads: Sequence[algorithm.Upload] | None = None) -> list[str]:
    """The warnings a run's settings call for before round 1: one line each, naming the setting to change.

    Args:
      config: a validated `run_config.ExperimentConfig`.
      uploads: the noised means a DP round forms (`dp_uploads`); None: the
        DP check is skipped.

    Returns:
      Lines without a trailing newline (empty: nothing to say).
    """
    return _server_step_warnings(config) + _learning_rate_warnings(config) + _dp_warnings(config, uploads)


def dp_uploads(config, spec, process) -> list[algorithm.Upload]:
    """The noised means of a DP round of this run, for `pre_run_warnings` (empty without DP).

    Args:
      config: the run's `run_config.ExperimentConfig`.
      spec: its `client_data.ClientDataSpec`.
      process: its built process (the clients' architectures).

    Returns:
      One `tff_pfl.algorithm.Upload` per noised mean: as the algorithm declares them
      (`Privacy.dp_uploads`, e.g. KT-pFL's soft predictions, FedDF's one per architecture), else
      the run's model's parameters over client_fraction x N clients (FedPer counts its whole
      model, an upper bound).
    """
    if config.privacy.dp_noise_multiplier is None:
        return []
    declared = algorithms.get(config.algorithm).privacy.dp_uploads
    if declared is not None:
        return declared(config.settings, spec, process, config.schedule.client_fraction)
    dimension = models.parameter_count(config.model_name(), spec.feature_shape, spec.num_classes)
    return [algorithm.Upload(dimension, config.schedule.client_fraction * spec.num_clients)]


def stall_margin(num_classes: int) -> float:
    """How far above chance a model must be to count as learning: min(`STALL_MARGIN`, chance / 2).

    Args:
      num_classes: C (chance is 1 / C).

    Returns:
      0.05 up to 10 classes; half of chance above (1.5 points over chance's 1 % for 100 classes).
    """
    return min(STALL_MARGIN, 0.5 / num_classes)


def stall_from_round(rounds: int) -> int:
    """The first round whose evaluation the stall check reads: ceil(`STALL_SHARE` x rounds).

    Args:
      rounds: the run's rounds.

    Returns:
      A round in [1, rounds].
    """
    return max(1, math.ceil(STALL_SHARE * rounds - 1e-9))


def _model(row: Mapping) -> str | None:
    """The model the stall check reads: `global_model` if evaluated, else the first evaluated one."""
    if 'test_global_model_accuracy_mean' in row:
        return 'global_model'
    for key in row:
        if key.startswith('test_') and key.endswith('_accuracy_mean'):
            return key[len('test_') : -len('_accuracy_mean')]
    return None


class RunMonitor:
    """Watches a run's metrics rows for a stalled model and a diverging loss.

    `observe(row)` returns the row's tags (progress line); `warnings` holds
    the first finding of each kind, prefixed with its round (report.md,
    `RunResult.warnings`).
    """

    def __init__(self, rounds: int, num_classes: int | None):
        """A monitor for a run of `rounds` rounds.

        Args:
          rounds: the run's rounds (or intervals).
          num_classes: C of the data; None: no stall check and no
            divergence test against a uniform guess.
        """
        self.rounds = rounds
        self.num_classes = num_classes if num_classes and num_classes >= 2 else None
        self.first_loss: float | None = None
        self.first_loss_round: int | None = None
        self._found: dict[str, str] = {}
        self._stalled_at: int | None = None
        self._last_round: int | None = None
        self._last_diverging: tuple[int, float] | None = None

    @property
    def warnings(self) -> list[str]:
        """The first finding of each kind, as `round r: TAG...` lines, with how the run went on."""
        found = dict(self._found)
        if 'diverging' in found and self._last_diverging is not None:
            last_round, last_loss = self._last_diverging
            if last_round == self._last_round:
                found['diverging'] += (
                    f'; the run diverged: still at round {last_round}, its last (train_loss {last_loss:.3g})'
                )
            else:
                found['diverging'] += f'; the run diverged, last at round {last_round} (train_loss {last_loss:.3g})'
        return list(found.values())

    def replay(self, rows: Sequence[Mapping]) -> None:
        """Observes restored rows (a resumed run) without returning their tags.

        Args:
          rows: the metrics rows of the rounds already run.
        """
        for row in rows:
            self.observe(row)

    def observe(self, row: Mapping) -> list[str]:
        """Checks one round's metrics row (after its evaluation, if any).

        Args:
          row: the round's metrics (`round`, `train_loss`, test accuracies
            when evaluated).

        Returns:
          The tags for its progress line: `DIVERGING: ...`, `STALLED: ...`
          (empty when neither applies).
        """
        round_num = int(row['round'])
        self._last_round = round_num
        tags = []
        diverging = self._diverging(row, round_num)
        if diverging:
            tags.append(diverging)
            self._found.setdefault('diverging', f'round {round_num}: {diverging}')
            self._last_diverging = (round_num, float(row['train_loss']))
        stalled = self._stalled(row, round_num)
        if stalled:
            tags.append(stalled)
        return tags

    def _diverging(self, row: Mapping, round_num: int) -> str | None:
        loss = row.get('train_loss')
        if loss is None:
            return None
        loss = float(loss)
        if not math.isfinite(loss):
            return f'DIVERGING: train_loss {loss}'
        if self.first_loss is None:
            if math.isfinite(loss) and loss > 0:
                self.first_loss, self.first_loss_round = loss, round_num
        elif loss > DIVERGE_GROWTH * self.first_loss:
            return f"DIVERGING: train_loss {loss:.3g}, {loss / self.first_loss:.2g}x round {self.first_loss_round}'s"
        if self.num_classes is not None:
            uniform = math.log(self.num_classes)
            if loss > DIVERGE_UNIFORM * uniform:
                return (
                    f"DIVERGING: train_loss {loss:.3g}, {loss / uniform:.2g}x a uniform guess's "
                    f'ln({self.num_classes}) = {uniform:.3g}'
                )
        return None

    def _stalled(self, row: Mapping, round_num: int) -> str | None:
        model = _model(row)
        if model is None or self.num_classes is None or round_num < stall_from_round(self.rounds):
            return None
        accuracy = float(row[f'test_{model}_accuracy_mean'])
        chance = 1.0 / self.num_classes
        if not accuracy < chance + stall_margin(self.num_classes):
            if self._stalled_at is not None and 'stalled' in self._found and 'left' not in self._found:
                self._found['left'] = (
                    f'round {round_num}: {model.replace("_", " ")} off chance ({100 * accuracy:.1f} %)'
                )
            return None
        tag = (
            f'STALLED: {model.replace("_", " ")} at chance ({100 * accuracy:.1f} %, chance {100 * chance:.1f} %) '
            f'after {round_num} of {self.rounds} rounds'
        )
        if self._stalled_at is None:
            self._stalled_at = round_num
            self._found['stalled'] = f'round {round_num}: {tag}'
        return tag
