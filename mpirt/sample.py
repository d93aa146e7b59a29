"""``python -m mpirt.sample``: generate text from a checkpoint (:mod:`mpirt.run.sample`)."""
if __name__ == "__main__":
    from mpirt.run import sample

    sample.main()
