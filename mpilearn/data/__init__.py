"""HDF5 event datasets (sharding, shuffling, prefetch), the calorimeter formats and the toy data."""
