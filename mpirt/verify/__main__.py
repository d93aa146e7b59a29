"""``[mpiexec -n N] python -m mpirt.verify ...`` (:mod:`mpirt.verify.cli`)."""
from mpirt.verify.cli import main

main()
