"""Configuration: validation errors name file, line, field and why."""

from __future__ import annotations

import json
import re

import pytest

from proxy.cli import main
from proxy.config import (
    ConfigError,
    config_from_urls,
    json_schema,
    load_config,
    parse_config,
    read_secret,
)
from tests.support import REPO

GOOD = """\
models:
  m:
    prefill:
      policy: prefix_hash
      instances:
        - url: http://10.0.0.1:8100/
          weight: 2
    decode:
      instances:
        - url: http://10.0.0.2:8200
retry:
  max_attempts: 4
"""


def test_a_valid_file_loads_with_defaults(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    cfg = load_config(path)
    assert cfg.models["m"].prefill.instances[0].url == "http://10.0.0.1:8100"
    assert cfg.models["m"].prefill.instances[0].weight == 2
    assert cfg.models["m"].decode.policy == "round_robin"
    assert cfg.retry.max_attempts == 4
    assert cfg.server.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "field", "why"),
    [
        (
            GOOD.replace("weight: 2", "weight: -1"),
            "models.m.prefill.instances.0.weight",
            "greater than 0",
        ),
        (
            GOOD.replace("prefix_hash", "random"),
            "models.m.prefill.policy",
            "round_robin",
        ),
        (
            GOOD.replace("http://10.0.0.2:8200", "10.0.0.2:8200"),
            "models.m.decode.instances.0.url",
            "http",
        ),
        (
            GOOD.replace("max_attempts: 4", "max_atempts: 4"),
            "retry.max_atempts",
            "unknown field",
        ),
        (
            GOOD.replace(
                "    decode:\n      instances:\n        - url: http://10.0.0.2:8200\n",
                "",
            ),
            "models.m.decode",
            "required field missing",
        ),
        (GOOD + "timeouts:\n  connect_s: 0\n", "timeouts.connect_s", "greater than 0"),
        (
            GOOD.replace("http://10.0.0.2:8200", "http://10.0.0.2:8200/v1"),
            "models.m.decode.instances.0.url",
            "without /v1",
        ),
        (
            GOOD.replace("http://10.0.0.2:8200", "http://me:secret@10.0.0.2:8200"),
            "models.m.decode.instances.0.url",
            "must not carry credentials",
        ),
        *(
            (
                GOOD.replace("http://10.0.0.2:8200", url),
                "models.m.decode.instances.0.url",
                why,
            )
            for url, why in [
                (
                    "ftp://10.0.0.2:8200",
                    "must be an http:// or https:// URL with a host",
                ),
                ("http://10.0.0.2:8200?x=1", "must not carry a query or fragment"),
                ("http://10.0.0.2:8200#f", "must not carry a query or fragment"),
                ("http://me@10.0.0.2:8200", "must not carry credentials"),
                ("http://:secret@10.0.0.2:8200", "must not carry credentials"),
            ]
        ),
        (
            GOOD.replace("weight: 2", "weight: .inf"),
            "models.m.prefill.instances.0.weight",
            "less than or equal to 1000000",
        ),
    ],
)
def test_config_errors_name_file_line_field_and_why(tmp_path, text, field, why):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:")
    assert f": {field}: " in message
    assert why in message


def test_error_points_at_the_offending_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^x.yaml:7: models.m.prefill.instances.0.weight"
    ):
        parse_config(GOOD.replace("weight: 2", "weight: zero"), "x.yaml")


def test_errors_in_a_list_item_or_at_the_top_point_at_their_line():
    empty_item = GOOD.replace("        - url: http://10.0.0.2:8200\n", "        - {}\n")
    with pytest.raises(
        ConfigError, match=r"^x.yaml:10: models.m.decode.instances.0: .*url or dns"
    ):
        parse_config(empty_item, "x.yaml")
    with pytest.raises(ConfigError, match=r"^x.yaml:1: models: required field"):
        parse_config("retry: {}\n", "x.yaml")


def test_the_longest_backoff_may_equal_the_first():
    equal = GOOD + "  backoff_base_s: 0.5\n  backoff_max_s: 0.5\n"
    assert parse_config(equal).retry.backoff_max_s == 0.5
    shorter = GOOD + "  backoff_base_s: 0.5\n  backoff_max_s: 0.4\n"
    with pytest.raises(ConfigError, match="backoff_max_s must be >= "):
        parse_config(shorter)


def test_a_yaml_key_that_is_not_a_scalar_is_a_config_error():
    with pytest.raises(ConfigError, match=r"(?s)invalid YAML.*unhashable key"):
        parse_config("? [a]\n: 1\n", "x.yaml")


def test_secrets_come_from_a_variable_a_file_or_both(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2026-12\n\n  k3  \nk4\n")
    monkeypatch.setenv("KVG_KEYS", " k1, ,k2 ")
    assert read_secret("KVG_KEYS", None, "auth") == ["k1", "k2"]
    assert read_secret(None, str(keys), "auth") == ["k3", "k4"]
    assert read_secret("KVG_KEYS", str(keys), "auth") == ["k1", "k2", "k3", "k4"]
    assert read_secret(None, None, "auth") == []


def test_a_secret_source_that_gives_no_key_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KVG_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"^auth: environment variable KVG_UNSET"):
        read_secret("KVG_UNSET", None, "auth")
    monkeypatch.setenv("KVG_EMPTY", " , ")
    with pytest.raises(ConfigError, match=r"^auth: no key found in KVG_EMPTY$"):
        read_secret("KVG_EMPTY", None, "auth")
    comments = tmp_path / "keys"
    comments.write_text("# none yet\n\n")
    with pytest.raises(
        ConfigError, match=f"^auth: no key found in {re.escape(str(comments))}$"
    ):
        read_secret(None, str(comments), "auth")


def test_duplicate_instances_are_rejected():
    text = GOOD.replace(
        "        - url: http://10.0.0.2:8200\n",
        "        - url: http://10.0.0.2:8200\n        - url: http://10.0.0.2:8200/\n",
    )
    with pytest.raises(ConfigError, match="listed twice"):
        parse_config(text)


def test_yaml_syntax_and_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_config("models: [", "f.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_a_key_written_twice_in_a_mapping_is_a_config_error():
    text = GOOD.replace(
        "    decode:\n",
        "    decode:\n      policy: round_robin\n      policy: random\n",
    )
    with pytest.raises(ConfigError, match="found the key 'policy' twice"):
        parse_config(text, "x.yaml")
    # Keys a merge brings may still be overridden.
    merged = GOOD.replace("retry:\n", "retry:\n  <<: {max_attempts: 2}\n")
    assert parse_config(merged).retry.max_attempts == 4


def test_files_that_are_not_utf8_are_config_errors(tmp_path):
    config = tmp_path / "proxy.yaml"
    config.write_bytes(b"# caf\xe9\n" + GOOD.encode())
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(config)
    keys = tmp_path / "keys"
    keys.write_bytes(b"# cl\xe9s\nk1\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_secret(None, str(keys), "auth.api_keys")


def test_no_yaml_config_from_urls():
    cfg = config_from_urls(["http://a:1"], ["http://b:2", "http://c:3"])
    assert [i.url for i in cfg.models["*"].decode.instances] == [
        "http://b:2",
        "http://c:3",
    ]
    with pytest.raises(ConfigError, match="command line: models"):
        config_from_urls([], ["http://b:2"])


def test_print_schema_is_the_json_schema(capsys):
    assert main(["--print-schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


def test_check_reports_config_errors_with_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("max_attempts: 4", "max_attempts: 0"))
    assert main(["--config", str(path), "--check"]) == 2
    assert "retry.max_attempts" in capsys.readouterr().err
    path.write_text(GOOD)
    assert main(["--config", str(path), "--check"]) == 0


def test_example_configs_are_valid(monkeypatch):
    examples = sorted((REPO / "configs").glob("*.yaml"))
    assert len(examples) >= 4
    for path in examples:
        load_config(path)
