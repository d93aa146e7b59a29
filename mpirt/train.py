"""``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``: train a model
(:mod:`mpirt.run.train`)."""
if __name__ == "__main__":
    # as the job's program: take TERM/INT before MPI starts and the data opens, so an early notice
    # (a requeued job's) still ends in a clean stop at the first step, not a killed rank
    from mpirt.run.jobctl import StopRequests

    early = StopRequests().install()
    from mpirt.run import train

    train.EARLY_STOPS = early
    train.main()
