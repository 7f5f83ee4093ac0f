"""The benchmark tool beside the library: suites, their runs and reports (tff-pfl-bench), the scoreboard, the claims."""
