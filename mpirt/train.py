"""``[mpiexec -n N] python -m mpirt.train [CONFIG.toml] [--key=value ...]``: train a model
(:mod:`mpirt.run.train`)."""
if __name__ == "__main__":
    import signal

    # until training starts an INT ends the process as a TERM does, also while MPI starts
    # (mpirt.run.startup.end_on_signal): Python's KeyboardInterrupt would wait for MPI to return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from mpirt.run import train

    train.main()
