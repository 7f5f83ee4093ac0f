"""What an algorithm declares to the pipeline, beside its settings and builder.

Each `processes/<algo>.py` ends with `ALGORITHMS`, a tuple of `Algorithm`s:
every name it registers, with its settings type, its builder, what its
report shows, how it runs and which privacy modes it takes.
`tff_pfl.program.algorithms` collects the modules' declarations (one line
per module) and reads them; nothing else in `tff_pfl` names an algorithm.
docs/architecture.md ("Adding an algorithm") gives the recipe.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# The families of personalized FL an algorithm declares (`Algorithm.family`), as the zoo table groups them
# (docs/zoo.md), with what makes each a family.
FAMILIES = {
    'global model': 'one model for every client, trained by averaging',
    'local': 'each client trains alone',
    'fine-tuning': 'a global model, then adapted on each client',
    'parameter decoupling': 'some layers shared and averaged, the others kept or fixed per client',
    'regularized personal model': "each client's own model, pulled towards a global one",
    'meta-learning': 'a global initialization that one local step personalizes',
    'model interpolation': "a mix of a global and a client's own model",
    'personalized aggregation': "each client's model aggregated from the others' with its own weights",
    'knowledge distillation': 'knowledge shared as predictions, distilled into each model',
    'hypernetwork': "a server network that writes each client's model",
    'decentralized': 'no server: clients exchange models with neighbours',
}

# Completes "<algorithm> ..." for an algorithm that declares no private uploads.
NO_PRIVACY = 'does not take user-level DP yet (docs/privacy.md lists the algorithms that do)'


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What a run gives a builder besides the data's spec, the model and the settings.

    Attributes:
      seed: the run's seed (initial weights, client streams).
      client_fraction: q, each client's chance (or the share of clients) per round.
      max_clients_per_round: the most clients a round can take, or None.
      dp: the run's user-level DP (a `tff_pfl.computations.privacy.DPConfig`),
        or None without DP.
      secure: whether the uploads' sums go through secure aggregation.
      make_model_aggregator: `() -> factory or None`, makes `model_aggregator`
        when a builder asks for it; None: no aggregator of the run's own.
    """

    seed: int = 0
    client_fraction: float = 1.0
    max_clients_per_round: int | None = None
    dp: Any = None
    secure: bool = False
    make_model_aggregator: Callable[[], Any] | None = None

    @property
    def model_aggregator(self) -> Any:
        """The `tff.aggregators` factory made of `dp` and `secure`, for one model update per client.

        None: the example-weighted mean. Made at each call, only by the
        builders that upload one model update per client.
        """
        return self.make_model_aggregator() if self.make_model_aggregator is not None else None


@dataclasses.dataclass(frozen=True)
class Upload:
    """One noised mean a DP round forms (for the warning that the noise swamps it).

    Attributes:
      dimension: d, the coordinates of one client's clipped upload (a model's
        parameters; the KT-pFL family's soft predictions: public batch x classes).
      clients: n, the expected number of clients the mean averages
        (client_fraction x the clients that upload it).
      label: what it is, for the message (e.g. an architecture's name); may be empty.
    """

    dimension: int
    clients: float
    label: str = ''


@dataclasses.dataclass(frozen=True)
class Privacy:
    """The privacy modes an algorithm takes, and what they protect.

    Attributes:
      uploads: what user-level DP clips and noises in the algorithm's uploads
        (the report's wording); None: it takes neither DP nor secure
        aggregation.
      why_not: completes "<algorithm> ..." when `uploads` is None.
      local: the noise is added on each client before its upload (local DP:
        the server sees each client's noised value), so the accountant counts
        every round a client takes part in, with no amplification by sampling.
      noise_factor: the norm of the DP noise on a round's noised mean, in
        units of z sqrt(d) / n (central DP; 1 for DP-FedAvg's mean).
      fixed_clip_only: the one-line refusal of adaptive clipping
        (`dp_target_quantile`), or None where it is taken.
      no_secure: the one-line refusal of secure aggregation, or None.
      secure_needs_dp: the one-line refusal of secure aggregation without DP,
        or None.
      dp_uploads: `(settings, spec, process, client_fraction) -> [Upload]`,
        the noised means of a DP round; None: one model of the run's model
        over client_fraction x N clients.
    """

    uploads: str | None = None
    why_not: str = NO_PRIVACY
    local: bool = False
    noise_factor: float = 1.0
    fixed_clip_only: str | None = None
    no_secure: str | None = None
    secure_needs_dp: str | None = None
    dp_uploads: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """Everything the pipeline needs to know about one algorithm.

    Attributes:
      name: the registered name (`--algorithm`).
      title: one line: the algorithm and its paper, for `--helpfull` and docs.
      settings: its frozen settings dataclass (a `tff_pfl.settings.Settings`),
        the only place its defaults are written.
      build: `(settings, spec, model_fn, run) -> PersonalizedProcess`, `run`
        a `RunOptions`.
      client_columns: `(client_state) -> {column: value}`, the algorithm's
        columns of clients.csv; None: none.
      plots: `(output_dir, run_result, process) -> [(title, file)]`, the
        algorithm's own plots and files in the run's directory; None: none.
      serverless: run by the serverless loop (`tff_pfl.program.decentralized`;
        the settings give its `loop_arguments()`), not the federated one.
      not_one_aggregation: why the round has no form made of phases with one
        broadcast, one aggregation and device-held client state each (so it
        can neither be split over several workers nor exported as
        MapReduceForm); None when the process has such a form (`process.device`).
      default_models: dataset -> the model used when none is given, where it
        differs from the dataset's default.
      check: `(settings, client_fraction) -> problem or None`, the algorithm's
        conditions on the run beyond its settings (e.g. full participation).
      privacy: the privacy modes it takes (`Privacy`).
      family: its family of personalized FL, a key of `FAMILIES` (the zoo
        table, docs/zoo.md).
    """

    name: str
    title: str
    settings: type
    build: Callable
    client_columns: Callable[[Mapping], Mapping] | None = None
    plots: Callable | None = None
    serverless: bool = False
    not_one_aggregation: str | None = None
    default_models: Mapping[str, str] = dataclasses.field(default_factory=dict)
    check: Callable | None = None
    privacy: Privacy = Privacy()
    family: str = ''

    @property
    def own_architectures(self) -> bool:
        """Whether each client has its own architecture by name (an `architectures` setting): the run takes no model."""
        return 'architectures' in self.settings.field_names()


def model_update_builder(builder: Callable) -> Callable:
    """The `build` of an algorithm whose uploads are one model update per client.

    The run's aggregator of those updates (DP's clipped, noised mean, secure
    sums, or None: the example-weighted mean) and its seed are passed on.

    Args:
      builder: `build_<algo>_process(spec, model_fn, settings, *,
        model_aggregator=, seed=)`.

    Returns:
      `(settings, spec, model_fn, run) -> process`, for `Algorithm.build`.
    """

    def build(settings, spec, model_fn, run: RunOptions):
        return builder(spec, model_fn, settings, model_aggregator=run.model_aggregator, seed=run.seed)

    return build


def gathering_builder(builder: Callable) -> Callable:
    """The `build` of an algorithm whose round gathers the sampled clients' rows at the server.

    Its round holds at most `max_clients_per_round` rows (the run's sampling
    decides it); the run's seed is passed on.

    Args:
      builder: `build_<algo>_process(spec, model_fn, settings, *, seed=,
        max_clients_per_round=)`.

    Returns:
      `(settings, spec, model_fn, run) -> process`, for `Algorithm.build`.
    """

    def build(settings, spec, model_fn, run: RunOptions):
        return builder(spec, model_fn, settings, seed=run.seed, max_clients_per_round=run.max_clients_per_round)

    return build


def participation_columns(client_state: Mapping) -> dict:
    """clients.csv's `rounds_taken_part`, for `Algorithm.client_columns`.

    Under sampling a client may not have taken part yet: its model is then
    still the initial one.

    Args:
      client_state: a client state with `num_participations`.

    Returns:
      `{'rounds_taken_part': num_participations}`.
    """
    return {'rounds_taken_part': int(client_state['num_participations'])}
