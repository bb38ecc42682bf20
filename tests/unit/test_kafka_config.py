"""Kafka client properties files, environment values and the redaction of secrets, without a broker."""
from __future__ import annotations

import json

import pytest

from connectors.kafka.config import KafkaConfigError, load_client_properties, read_properties
from connectors.secrets import REDACTED, redact, split_secrets

JAAS = "org.apache.kafka.common.security.{}.{} required username=\"alice\" password=\"{}\";"


def _file(tmp_path, text: str):
    path = tmp_path / "client.properties"
    path.write_text(text)
    path.chmod(0o600)  # a file that writes a password out is refused when others may read it (below)
    return path


def test_java_properties_syntax(tmp_path):
    path = _file(tmp_path, "# comment\n! also a comment\n  a.b = 1\nc:2\nd 3\nlong=one \\\n    two\\\\\n"
                           "esc=x\\=y\\ty\nempty=\n")
    assert read_properties(path) == {"a.b": "1", "c": "2", "d": "3", "long": "one two\\", "esc": "x=y\ty",
                                     "empty": ""}


@pytest.mark.parametrize("module, mechanism", [("plain", ("PlainLoginModule", "PLAIN")),
                                               ("scram", ("ScramLoginModule", "SCRAM-SHA-512"))])
def test_sasl_plain_and_scram_from_the_jaas_line(tmp_path, module, mechanism):
    cls, mech = mechanism
    path = _file(tmp_path, f"security.protocol=sasl_ssl\nsasl.mechanism={mech}\n"
                           f"sasl.jaas.config={JAAS.format(module, cls, 'p@ss word=;')}\n"
                           "ssl.truststore.type=PEM\nssl.truststore.location=/etc/ca.pem\n"
                           "ssl.endpoint.identification.algorithm=\nrequest.timeout.ms=40000\nclient.id=me\n")
    assert load_client_properties(path) == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": mech, "sasl_plain_username": "alice",
        "sasl_plain_password": "p@ss word=;", "ssl_cafile": "/etc/ca.pem", "ssl_check_hostname": False,
        "request_timeout_ms": 40000, "client_id": "me"}


def test_librdkafka_names_and_a_pem_keystore(tmp_path):
    path = _file(tmp_path, "sasl.username=bob\nsasl.password=pw\nssl.ca.location=/ca.pem\n"
                           "ssl.keystore.type=PEM\nssl.keystore.location=/me.pem\nssl.key.password=kpw\n")
    assert load_client_properties(path) == {"sasl_plain_username": "bob", "sasl_plain_password": "pw",
                                            "ssl_cafile": "/ca.pem", "ssl_certfile": "/me.pem",
                                            "ssl_keyfile": "/me.pem", "ssl_password": "kpw"}


def test_values_from_the_environment(tmp_path, monkeypatch):
    path = _file(tmp_path, "config.providers=env\n"
                           "config.providers.env.class=org.apache.kafka.common.config.provider.EnvVarConfigProvider\n"
                           f"sasl.jaas.config={JAAS.format('plain', 'PlainLoginModule', '${env:KAFKA_PW}')}\n")
    monkeypatch.setenv("KAFKA_PW", "from-env")
    assert load_client_properties(path)["sasl_plain_password"] == "from-env"
    monkeypatch.delenv("KAFKA_PW")
    with pytest.raises(KafkaConfigError, match=r"sasl.jaas.config: environment variable KAFKA_PW is not set"):
        load_client_properties(path)


@pytest.mark.parametrize("text, says", [
    ("foo.bar=1\n", "foo.bar: not a Kafka client property"),
    ("bootstrap.servers=b:9092\n", "bootstrap.servers: give the brokers with --bootstrap"),
    ("ssl.truststore.location=/ts.jks\n", "a JKS store cannot be read by Python's TLS"),
    ("sasl.jaas.config=com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true;\n",
     "login module com.sun.security.auth.module.Krb5LoginModule is not supported"),
    ("sasl.jaas.config=" + JAAS.format("plain", "PlainLoginModule", "x").replace(' password="x"', "") + "\n",
     "has no password"),
    ("request.timeout.ms=soon\n", "request.timeout.ms=soon: expects a whole number"),
])
def test_what_cannot_be_translated_is_a_one_line_error_naming_the_file_and_key(tmp_path, text, says):
    path = _file(tmp_path, text)
    with pytest.raises(KafkaConfigError) as err:
        load_client_properties(path)
    assert says in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_command_line_option_merges_the_file_and_the_pairs(tmp_path, monkeypatch):
    from connectors.fields import OptionError
    from flowtrain.commands.kafka_options import kafka_config

    path = _file(tmp_path, "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\nclient.id=file\n"
                           f"sasl.jaas.config={JAAS.format('plain', 'PlainLoginModule', 'pw')}\n")
    monkeypatch.setenv("CID", "from-env")
    got = kafka_config(["client_id=${env:CID}"], str(path))
    assert got["client_id"] == "from-env" and got["sasl_plain_password"] == "pw"
    monkeypatch.setenv("FLOWTRAIN_KAFKA_CONFIG_FILE", str(path))
    assert kafka_config(None)["sasl_plain_username"] == "alice"
    with pytest.raises(OptionError, match="nope.properties: cannot read it"):
        kafka_config(None, str(tmp_path / "nope.properties"))


def test_every_kafka_command_takes_the_file(tmp_path):
    from flowtrain.cli.main import build_parser

    parser = build_parser()
    for argv in (["replay"], ["stream"], ["stream", "pipeline"], ["stream", "train"], ["stream", "score"]):
        args, _ = parser.parse_known_args([*argv, "--kafka-config-file", "c.properties"])
        assert args.kafka_config_file == "c.properties", argv


def test_redact_hides_secrets_in_dicts_command_lines_and_text():
    config = {"beam_args": ["--runner=PrismRunner", "--s3_secret_access_key=abc", "--s3_access_key_id", "AKIA",
                            "--s3_secret_access_key", "xyz", "--azure_connection_string=k"],
              "kafka_config": {"sasl_plain_username": "alice", "sasl_plain_password": "pw", "ssl_password": "k"},
              "pairs": ["sasl_plain_password=pw2", "client_id=x"], "sasl.jaas.config": JAAS.format("a", "B", "pw3"),
              "note": 'login: username="alice" password="pw4";', "update_key_file": "/keys/update.key",
              "epochs": 3}
    text = json.dumps(redact(config))
    for secret in ("abc", "xyz", '"k"', "pw", "pw2", "pw3", "pw4"):
        assert f'{secret}"' not in text and f"={secret}" not in text, secret
    red = redact(config)
    assert red["beam_args"][:4] == ["--runner=PrismRunner", f"--s3_secret_access_key={REDACTED}", "--s3_access_key_id",
                                    "AKIA"]
    assert red["kafka_config"]["sasl_plain_username"] == "alice" and red["update_key_file"] == "/keys/update.key"
    assert red["epochs"] == 3 and config["kafka_config"]["sasl_plain_password"] == "pw"  # a copy
    assert split_secrets(config["kafka_config"]) == ({"sasl_plain_username": "alice"},
                                                     {"sasl_plain_password": "pw", "ssl_password": "k"})


def test_a_properties_file_writing_a_password_out_is_refused_when_group_or_others_may_read_it(tmp_path,
                                                                                              monkeypatch):
    """#28 item 14: a secret file with group/other permissions is refused naming its mode (as ssh does); a
    file whose passwords come from the environment may stay world-readable."""
    literal = _file(tmp_path, "sasl.jaas.config=" + JAAS.format("plain", "PlainLoginModule", "pw") + "\n")
    literal.chmod(0o644)
    with pytest.raises(KafkaConfigError, match=r"mode 0644 .*chmod 600 .*sasl.jaas.config"):
        load_client_properties(literal)
    literal.chmod(0o600)
    assert load_client_properties(literal)["sasl_plain_password"] == "pw"
    key = tmp_path / "key.properties"
    key.write_text("ssl.key.password=kpw\n")
    key.chmod(0o640)
    with pytest.raises(KafkaConfigError, match=r"mode 0640 lets its group.*ssl.key.password"):
        load_client_properties(key)
    monkeypatch.setenv("KAFKA_PW", "from-env")
    from_env = tmp_path / "env.properties"
    from_env.write_text("sasl.jaas.config=" + JAAS.format("plain", "PlainLoginModule", "${env:KAFKA_PW}") +
                        "\nssl.key.password=${env:KAFKA_PW}\n")
    from_env.chmod(0o644)
    assert load_client_properties(from_env)["sasl_plain_password"] == "from-env"
