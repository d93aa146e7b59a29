"""The real-SLURM tier is collected only when tests/slurm/run.sh runs it (it sets
MPIRT_SLURM_TIER after starting a cluster); the other tiers never see these files."""
import os

collect_ignore_glob = [] if os.environ.get("MPIRT_SLURM_TIER") else ["test_*.py"]
