"""Writes docs/api.md, the public Python API, from the docstrings.

    uv run --locked python docs/gen_api.py > docs/api.md

`tests/test_docs.py` fails when docs/api.md differs from what this prints.
The public API is the list below (for the algorithm modules of processes/,
each registered module's `__all__`); what is not listed is internal and may
change without notice.
"""

import dataclasses
import importlib
import inspect
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tff_pfl import settings as settings_lib  # noqa: E402
from tff_pfl.program import algorithms, config_parts  # noqa: E402

# (module, [names]), in the order a user meets them.
PUBLIC = [
    (
        'tff_pfl.data.federated',
        ['from_federated_data', 'user_ids', 'by_user_id', 'default_cache_dir', 'clear_cache', 'default_cache_limit_gb'],
    ),
    ('tff_pfl.data.pipeline', ['prepare', 'PreparedData']),
    ('tff_pfl.data.client_data', ['ClientDataSpec', 'read_split_numpy']),
    ('tff_pfl.models', ['register', 'unregister', 'get', 'names', 'import_module']),
    ('tff_pfl.models.adapters', ['keras_model_fn']),
    # The registry's algorithm modules, in its order: each module's `__all__` (its builder and settings).
    *((module.__name__, list(module.__all__)) for module in algorithms.modules()),
    ('tff_pfl.algorithm', ['Algorithm', 'RunOptions', 'Privacy', 'Upload', 'model_update_builder']),
    ('tff_pfl.computations.template', ['PersonalizedProcess', 'ServerlessProcess', 'RoundOutput']),
    ('tff_pfl.computations.local_training', ['loss_from', 'metrics_from']),
    ('tff_pfl.computations.keras_metrics', ['KerasMetric', 'from_metric']),
    ('tff_pfl.computations.privacy', ['DPConfig']),
    ('tff_pfl.program.training_loop', ['run', 'RunResult']),
    ('tff_pfl.program.evaluation', ['client_rows']),
    ('tff_pfl.program.tff_programs', ['learning_process', 'ClientIdsDataSource', 'native_context']),
    ('tff_pfl.program.run_config', ['make_config', 'ExperimentConfig']),
    (
        'tff_pfl.program.config_parts',
        [
            'DataConfig',
            'ScheduleConfig',
            'EvaluationConfig',
            'CheckpointConfig',
            'PrivacyConfig',
            'RuntimeConfig',
            'PartitionSettings',
            *(cls.__name__ for cls in config_parts.PARTITIONS.values()),
        ],
    ),
    ('tff_pfl.program.experiment', ['run_experiment']),
    (
        'tff_pfl.runtime',
        [
            'local_runtime',
            'runtime_for',
            'RemoteRuntime',
            'refuse_implicit_runtime',
            'TlsCredentials',
            'check_worker',
            'WorkerLostError',
        ],
    ),
]


# Long qualified names in signatures, as a user writes them.
_SHORT = [
    (r'tensorflow_federated\.python\.learning\.optimizers\.optimizer\.Optimizer', 'tff.learning.optimizers.Optimizer'),
    (r'tensorflow_federated\.python\.aggregators\.factory\.', 'tff.aggregators.'),
    (r'keras\.src\.engine\.training\.Model', 'tf.keras.Model'),
    (r'keras\.src\.losses\.Loss', 'tf.keras.losses.Loss'),
    (r'tensorflow\.python\.framework\.tensor\.Tensor', 'tf.Tensor'),
    (r'numpy\.ndarray', 'np.ndarray'),
    (r'collections\.abc\.', ''),
    (r'<built-in function print>', 'print'),
    (r'<function (\w+) at 0x[0-9a-f]+>', r'\1'),
    (r'\btff_pfl\.(?:[a-z_]+\.)*([a-z_]+)\.([A-Z]\w*)', r'\1.\2'),
    (r'\bprocesses\.[a-z_]+\.([A-Z]\w*)', r'\1'),
]


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return '(...)'
    for pattern, replacement in _SHORT:
        text = re.sub(pattern, replacement, text)
    return text


def _doc(obj) -> list[str]:
    doc = inspect.getdoc(obj) or '(no docstring)'
    return ['```text', doc, '```', '']


def _settings_table(cls) -> list[str]:
    lines = ['| setting | default | meaning |', '|---|---|---|']
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else '(required)'
        meaning = settings_lib.help_of(field).replace('|', '\\|')
        lines.append(f'| `{field.name}` | `{default!r}` | {meaning} |')
    return [*lines, '']


def _public_methods(cls) -> list[str]:
    lines = []
    for name, member in inspect.getmembers(cls):
        if name.startswith('_') or name in vars(object):
            continue
        if name not in vars(cls) and not any(name in vars(base) for base in cls.__mro__[1:2] if base is not object):
            continue
        if isinstance(member, property):
            first = (inspect.getdoc(member) or '').split('\n\n')[0].replace('\n', ' ')
            lines.append(f'- `{name}` (property): {first}')
        elif callable(member):
            first = (inspect.getdoc(member) or '').split('\n\n')[0].replace('\n', ' ')
            lines.append(f'- `{name}{_signature(member)}`: {first}')
    return [*lines, ''] if lines else []


def render() -> str:
    """The whole of docs/api.md.

    Returns:
      Markdown text.
    """
    out = [
        '# Python API',
        '',
        'The public API, generated from the docstrings by `docs/gen_api.py` (`uv run --locked python',
        'docs/gen_api.py > docs/api.md`; `tests/test_docs.py` keeps it current). What is not listed',
        'here is internal. [own_code.md](own_code.md) shows it at work.',
        '',
    ]
    for module_name, names in PUBLIC:
        module = importlib.import_module(module_name)
        out += [f'## `{module_name}`', '']
        summary = (inspect.getdoc(module) or '').split('\n\n')[0]
        if summary:
            out += [summary, '']
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                out += [f'### class `{name}`', '']
                out += _doc(obj)
                if dataclasses.is_dataclass(obj) and issubclass(obj, settings_lib.Settings):
                    out += _settings_table(obj)
                else:
                    out += _public_methods(obj)
            else:
                out += [f'### `{name}{_signature(obj)}`', '']
                out += _doc(obj)
    return '\n'.join(out).rstrip() + '\n'


if __name__ == '__main__':
    sys.stdout.write(render())
