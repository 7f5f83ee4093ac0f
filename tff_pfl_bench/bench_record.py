"""One benchmark run's record (`bench_result.json`): its accuracy curves, chosen rounds and bytes.

`run_record` makes the record `bench_run` writes last in a run's directory
(a run is complete when it exists) and `publish_results` copies to the
results directory: the per-client accuracy of the suite's model, the test
curve and, with `eval_validation`, the validation curve and the round it
selects (`selected_round`), the best round on test (`best_test_round`; a
leaderboard's measure, optimistic), rounds to the suite's target accuracy,
and the run's bytes (`communication_totals`).
"""

import collections
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from tff_pfl.program import run_config as run_config_lib


def _participants(config: run_config_lib.ExperimentConfig, num_clients: int, row: Mapping) -> int:
    if row.get('num_clients') is not None:
        return int(row['num_clients'])
    if config.schedule.client_fraction >= 1.0:
        return num_clients
    return max(1, int(math.ceil(config.schedule.client_fraction * num_clients)))


def communication_totals(
    per_call: Mapping, config: run_config_lib.ExperimentConfig, rounds: Sequence[Mapping], num_clients: int
) -> dict:
    """Bytes of a whole run from the bytes of one call per client.

    Args:
      per_call: `_check_process`'s communication: `bytes_down_per_client`,
        `bytes_up_per_client` of one round, and those of `personalize`.
      config: the run's configuration (client fraction, for rounds whose
        metrics do not count their clients).
      rounds: the run's metrics rows.
      num_clients: clients of the partition.

    Returns:
      `has_personalize` and the `personalize_*` entries of `per_call`;
      `bytes_down_per_client_per_round` / `bytes_up_per_client_per_round`
      (`per_call`'s `bytes_*_per_client`); `client_rounds`, the clients of
      every round summed over rounds; `bytes_down_total` / `bytes_up_total`,
      rounds and `personalize` for every client; and `bytes_down_per_client`
      / `bytes_up_per_client`, the totals divided by `num_clients`. Only
      `per_call` when it holds an `error` (a type without a fixed size).
    """
    result = dict(per_call)
    if 'error' in per_call:
        return result
    client_rounds = sum(_participants(config, num_clients, row) for row in rounds)
    down = client_rounds * per_call['bytes_down_per_client']
    up = client_rounds * per_call['bytes_up_per_client']
    if per_call.get('has_personalize'):
        down += num_clients * per_call['personalize_bytes_down_per_client']
        up += num_clients * per_call['personalize_bytes_up_per_client']
    result['bytes_down_per_client_per_round'] = result.pop('bytes_down_per_client')
    result['bytes_up_per_client_per_round'] = result.pop('bytes_up_per_client')
    result.update(
        client_rounds=client_rounds,
        bytes_down_total=down,
        bytes_up_total=up,
        bytes_down_per_client=down / num_clients,
        bytes_up_per_client=up / num_clients,
    )
    return result


def model_curve(rounds: Sequence[Mapping], model: str, final_only: bool, split: str = 'test') -> list[dict]:
    """Per-round mean accuracy of `model` on the rounds where it was evaluated.

    Args:
      rounds: the run's metrics rows.
      model: e.g. 'global_model'.
      final_only: the model is made by a final `personalize` stage, so only
        the last round's value is that model.
      split: 'test' (`test_<model>_accuracy_mean`) or 'val'
        (`val_<model>_accuracy_mean`, in the rows of runs with `eval_validation`).

    Returns:
      `[{'round': r, 'accuracy': a}, ...]`, accuracy as a fraction; empty
      when the rows do not have the split's key.
    """
    key = f'{split}_{model}_accuracy_mean'
    points = [
        {'round': int(row['round']), 'accuracy': float(row[key])}
        for row in rounds
        if row.get(key) is not None and row.get(key) != ''
    ]
    if final_only and points:
        last = int(rounds[-1]['round'])
        points = [p for p in points if p['round'] == last]
    return points


def rounds_to_target(curve: Sequence[Mapping], target: float | None) -> int | None:
    """The first round of `curve` whose accuracy is >= `target`; None if none is.

    Args:
      curve: `[{'round': r, 'accuracy': a}, ...]` in round order, as
        `model_curve` returns.
      target: accuracy as a fraction, or None.

    Returns:
      The round number, or None when `target` is None or never reached.
    """
    if target is None:
        return None
    for point in curve:
        if point['accuracy'] >= target:
            return point['round']
    return None


def selected_round(curve: Sequence[Mapping], val_curve: Sequence[Mapping]) -> dict | None:
    """The evaluated round with the best validation mean, and the test accuracy there.

    Args:
      curve: the test curve (`model_curve`).
      val_curve: the validation curve of the same rounds (`model_curve(..., split='val')`).

    Returns:
      `{'round', 'val_accuracy', 'test_accuracy'}` of the round with the
      highest finite validation mean (ties: the earliest); None without a
      validation curve. The test numbers are read only at that round.
    """
    best = _best_point(val_curve)
    if best is None:
        return None
    test = {p['round']: p['accuracy'] for p in curve}
    return {'round': best['round'], 'val_accuracy': best['accuracy'], 'test_accuracy': test.get(best['round'])}


def best_test_round(curve: Sequence[Mapping]) -> dict | None:
    """The evaluated round with the highest mean test accuracy (a leaderboard's measure; optimistic).

    Args:
      curve: the test curve (`model_curve`), in round order.

    Returns:
      `{'round', 'test_accuracy'}` (ties: the earliest), or None without a curve.
    """
    best = _best_point(curve)
    return None if best is None else {'round': best['round'], 'test_accuracy': best['accuracy']}


def _best_point(points: Sequence[Mapping]) -> Mapping | None:
    """The point of highest finite accuracy, the earliest on ties; None if none (a NaN is never the best)."""
    best = None
    for point in points:
        if math.isfinite(point['accuracy']) and (best is None or point['accuracy'] > best['accuracy']):
            best = point
    return best


def run_record(suite, run, config, result, seconds, communication, partition_text) -> dict:
    model = run.algorithm.model
    num_clients = len(result.clients)
    final_only = communication['has_personalize'] and model != 'global_model'
    curve = model_curve(result.rounds, model, final_only)
    val_curve = model_curve(result.rounds, model, final_only, split='val')
    return collections.OrderedDict(
        suite=suite.name,
        partition=run.partition.name,
        algorithm=run.algorithm.name,
        registry_name=run.algorithm.algorithm,
        seed=run.seed,
        model=model,
        seconds=seconds,
        # A training round's wall time, the median over rounds (evaluation and personalization apart).
        seconds_per_round=statistics.median(float(row['round_seconds']) for row in result.rounds),
        rounds=config.schedule.rounds,
        final_round=int(result.rounds[-1]['round']),
        # The round where the run stopped because its training loss was NaN or infinite (None: it did not).
        diverged_round=result.diverged_round,
        summary={name: {k: float(v) for k, v in s.items()} for name, s in result.summary.items()},
        clients=[
            collections.OrderedDict(
                client_id=row['client_id'],
                accuracy=float(row[f'{model}_accuracy']),
                num_examples=int(row[f'{model}_num_examples']),
            )
            for row in result.clients
        ],
        final_only=final_only,
        curve=curve,
        # With eval_validation: the validation curve, and the test accuracy at its best round.
        val_curve=val_curve,
        selected=selected_round(curve, val_curve),
        # The best round on test (a leaderboard's measure): optimistic, labelled so wherever shown.
        best_test_round=best_test_round(curve),
        # User-level DP: the privacy spent by the end of the run (None without DP).
        dp_epsilon=result.rounds[-1].get('dp_epsilon'),
        dp_delta=config.privacy.delta_for(num_clients) if config.privacy.dp_noise_multiplier is not None else None,
        target_accuracy=suite.target_accuracy,
        rounds_to_target=rounds_to_target(curve, suite.target_accuracy),
        communication=communication_totals(communication, config, result.rounds, num_clients),
        partition_csv=partition_text,
        config=dataclasses.asdict(config),
    )
