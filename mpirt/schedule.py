"""``python -m mpirt.schedule``: print and check a pipeline schedule (:mod:`mpirt.run.schedule`)."""
if __name__ == "__main__":
    import sys

    from mpirt.run import schedule

    sys.exit(schedule.main())
