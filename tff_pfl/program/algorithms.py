"""Algorithm name -> process builder, per-client report columns and plots.

Each entry turns an `ExperimentConfig` into a `PersonalizedProcess`, and may
say which client-state fields belong in `clients.csv` and which extra plots
the run's report shows.
"""

import collections
import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np
import tensorflow_federated as tff

from tff_pfl.computations import local_training
from tff_pfl.program import reports


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How the program runs and reports one algorithm.

    Attributes:
      build: `(config, spec, model_fn) -> PersonalizedProcess`.
      client_columns: `(client_state) -> {column: value}` for clients.csv.
      plots: `(output_dir, run_result, process) -> [(title, file)]`.
      run: `(process, spec, config, on_round=, log=, checkpoints=,
        checkpoint_every=, on_resume=, spill_dir=) -> RunResult` for
        algorithms that need their own run loop (serverless ones); default
        `training_loop.run`.
      not_one_aggregation: why the algorithm's round has no form made of
        phases with one broadcast, one aggregation and device-held client
        state each (so it can neither be split over several workers nor
        exported as MapReduceForm); None when the process has such a form
        (`process.device`).
    """

    build: Callable
    client_columns: Callable[[Mapping], Mapping] | None = None
    plots: Callable | None = None
    run: Callable | None = None
    not_one_aggregation: str | None = None


def _short_ids(client_ids):
    """`client_00007` -> `00007`, for plot labels."""
    return [c.replace('client_', '') for c in client_ids]


def _local_config(config):
    if config.local_steps:
        # "l local steps": enough epochs for them, capped at l.
        return local_training.TrainingConfig(
            config.local_steps, config.batch_size, config.client_learning_rate, max_steps=config.local_steps
        )
    return local_training.TrainingConfig(config.local_epochs, config.batch_size, config.client_learning_rate)


def _server_optimizer(config):
    return tff.learning.optimizers.build_sgdm(learning_rate=config.server_learning_rate)


def _fedavg(config, spec, model_fn):
    from processes import fedavg

    return fedavg.build_fedavg_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        server_optimizer=_server_optimizer(config),
        seed=config.seed,
    )


def _persfl_builder(soft_loss):
    def build(config, spec, model_fn):
        from processes import persfl

        return persfl.build_persfl_process(
            spec,
            model_fn,
            local_config=_local_config(config),
            distill_config=local_training.TrainingConfig(
                config.distill_epochs, config.distill_batch_size, config.distill_learning_rate
            ),
            temperatures=config.temperatures,
            imitations=config.imitations,
            soft_loss=soft_loss,
            teacher=config.teacher,
            server_optimizer=_server_optimizer(config),
            seed=config.seed,
        )

    return build


def _persfl_columns(state):
    return collections.OrderedDict(
        teacher_round=int(state['teacher_round']),
        teacher_val_loss=float(state['teacher_loss']),
        temperature=float(state['temperature']),
        imitation=float(state['imitation']),
        personalized_val_accuracy=float(state['personalized_val_accuracy']),
    )


def _persfl_plots(out, result, process):
    client_ids, states = list(result.client_states), list(result.client_states.values())
    short = _short_ids(client_ids)
    reports.plot_client_bars(
        short,
        {'teacher round': [int(s['teacher_round']) for s in states]},
        os.path.join(out, 'teacher_rounds.png'),
        "Round of each client's optimal teacher",
        'round',
    )
    reports.plot_client_bars(
        short,
        {'T (temperature)': [float(s['temperature']) for s in states]},
        os.path.join(out, 'chosen_temperature.png'),
        'Chosen temperature T per client',
        'T',
    )
    reports.plot_client_bars(
        short,
        {'lambda (imitation)': [float(s['imitation']) for s in states]},
        os.path.join(out, 'chosen_imitation.png'),
        'Chosen imitation lambda per client',
        'lambda',
    )
    grid = np.stack([np.asarray(s['grid_val_accuracy']) for s in states])
    labels = [f'T={t:g}, λ={lam:g}' for t, lam in process.grid_candidates]
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


def _selffl(config, spec, model_fn):
    from processes import selffl

    return selffl.build_selffl_process(
        spec,
        model_fn,
        learning_rate=config.client_learning_rate,
        batch_size=config.batch_size,
        l_max=config.selffl_max_steps,
        default_steps=config.selffl_default_steps,
        activity_rate=config.client_fraction,
        warmup_rounds=config.warmup_rounds,
        seed=config.seed,
    )


def _selffl_columns(state):
    return collections.OrderedDict(
        num_participations=int(state['num_participations']),
        local_steps=int(state['local_steps']),
        sigma_m_sq=float(state['sigma_m_sq']),
    )


def _selffl_plots(out, result, process):
    del process
    client_ids, states = list(result.client_states), list(result.client_states.values())
    short = _short_ids(client_ids)
    order = sorted(range(len(states)), key=lambda i: float(states[i]['sigma_m_sq']))
    if len(order) > 60:  # a readable sample of clients, spread over the range
        order = [order[int(i)] for i in np.linspace(0, len(order) - 1, 60)]
    reports.plot_client_bars(
        [short[i] for i in order],
        {'local steps (last round)': [int(states[i]['local_steps']) for i in order]},
        os.path.join(out, 'local_steps.png'),
        'Self-FL local steps per client (sorted by sigma_m^2)',
        'steps',
    )
    reports.plot_client_bars(
        [short[i] for i in order],
        {'sigma_m^2': [float(states[i]['sigma_m_sq']) for i in order]},
        os.path.join(out, 'intra_client_variance.png'),
        'Intra-client uncertainty sigma_m^2',
        'sigma_m^2',
    )
    return [('Local steps per client', 'local_steps.png'), ('Intra-client uncertainty', 'intra_client_variance.png')]


def _ktpfl(config, spec, model_fn):
    from processes import ktpfl

    del model_fn  # every client has its own architecture
    return ktpfl.build_ktpfl_process(
        spec,
        _client_architectures(config, spec.num_clients),
        local_config=_local_config(config),
        distill_epochs=config.distill_epochs,
        distill_batch_size=config.distill_batch_size,
        distill_learning_rate=config.distill_learning_rate,
        public_batch=config.public_batch,
        temperature=config.kt_temperature,
        coefficient_learning_rate=config.kt_coefficient_learning_rate,
        rho=config.kt_rho,
        c_update=config.kt_c_update,
        seed=config.seed,
    )


def _client_architectures(config, num_clients):
    """Architectures are assigned to clients in turn."""
    return [config.architectures[i % len(config.architectures)] for i in range(num_clients)]


def _feddf_builder(finetune):
    def build(config, spec, model_fn):
        from processes import feddf

        del model_fn  # every client has its architecture's prototype
        return feddf.build_feddf_process(
            spec,
            _client_architectures(config, spec.num_clients),
            local_config=_local_config(config),
            server_distill_epochs=config.distill_epochs,
            distill_batch_size=config.distill_batch_size,
            distill_learning_rate=config.distill_learning_rate,
            public_batch=config.public_batch,
            temperature=config.kt_temperature,
            finetune_epochs=config.finetune_epochs if finetune else 0,
            seed=config.seed,
        )

    return build


def _communication_plots(out, result, process):
    del result
    reports.write_csv(os.path.join(out, 'communication.csv'), [dict(process.communication)])
    return []


def _ktpfl_homogeneous(config, spec, model_fn):
    from processes import ktpfl

    return ktpfl.build_ktpfl_homogeneous_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        transfer_steps=config.distill_epochs,
        transfer_learning_rate=config.distill_learning_rate,
        coefficient_learning_rate=config.kt_coefficient_learning_rate,
        rho=config.kt_rho,
        seed=config.seed,
    )


def _client_matrix(out, name, title, matrix, client_ids, row_labels=None):
    """A client x client matrix as `<name>.png` (heatmap) and `<name>.csv`."""
    short = _short_ids(client_ids)
    reports.plot_heatmap(
        matrix, os.path.join(out, f'{name}.png'), title, row_labels=row_labels or short, col_labels=short
    )
    reports.write_csv(
        os.path.join(out, f'{name}.csv'),
        [dict(client_id=c, **{m: float(v) for m, v in zip(short, row)}) for c, row in zip(client_ids, matrix)],
    )


def _ktpfl_plots(out, result, process):
    client_ids = list(result.client_states)
    architectures = getattr(process, 'architectures', None) or [''] * len(client_ids)
    labels = [f'{s} {a}'.strip() for s, a in zip(_short_ids(client_ids), architectures)]
    _client_matrix(
        out,
        'knowledge_coefficients',
        "Knowledge coefficients c[n, m] (row n: client n's mix)",
        np.asarray(result.state['coefficients']),
        client_ids,
        row_labels=labels,
    )
    _communication_plots(out, result, process)
    return [('Knowledge coefficients', 'knowledge_coefficients.png')]


def _kdpdfl_builder(mode):
    def build(config, spec, model_fn):
        from processes import kdpdfl

        return kdpdfl.build_kdpdfl_process(
            spec,
            model_fn,
            local_config=_local_config(config),
            max_neighbours=config.kd_max_neighbours,
            mu1=config.kd_mu1,
            mu2=config.kd_mu2,
            c_base=config.kd_c_base,
            distance_batch=config.kd_distance_batch,
            distance_layer=config.kd_distance_layer,
            mode=mode,
            broadcast=config.kd_broadcast,
            seed=config.seed,
        )

    return build


def _decentralized_run(finetune):
    def run(process, spec, config, *, on_round, log, **loop):
        from tff_pfl.program import decentralized

        return decentralized.run(
            process,
            spec.client_ids,
            intervals=config.rounds,
            exchange_interval=config.exchange_interval,
            seed=config.seed,
            mean_reachable=config.kd_mean_neighbours,
            finetune_from=config.finetune_from_slot if finetune else None,
            eval_every=config.eval_every,
            on_round=on_round,
            log=log,
            **loop,
        )

    return run


def _kdpdfl_columns(state):
    return collections.OrderedDict(
        num_exchanges=int(state['num_participations']), confidence=float(state['confidence'])
    )


def _kdpdfl_plots(out, result, process):
    del process
    graph = np.stack([np.asarray(s['connectivity']) for s in result.client_states.values()])
    _client_matrix(
        out,
        'collaboration_graph',
        "Collaboration weights w[i, j] (row i: client i's private vector)",
        graph,
        list(result.client_states),
    )
    return [('Collaboration graph W', 'collaboration_graph.png')]


def _fedavg_finetune(config, spec, model_fn):
    from processes import fedavg

    return fedavg.build_fedavg_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        server_optimizer=_server_optimizer(config),
        finetune_epochs=config.finetune_epochs,
        seed=config.seed,
    )


def _finetune_plots(out, result, process):
    del process
    states = list(result.client_states.values())
    reports.plot_client_bars(
        _short_ids(list(result.client_states)),
        {'fine-tuning epochs': [int(s['finetune_epochs']) for s in states]},
        os.path.join(out, 'finetune_epochs.png'),
        'Fine-tuning epochs chosen on validation',
        'epochs',
    )
    return [('Fine-tuning epochs per client', 'finetune_epochs.png')]


def _local(config, spec, model_fn):
    from processes import local

    return local.build_local_process(spec, model_fn, local_config=_local_config(config), seed=config.seed)


def _fedper(config, spec, model_fn):
    from processes import fedper

    return fedper.build_fedper_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        personal_layers=config.personal_layers,
        server_optimizer=_server_optimizer(config),
        seed=config.seed,
    )


def _ditto(config, spec, model_fn):
    from processes import ditto

    return ditto.build_ditto_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        personal_config=local_training.TrainingConfig(
            config.personal_epochs, config.batch_size, config.client_learning_rate
        ),
        ditto_lambda=config.ditto_lambda,
        server_optimizer=_server_optimizer(config),
        seed=config.seed,
    )


def _pfedme(config, spec, model_fn):
    from processes import pfedme

    return pfedme.build_pfedme_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        pfedme_lambda=config.pfedme_lambda,
        inner_steps=config.pfedme_inner_steps,
        personal_learning_rate=config.pfedme_personal_learning_rate,
        beta=config.pfedme_beta,
        seed=config.seed,
    )


def _perfedavg_builder(variant):
    def build(config, spec, model_fn):
        from processes import perfedavg

        return perfedavg.build_perfedavg_process(
            spec,
            model_fn,
            local_config=_local_config(config),
            alpha=config.perfedavg_alpha,
            variant=variant,
            delta=config.perfedavg_delta,
            seed=config.seed,
        )

    return build


def _apfl(config, spec, model_fn):
    from processes import apfl

    return apfl.build_apfl_process(
        spec,
        model_fn,
        local_config=_local_config(config),
        initial_alpha=config.apfl_alpha,
        alpha_learning_rate=config.apfl_alpha_learning_rate,
        server_optimizer=_server_optimizer(config),
        seed=config.seed,
    )


def _apfl_plots(out, result, process):
    del process
    reports.plot_client_bars(
        _short_ids(list(result.client_states)),
        {'alpha': [float(s['alpha']) for s in result.client_states.values()]},
        os.path.join(out, 'apfl_alpha.png'),
        'APFL mixing weight alpha per client',
        'alpha',
    )
    return [('APFL alpha per client', 'apfl_alpha.png')]


_KDPDFL_LIMIT = (
    "it is serverless: each exchange gathers every neighbour's own model at the star (one slot per "
    "neighbour) and sends the star's new model back for a second client stage, and its own run loop "
    "samples the star and its neighbours per time slot; a device form of two phases, like KT-pFL's, "
    'is not built'
)

_ALGORITHMS = {
    'fedavg': Algorithm(_fedavg),
    'persfl': Algorithm(_persfl_builder('kl'), _persfl_columns, _persfl_plots),
    'persfl_gd': Algorithm(_persfl_builder('ce'), _persfl_columns, _persfl_plots),
    'selffl': Algorithm(_selffl, _selffl_columns, _selffl_plots),
    'ktpfl': Algorithm(_ktpfl, lambda state: {'architecture_id': int(state['architecture'])}, _ktpfl_plots),
    'ktpfl_homo': Algorithm(_ktpfl_homogeneous, plots=_ktpfl_plots),
    'feddf': Algorithm(
        _feddf_builder(False), lambda state: {'architecture_id': int(state['architecture'])}, _communication_plots
    ),
    'pfeddf': Algorithm(
        _feddf_builder(True), lambda state: {'architecture_id': int(state['architecture'])}, _communication_plots
    ),
    'local': Algorithm(_local),
    'fedavg_ft': Algorithm(
        _fedavg_finetune, lambda state: {'finetune_epochs': int(state['finetune_epochs'])}, _finetune_plots
    ),
    'fedper': Algorithm(_fedper),
    'ditto': Algorithm(_ditto),
    'pfedme': Algorithm(_pfedme),
    'perfedavg_fo': Algorithm(_perfedavg_builder('fo')),
    'perfedavg_hf': Algorithm(_perfedavg_builder('hf')),
    'apfl': Algorithm(_apfl, lambda state: {'alpha': float(state['alpha'])}, _apfl_plots),
    'kdpdfl': Algorithm(
        _kdpdfl_builder('kdpdfl'),
        _kdpdfl_columns,
        _kdpdfl_plots,
        _decentralized_run(False),
        not_one_aggregation=_KDPDFL_LIMIT,
    ),
    'kdpdfl_fedavg': Algorithm(
        _kdpdfl_builder('fedavg'), _kdpdfl_columns, None, _decentralized_run(False), not_one_aggregation=_KDPDFL_LIMIT
    ),
    'kdpdfl_fedavg_plus': Algorithm(
        _kdpdfl_builder('fedavg'), _kdpdfl_columns, None, _decentralized_run(True), not_one_aggregation=_KDPDFL_LIMIT
    ),
    'kdpdfl_local': Algorithm(
        _kdpdfl_builder('local'), _kdpdfl_columns, None, _decentralized_run(False), not_one_aggregation=_KDPDFL_LIMIT
    ),
}


def names() -> list[str]:
    """Names accepted by `--algorithm`.

    Returns:
      The registered algorithm names, sorted.
    """
    return sorted(_ALGORITHMS)


def get(name: str) -> Algorithm:
    """The registry entry of `name` (validated by `ExperimentConfig`).

    Args:
      name: a registered algorithm name (one of `names()`).

    Returns:
      The `Algorithm` registered as `name`.

    Raises:
      KeyError: for an unknown name.
    """
    return _ALGORITHMS[name]


def build(config, spec, model_fn):
    """Builds the process of `config.algorithm` for the partition `spec`.

    Args:
      config: the run's `ExperimentConfig`; `config.algorithm` picks the
        builder, the other fields set its hyperparameters.
      spec: the `client_data.ClientDataSpec` of the partitioned client data.
      model_fn: no-argument callable returning a fresh `tf.keras.Model` for
        the data's feature shape and classes (ignored by the algorithms
        whose clients each have their own architecture).

    Returns:
      The algorithm's `PersonalizedProcess`.

    Raises:
      KeyError: for an unknown `config.algorithm`.
    """
    return _ALGORITHMS[config.algorithm].build(config, spec, model_fn)
