"""The example model files, one builder each (``build(hparams)``) with their ``DEFAULTS``.

In a checkout they are ``models/<name>.py`` (the top-level ``models`` is this folder); once
installed they are the modules ``mpilearn.models.<name>``: ``--set model=mpilearn.models.mlp``.
"""
