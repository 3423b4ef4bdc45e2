"""The calorimeter application on top of the framework: the 3DGAN's shower format and
preprocessing, synthetic showers, the GAN protocol, physics validation and its plots, the
reference's metric, and the validate CLI. The core (comm, train, hpo, data, the Horovod
APIs) imports nothing from here."""
