"""The algorithm registry: name -> settings type, process builder, report columns and plots.

Each entry names the algorithm's settings dataclass (`processes/<algo>.py`;
the only place its defaults are written), builds its `PersonalizedProcess`
from those settings, and may say which client-state fields belong in
`clients.csv` and which extra plots the run's report shows.
"""

import collections
import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np

from processes import apfl, ditto, fedavg, feddf, fedper, kdpdfl, ktpfl, local, perfedavg, persfl, pfedme, selffl
from tff_pfl import settings as settings_lib
from tff_pfl.computations import aggregators, heterogeneous, privacy
from tff_pfl.program import reports


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How the program builds, runs and reports one algorithm.

    Attributes:
      title: one line: the algorithm and its paper, for `--helpfull` and docs.
      settings: the algorithm's frozen settings dataclass (a
        `tff_pfl.settings.Settings`).
      build: `(settings, spec, model_fn, config) -> PersonalizedProcess`;
        `config` is the run's `ExperimentConfig` (its seed, and for Self-FL
        the client fraction).
      client_columns: `(client_state) -> {column: value}` for clients.csv.
      plots: `(output_dir, run_result, process) -> [(title, file)]`.
      run: `(process, spec, config, settings, on_round=, log=, checkpoints=,
        checkpoint_every=, on_resume=, spill_dir=) -> RunResult` for
        algorithms that need their own run loop (serverless ones); default
        `training_loop.run`.
      not_one_aggregation: why the algorithm's round has no form made of
        phases with one broadcast, one aggregation and device-held client
        state each (so it can neither be split over several workers nor
        exported as MapReduceForm); None when the process has such a form
        (`process.device`).
      default_models: dataset -> the model this algorithm uses when `--model`
        is not given, where it differs from the dataset's default.
      check: `(config) -> problem or None`, the algorithm's conditions on the
        common settings (e.g. full participation).
      private_uploads: what user-level DP (`--dp_noise_multiplier`) clips
        and noises in this algorithm's uploads; None: it takes no DP.
      no_privacy: why not, when `private_uploads` is None (completes
        "<algorithm> ...").
      local_dp: the noise is added on each client before its upload (local
        DP: the server sees each client's noised value), so the accountant
        counts every round a client takes part in, with no amplification by
        sampling.
    """

    title: str
    settings: type
    build: Callable
    client_columns: Callable[[Mapping], Mapping] | None = None
    plots: Callable | None = None
    run: Callable | None = None
    not_one_aggregation: str | None = None
    default_models: Mapping[str, str] = dataclasses.field(default_factory=dict)
    check: Callable | None = None
    private_uploads: str | None = None
    no_privacy: str = 'does not take user-level DP yet (docs/privacy.md lists the algorithms that do)'
    local_dp: bool = False

    @property
    def own_architectures(self) -> bool:
        """Whether each client has its own architecture (`--architectures`, no `--model`)."""
        return issubclass(self.settings, heterogeneous.PublicKnowledge)


def _short_ids(client_ids):
    """`client_00007` -> `00007`, for plot labels."""
    return [c.replace('client_', '') for c in client_ids]


def _client_fields(client_states, fields):
    """`(client ids, {field: np.ndarray over clients})`, without holding every state.

    Reading every state whole into a list held one model per client in
    memory (about 5 GB for Self-FL at 1,000,000 clients).
    """
    if hasattr(client_states, 'fields'):  # a training_loop.StateView
        return list(client_states), client_states.fields(fields)
    ids = list(client_states)
    values = {f: np.stack([np.asarray(client_states[c][f]) for c in ids]) for f in fields}
    return ids, values


def _persfl_columns(state):
    return collections.OrderedDict(
        teacher_round=int(state['teacher_round']),
        teacher_val_loss=float(state['teacher_loss']),
        temperature=float(state['temperature']),
        imitation=float(state['imitation']),
        personalized_val_accuracy=float(state['personalized_val_accuracy']),
    )


def _persfl_plots(out, result, process):
    client_ids, fields = _client_fields(
        result.client_states, ('teacher_round', 'temperature', 'imitation', 'grid_val_accuracy')
    )
    short = _short_ids(client_ids)
    reports.plot_client_bars(
        short,
        {'teacher round': [int(v) for v in fields['teacher_round']]},
        os.path.join(out, 'teacher_rounds.png'),
        "Round of each client's optimal teacher",
        'round',
    )
    reports.plot_client_bars(
        short,
        {'T (temperature)': [float(v) for v in fields['temperature']]},
        os.path.join(out, 'chosen_temperature.png'),
        'Chosen temperature T per client',
        'T',
    )
    reports.plot_client_bars(
        short,
        {'lambda (imitation)': [float(v) for v in fields['imitation']]},
        os.path.join(out, 'chosen_imitation.png'),
        'Chosen imitation lambda per client',
        'lambda',
    )
    grid = fields['grid_val_accuracy']
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


def _selffl_columns(state):
    return collections.OrderedDict(
        num_participations=int(state['num_participations']),
        local_steps=int(state['local_steps']),
        sigma_m_sq=float(state['sigma_m_sq']),
    )


def _selffl_plots(out, result, process):
    del process
    client_ids, fields = _client_fields(result.client_states, ('sigma_m_sq', 'local_steps'))
    short = _short_ids(client_ids)
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


def _communication_plots(out, result, process):
    del result
    reports.write_csv(os.path.join(out, 'communication.csv'), [dict(process.communication)])
    return []


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
    architectures = process.architectures or [''] * len(client_ids)
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


def _finetune_plots(out, result, process):
    del process
    client_ids, fields = _client_fields(result.client_states, ('finetune_epochs',))
    reports.plot_client_bars(
        _short_ids(client_ids),
        {'fine-tuning epochs': [int(v) for v in fields['finetune_epochs']]},
        os.path.join(out, 'finetune_epochs.png'),
        'Fine-tuning epochs chosen on validation',
        'epochs',
    )
    return [('Fine-tuning epochs per client', 'finetune_epochs.png')]


def _apfl_plots(out, result, process):
    del process
    client_ids, fields = _client_fields(result.client_states, ('alpha',))
    reports.plot_client_bars(
        _short_ids(client_ids),
        {'alpha': [float(v) for v in fields['alpha']]},
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


def _serverless_run(process, spec, config, settings, *, on_round, log, **loop):
    from tff_pfl.program import decentralized

    return decentralized.run(
        process,
        spec.client_ids,
        intervals=config.rounds,
        seed=config.seed,
        eval_every=config.eval_every,
        on_round=on_round,
        log=log,
        **settings.loop_arguments(),
        **loop,
    )


def _ktpfl_sampling(config):
    """KT-pFL samples clients (the paper's Table 2), except with the released code's c step."""
    if config.client_fraction < 1.0 and config.settings.kt_c_update == 'released':
        return (
            '--kt_c_update=released needs every client every round (its softmax renormalises c over all of them): '
            '--client_fraction=1'
        )
    return None


def _local_dp_checks(config):
    """The KT-pFL family's DP is local: a fixed clip, and no secure aggregation (it would hide nothing)."""
    if config.secure_aggregation:
        return ktpfl.LOCAL_DP_SECURE
    if config.dp_noise_multiplier is not None and config.dp_clip is None and config.dp_target_quantile is not None:
        return ktpfl.LOCAL_DP_ADAPTIVE
    return None


def _ktpfl_checks(config):
    return _ktpfl_sampling(config) or _local_dp_checks(config)


_FEDDF_UPLOADS = (
    "each client's parameter update in its architecture's slot (the ensemble is the noised prototypes', "
    "not the clients' logits)"
)


def _feddf_secure(config):
    """FedDF's secure aggregation needs DP (the clipped updates bound the secure sums)."""
    if config.secure_aggregation and config.dp_noise_multiplier is None:
        return feddf.SECURE_NEEDS_DP
    return None


def _architecture_column(state):
    return {'architecture_id': int(state['architecture'])}


def _serverless(title, settings_cls, plots=None) -> Algorithm:
    """A KD-PDFL-family entry: its settings (whose type is the exchange mode) and plots; the serverless loop."""
    return Algorithm(
        title,
        settings_cls,
        lambda s, spec, model_fn, config: kdpdfl.build_kdpdfl_process(spec, model_fn, s, seed=config.seed),
        _kdpdfl_columns,
        plots,
        _serverless_run,
        not_one_aggregation=_KDPDFL_LIMIT,
    )


def _selffl_privacy(config):
    """Self-FL's DP needs a fixed clip, and its secure aggregation needs DP (their bounded record)."""
    if config.dp_noise_multiplier is not None and config.dp_clip is None and config.dp_target_quantile is not None:
        return aggregators.SELFFL_ADAPTIVE
    if config.secure_aggregation and config.dp_noise_multiplier is None:
        return aggregators.SELFFL_SECURE
    return None


def _upload_aggregator(config, spec):
    """How the uploads are aggregated: DP's clipped, noised, unweighted mean, through secure sums or not.

    Returns None (the example-weighted mean) without DP or secure aggregation.
    """
    dp = config.privacy(spec.num_clients)
    if dp is not None:
        return dp.factory(secure=config.secure_aggregation)
    if not config.secure_aggregation:
        return None
    return privacy.secure_mean_factory(max(spec.split_sizes['train']))


def _persfl(title, settings_cls) -> Algorithm:
    """A PersFL entry: the soft loss of stage 2 (Eq. 3 KL or Eq. 7 cross-entropy) is the settings type."""
    return Algorithm(
        title,
        settings_cls,
        lambda s, spec, model_fn, config: persfl.build_persfl_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        _persfl_columns,
        _persfl_plots,
        private_uploads="stage 1's model updates (stage 2 stays on the clients)",
    )


_ALGORITHMS = {
    'fedavg': Algorithm(
        'FedAvg (McMahan et al., 2017)',
        fedavg.FedAvgSettings,
        lambda s, spec, model_fn, config: fedavg.build_fedavg_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        private_uploads='model updates',
    ),
    'fedavg_ft': Algorithm(
        'FedAvg + local fine-tuning chosen on validation',
        fedavg.FedAvgFTSettings,
        lambda s, spec, model_fn, config: fedavg.build_fedavg_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        lambda state: {'finetune_epochs': int(state['finetune_epochs'])},
        _finetune_plots,
        private_uploads='model updates (fine-tuning stays on the clients)',
    ),
    'persfl': _persfl(
        'PersFL (Divi et al., 2021): optimal teachers, then a per-client distillation grid', persfl.PersFLSettings
    ),
    'persfl_gd': _persfl(
        'PersFL-GD (Divi et al., 2021): PersFL with cross-entropy instead of KL', persfl.PersFLGDSettings
    ),
    'selffl': Algorithm(
        'Self-FL (Chen et al., 2022): uncertainty-driven starting points, local steps and aggregation',
        selffl.SelfFLSettings,
        lambda s, spec, model_fn, config: selffl.build_selffl_process(
            spec,
            model_fn,
            s,
            activity_rate=config.client_fraction,
            dp=config.privacy(spec.num_clients),
            secure=config.secure_aggregation,
            seed=config.seed,
        ),
        _selffl_columns,
        _selffl_plots,
        check=_selffl_privacy,
        private_uploads=(
            'the sums of updates, precision weights and variance statistics, as one record per client '
            '(personal models stay on the clients)'
        ),
    ),
    'ktpfl': Algorithm(
        'KT-pFL (Zhang et al., 2021): soft predictions on public data mixed by a learned coefficient matrix',
        ktpfl.KTpFLSettings,
        lambda s, spec, model_fn, config: ktpfl.build_ktpfl_process(
            spec,
            s,
            dp=config.privacy(spec.num_clients),
            seed=config.seed,
            max_clients_per_round=config.max_clients_per_round(spec.num_clients),
        ),
        _architecture_column,
        _ktpfl_plots,
        check=_ktpfl_checks,
        private_uploads="each client's soft predictions, clipped and noised on the client (local DP)",
        local_dp=True,
    ),
    'ktpfl_homo': Algorithm(
        'KT-pFL, homogeneous variant (Zhang et al., 2021): parameters mixed by the coefficient matrix',
        ktpfl.KTpFLHomoSettings,
        lambda s, spec, model_fn, config: ktpfl.build_ktpfl_homogeneous_process(
            spec,
            model_fn,
            s,
            dp=config.privacy(spec.num_clients),
            seed=config.seed,
            max_clients_per_round=config.max_clients_per_round(spec.num_clients),
        ),
        plots=_ktpfl_plots,
        check=_local_dp_checks,
        private_uploads="each client's parameters, clipped and noised on the client (local DP)",
        local_dp=True,
    ),
    'feddf': Algorithm(
        'FedDF (Lin et al., 2020): per-architecture averaging, then ensemble distillation on public data',
        feddf.FedDFSettings,
        lambda s, spec, model_fn, config: feddf.build_feddf_process(
            spec, s, dp=config.privacy(spec.num_clients), secure=config.secure_aggregation, seed=config.seed
        ),
        _architecture_column,
        _communication_plots,
        check=_feddf_secure,
        private_uploads=_FEDDF_UPLOADS,
    ),
    'pfeddf': Algorithm(
        'pFedDF: FedDF with local fine-tuning of the prototype',
        feddf.PFedDFSettings,
        lambda s, spec, model_fn, config: feddf.build_feddf_process(
            spec, s, dp=config.privacy(spec.num_clients), secure=config.secure_aggregation, seed=config.seed
        ),
        _architecture_column,
        _communication_plots,
        check=_feddf_secure,
        private_uploads=_FEDDF_UPLOADS,
    ),
    'local': Algorithm(
        'Local-only training',
        local.LocalSettings,
        lambda s, spec, model_fn, config: local.build_local_process(spec, model_fn, s, seed=config.seed),
        no_privacy='uploads nothing but training metrics: there is no model to protect',
    ),
    'fedper': Algorithm(
        'FedPer (Arivazhagan et al., 2019): shared base layers, personal head',
        fedper.FedPerSettings,
        lambda s, spec, model_fn, config: fedper.build_fedper_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        # Logistic regression has one layer: nothing would be shared.
        default_models={'synthetic': 'mnist_dnn'},
        private_uploads="the shared base's updates (the head stays on the clients)",
    ),
    'ditto': Algorithm(
        'Ditto (Li et al., 2021): personal models pulled towards the global one',
        ditto.DittoSettings,
        lambda s, spec, model_fn, config: ditto.build_ditto_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        private_uploads="the global model's updates (v_i stays on the clients)",
    ),
    'pfedme': Algorithm(
        'pFedMe (Dinh et al., 2020): Moreau envelopes',
        pfedme.PFedMeSettings,
        lambda s, spec, model_fn, config: pfedme.build_pfedme_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        private_uploads="the local models' updates (the personalized theta_i stays on the clients)",
    ),
    'perfedavg_fo': Algorithm(
        'Per-FedAvg FO (Fallah et al., 2020): first-order MAML',
        perfedavg.PerFedAvgSettings,
        lambda s, spec, model_fn, config: perfedavg.build_perfedavg_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        private_uploads='meta-model updates',
    ),
    'perfedavg_hf': Algorithm(
        'Per-FedAvg HF (Fallah et al., 2020): Hessian-free MAML',
        perfedavg.PerFedAvgHFSettings,
        lambda s, spec, model_fn, config: perfedavg.build_perfedavg_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        private_uploads='meta-model updates',
    ),
    'apfl': Algorithm(
        'APFL (Deng et al., 2020): adaptive mixture of local and global models',
        apfl.APFLSettings,
        lambda s, spec, model_fn, config: apfl.build_apfl_process(
            spec, model_fn, s, model_aggregator=_upload_aggregator(config, spec), seed=config.seed
        ),
        lambda state: {'alpha': float(state['alpha'])},
        _apfl_plots,
        private_uploads="the global model w's updates (v_i and alpha_i stay on the clients)",
    ),
    'kdpdfl': _serverless(
        'KD-PDFL (Jeong & Kountouris, 2023): serverless, star nodes weigh neighbours by logit distances',
        kdpdfl.KDPDFLSettings,
        _kdpdfl_plots,
    ),
    'kdpdfl_fedavg': _serverless(
        'Serverless FedAvg over the same star exchanges (KD-PDFL baseline)', kdpdfl.ServerlessFedAvgSettings
    ),
    'kdpdfl_fedavg_plus': _serverless(
        'Serverless FedAvg, then local fine-tuning from a slot on (KD-PDFL baseline)',
        kdpdfl.ServerlessFedAvgPlusSettings,
    ),
    'kdpdfl_local': _serverless(
        'Local learning in the serverless loop (KD-PDFL baseline)', kdpdfl.ServerlessLocalSettings
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


def all_setting_names() -> set[str]:
    """Every algorithm setting's name (the algorithm flags), over the registry.

    Returns:
      The union of the settings classes' field names.
    """
    return {name for entry in _ALGORITHMS.values() for name in entry.settings.field_names()}


def users_of(name: str) -> list[str]:
    """The algorithms that have the setting `name`.

    Args:
      name: a settings field name.

    Returns:
      Registered algorithm names, sorted.
    """
    return [a for a in names() if name in _ALGORITHMS[a].settings.field_names()]


def build(algorithm: str, settings: settings_lib.Settings, spec, model_fn, config):
    """Builds the process of `algorithm` for the partition `spec`.

    Args:
      algorithm: a registered name.
      settings: its settings (an instance of `get(algorithm).settings`).
      spec: the `client_data.ClientDataSpec` of the partitioned client data.
      model_fn: no-argument callable returning a fresh `tf.keras.Model` for
        the data's feature shape and classes (ignored by the algorithms
        whose clients each have their own architecture).
      config: the run's `ExperimentConfig` (seed; Self-FL's activity rate).

    Returns:
      The algorithm's `PersonalizedProcess`.

    Raises:
      KeyError: for an unknown `algorithm`.
      ValueError: the process cannot be built for this data and model.
    """
    return _ALGORITHMS[algorithm].build(settings, spec, model_fn, config)
