"""Algorithm name -> process builder, from an `ExperimentConfig`."""

import tensorflow_federated as tff

from tff_pfl.computations import local_training


def _fedavg(config, spec, model_fn):
    from processes import fedavg

    return fedavg.build_fedavg_process(
        spec,
        model_fn,
        local_config=local_training.TrainingConfig(
            config.local_epochs, config.batch_size, config.client_learning_rate
        ),
        server_optimizer=tff.learning.optimizers.build_sgdm(learning_rate=config.server_learning_rate),
        seed=config.seed,
    )


_BUILDERS = {'fedavg': _fedavg}


def names() -> list[str]:
    """Names accepted by `--algorithm`."""
    return sorted(_BUILDERS)


def build(config, spec, model_fn):
    """Builds the process of `config.algorithm` for the partition `spec`."""
    return _BUILDERS[config.algorithm](config, spec, model_fn)
