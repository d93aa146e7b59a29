"""mpirt's version: the one place it is written (pyproject.toml reads it from here). A module of its
own, not the package's ``__init__``: under an editable install, a folder named ``mpirt`` in the
working directory (a user's clone, seen from its parent) becomes the top-level ``mpirt`` package and
its ``__init__`` never runs, while submodules such as this one still load from the install."""
__version__ = "0.1.0"
