"""Every client's evaluation in a run: which clients are scored, their rows and summaries.

`evaluate_all` scores the states of the run's store with the process's
`evaluate` (each client's models on its own test split) and, for a run with
a validation curve, with the same algorithm built on the validation splits;
`summarize_evaluation` turns the per-client results into clients.csv rows
and across-client summaries (`tff_pfl.metrics`).
"""

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from tff_pfl import metrics as metrics_lib


def flatten(nested: Mapping, prefix: str = '') -> collections.OrderedDict:
    """`{'a': {'b': 1}}` -> `{'a_b': 1}`, values as Python scalars.

    Args:
      nested: a (nested) mapping of metrics; values are array-likes.
      prefix: prepended to every flattened key.

    Returns:
      Flat key -> value, in `nested`'s order: rank-0 values as Python
      scalars, others as (nested) lists.
    """
    flat = collections.OrderedDict()
    for key, value in nested.items():
        name = f'{prefix}{key}'
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + '_'))
        else:
            value = np.asarray(value)
            flat[name] = value.item() if value.ndim == 0 else value.tolist()
    return flat


def summarize_evaluation(
    client_ids: Sequence[str], evaluations: Sequence[Mapping], source_ids: Mapping[str, str] | None = None
):
    """Per-client rows and across-client summaries of an `evaluate` result.

    Args:
      client_ids: the evaluated clients, in the order of `evaluations`.
      evaluations: one (nested) evaluation mapping per client; every entry
        that holds an `accuracy` is a model, with its `num_examples`.
      source_ids: client id -> the client's id in its source (a user's
        `ClientData` ids, a naturally federated dataset's), added to each row
        as `source_id`; None: no such column.

    Returns:
      `(rows, summaries)`: one flat dict per client (`client_id` first, then
      `source_id` where given), and model name (e.g. 'global_model') ->
      `metrics.summarize` of its test accuracies weighted by the clients'
      test sizes.
    """
    rows = []
    for c, e in zip(client_ids, evaluations):
        row = collections.OrderedDict(client_id=c)
        if source_ids is not None:
            row['source_id'] = source_ids[c]
        row.update(flatten(e))
        rows.append(row)
    summaries = collections.OrderedDict()
    model_names = [k for k, v in evaluations[0].items() if isinstance(v, Mapping) and 'accuracy' in v]
    for model_name in model_names:
        accuracies = [float(e[model_name]['accuracy']) for e in evaluations]
        sizes = [float(e[model_name]['num_examples']) for e in evaluations]
        summaries[model_name] = metrics_lib.summarize(accuracies, sizes)
        # Self-FL's Table 1: weighted accuracy of the 10% of clients with the
        # most samples (test sizes are proportional to client sizes).
        summaries[model_name]['top_10_by_samples'] = metrics_lib.top_by_weight_mean(accuracies, sizes)
    return rows, summaries


def source_id_map(client_ids: Sequence[str], source_ids: Sequence[str] | None) -> dict | None:
    """client id -> source id, for `summarize_evaluation` (None when `source_ids` is None).

    Args:
      client_ids: every client id.
      source_ids: one source id per client, in `client_ids` order, or None.

    Returns:
      The mapping, or None.

    Raises:
      ValueError: if `source_ids` does not hold one id per client.
    """
    if source_ids is None:
        return None
    source_ids = list(source_ids)
    if len(source_ids) != len(client_ids):
        raise ValueError(f'source_ids has {len(source_ids)} ids for {len(client_ids)} clients')
    return dict(zip(client_ids, (str(s) for s in source_ids)))


def client_rows(spec, evaluations: Sequence[Mapping], client_ids: Sequence[str] | None = None) -> list:
    """The flat per-client rows of a `process.evaluate(...)` result: the shape `training_loop.run` returns.

    `training_loop.run(...).clients` and `client_rows(spec, process.evaluate(state, client_states))`
    are the same rows (`client_id`, then `source_id` where the partition has
    the user's ids, then `global_model_accuracy`, ...), so a user's own loop
    over `process.next` reads its results as the project's loop does.

    Args:
      spec: the partition (`client_data.ClientDataSpec`).
      evaluations: one (nested) evaluation mapping per client.
      client_ids: the evaluated clients, in order; None: every client of
        `spec`.

    Returns:
      One flat dict per client.

    Raises:
      ValueError: if `evaluations` does not hold one result per client.
    """
    client_ids = list(spec.client_ids if client_ids is None else client_ids)
    evaluations = list(evaluations)
    if len(evaluations) != len(client_ids):
        raise ValueError(f'evaluations has {len(evaluations)} results for {len(client_ids)} clients')
    sources = source_id_map(spec.client_ids, spec.source_ids)
    rows, _ = summarize_evaluation(client_ids, evaluations, sources)
    return rows


def evaluation_sample(seed: int, round_num: int, num_clients: int, eval_clients: int) -> np.ndarray | None:
    """The clients an intermediate evaluation scores: a seeded sample, or None for every client.

    The draw depends only on (seed, round), not on the run's sampling
    generator, so sampled evaluation changes no training number, and a resumed
    run scores the same clients.

    Args:
      seed: the run's seed.
      round_num: the round (or interval) evaluated.
      num_clients: the population.
      eval_clients: the sample size; 0 or at least `num_clients`: every client.

    Returns:
      Sorted client indices without repetition, or None.
    """
    if not 0 < eval_clients < num_clients:
        return None
    rng = np.random.default_rng([seed, 0xE7A1, round_num])
    return np.sort(rng.choice(num_clients, size=eval_clients, replace=False))


def evaluate_all(
    process,
    state,
    store,
    row: dict,
    sample: np.ndarray | None = None,
    source_ids: Mapping[str, str] | None = None,
    validation=None,
):
    """Evaluates every client (or a sample of them); adds the across-client summaries to `row`.

    Args:
      process: the algorithm.
      state: the server state.
      store: the run's store (a `client_states.ClientStates`).
      row: the current metrics row; gets a
        `test_<model>_accuracy_<statistic>` entry per model and statistic,
        and `eval_clients`, the number of clients scored. A sample also adds
        `test_<model>_accuracy_mean_ci95`, the half-width of the 95 %
        confidence interval of the population's mean
        (`metrics.sample_mean_interval`).
      sample: indices (into `store.ids()`) of the clients to score; None:
        every client.
      source_ids: as in `summarize_evaluation`.
      validation: optional; the same algorithm built on the validation
        splits (`ClientDataSpec.evaluation_split='val'`): the same states
        are scored on them too, adding `val_<model>_accuracy_mean` and
        `val_<model>_accuracy_weighted_mean` to `row` and
        `<model>_val_accuracy` to each client row.

    Returns:
      `summarize_evaluation`'s `(client rows, summaries)` of the scored
      clients.
    """
    ids = store.ids()
    if sample is not None:
        ids = [ids[i] for i in sample]
    evaluations = store.evaluate(process, state, None if sample is None else ids)
    client_rows, summaries = summarize_evaluation(ids, evaluations, source_ids)
    row['eval_clients'] = len(ids)
    for model_name, summary in summaries.items():
        for stat in ('mean', 'weighted_mean', 'std', 'worst_10', 'best_10', 'top_10_by_samples'):
            row[f'test_{model_name}_accuracy_{stat}'] = summary[stat]
        if sample is not None:
            accuracies = [float(e[model_name]['accuracy']) for e in evaluations]
            row[f'test_{model_name}_accuracy_mean_ci95'] = metrics_lib.sample_mean_interval(
                accuracies, len(store.ids())
            )
    if validation is not None:
        val_evaluations = store.evaluate(validation, state, None if sample is None else ids)
        val_rows, val_summaries = summarize_evaluation(ids, val_evaluations)
        for model_name, summary in val_summaries.items():
            for stat in ('mean', 'weighted_mean'):
                row[f'val_{model_name}_accuracy_{stat}'] = summary[stat]
            for client_row, val_row in zip(client_rows, val_rows):
                client_row[f'{model_name}_val_accuracy'] = val_row[f'{model_name}_accuracy']
    return client_rows, summaries
