"""``python -m mpirt.slurm``: render and check SLURM batch scripts (:mod:`mpirt.run.slurm`)."""
if __name__ == "__main__":
    import sys

    from mpirt.run import slurm

    sys.exit(slurm.main())
