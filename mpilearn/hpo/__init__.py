"""Hyperparameter search over MPI: layout, search spaces, searchers, coordinator, journal."""
