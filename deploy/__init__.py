"""Deployment: workers (README.md, systemd/, kubernetes/) and the loader of exported computations."""
