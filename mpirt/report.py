"""``python -m mpirt.report``: plots and tables of a finished run (:mod:`mpirt.monitor.report`)."""
if __name__ == "__main__":
    from mpirt.monitor import report

    report.main()
