"""The run loop every algorithm shares: sampling, client-state store, rounds,
evaluation of every client, and release of metrics as the run goes.

The loop talks to a `template.PersonalizedProcess` only through its typed
computations, so the same loop drives every algorithm.
"""

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import numpy as np

from tff_pfl import metrics as metrics_lib
from tff_pfl.computations import device_state
from tff_pfl.computations import template
from tff_pfl.program import checkpoints as checkpoints_lib


def sample_clients(rng: np.random.Generator, client_ids: Sequence[str], fraction: float) -> list[str]:
    """Clients of one round: all of them, or `ceil(fraction * n)` without replacement.

    Args:
      rng: the run's sampling generator (its state advances).
      client_ids: every client id.
      fraction: share of clients per round, in (0, 1].

    Returns:
      The sampled ids, in the order of `client_ids`.
    """
    if fraction >= 1.0:
        return list(client_ids)
    count = max(1, int(np.ceil(fraction * len(client_ids))))
    chosen = np.sort(rng.choice(len(client_ids), size=count, replace=False))
    return [client_ids[i] for i in chosen]


def flatten(nested: Mapping, prefix: str = '') -> collections.OrderedDict:
    """`{'a': {'b': 1}}` -> `{'a_b': 1}`, values as Python scalars."""
    flat = collections.OrderedDict()
    for key, value in nested.items():
        name = f'{prefix}{key}'
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + '_'))
        else:
            value = np.asarray(value)
            flat[name] = value.item() if value.ndim == 0 else value.tolist()
    return flat


class ClientStateStore:
    """Client states keyed by client id; pass-in/pass-out around `next`."""

    def __init__(self, process: template.PersonalizedProcess, client_ids: Sequence[str]):
        self._states = {c: process.initial_client_state(c) for c in client_ids}

    def get(self, client_ids: Sequence[str]) -> list:
        return [self._states[c] for c in client_ids]

    def restore(self, states: Mapping) -> None:
        """Puts back every client's state from a checkpoint."""
        self.put(list(states), list(states.values()))

    def put(self, client_ids: Sequence[str], states: Sequence) -> None:
        for client_id, state in zip(client_ids, states):
            returned_id = state['client_id']
            if isinstance(returned_id, bytes):
                returned_id = returned_id.decode()
            if returned_id != client_id:
                raise RuntimeError(f'client state of {returned_id!r} returned in the slot of {client_id!r}')
            self._states[client_id] = state

    def all(self) -> list:
        return list(self._states.values())

    def ids(self) -> list[str]:
        return list(self._states)

    def states(self) -> dict:
        """Client id -> client state, for every client."""
        return dict(self._states)

    def initialize(self, process: template.PersonalizedProcess):
        return process.initialize()

    def run_round(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str]):
        """One `next` over `client_ids`; stores their new states and returns `(state, metrics)`."""
        output = process.next(state, self.get(client_ids))
        self.put(client_ids, output.client_states)
        return output.state, output.metrics

    def personalize(self, process: template.PersonalizedProcess, state) -> None:
        self.put(self.ids(), process.personalize(state, self.all()))

    def evaluate(self, process: template.PersonalizedProcess, state) -> list:
        return process.evaluate(state, self.all())


class DeviceStateStore:
    """Client states kept by the devices, as files in `state_dir`.

    The process runs as its `DeviceProcess`: each client's work reads its
    state from `<state_dir>/<client_id>.state` and writes the new one back,
    so rounds have the shape `(S@SERVER, D@CLIENTS) -> <S@SERVER, M@SERVER>`
    that TFF's mergeable context splits over several workers. Every worker
    must see `state_dir` at the same path (as it sees the client data).
    """

    def __init__(self, process: template.PersonalizedProcess, client_ids: Sequence[str], state_dir: str):
        """Args: the process (it must have a `device` form), every client id, and the state directory.

        Raises:
          ValueError: if the process has no device-state form, or a state
            path is not usable.
        """
        if process.device is None:
            raise ValueError('this algorithm has no device-state form')
        os.makedirs(state_dir, exist_ok=True)
        self._process = process
        self._inputs = collections.OrderedDict(
            (c, device_state.device_input(c, state_dir)) for c in client_ids)

    def get(self, client_ids: Sequence[str]) -> list:
        return [self._inputs[c] for c in client_ids]

    def restore(self, states: Mapping) -> None:
        """Writes every client's state from a checkpoint back to its state file."""
        for client_id, state in states.items():
            device_state.save(self._inputs[client_id]['state_file'], state)

    def all(self) -> list:
        return list(self._inputs.values())

    def ids(self) -> list[str]:
        return list(self._inputs)

    def states(self) -> dict:
        """Client id -> client state, read from the state files (initial state where none yet)."""
        states = {}
        for client_id, device in self._inputs.items():
            initial = self._process.initial_client_state(client_id)
            if os.path.exists(device['state_file']):
                states[client_id] = device_state.load(device['state_file'], initial)
            else:
                states[client_id] = initial
        return states

    def initialize(self, process: template.PersonalizedProcess):
        return process.device.initialize()

    def run_round(self, process: template.PersonalizedProcess, state, client_ids: Sequence[str]):
        return device_state.run_round(process.device, state, self.get(client_ids))

    def personalize(self, process: template.PersonalizedProcess, state) -> None:
        process.device.personalize(state, self.all())

    def evaluate(self, process: template.PersonalizedProcess, state) -> list:
        return device_state.in_client_order(process.device.evaluate(state, self.all()), self.ids())


@dataclasses.dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
      state: final server state.
      client_states: client id -> final client state.
      rounds: one metrics dict per round.
      clients: one dict per client: its final evaluation, flattened.
      summary: model name -> metric summary of per-client test accuracy.
    """

    state: object
    client_states: dict
    rounds: list
    clients: list
    summary: dict


def summarize_evaluation(client_ids: Sequence[str], evaluations: Sequence[Mapping]):
    """Per-client rows and across-client summaries of an `evaluate` result.

    Returns:
      `(rows, summaries)`: one flat dict per client (`client_id` first), and
      model name (e.g. 'global_model') -> `metrics.summarize` of its test
      accuracies weighted by the clients' test sizes.
    """
    rows = [collections.OrderedDict(client_id=c, **flatten(e)) for c, e in zip(client_ids, evaluations)]
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


def evaluate_all(process, state, store, row: dict):
    """Evaluates every client; adds the across-client summaries to `row`.

    Returns:
      `summarize_evaluation`'s `(client rows, summaries)`.
    """
    client_rows, summaries = summarize_evaluation(store.ids(), store.evaluate(process, state))
    for model_name, summary in summaries.items():
        for stat in ('mean', 'weighted_mean', 'std', 'worst_10', 'best_10', 'top_10_by_samples'):
            row[f'test_{model_name}_accuracy_{stat}'] = summary[stat]
    return client_rows, summaries


def progress_line(label: str, done: int, total: int, row: Mapping, summaries: Mapping, started: float) -> str:
    """One progress line: training metrics, test accuracies if evaluated, time and ETA.

    Args:
      label: e.g. `round 3/100`.
      done: steps finished; total: steps in the run (for the ETA).
      row: this step's metrics row (`train_loss`, `train_accuracy`, `round_seconds`).
      summaries: model name -> accuracy summary, empty when not evaluated.
      started: `time.monotonic()` at the start of the run.
    """
    eta = (time.monotonic() - started) / done * (total - done)
    line = f'{label}  train_loss {row.get("train_loss", float("nan")):.4f}  '
    line += f'train_acc {row.get("train_accuracy", float("nan")):.4f}'
    for model_name, summary in summaries.items():
        line += f'  test_acc[{model_name}] {summary["mean"]:.4f}'
    return line + f'  {row["round_seconds"]:.2f}s  ETA {_format_eta(eta)}'


def _format_eta(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    seconds = int(round(seconds))
    return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


def run(
    process: template.PersonalizedProcess,
    client_ids: Sequence[str],
    *,
    rounds: int,
    client_fraction: float,
    seed: int,
    eval_every: int = 0,
    on_round: Optional[Callable[[Mapping], None]] = None,
    log: Callable[[str], None] = print,
    device_state_dir: Optional[str] = None,
    checkpoints: Optional[checkpoints_lib.RunCheckpoints] = None,
    checkpoint_every: int = 0,
    on_resume: Optional[Callable[[int, list], None]] = None,
) -> RunResult:
    """Trains for `rounds` rounds, evaluating every client as it goes.

    Args:
      process: the algorithm.
      client_ids: every client of the partition.
      rounds: number of training rounds.
      client_fraction: share of clients sampled per round.
      seed: seeds client sampling (independently of training randomness).
      eval_every: evaluate all clients every this many rounds (0: only at the
        end); the last round is always evaluated.
      After the last round, a process with a `personalize` stage runs it on
      every client before the final evaluation.
      on_round: called with each round's metrics row (e.g. to append CSV).
      log: receives one progress line per round.
      device_state_dir: if given, the client states stay on the devices as
        files in this directory (`DeviceStateStore`), and the rounds run as
        the process's `DeviceProcess` (needed to split them over several
        workers); default: the driver keeps them (`ClientStateStore`).
      checkpoints: where the run's checkpoints live; if it holds one, the
        run continues after its round, with its server state, client states,
        sampling state and metrics rows, and gives the numbers an
        uninterrupted run gives.
      checkpoint_every: write a checkpoint after every this many rounds
        (0: never); never after the last round, whose results follow at once.
      on_resume: called with the round resumed after and the restored rows.

    Returns:
      A `RunResult`.
    """
    rng = np.random.default_rng([seed, 0x5A3D])
    if device_state_dir is None:
        store = ClientStateStore(process, client_ids)
    else:
        store = DeviceStateStore(process, client_ids, device_state_dir)
    state = store.initialize(process)
    rows, started, first_round = [], time.monotonic(), 1
    if checkpoints is not None:
        restored = checkpoints.load_latest(state, process.initial_client_state(client_ids[0]))
        if restored is not None:
            if restored.round_num >= rounds or list(restored.client_states) != list(client_ids):
                raise ValueError(f'the checkpoint of round {restored.round_num} in {checkpoints.directory} '
                                 f'does not belong to this run')
            state, rows, first_round = restored.server_state, list(restored.rows), restored.round_num + 1
            store.restore(restored.client_states)
            rng.bit_generator.state = restored.rng_state
            log(f'resuming after round {restored.round_num} (checkpoint in {checkpoints.directory})')
            if on_resume is not None:
                on_resume(restored.round_num, rows)
    for round_num in range(first_round, rounds + 1):
        round_start = time.monotonic()
        sampled = sample_clients(rng, client_ids, client_fraction)
        state, round_metrics = store.run_round(process, state, sampled)
        row = collections.OrderedDict(round=round_num, **flatten(round_metrics))
        row['round_seconds'] = time.monotonic() - round_start
        evaluate_now = round_num == rounds or (eval_every and round_num % eval_every == 0)
        if round_num == rounds and process.personalize is not None:
            log(f'personalizing {len(client_ids)} clients ...')
            personalize_start = time.monotonic()
            store.personalize(process, state)
            row['personalize_seconds'] = time.monotonic() - personalize_start
        if evaluate_now:
            client_rows, summaries = evaluate_all(process, state, store, row)
        rows.append(row)
        if on_round is not None:
            on_round(row)
        if checkpoints is not None and checkpoint_every and round_num % checkpoint_every == 0 and round_num < rounds:
            checkpoints.save(round_num, state, store.states(), rng.bit_generator.state, rows)
        log(progress_line(f'round {round_num}/{rounds}', round_num - first_round + 1, rounds - first_round + 1, row,
                          summaries if evaluate_now else {}, started))
    return RunResult(
        state=state,
        client_states=store.states(),
        rounds=rows,
        clients=client_rows,
        summary=summaries,
    )
