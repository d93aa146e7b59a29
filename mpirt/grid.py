"""``python -m mpirt.grid``: show the dp x pp x cp x tp grid of a world size (:mod:`mpirt.parallel.grid`)."""
if __name__ == "__main__":
    import sys

    from mpirt.parallel import grid

    sys.exit(grid.main())
