"""The algorithm registry: the declarations of `processes/<algo>.py`, by name.

Each module named in `MODULE_NAMES` ends with `ALGORITHMS`, a tuple of
`tff_pfl.algorithm.Algorithm`s (its names, settings type, builder, report
hooks, run mode and privacy modes). This module only collects them and
builds a process from the run's configuration; adding an algorithm is one
new module and its name in `MODULE_NAMES` here (docs/architecture.md,
"Adding an algorithm").
"""

import importlib

import processes
from tff_pfl import algorithm
from tff_pfl import settings as settings_lib
from tff_pfl.computations import privacy

# The modules of processes/ whose declarations make up the registry: one line per module, the only
# place they are listed (docs/api.md documents them in this order). tests/test_declarations.py fails
# naming a module of processes/ that declares algorithms and is not here.
MODULE_NAMES = (
    'fedavg',
    'persfl',
    'selffl',
    'ktpfl',
    'ktpfl_homo',
    'kdpdfl',
    'local',
    'fedper',
    'fedbn',
    'ditto',
    'apfl',
    'pfedme',
    'perfedavg',
    'feddf',
    'fedamp',
    'pfedhn',
    'fedfomo',
    'fedrep',
    'lgfedavg',
    'fedbabu',
    'fedala',
    'fedrod',
    'fedproto',
    'feddbe',
)

_MODULES = tuple(importlib.import_module(f'{processes.__name__}.{name}') for name in MODULE_NAMES)


def modules() -> tuple:
    """The registry's modules of processes/, in `MODULE_NAMES` order.

    Returns:
      The imported modules; each has `ALGORITHMS` (its declarations) and
      `__all__` (its public API: builder and settings types).
    """
    return _MODULES


def _collect(modules) -> dict[str, algorithm.Algorithm]:
    found = {}
    for module in modules:
        for entry in module.ALGORITHMS:
            if entry.name in found:
                raise ValueError(f'algorithm {entry.name!r} is declared twice (second time in {module.__name__})')
            found[entry.name] = entry
    return found


_ALGORITHMS = _collect(_MODULES)


def names() -> list[str]:
    """Names accepted by `--algorithm`.

    Returns:
      The registered algorithm names, sorted.
    """
    return sorted(_ALGORITHMS)


def get(name: str) -> algorithm.Algorithm:
    """The declaration of `name` (validated by `ExperimentConfig`).

    Args:
      name: a registered algorithm name (one of `names()`).

    Returns:
      The `tff_pfl.algorithm.Algorithm` declared as `name`.

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


def privacy_problem(entry: algorithm.Algorithm, privacy) -> str | None:
    """The algorithm's refusal of the run's privacy settings, from its declared privacy modes.

    Args:
      entry: the algorithm's declaration.
      privacy: the run's `config_parts.PrivacyConfig`.

    Returns:
      One line, or None when its privacy modes take the run's settings.
    """
    modes = entry.privacy
    if privacy.secure_aggregation and modes.no_secure:
        return modes.no_secure
    if privacy.adaptive_clipping and modes.fixed_clip_only:
        return modes.fixed_clip_only
    if privacy.secure_aggregation and not privacy.dp and modes.secure_needs_dp:
        return modes.secure_needs_dp
    return None


def run_options(config, spec) -> algorithm.RunOptions:
    """What the run gives the builder: its seed, sampling, DP and the upload aggregator they make.

    Args:
      config: the run's `run_config.ExperimentConfig`.
      spec: the `client_data.ClientDataSpec` of its client data.

    Returns:
      A `tff_pfl.algorithm.RunOptions`; its `model_aggregator` is DP's clipped,
      noised, unweighted mean (through secure sums or not), or the secure
      example-weighted mean, or None (the example-weighted mean).
    """
    dp = config.dp_mechanism(spec.num_clients)

    def model_aggregator():
        if dp is not None:
            return dp.factory(secure=config.privacy.secure_aggregation)
        if config.privacy.secure_aggregation:
            return privacy.secure_mean_factory(max(spec.split_sizes['train']))
        return None

    return algorithm.RunOptions(
        seed=config.seed,
        client_fraction=config.schedule.client_fraction,
        max_clients_per_round=config.max_clients_per_round(spec.num_clients),
        dp=dp,
        secure=config.privacy.secure_aggregation,
        make_model_aggregator=model_aggregator,
    )


def build(name: str, settings: settings_lib.Settings, spec, model_fn, config):
    """Builds the process of `name` for the partition `spec`.

    Args:
      name: a registered algorithm name.
      settings: its settings (an instance of `get(name).settings`).
      spec: the `client_data.ClientDataSpec` of the partitioned client data.
      model_fn: no-argument callable returning a fresh `tf.keras.Model` for
        the data's feature shape and classes (ignored by the algorithms
        whose clients each have their own architecture).
      config: the run's `ExperimentConfig` (seed, sampling, DP).

    Returns:
      The algorithm's `PersonalizedProcess`.

    Raises:
      KeyError: for an unknown `name`.
      ValueError: the process cannot be built for this data and model.
    """
    return _ALGORITHMS[name].build(settings, spec, model_fn, run_options(config, spec))
