"""HDF5 event datasets (sharding, shuffling, prefetch) and the toy data (the calorimeter format is mpilearn.calo.format)."""
