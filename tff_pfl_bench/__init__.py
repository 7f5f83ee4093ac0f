"""The benchmark tool beside the library: suites, their runs and reports, and the scoreboard (tff-pfl-bench)."""
