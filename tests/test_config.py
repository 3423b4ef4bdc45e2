"""Config validation: unknown keys with suggestions, types, choices, --set parsing."""
import pytest

from mpilearn.core.comm import UsageError
from mpilearn.core.config import parse_set, resolve


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


def test_train_help_names_every_config_key():
    """`python -m mpilearn.train --help` promises every key: each leaf of the schema is named
    there, spelt out or inside a `prefix.{a,b}` group."""
    import re

    from mpilearn.core.config import SCHEMA
    from mpilearn.train.__main__ import EPILOG

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield prefix + key

    groups = {m.group(1): m.group(2).split(",")
              for m in re.finditer(r"([\w.]+)\.\{([\w,]+)\}", EPILOG)}
    missing = [k for k in leaves(SCHEMA) if k not in EPILOG
               and k.rsplit(".", 1)[-1] not in groups.get(k.rsplit(".", 1)[0], ())]
    assert not missing, f"train --help does not name {missing}"


def test_search_elastic_is_checked_and_refuses_what_cannot_survive(monkeypatch):
    from mpilearn.core.config import hpo_schema
    from mpilearn.hpo.elastic import check

    with pytest.raises(UsageError, match="'search.elastic' must be"):
        resolve(None, ["model=m", "search.elastic=maybe"], schema=hpo_schema())
    config = resolve(None, ["model=m", "search.elastic=true"], schema=hpo_schema())
    assert config["search"]["elastic"] is True
    check({**config, "search": {**config["search"], "elastic": False}})  # the default
    assert config["search"]["fold_mode"] == "parallel"
    check(config)  # folds in parallel are elastic too (tests/test_sweep_ulfm.py)
    config["train"]["algorithm"] = "easgd"
    with pytest.raises(UsageError, match="train.algorithm=easgd is not elastic"):
        check(config)
    # mpilearn-run --min-np 3 (ULFM mode): the sweep is elastic, its folds' training is not
    monkeypatch.setenv("MPILEARN_ELASTIC_MIN_RANKS", "3")
    config = resolve(None, ["model=m"], schema=hpo_schema())
    assert config["search"]["elastic"] is True and config["train"]["elastic"]["min_ranks"] == 0
    monkeypatch.setenv("MPILEARN_ELASTIC_MODE", "relaunch")
    assert resolve(None, ["model=m"], schema=hpo_schema())["search"]["elastic"] is False


def test_every_config_key_has_one_description():
    """One source for --help, the unknown-key check and the docs' reference: every key of the
    schema (training and search) has its meaning in DESCRIPTIONS, and nothing there is stale."""
    from mpilearn.core.config import DESCRIPTIONS, _flat_keys, documented_keys, hpo_schema

    keys = {key for key, _ in documented_keys()}
    assert not keys - set(DESCRIPTIONS), (
        f"add these keys' meaning to DESCRIPTIONS in mpilearn/core/config.py: "
        f"{sorted(keys - set(DESCRIPTIONS))}")
    sections = set(_flat_keys(hpo_schema()))  # a section (train.elastic) may have one too
    stale = set(DESCRIPTIONS) - keys - sections
    assert not stale, f"descriptions of keys that do not exist: {sorted(stale)}"
