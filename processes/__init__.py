"""One module per algorithm: `build_<algorithm>_process(...) -> PersonalizedProcess`."""
