"""Each algorithm is declared in its own module, the registry only collects the declarations, and the
library imports neither the algorithms (but through the registry) nor the benchmark tool."""

import ast
import inspect
import pathlib
import types

import pytest

from tff_pfl import algorithm
from tff_pfl.program import algorithms, run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _process_modules():
    return sorted(p.stem for p in (ROOT / 'processes').glob('*.py') if p.stem != '__init__')


# Modules of processes/ that declare no algorithm: parts an algorithm family shares.
SHARED_PARTS = {
    'ktpfl_rounds': {'ktpfl', 'ktpfl_homo', 'fedamp', 'fedfomo', 'pfedhn'},
    'ktpfl_coefficients': {'ktpfl', 'ktpfl_homo'},
    'kdpdfl_exchange': {'kdpdfl'},
    'pfedhn_network': {'pfedhn'},
    'head_split': {'fedrod', 'feddbe'},
}


def test_every_module_of_processes_is_in_the_registry_and_declares_its_algorithms():
    registered = [m.__name__.split('.')[-1] for m in algorithms.modules()]
    assert registered == list(algorithms.MODULE_NAMES)
    missing = set(_process_modules()) - set(SHARED_PARTS) - set(registered)
    assert not missing, (
        f'modules of processes/ missing from MODULE_NAMES (tff_pfl/program/algorithms.py): {sorted(missing)}'
    )
    assert set(registered) == set(_process_modules()) - set(SHARED_PARTS)
    for part, users in SHARED_PARTS.items():
        assert not hasattr(__import__(f'processes.{part}', fromlist=['_']), 'ALGORITHMS')
        assert set(_importers(['processes'], part, submodule=True)) == {f'processes/{u}.py' for u in users}
    declared = [entry for module in algorithms.modules() for entry in module.ALGORITHMS]
    assert all(isinstance(entry, algorithm.Algorithm) for entry in declared)
    assert sorted(entry.name for entry in declared) == algorithms.names()
    for module in algorithms.modules():
        for entry in module.ALGORITHMS:
            # The declaration sits beside its settings and builder.
            assert entry.settings.__module__ == module.__name__, entry.name
            assert algorithms.get(entry.name) is entry


@pytest.mark.parametrize('name', algorithms.MODULE_NAMES)
def test_each_algorithm_modules_public_api_lists_its_builders_and_settings(name):
    """docs/api.md documents a registered module's `__all__`: it names the module's builders and settings types."""
    module = algorithms.modules()[algorithms.MODULE_NAMES.index(name)]
    own = {
        n
        for n, value in vars(module).items()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and n.startswith('build_')
        and n.endswith('_process')
    }
    own |= {entry.settings.__name__ for entry in module.ALGORITHMS}
    missing = own - set(getattr(module, '__all__', ()))
    assert not missing, f'{module.__name__}.__all__ does not list {sorted(missing)}'
    for public in module.__all__:
        assert getattr(module, public).__module__ == module.__name__, public


def test_a_name_declared_twice_is_refused():
    first = types.SimpleNamespace(__name__='processes.a', ALGORITHMS=(algorithms.get('local'),))
    second = types.SimpleNamespace(__name__='processes.b', ALGORITHMS=(algorithms.get('local'),))
    with pytest.raises(ValueError, match=r"algorithm 'local' is declared twice \(second time in processes.b\)"):
        algorithms._collect((first, second))


def _importers(packages, imported, submodule=False):
    """The files under `packages` that import the top-level package `imported` (or, with `submodule`,
    the module `processes.<imported>` by `from processes import ...`)."""
    found = []
    for package in packages:
        for path in sorted((ROOT / package).rglob('*.py')):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                    if submodule and node.module == 'processes':
                        names = [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n.split('.')[0] == imported for n in names):
                    found.append(str(path.relative_to(ROOT)))
    return sorted(set(found))


def test_only_the_registry_imports_processes():
    assert _importers(['tff_pfl'], 'processes') == ['tff_pfl/program/algorithms.py']


def test_the_library_never_imports_the_benchmark_tool():
    assert _importers(['tff_pfl', 'processes', 'deploy'], 'tff_pfl_bench') == []
    assert _importers(['tff_pfl_bench'], 'tff_pfl_bench')  # the test reads imports: it sees the tool's own


def test_the_algorithms_whose_clients_name_their_architectures():
    own = [name for name in algorithms.names() if algorithms.get(name).own_architectures]
    assert own == ['feddf', 'ktpfl', 'pfeddf']


def test_unknown_algorithm_is_one_line_in_every_entry_point():
    with pytest.raises(run_config.ConfigError) as refused:
        run_config.declaration('fedsgd')
    line = str(refused.value)
    assert line.startswith("unknown algorithm 'fedsgd'; known: apfl, ditto,") and '\n' not in line
    assert run_config.declaration('persfl') is algorithms.get('persfl')
    # The one place: no other module of the library writes the refusal.
    writers = [
        str(p.relative_to(ROOT)) for p in (ROOT / 'tff_pfl').rglob('*.py') if 'unknown algorithm' in p.read_text()
    ]
    assert writers == ['tff_pfl/program/run_config.py']
    with pytest.raises(run_config.ConfigError) as from_dict:
        run_config.ExperimentConfig.from_dict({'algorithm': 'fedsgd', 'output_dir': 'x'}, where='run.toml: ')
    assert str(from_dict.value) == 'run.toml: ' + line
    with pytest.raises(run_config.ConfigError) as validate:
        run_config.make_config(output_dir='x', algorithm='fedsgd').validate()
    assert str(validate.value) == line


@pytest.mark.parametrize(
    'name, values, refusal',
    [
        ('selffl', dict(dp_noise_multiplier=0.5, dp_target_quantile=0.5), 'ADAPTIVE_CLIP_REFUSED'),
        ('selffl', dict(secure_aggregation=True), 'SECURE_NEEDS_DP'),
        ('feddf', dict(secure_aggregation=True), 'SECURE_NEEDS_DP'),
        ('ktpfl', dict(secure_aggregation=True, dp_noise_multiplier=0.5, dp_clip=1.0), 'LOCAL_DP_SECURE'),
        ('ktpfl_homo', dict(dp_noise_multiplier=0.5, dp_target_quantile=0.5), 'LOCAL_DP_ADAPTIVE'),
    ],
)
def test_declared_privacy_modes_refuse_in_one_line(name, values, refusal):
    config = run_config.make_config(output_dir='x', algorithm=name, **values)
    with pytest.raises(run_config.ConfigError) as refused:
        config.validate()
    module = 'processes.ktpfl_rounds' if refusal.startswith('LOCAL_DP') else algorithms.get(name).build.__module__
    assert str(refused.value) == getattr(__import__(module, fromlist=['_']), refusal)


@pytest.mark.parametrize(
    'name, values',
    [
        ('selffl', dict(dp_noise_multiplier=0.5, dp_clip=1.0, secure_aggregation=True)),
        ('feddf', dict(dp_noise_multiplier=0.5, dp_clip=1.0, secure_aggregation=True)),
        ('ktpfl', dict(dp_noise_multiplier=0.5, dp_clip=1.0)),
        ('fedavg', dict(dp_noise_multiplier=0.5, dp_target_quantile=0.5, secure_aggregation=True)),
    ],
)
def test_declared_privacy_modes_take_what_they_support(name, values):
    run_config.make_config(output_dir='x', algorithm=name, **values).validate()


def test_run_options_make_the_upload_aggregator_only_when_asked():
    made = []
    run = algorithm.RunOptions(seed=3, make_model_aggregator=lambda: made.append(1) or 'factory')
    assert not made
    assert run.model_aggregator == 'factory' and made == [1]
    assert algorithm.RunOptions().model_aggregator is None


def test_model_update_builder_passes_the_runs_aggregator_and_seed_on():
    calls = []

    def build_x_process(spec, model_fn, settings, *, model_aggregator=None, seed=0):
        calls.append((spec, model_fn, settings, model_aggregator, seed))
        return 'process'

    build = algorithm.model_update_builder(build_x_process)
    run = algorithm.RunOptions(seed=7, make_model_aggregator=lambda: 'dp factory')
    assert build('settings', 'spec', 'model_fn', run) == 'process'
    assert calls == [('spec', 'model_fn', 'settings', 'dp factory', 7)]
    # Every algorithm declares it unless its uploads are not one model update per client: these, named (a new
    # algorithm whose upload is one update per client needs no line here).
    others = [
        n for n in algorithms.names() if not algorithms.get(n).build.__qualname__.startswith('model_update_builder')
    ]
    assert others == [
        'fedamp',  # the server gathers every client's model (gathering_builder)
        'feddf',  # the server distills the averaged models on public data
        'fedfomo',  # gathering_builder
        'fedproto',  # per-class prototype sums, no model
        'kdpdfl',  # serverless: no server aggregation
        'kdpdfl_fedavg',
        'kdpdfl_fedavg_plus',
        'kdpdfl_local',
        'ktpfl',  # soft predictions on public data
        'ktpfl_homo',
        'local',  # no upload
        'pfeddf',
        'pfedhn',  # gathering_builder
        'selffl',  # the update with its uncertainty, for the precision weights
    ]
