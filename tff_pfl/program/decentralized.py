"""The serverless algorithms' round (KD-PDFL and its baselines), on the one run loop.

Time runs in slots. Every `exchange_interval` slots a random client wakes up
as the star node and draws its reachable neighbours (`process.draw_neighbours`);
the driver hands the star's state to the process as the SERVER value of one
exchange and the neighbours' states as CLIENTS, then stores what comes back.
The star and its neighbours spend two slots on the exchange (gather, then
broadcast); in every other slot every client trains locally
(`process.local_work`, one slot of local work each). One row of metrics per
exchange interval. The interval is the `step` of `training_loop.run_rounds`,
the loop federated runs use too (resume, divergence check, evaluation,
release, checkpoints, progress).

The loop reads what it needs from the process's declared properties
(`template.ServerlessProcess`: `mode`, `max_neighbours`, `local_work`); the
exchange settings come from the algorithm's settings through `run`'s
arguments.
"""

import collections
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tff_pfl.computations import template
from tff_pfl.program import checkpoints as checkpoints_lib
from tff_pfl.program import client_states, evaluation, training_loop


def run(
    process,
    client_ids: Sequence[str],
    *,
    intervals: int,
    exchange_interval: int,
    seed: int,
    mean_reachable: float | None = None,
    finetune_from: int | None = None,
    eval_every: int = 0,
    eval_clients: int = 0,
    on_round: Callable[[Mapping], None] | None = None,
    log: Callable[[str], None] = print,
    checkpoints: checkpoints_lib.RunCheckpoints | None = None,
    checkpoint_every: int = 0,
    on_resume: Callable[[int, list], None] | None = None,
    spill_dir: str | None = None,
    stop_on_divergence: bool = False,
    num_classes: int | None = None,
    source_ids: Sequence[str] | None = None,
    validation=None,
) -> training_loop.RunResult:
    """Runs `intervals` exchange intervals of `exchange_interval` slots each.

    Args:
      process: a `template.ServerlessProcess`
        (`processes.kdpdfl.build_kdpdfl_process`).
      client_ids: every client.
      intervals: number of exchange intervals (rows of metrics).
      exchange_interval: T_ex, slots per interval (>= 2).
      seed: seeds the star and neighbour draws.
      mean_reachable: mean number of reachable peers (Rayleigh fading),
        `kd_mean_neighbours`; required unless `process.mode` is 'local'
        (which never draws neighbours).
      finetune_from: slot from which exchanges stop and clients only train
        locally (FedAvg+); None: never.
      eval_every: evaluate every client every this many intervals (0: only at
        the end); the last interval is always evaluated.
      eval_clients: evaluations before the last interval score a seeded
        sample of this many clients (`evaluation.evaluation_sample`);
        0: every client.
      on_round: called with each interval's metrics row.
      log: receives one progress line per interval.
      checkpoints: as in `training_loop.run`, counting intervals; the
        checkpoint also keeps the star and neighbour generator's state.
      checkpoint_every: as in `training_loop.run`, counting intervals.
      on_resume: as in `training_loop.run`, with the interval resumed after.
      spill_dir: as in `training_loop.run`.
      stop_on_divergence: as in `training_loop.run`, for an interval whose
        mean training loss is NaN or infinite.
      num_classes: as in `training_loop.run` (the `health.RunMonitor` tags).
      source_ids: as in `training_loop.run`.
      validation: as in `training_loop.run`.

    Returns:
      A `training_loop.RunResult` (its `rounds` are the intervals).

    Raises:
      TypeError: if `process` is not a `template.ServerlessProcess`.
      ValueError: if `exchange_interval` < 2, `mean_reachable` is missing for
        a mode that exchanges, `source_ids` does not hold one id per client,
        or the newest checkpoint in `checkpoints` belongs to another run.
    """
    if not isinstance(process, template.ServerlessProcess):
        raise TypeError(f'decentralized.run takes a template.ServerlessProcess, got {type(process).__name__}')
    if exchange_interval < 2:
        raise ValueError(f'exchange_interval must be >= 2 (gather and broadcast slots), got {exchange_interval}')
    if process.mode != 'local' and (mean_reachable is None or not mean_reachable > 0):
        raise ValueError(f'mode {process.mode!r} draws neighbours: mean_reachable must be > 0, got {mean_reachable}')
    rng = np.random.default_rng([seed, 0x4B44])
    num_clients = len(client_ids)
    store = client_states.ClientStateStore(process, client_ids, spill_dir=spill_dir)

    def one_interval(interval, count, state):
        del count  # always 1: every interval is its own call
        first_slot = (interval - 1) * exchange_interval
        slots = np.full(num_clients, exchange_interval, np.int32)
        row = collections.OrderedDict(round=interval, slot=first_slot + exchange_interval)
        exchanging = process.mode != 'local' and (finetune_from is None or first_slot < finetune_from)
        if exchanging:
            star = int(rng.integers(num_clients))
            neighbours = process.draw_neighbours(rng, num_clients, star, mean_reachable=mean_reachable)
            row['star'] = star
            row['num_neighbours'] = len(neighbours)
            if neighbours:
                invitation = np.full(process.max_neighbours, -1, np.int32)
                invitation[: len(neighbours)] = neighbours
                server_state = collections.OrderedDict(
                    star=store.get([client_ids[star]])[0], neighbours=invitation, exchange_num=np.int32(interval - 1)
                )
                neighbour_ids = [client_ids[j] for j in neighbours]
                output = process.next(server_state, store.get(neighbour_ids))
                state = output.state
                store.put([client_ids[star]], [state['star']])
                store.put(neighbour_ids, output.client_states)
                row.update(evaluation.flatten(output.metrics, 'exchange_'))
                slots[[star] + neighbours] = exchange_interval - 2
        states, train_metrics = process.local_work(store.all(), list(slots), np.int32(first_slot))
        store.put(store.ids(), states)
        row.update(evaluation.flatten(train_metrics))
        return state, [row]

    return training_loop.run_rounds(
        process,
        client_ids,
        store,
        rng,
        one_interval,
        rounds=intervals,
        unit='interval',
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
        progress_label=lambda interval, row: f'interval {interval}/{intervals} (slot {row["slot"]})',
    )
