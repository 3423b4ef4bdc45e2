"""Config validation: unknown keys with suggestions, types, choices, --set parsing."""
import pytest

from mpilearn.comm import UsageError
from mpilearn.config import parse_set, resolve


def test_defaults_and_overrides():
    c = resolve(None, ["model=m.py", "train.epochs=3", "hparams.lr=0.5", "data.files=a.h5"])
    assert c["train"]["epochs"] == 3 and c["hparams"] == {"lr": 0.5}
    assert c["data"]["files"] == ["a.h5"] and c["train"]["backend"] == "mpi"


@pytest.mark.parametrize("sets,message", [
    (["model=m", "trian.epochs=1"], "unknown config key 'trian'; did you mean 'train'?"),
    (["model=m", "train.batchsize=1"], "did you mean 'train.batch_size'?"),
    (["model=m", "train.deterministic=1"], "'train.deterministic' must be a boolean"),
    (["model=m", "train.fusion_mb=big"], "'train.fusion_mb' must be a number"),
    (["model=m", "device.type=tpu"], "choose one of auto, cpu, cuda"),
    (["model=m", "train.epochs=0"], "'train.epochs' must be at least 1"),
    ([], "no model given"),
    (["model=m", "nokeyvalue"], "--set expects key=value"),
])
def test_errors_name_the_key(sets, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("?", r"\?")):
        resolve(None, sets)


def test_int_accepted_for_float():
    assert resolve(None, ["model=m", "train.fusion_mb=4"])["train"]["fusion_mb"] == 4


def test_parse_set_yaml_values():
    assert parse_set(["a.b=[1, 2]", "c=true", "d=x"]) == {"a": {"b": [1, 2]}, "c": True, "d": "x"}
