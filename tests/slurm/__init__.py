"""The real-SLURM tier (a package, so its conftest does not shadow tests/conftest.py)."""
