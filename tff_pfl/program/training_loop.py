"""The run loop every algorithm shares: sampling, client-state store, rounds,
evaluation of every client, and release of metrics as the run goes.

The loop talks to a `template.PersonalizedProcess` only through its typed
computations, so the same loop drives every algorithm.
"""

import collections
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tff_pfl.computations import template
from tff_pfl.program import checkpoints as checkpoints_lib
from tff_pfl.program import client_states, device_store, evaluation, health


def clients_per_round(num_clients: int, fraction: float) -> int:
    """How many clients `sample_clients` draws without Poisson sampling.

    Args:
      num_clients: N, every client.
      fraction: share of clients per round, in (0, 1].

    Returns:
      `ceil(fraction * N)`, at least 1 (N for a fraction of 1).
    """
    if fraction >= 1.0:
        return num_clients
    return max(1, int(np.ceil(fraction * num_clients)))


def sample_clients(
    rng: np.random.Generator, client_ids: Sequence[str], fraction: float, *, poisson: bool = False
) -> list[str]:
    """Clients of one round: all of them, `ceil(fraction * n)` without replacement, or a Poisson draw.

    Args:
      rng: the run's sampling generator (its state advances).
      client_ids: every client id.
      fraction: share of clients per round, in (0, 1].
      poisson: each client takes part independently with probability
        `fraction` (the sampling DP accounting assumes); the draw may be
        empty.

    Returns:
      The sampled ids, in the order of `client_ids`.
    """
    if fraction >= 1.0:
        return list(client_ids)
    if poisson:
        return [c for c, chosen in zip(client_ids, rng.random(len(client_ids)) < fraction) if chosen]
    count = clients_per_round(len(client_ids), fraction)
    chosen = np.sort(rng.choice(len(client_ids), size=count, replace=False))
    return [client_ids[i] for i in chosen]


@dataclasses.dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
      state: final server state.
      client_states: client id -> final client state (a read-only
        mapping; a `client_states.StateView` reads each state from the store on lookup;
        a client that never took part reads as its initial state, made by
        a TFF call, so look it up while the run's TFF runtime is up).
      rounds: one metrics dict per round.
      clients: one dict per client: its final evaluation, flattened.
      summary: model name -> metric summary of per-client test accuracy.
      diverged_round: the round whose mean training loss was NaN or
        infinite, where the run stopped (`diverged`); None: it ran every
        round.
      warnings: what the run warned about, one line each: the pre-run
        warnings (`health.pre_run_warnings`, added by
        `experiment.run_experiment`), then the first `STALLED` and
        `DIVERGING` finding of the rounds (`health.RunMonitor`).
    """

    state: object
    client_states: Mapping
    rounds: list
    clients: list
    summary: dict
    diverged_round: int | None = None
    warnings: list = dataclasses.field(default_factory=list)


def diverged(row: Mapping) -> bool:
    """Whether a round's mean training loss is NaN or infinite.

    Args:
      row: the round's metrics row (a round that trained nobody has no
        `train_loss`).

    Returns:
      True if `train_loss` is there and not finite.
    """
    loss = row.get('train_loss')
    return loss is not None and not math.isfinite(float(loss))


def divergence_line(label: str, row: Mapping) -> str:
    """The log line of a run that stops at a diverged round (`diverged`).

    Args:
      label: the step, e.g. `round 3`.
      row: the step's metrics row.

    Returns:
      The line, without a trailing newline.
    """
    return (
        f'{label}: the mean training loss is {float(row["train_loss"])}: the run diverged and stops here; its models '
        "are evaluated as the last round's (--nostop_on_divergence trains every round)"
    )


def check_rounds_per_call(
    rounds_per_call: int,
    *,
    client_fraction: float,
    device_state_dir: str | None = None,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    prefix: str = '',
) -> None:
    """Refuses, in one line, a `rounds_per_call` that `run` cannot keep.

    Several rounds share one call only over the same clients, with the
    client states in the driver, and with evaluations and checkpoints
    between calls.

    Args:
      rounds_per_call: as in `run`.
      client_fraction: as in `run`.
      device_state_dir: as in `run`.
      eval_every: as in `run`.
      checkpoint_every: as in `run`.
      prefix: put before each argument's name in the message (`--` for flags).

    Raises:
      ValueError: naming the first argument that conflicts.
    """
    k = rounds_per_call
    if k < 1:
        raise ValueError(f'{prefix}rounds_per_call must be >= 1, got {k}')
    if k == 1:
        return
    if client_fraction < 1.0:
        raise ValueError(
            f'{prefix}rounds_per_call={k} runs the same clients in every round of a call: it needs '
            f'{prefix}client_fraction=1, got {client_fraction:g}'
        )
    if device_state_dir is not None:
        raise ValueError(
            f'{prefix}rounds_per_call={k} keeps the client states in the driver: it does not run with the client '
            'states on the devices (several workers)'
        )
    for name, every in (('eval_every', eval_every), ('checkpoint_every', checkpoint_every)):
        if every % k:
            raise ValueError(
                f'{prefix}{name}={every} is not a multiple of {prefix}rounds_per_call={k}: evaluations and '
                'checkpoints fall between calls'
            )


def progress_line(
    label: str, done: int, total: int, row: Mapping, summaries: Mapping, started: float, tags: Sequence[str] = ()
) -> str:
    """One progress line: training metrics, test accuracies if evaluated, time, ETA and warning tags.

    Args:
      label: e.g. `round 3/100`.
      done: steps finished.
      total: steps in the run (for the ETA).
      row: this step's metrics row (`train_loss`, `train_accuracy`, `round_seconds`).
      summaries: model name -> accuracy summary, empty when not evaluated.
      started: `time.monotonic()` at the start of the run.
      tags: `health.RunMonitor.observe`'s findings for this step
        (`STALLED: ...`, `DIVERGING: ...`), appended at the end.

    Returns:
      The line, without a trailing newline.
    """
    eta = (time.monotonic() - started) / done * (total - done)
    line = f'{label}  train_loss {row.get("train_loss", float("nan")):.4f}  '
    line += f'train_acc {row.get("train_accuracy", float("nan")):.4f}'
    for model_name, summary in summaries.items():
        line += f'  test_acc[{model_name}] {summary["mean"]:.4f}'
    line += f'  {row["round_seconds"]:.2f}s  ETA {_format_eta(eta)}'
    return ''.join([line, *(f'  {tag}' for tag in tags)])


def _format_eta(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    seconds = int(round(seconds))
    return f'{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}'


def save_checkpoint(
    checkpoints: checkpoints_lib.RunCheckpoints, round_num: int, state, store, rng: np.random.Generator, rows: list
) -> None:
    """Writes the checkpoint of `round_num`: the clients changed since the last one, or every stored client.

    Every stored client is written when the store asks for it (its first
    checkpoint) or when the chain of segments grows past
    `checkpoints.COMPACT_RATIO` times the stored states.

    Args:
      checkpoints: the run's checkpoints.
      round_num: the round (or interval) just finished.
      state: the server state after it.
      store: the run's store (a `client_states.ClientStates`).
      rng: the run's sampling generator.
      rows: the metrics rows so far.
    """
    clients = store.changes(everything=False)
    if not clients.complete and checkpoints.wants_everything(clients.nbytes, store.nbytes):
        clients = store.changes(everything=True)
    checkpoints.save(round_num, state, store.ids(), clients, rng.bit_generator.state, rows)
    store.saved()


def resume(
    checkpoints: checkpoints_lib.RunCheckpoints | None,
    state,
    store,
    rng: np.random.Generator,
    client_ids: Sequence[str],
    last: int,
    unit: str,
    log: Callable[[str], None],
    on_resume: Callable[[int, list], None] | None,
) -> tuple:
    """Continues from the newest checkpoint that can be read whole, if there is one.

    A newer damaged checkpoint costs its rounds: it is skipped with one log
    line naming it and why, and set aside (`RunCheckpoints.load_latest`).

    Args:
      checkpoints: the run's checkpoints (None: none).
      state: the initial server state (for its structure).
      store: the client-state store; its states are overwritten.
      rng: the run's generator; its state is overwritten.
      client_ids: every client id of this run.
      last: the run's last round (or interval).
      unit: 'round' or 'interval', for the messages.
      log: as in `run`.
      on_resume: as in `run`.

    Returns:
      `(server state, metrics rows so far, first round to run)`.

    Raises:
      ValueError: if the checkpoint belongs to another run.
      checkpoints.CheckpointError: if there are checkpoints and none can be
        read whole.
    """
    restored = checkpoints.load_latest(state) if checkpoints is not None else None
    if restored is None:
        return state, [], 1
    if restored.round_num >= last or restored.client_ids != list(client_ids):
        raise ValueError(
            f'the checkpoint of {unit} {restored.round_num} in {checkpoints.directory} does not belong to this run'
        )
    store.restore(restored)
    rng.bit_generator.state = restored.rng_state
    rows = list(restored.rows)
    for damage in restored.skipped:  # one line each; set aside by `load_latest`
        aside = ', '.join(os.path.basename(f) + checkpoints_lib.DAMAGED_SUFFIX for f in damage.files)
        log(f'{damage}; skipped (kept as {aside}), resuming from the checkpoint of {unit} {restored.round_num}')
    log(f'resuming after {unit} {restored.round_num} (checkpoint in {checkpoints.directory})')
    if on_resume is not None:
        on_resume(restored.round_num, rows)
    return restored.server_state, rows, restored.round_num + 1


def run(
    process: template.PersonalizedProcess,
    client_ids: Sequence[str],
    *,
    rounds: int,
    client_fraction: float,
    seed: int,
    eval_every: int = 0,
    on_round: Callable[[Mapping], None] | None = None,
    log: Callable[[str], None] = print,
    device_state_dir: str | None = None,
    checkpoints: checkpoints_lib.RunCheckpoints | None = None,
    checkpoint_every: int = 0,
    on_resume: Callable[[int, list], None] | None = None,
    spill_dir: str | None = None,
    poisson_sampling: bool = False,
    privacy: Callable[[int], Mapping] | None = None,
    eval_clients: int = 0,
    stop_on_divergence: bool = False,
    num_classes: int | None = None,
    source_ids: Sequence[str] | None = None,
    rounds_per_call: int = 1,
    validation: template.PersonalizedProcess | None = None,
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
        files in this directory (`device_store.DeviceStateStore`), and the rounds run as
        the process's `DeviceProcess` (needed to split them over several
        workers); default: the driver keeps them (`client_states.ClientStateStore`).
      checkpoints: where the run's checkpoints live; if it holds one, the
        run continues after its round, with its server state, client states,
        sampling state and metrics rows, and gives the numbers an
        uninterrupted run gives.
      checkpoint_every: write a checkpoint after every this many rounds
        (0: never); never after the last round, whose results follow at once.
      on_resume: called with the round resumed after and the restored rows.
      spill_dir: where the driver's client-state store is memory-mapped
        once it exceeds `client_states.SPILL_BYTES` (None: it stays on the heap).
      poisson_sampling: sample clients by `sample_clients(poisson=True)`. A
        round that draws no client uploads nothing and changes nothing
        (`num_clients` 0 in its row).
      privacy: `round -> columns` added to each round's row (the privacy
        spent after that round, `dp_epsilon`).
      eval_clients: evaluations before the last round score a seeded sample
        of this many clients (`evaluation_sample`), with a confidence
        interval of the mean; 0: every client. The last round always scores
        every client.
      stop_on_divergence: a round whose mean training loss is NaN or
        infinite (`diverged`) becomes the last: the clients are personalized
        and evaluated as after the last round, and the run stops there
        (`RunResult.diverged_round`).
      num_classes: the data's classes, for `health.RunMonitor`'s checks
        against chance and a uniform guess (None: only the growth of the
        training loss is checked).
      source_ids: the clients' own ids in their source, one per client in
        `client_ids` order (`ClientDataSpec.source_ids`: a user's
        `ClientData` ids, kept by `tff_pfl.data.federated`): each row of
        `RunResult.clients` then carries its client's as `source_id`.
        None: rows carry `client_id` only.
      rounds_per_call: run this many rounds in one TFF call
        (`PersonalizedProcess.several_rounds`), with the numbers of one round
        a call and less of TFF's fixed cost a call (docs/runtime.md,
        "Several rounds a call"). Every client takes part in every round
        (`client_fraction` 1), the client states stay in the driver (no
        `device_state_dir`), and `eval_every` and `checkpoint_every` are
        multiples of it, so that evaluations and checkpoints fall between
        calls; the last call runs the rounds left. A call's rounds share
        its time equally (`round_seconds`). With `stop_on_divergence`, a
        round that diverges inside a call stops the run after that call:
        its row is the last, and the models evaluated are the call's last
        round's.
      validation: optional; the same algorithm built on the clients'
        validation splits, whose `evaluate` also scores every evaluation's
        states (`evaluate_all`): the validation curve.

    Returns:
      A `RunResult`.

    Raises:
      ValueError: if `source_ids` does not hold one id per client, or
        `rounds_per_call` is below 1 or given (above 1) with partial
        participation, `device_state_dir`, or an `eval_every` or
        `checkpoint_every` that is not a multiple of it (one line naming
        the argument).
    """
    check_rounds_per_call(
        rounds_per_call,
        client_fraction=client_fraction,
        device_state_dir=device_state_dir,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
    )
    rng = np.random.default_rng([seed, 0x5A3D])
    if device_state_dir is None:
        store = client_states.ClientStateStore(process, client_ids, spill_dir=spill_dir)
    else:
        store = device_store.DeviceStateStore(process, client_ids, device_state_dir)

    def some_rounds(round_num, count, state):
        if count > 1:  # every client, every round (check_rounds_per_call): the rng draws nothing
            state, every_metrics = store.run_rounds(process, state, list(client_ids), count)
        else:
            sampled = sample_clients(rng, client_ids, client_fraction, poisson=poisson_sampling)
            if sampled:
                state, round_metrics = store.run_round(process, state, sampled)
            else:  # an empty Poisson draw: nothing to aggregate
                round_metrics = {'num_clients': 0}
            every_metrics = [round_metrics]
        rows = []
        for i, round_metrics in enumerate(every_metrics):
            row = collections.OrderedDict(round=round_num + i, **evaluation.flatten(round_metrics))
            if privacy is not None:
                row.update(privacy(round_num + i))
            rows.append(row)
        return state, rows

    return run_rounds(
        process,
        client_ids,
        store,
        rng,
        some_rounds,
        rounds=rounds,
        rounds_per_call=rounds_per_call,
        unit='round',
        seed=seed,
        eval_every=eval_every,
        eval_clients=eval_clients,
        on_round=on_round,
        log=log,
        checkpoints=checkpoints,
        checkpoint_every=checkpoint_every,
        on_resume=on_resume,
        stop_on_divergence=stop_on_divergence,
        num_classes=num_classes,
        source_ids=source_ids,
        validation=validation,
    )


def run_rounds(
    process: template.PersonalizedProcess,
    client_ids: Sequence[str],
    store: client_states.ClientStates,
    rng: np.random.Generator,
    step: Callable,
    *,
    rounds: int,
    unit: str,
    seed: int,
    eval_every: int = 0,
    eval_clients: int = 0,
    on_round: Callable[[Mapping], None] | None = None,
    log: Callable[[str], None] = print,
    checkpoints: checkpoints_lib.RunCheckpoints | None = None,
    checkpoint_every: int = 0,
    on_resume: Callable[[int, list], None] | None = None,
    stop_on_divergence: bool = False,
    num_classes: int | None = None,
    source_ids: Sequence[str] | None = None,
    progress_label: Callable[[int, Mapping], str] | None = None,
    rounds_per_call: int = 1,
    validation: template.PersonalizedProcess | None = None,
) -> RunResult:
    """The one run loop: rounds of `step`, resumed from a checkpoint, checked, evaluated, released, saved.

    `run` (federated rounds over sampled clients) and the serverless loop
    (`decentralized.run`, star exchanges and local slots) are this loop with
    their own `step`. Per round: `step` (timed as `round_seconds`, a call's
    rounds sharing its time equally); the
    divergence check; at the last round the process's `personalize` stage
    (where it has one); every client's evaluation every `eval_every` rounds
    and at the end; `on_round`; a checkpoint every `checkpoint_every` rounds;
    a progress line with the health tags.

    Args:
      process: the algorithm.
      client_ids: every client.
      store: the run's client-state store.
      rng: the driver's generator that `step` draws from (its state is part
        of every checkpoint).
      step: `(round_num, count, state) -> (state, rows)`: `count` rounds
        from `round_num` on, in one call; `rows` holds each round's ordered
        metrics (`count` is 1 unless `rounds_per_call` is above 1).
      rounds: the last round (the rows count `unit`s).
      unit: what a round is called in lines and checkpoints ('round',
        'interval').
      seed: seeds the evaluation samples.
      eval_every: as in `run`.
      eval_clients: as in `run`.
      on_round: as in `run`.
      log: as in `run`.
      checkpoints: as in `run`.
      checkpoint_every: as in `run`.
      on_resume: as in `run`.
      stop_on_divergence: as in `run`.
      num_classes: as in `run`.
      source_ids: as in `run`.
      progress_label: `(round_num, row) -> label` of the progress line;
        default `'<unit> <n>/<rounds>'`.
      rounds_per_call: the most rounds one call of `step` runs; calls start
        after round 0 and after each multiple of it (the caller keeps
        evaluations and checkpoints on those boundaries,
        `check_rounds_per_call`).
      validation: as in `run`.

    Returns:
      A `RunResult`.

    Raises:
      ValueError: if `source_ids` does not hold one id per client.
    """
    source_map = evaluation.source_id_map(client_ids, source_ids)
    state = store.initialize(process)
    started = time.monotonic()
    state, rows, first_round = resume(checkpoints, state, store, rng, client_ids, rounds, unit, log, on_resume)
    monitor = health.RunMonitor(rounds, num_classes)
    monitor.replay(rows)
    diverged_round = None
    client_rows, summaries = [], {}
    round_num = first_round
    while round_num <= rounds and diverged_round is None:
        count = min(rounds_per_call - (round_num - 1) % rounds_per_call, rounds - round_num + 1)
        call_start = time.monotonic()
        state, call_rows = step(round_num, count, state)
        seconds = (time.monotonic() - call_start) / count
        for row in call_rows:
            row['round_seconds'] = seconds
            if stop_on_divergence and diverged(row):
                diverged_round = round_num
                log(divergence_line(f'{unit} {round_num}', row))
            last = round_num == rounds or diverged_round is not None
            evaluate_now = last or (eval_every and round_num % eval_every == 0)
            if last and process.personalize is not None:
                log(f'personalizing {len(client_ids)} clients ...')
                personalize_start = time.monotonic()
                store.personalize(process, state)
                row['personalize_seconds'] = time.monotonic() - personalize_start
            if evaluate_now:
                sample = None if last else evaluation.evaluation_sample(seed, round_num, len(client_ids), eval_clients)
                client_rows, summaries = evaluation.evaluate_all(
                    process, state, store, row, sample, source_map, validation
                )
            rows.append(row)
            if on_round is not None:
                on_round(row)
            if checkpoints is not None and checkpoint_every and round_num % checkpoint_every == 0 and not last:
                save_checkpoint(checkpoints, round_num, state, store, rng, rows)
            label = progress_label(round_num, row) if progress_label else f'{unit} {round_num}/{rounds}'
            log(
                progress_line(
                    label,
                    round_num - first_round + 1,
                    rounds - first_round + 1,
                    row,
                    summaries if evaluate_now else {},
                    started,
                    monitor.observe(row),
                )
            )
            round_num += 1
            if diverged_round is not None:
                break
    return RunResult(
        state=state,
        client_states=store.states(),
        rounds=rows,
        clients=client_rows,
        summary=summaries,
        diverged_round=diverged_round,
        warnings=monitor.warnings,
    )
