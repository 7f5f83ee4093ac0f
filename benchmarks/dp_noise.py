"""Noise multipliers that reach chosen epsilons for a run's schedule (for DP suites' rows).

    uv run --locked python benchmarks/dp_noise.py --epsilons=1,3,8 --client_fraction=0.1 --rounds=200 \
        --num_clients=1000 --target_quantile=0.5

prints one line per epsilon: the smallest noise multiplier z whose epsilon after `--rounds` rounds of
Poisson sampling with q = `--client_fraction`, at delta (default 1 / num_clients^1.1), is at most it
(`tff_pfl.computations.privacy.noise_multiplier_for`, RDP accountant, rounded up to 4 decimals), and the
epsilon it reaches.
"""

import argparse
import math
import sys

from tff_pfl.computations import privacy


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(',') if v]


def main(argv=None) -> int:
    """Prints the calibrated noise multipliers; exits 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epsilons', type=_floats, required=True, help='comma-separated targets, e.g. 1,3,8')
    parser.add_argument('--client_fraction', type=float, required=True, help='q, in (0, 1]')
    parser.add_argument('--rounds', type=int, required=True)
    parser.add_argument('--num_clients', type=int, required=True, help='N: the expected clients per round are q N')
    parser.add_argument('--delta', type=float, default=None, help='default 1 / N^1.1')
    parser.add_argument('--target_quantile', type=float, default=None, help='adaptive clipping (default: fixed clip)')
    args = parser.parse_args(argv)
    if not 0 < args.client_fraction <= 1 or args.rounds < 1 or args.num_clients < 1:
        parser.error('need 0 < client_fraction <= 1, rounds >= 1, num_clients >= 1')
    if any(e <= 0 for e in args.epsilons):
        parser.error('epsilons must be > 0')
    delta = args.delta if args.delta is not None else privacy.default_delta(args.num_clients)
    mechanism = {'clients_per_round': args.client_fraction * args.num_clients, 'clip': 1.0}
    if args.target_quantile is not None:
        mechanism.update(clip=None, target_quantile=args.target_quantile)
    for target in args.epsilons:
        try:
            z = privacy.noise_multiplier_for(target, args.client_fraction, args.rounds, delta, **mechanism)
        except privacy.PrivacyError as e:
            parser.error(str(e))
        z = math.ceil(z * 1e4) / 1e4  # printed with 4 decimals, rounded up: it still reaches the target
        reached = privacy.epsilon(privacy.DPConfig(z, **mechanism), args.client_fraction, args.rounds, delta)
        print(f'epsilon {target:g}: dp_noise_multiplier = {z:.4f} (reaches {reached:.4f} at delta {delta:.3g})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
