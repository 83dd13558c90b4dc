"""The role programs' entry points at the design card's path (`python -m workers.main`, `python -m
workers.broker` from a checkout). The programs themselves are `vime.workers`, inside the installed
package, so that an installed `vime` never ships a top-level `workers` package that could collide with
another distribution's."""
