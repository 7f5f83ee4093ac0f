"""Self-FL on the two-level Gaussian model: the iteration vs the closed forms.

Client m holds N_m ~ U{5..200} samples from N(theta_m, 1), theta_m ~ N(0, 1);
the true variances are used (sigma_0^2 = 1, sigma_m^2 = 1 / N_m) and each
client's steps contract exactly as Eq. 8 asks. For M = 20, 80, 320, 1280
(5 seeds) the numpy iteration (`tff_pfl.reference.selffl_gaussian`) is run
for 40 rounds; for M = 20 and 80 the TFF process too, and its personal
estimates are compared with the numpy ones and with theta_m^(FL) (Eq. 3).

    uv run python benchmarks/selffl_gaussian.py
"""

import functools
import json
import os
import tempfile

import numpy as np
from absl import app, flags

from processes import selffl
from tff_pfl import models, runtime
from tff_pfl.reference import selffl_gaussian as reference

_ROUNDS = flags.DEFINE_integer('rounds', 40, 'Rounds.')
SETTINGS = {'heterogeneous': 1.0, 'homogeneous': 0.1}  # sigma_0^2
_OUT = flags.DEFINE_string('out', 'benchmarks/results/selffl_gaussian', 'Result path prefix (.json, .md).')
ETA = 0.001


def run_tff(samples, rounds, workdir, sigma0_sq):
    spec = reference.write_client_files(os.path.join(workdir, f'm{len(samples)}-{sigma0_sq:g}'), samples, seed=0)
    model_fn = functools.partial(models.gaussian_mean, spec.feature_shape, 1)
    process = selffl.build_selffl_process(
        spec,
        model_fn,
        selffl.SelfFLSettings(client_learning_rate=ETA),  # full-batch steps: batch_size is not used
        loss='gaussian',
        known_sigma0_sq=sigma0_sq,
        gaussian_noise_var=1.0,
    )
    state = process.initialize()
    states = [process.initial_client_state(c) for c in spec.client_ids]
    for _ in range(rounds):
        state, states, _ = process.next(state, states)
    return (
        np.array([float(s['personal'][0]) for s in states]),
        float(state['model'][0]),
        [int(s['local_steps']) for s in states],
    )


def main(argv):
    del argv
    rows, result = [], {'rounds': _ROUNDS.value, 'eta': ETA, 'settings': {}}
    workdir = tempfile.mkdtemp(prefix='selffl_gaussian.')
    with runtime.local_runtime():
        for setting, sigma0_sq in SETTINGS.items():
            by_m = result['settings'].setdefault(setting, {'sigma0_sq': sigma0_sq, 'by_m': {}})['by_m']
            for num_clients in (20, 80, 320, 1280):
                distance, shift, mean_shift, global_error = [], [], [], []
                for seed in range(5):
                    samples = reference.generate(num_clients, seed, sigma0_sq=sigma0_sq)
                    theta_fl, theta_g, z = reference.closed_forms(samples, sigma0_sq=sigma0_sq)
                    personal, global_ = reference.iterate(samples, _ROUNDS.value, eta=ETA, sigma0_sq=sigma0_sq)
                    distance.append(np.abs(personal[-1] - theta_fl).max())
                    shift.append(np.abs(theta_fl - z).max())
                    mean_shift.append(np.abs(theta_fl - z).mean())
                    global_error.append(abs(global_[-1] - theta_g))
                entry = dict(
                    max_distance=float(np.mean(distance)),
                    max_shift=float(np.mean(shift)),
                    mean_shift=float(np.mean(mean_shift)),
                    global_error=float(np.mean(global_error)),
                )
                if num_clients <= 80:
                    samples = reference.generate(num_clients, 0, sigma0_sq=sigma0_sq)
                    theta_fl, theta_g, z = reference.closed_forms(samples, sigma0_sq=sigma0_sq)
                    personal, global_ = reference.iterate(samples, _ROUNDS.value, eta=ETA, sigma0_sq=sigma0_sq)
                    tff_personal, tff_global, steps = run_tff(samples, _ROUNDS.value, workdir, sigma0_sq)
                    entry['tff_vs_numpy_max_difference'] = float(np.abs(tff_personal - personal[-1]).max())
                    entry['tff_max_distance_seed0'] = float(np.abs(tff_personal - theta_fl).max())
                    if num_clients == 20 and setting == 'heterogeneous':
                        rows = [
                            dict(
                                client=m,
                                n=len(samples[m]),
                                z=z[m],
                                theta_fl=theta_fl[m],
                                tff=tff_personal[m],
                                numpy=personal[-1][m],
                                steps=steps[m],
                            )
                            for m in range(num_clients)
                        ]
                        result['theta_g'] = float(theta_g)
                        result['tff_global'] = tff_global
                by_m[num_clients] = entry
                print(setting, num_clients, entry, flush=True)
    result['clients_m20'] = rows
    with open(_OUT.value + '.json', 'w') as f:
        json.dump(result, f, indent=1, default=float)
    lines = [
        '# Self-FL on the two-level Gaussian model',
        '',
        f'N_m ~ U{{5..200}}, s = 1, true variances, eta = {ETA}, {_ROUNDS.value} rounds, '
        'every client every round; 5 seeds per M (means shown).',
        'Command: `uv run python benchmarks/selffl_gaussian.py`',
        '',
    ]
    for setting, block in result['settings'].items():
        lines += [
            f'## {setting}: sigma_0^2 = {block["sigma0_sq"]}',
            '',
            '| M | max_m \\|theta_m - theta_m^(FL)\\| | max personalization shift \\|theta^(FL) - z\\| '
            '| mean shift | \\|theta - theta^(G)\\| | TFF vs numpy (seed 0) |',
            '|---|---|---|---|---|---|',
        ]
        for m, e in block['by_m'].items():
            tff_cell = f'{e["tff_vs_numpy_max_difference"]:.1e}' if 'tff_vs_numpy_max_difference' in e else ''
            lines.append(
                f'| {m} | {e["max_distance"]:.4f} | {e["max_shift"]:.3f} | {e["mean_shift"]:.3f} | '
                f'{e["global_error"]:.4f} | {tff_cell} |'
            )
        lines.append('')
    lines += [
        '## heterogeneous, M = 20, seed 0: each client (TFF process after the last round)',
        '',
        '| client | N_m | z_m (local) | theta_m^(FL) (Eq. 3) | TFF estimate | numpy iteration | local steps |',
        '|---|---|---|---|---|---|---|',
    ]
    lines += [
        f'| {r["client"]} | {r["n"]} | {r["z"]:.4f} | {r["theta_fl"]:.4f} | {r["tff"]:.4f} | {r["numpy"]:.4f} | '
        f'{r["steps"]} |'
        for r in rows
    ]
    lines += ['', f'Global: theta^(G) = {result["theta_g"]:.4f}, TFF {result["tff_global"]:.4f}.', '']
    with open(_OUT.value + '.md', 'w') as f:
        f.write('\n'.join(lines))
    print('\n'.join(lines))


if __name__ == '__main__':
    app.run(main)
