"""Typed configuration: defaults < YAML < environment < flags, with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from gateway.contract.settings import ConfigError, load_config, parse_assignments, to_dict


@dataclass
class Redis:
    url: str = "redis://127.0.0.1:6379/0"
    timeout: float = 1.0


@dataclass
class Pool:
    model: str = ""
    block_size: int = 16
    tokenizer: str | None = None


@dataclass
class Conf:
    port: int = 8000
    debug: bool = False
    policy: Literal["ttft", "round_robin"] = "ttft"
    redis: Redis = field(default_factory=Redis)
    pools: list[Pool] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "port: 9000\nredis: {url: redis://file}\npools:\n  - {model: a}\n  - {model: b, block_size: 32}\n"
    )
    env = {
        "KVROUTE_PORT": "9100",
        "KVROUTE_REDIS__TIMEOUT": "2.5",
        "KVROUTE_POOLS__1__TOKENIZER": "/t.json",
        "OTHER": "x",
    }
    c = load_config(Conf, file=f, env=env, overrides={"port": "9200", "debug": True})
    assert c.port == 9200 and c.debug is True
    assert c.redis == Redis("redis://file", 2.5)
    assert c.pools == [Pool("a"), Pool("b", 32, "/t.json")]
    assert to_dict(c)["pools"][1]["block_size"] == 32


def test_flags_parse_and_defaults() -> None:
    c = load_config(
        Conf,
        overrides=parse_assignments(["redis.url=rediss://x", "pools.0.model=m", "labels.zone=a"]),
    )
    assert c.redis.url == "rediss://x" and c.pools[0].model == "m" and c.labels == {"zone": "a"}
    assert load_config(Conf) == Conf()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"port": "eighty"}, "port: expected an integer"),
        ({"debug": "maybe"}, "debug: expected true or false"),
        ({"policy": "fastest"}, "policy: must be one of"),
        ({"redis.nope": 1}, "redis: unknown setting"),
        ({"pools.0.block_size": "x"}, "pools.0.block_size: expected an integer"),
        ({"redis": 5}, "redis: expected a mapping"),
    ],
)
def test_errors_name_the_setting(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(Conf, overrides=overrides)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(Conf, file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Conf, file=bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(Conf, file=lst)
    with pytest.raises(ConfigError, match="PATH=VALUE"):
        parse_assignments(["novalue"])


def test_unknown_env_vars_are_ignored_not_fatal() -> None:
    # other components share the KVROUTE_ prefix; only paths of this schema are read
    assert load_config(Conf, env={"KVROUTE_SIM_WORKERS": "4"}) == Conf()


def test_string_settings_from_env_and_flags_stay_verbatim() -> None:
    env = {"KVROUTE_REDIS__URL": "true", "KVROUTE_PORT": "9300"}
    c = load_config(
        Conf, env=env, overrides=parse_assignments(["pools.0.model=0x1F", "pools.0.tokenizer=null"])
    )
    assert c.redis.url == "true" and c.port == 9300
    assert c.pools[0].model == "0x1F" and c.pools[0].tokenizer == "null"
    assert load_config(Conf, overrides={"labels": "{a: b}"}).labels == {"a": "b"}


def test_untyped_values_from_flags_are_parsed() -> None:
    """``dict[str, Any]`` settings (workload and policy parameters) get numbers and lists
    from ``--set``, not their text; typed string settings stay verbatim."""

    @dataclass
    class C:
        params: dict[str, Any] = field(default_factory=dict)
        secret: str = ""

    got = load_config(
        C,
        env={},
        overrides=parse_assignments(
            ["params.n=400", "params.turns=[2, 3]", "params.name=x", "secret=0x1F"]
        ),
    )
    assert got.params == {"n": 400, "turns": [2, 3], "name": "x"} and got.secret == "0x1F"
