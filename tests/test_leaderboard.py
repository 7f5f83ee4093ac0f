"""The leaderboard section: a paper's best-round-on-test numbers beside ours, computed by hand on made-up records."""

import statistics

import pytest

from tff_pfl_bench import bench_parse, bench_report, bench_suite, leaderboard

SUITE = """
name = "board"
[defaults]
dataset = "synthetic"
num_clients = 3
rounds = 200
eval_every = 50
seeds = [0, 1, 2]
[[partitions]]
name = "dir"
partition = "natural"
[[algorithms]]
name = "FedAvg"
algorithm = "fedavg"
[[algorithms]]
name = "FedPer"
algorithm = "fedper"
model = "personalized_model"
[paper]
"FedAvg" = { dir = 85.85 }
[paper_source]
source = "A leaderboard, Fashion-MNIST"
measure = "best round on test"
"""


def _record(suite, algorithm, seed, curve, last, selected, seconds):
    run = next(r for r in suite.runs() if (r.algorithm.name, r.seed) == (algorithm, seed))
    points = [{'round': r, 'accuracy': a} for r, a in curve]
    best = max(points, key=lambda p: p['accuracy'])
    return {
        'run': run,
        'model': run.algorithm.model,
        'summary': {run.algorithm.model: {'mean': last}},
        'curve': points,
        'best_test_round': {'round': best['round'], 'test_accuracy': best['accuracy']},
        'selected': {'round': 150, 'test_accuracy': selected},
        'final_round': curve[-1][0],
        'rounds': 200,
        'seconds': seconds,
    }


def test_the_rows_by_hand():
    suite = bench_parse.parse_suite(SUITE, 'board.toml')
    assert suite.paper_measure == leaderboard.BEST_ROUND
    # FedAvg still rises over the last quarter (round 150 -> 200); FedPer peaks at 100 and falls.
    records = [
        _record(suite, 'FedAvg', 0, [(50, 0.80), (100, 0.84), (150, 0.85), (200, 0.86)], 0.86, 0.85, 3000),
        _record(suite, 'FedAvg', 1, [(50, 0.81), (100, 0.84), (150, 0.86), (200, 0.87)], 0.87, 0.86, 3600),
        _record(suite, 'FedPer', 0, [(50, 0.90), (100, 0.97), (150, 0.96), (200, 0.96)], 0.96, 0.96, 1200),
    ]
    fedavg, fedper = leaderboard.leaderboard_rows(suite, records)
    best = [86.0, 87.0]
    assert fedavg == {
        'algorithm': 'FedAvg',
        'partition': 'dir',
        'runs': '2/3',
        'paper': '85.85',
        'best round on test': f'{statistics.fmean(best):.2f} ± {statistics.stdev(best):.2f}',
        'diff': f'{statistics.fmean(best) - 85.85:+.2f}',
        'last round': f'86.50 ± {statistics.stdev([86.0, 87.0]):.2f}',
        'validation-selected round': f'85.50 ± {statistics.stdev([85.0, 86.0]):.2f}',
        'rounds run': '200',
        'minutes a run': '55',
        # (0.865 - 0.855) x 100 = 1.00 points from round 150 (closest to 0.75 x 200) to 200.
        'still climbing': 'yes (+1.00 from round 150 to 200)',
    }
    assert fedper['paper'] == '' and fedper['diff'] == ''
    assert fedper['best round on test'] == '97.00' and fedper['last round'] == '96.00'
    assert fedper['still climbing'] == 'no (+0.00 from round 150 to 200)'


def test_climbing_reads_the_rounds_every_seed_evaluated():
    # Seed 1 stopped at round 100: the common rounds are 50 and 100; 0.75 x 100 is closest to 50.
    rise = leaderboard.climbing(
        [
            [{'round': 50, 'accuracy': 0.5}, {'round': 100, 'accuracy': 0.6}, {'round': 150, 'accuracy': 0.9}],
            [{'round': 50, 'accuracy': 0.5}, {'round': 100, 'accuracy': 0.5}],
        ]
    )
    assert rise == (True, pytest.approx(5.0), 50, 100)
    assert leaderboard.climbing([[{'round': 5, 'accuracy': 0.5}]]) is None


def test_the_section_is_in_the_report_only_for_a_best_round_paper():
    suite = bench_parse.parse_suite(SUITE, 'board.toml')
    record = _record(suite, 'FedAvg', 0, [(50, 0.80), (200, 0.86)], 0.86, 0.85, 600)
    text = bench_report.render_report(suite, '/tmp/x', [record], [], [], [])
    assert "## Leaderboard: the paper's measure beside ours (%)" in text
    row = '| FedAvg | dir | 1/3 | 85.85 | 86.00 | +0.15 | 86.00 | 85.00 | 200 | 10 | yes (+6.00 from round 50 to 200) |'
    assert row in text
    plain = bench_parse.parse_suite(SUITE.replace('measure = "best round on test"\n', ''), 'board.toml')
    assert plain.paper_measure == 'last round'
    assert leaderboard.leaderboard_lines(plain, [record]) == []


def test_an_unknown_measure_is_refused_naming_the_known_ones():
    with pytest.raises(bench_suite.SuiteError, match='paper_source.measure: must be one of "last round", "best round'):
        bench_parse.parse_suite(SUITE.replace('"best round on test"', '"best"'), 'board.toml')


def test_the_pfllib_suite_reports_the_leaderboard_measure():
    suite = bench_parse.load_suite('benchmarks/suites/pfllib_fmnist.toml')
    assert suite.paper_measure == leaderboard.BEST_ROUND
