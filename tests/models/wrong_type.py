"""A model file whose builder returns the wrong thing (a plain dict)."""


def build(hparams):
    return {"model": None}
