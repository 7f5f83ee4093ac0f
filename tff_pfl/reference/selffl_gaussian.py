"""Self-FL on the two-level Gaussian model in numpy, and its closed forms.

The model (Self-FL §2.1): theta_m ~ N(theta_0, sigma_0^2); client m holds N_m
samples from N(theta_m, s^2), so its local optimum is the sample mean z_m with
sigma_m^2 = s^2 / N_m. The FL-optimal personal estimate is the posterior mean
theta_m^(FL) (Eq. 3) and the global one theta^(G) (Eq. 2).

`iterate` is the iteration `processes.selffl` runs with loss='gaussian',
known variances and every client in every round, written independently in
float64: it is both the test reference of the TFF process and the quick way
to study the iteration's distance to the closed forms as M grows.
"""

import math

import numpy as np


def generate(num_clients: int, seed: int, *, min_size=5, max_size=200, sigma0_sq=1.0, noise_var=1.0, theta0=0.0):
    """Draws the clients' samples.

    Args:
      num_clients: M, the number of clients.
      seed: seed of the NumPy generator.
      min_size: the smallest N_m.
      max_size: the largest N_m (inclusive).
      sigma0_sq: sigma_0^2, the variance of the clients' theta_m.
      noise_var: s^2, the variance of the samples around theta_m.
      theta0: theta_0, the mean of the theta_m.

    Returns:
      A list of 1-D float arrays, one per client, sizes uniform in
      [min_size, max_size].
    """
    rng = np.random.default_rng(seed)
    sizes = rng.integers(min_size, max_size + 1, size=num_clients)
    thetas = rng.normal(theta0, math.sqrt(sigma0_sq), size=num_clients)
    return [rng.normal(t, math.sqrt(noise_var), size=n) for t, n in zip(thetas, sizes)]


def closed_forms(samples, sigma0_sq=1.0, noise_var=1.0):
    """theta_m^(FL) for every client (Eq. 3) and theta^(G) (Eq. 2).

    Args:
      samples: the clients' 1-D sample arrays (as from `generate`).
      sigma0_sq: sigma_0^2.
      noise_var: s^2.

    Returns:
      `(theta_fl [M], theta_g, z [M])`.
    """
    z = np.array([s.mean() for s in samples])
    sigma_sq = noise_var / np.array([len(s) for s in samples], float)
    precision = 1.0 / (sigma0_sq + sigma_sq)
    others = precision.sum() - precision
    theta_fl = (z / sigma_sq + (precision * z).sum() - precision * z) / (1.0 / sigma_sq + others)
    theta_g = (precision * z).sum() / precision.sum()
    return theta_fl, theta_g, z


def local_steps(eta, sigma_m_sq, others, l_max):
    """Eq. 8 with the project's rule where it is undefined (see processes.selffl).

    Args:
      eta: the gradient step size.
      sigma_m_sq: the client's sigma_m^2.
      others: S_-m, the total precision of the other clients.
      l_max: the cap on the number of steps.

    Returns:
      `(steps, rho)`: the number of steps, an int in [1, l_max], and the
      contraction rho = S_-m / (1/sigma_m^2 + S_-m).
    """
    rho = others / (1.0 / sigma_m_sq + others)
    kappa = eta / sigma_m_sq
    if 0.0 < kappa < 1.0:
        steps = round(math.log(rho) / math.log(1.0 - kappa))
    else:
        steps = math.ceil(l_max * (1.0 - rho))
    return int(min(max(steps, 1), l_max)), rho


def iterate(samples, rounds, *, eta, l_max=40, default_steps=20, sigma0_sq=1.0, noise_var=1.0):
    """Runs the Self-FL iteration; returns `(personal [rounds, M], global [rounds])`.

    Round 1: no total precision is known yet, so every client takes
    `default_steps` plain gradient steps from the global model (0). From round
    2: Eq. 10 initialisation, Eq. 8 steps with the step size that contracts
    exactly by rho, Eq. 11 aggregation; activity rate 1.

    Args:
      samples: the clients' 1-D sample arrays (as from `generate`).
      rounds: the number of rounds.
      eta: the gradient step size.
      l_max: the cap on the local steps.
      default_steps: the local steps of round 1.
      sigma0_sq: sigma_0^2 (known).
      noise_var: s^2 (known).

    Returns:
      `(personal, global)`: float64 arrays of the clients' theta_m
      `[rounds, M]` and the global theta `[rounds]` after each round.
    """
    n = np.array([len(s) for s in samples], float)
    z = np.array([s.mean() for s in samples])
    sigma_sq = noise_var / n
    precision = 1.0 / (sigma0_sq + sigma_sq)
    theta = 0.0
    personal = np.full(len(samples), np.nan)
    total = 0.0
    personal_history, global_history = [], []
    for _ in range(rounds):
        new_personal = np.empty_like(personal)
        for m in range(len(samples)):
            if total > 0.0:
                others = total - precision[m] if total - precision[m] > 0 else total * (len(samples) - 1) / len(samples)
                previous = personal[m]
                value = theta - precision[m] / others * (previous - theta)
                steps, rho = local_steps(eta, sigma_sq[m], others, l_max)
                step_size = sigma_sq[m] * (1.0 - rho ** (1.0 / steps))
            else:
                value, steps, step_size = theta, default_steps, eta
            for _ in range(steps):  # full-batch gradient of sum (x - theta)^2 / 2 s^2
                value -= step_size * n[m] * (value - z[m]) / noise_var
            new_personal[m] = value
        personal = new_personal
        theta = (precision * personal).sum() / precision.sum()
        total = precision.sum()
        personal_history.append(personal.copy())
        global_history.append(theta)
    return np.array(personal_history), np.array(global_history)


def write_client_files(root: str, samples, seed: int, noise_var=1.0):
    """Writes the clients' samples as project client files (feature shape [1]).

    Each client's training split holds its samples; its validation and test
    splits one extra draw each from N(its sample mean, s^2) (they are not used
    by the iteration).

    Args:
      root: the directory to write the client files to.
      samples: the clients' 1-D sample arrays (as from `generate`).
      seed: seed of the validation and test draws.
      noise_var: s^2, the variance of the validation and test draws.

    Returns:
      The `client_data.ClientDataSpec`.
    """
    from tff_pfl.data import client_data_writer

    rng = np.random.default_rng(seed + 10_000)
    x, splits, start = [], [], 0
    for s in samples:
        extra = rng.normal(s.mean(), math.sqrt(noise_var), size=2)
        x.append(np.concatenate([s, extra]))
        n = len(s)
        splits.append(
            {'train': np.arange(start, start + n), 'val': np.array([start + n]), 'test': np.array([start + n + 1])}
        )
        start += n + 2
    x = np.concatenate(x).astype(np.float32)[:, np.newaxis]
    return client_data_writer.write_client_data(root, x, np.zeros(len(x), np.int32), 1, splits)
