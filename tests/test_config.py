from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest

from edgefl.agent.config import (
    AgentBrokerConfig,
    Profile,
    load_profile,
    parse_profile,
    profile_to_dict,
)
from edgefl.errors import ConfigError
from edgefl.profiles import BrokerConfig, DashboardConfig
from edgefl.validators import (
    check_device_id,
    check_finite_float,
    check_positive_int,
    check_qos,
    check_topic_prefix,
    is_loopback_host,
    parse_broker_url,
)

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "firmware_configs"
DIGITS_MODEL = REPO / "models" / "digits_cnn_int8_rawin.tflite"  # the profiles run the raw-input form


class Writer(Protocol):
    def __call__(self, extra: str, *, head: str = ...) -> Path: ...


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.tflite"
    path.write_bytes(b"TFL3 not really a model")
    return path


@pytest.fixture
def write(tmp_path: Path, model_file: Path) -> Writer:
    """Write a profile whose [device] and [model] are valid, plus the given extra TOML."""

    def _write(extra: str, *, head: str = '[device]\nid = "dev-1"\n\n[model]\npath = "m.tflite"\n') -> Path:
        path = tmp_path / "profile.toml"
        path.write_text(head + "\n" + extra, encoding="utf-8")
        return path

    return _write


def problems_of(path: Path, overrides: Mapping[str, object] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_profile(path, overrides)
    return info.value.problems


def table(rendered: Mapping[str, object], name: str) -> dict[str, object]:
    value = rendered[name]
    assert isinstance(value, dict)
    return value


# --------------------------------------------------------------------------------------------------
# Shipped profiles
# --------------------------------------------------------------------------------------------------


def test_profiles_directory_has_the_five_device_profiles_and_the_coordinator_profile() -> None:
    assert sorted(p.name for p in PROFILES.glob("*.toml")) == [
        "coordinator.toml",
        "dev_x86.toml",
        "gateway_aarch64_256mb.toml",
        "gateway_aarch64_256mb_mobilenet.toml",
        "gateway_armv7_512mb.toml",
        "rpi4.toml",
    ]


@pytest.mark.parametrize(
    ("name", "runtime", "cap_mb", "threads", "state_dir"),
    [
        ("dev_x86.toml", "auto", 96, 1, PROFILES / "state" / "dev-x86-0"),
        ("gateway_aarch64_256mb.toml", "litert", 96, 1, Path("/var/lib/edgefl")),
        ("gateway_armv7_512mb.toml", "tflite", 128, 1, Path("/var/lib/edgefl")),
        ("rpi4.toml", "litert", 192, 2, Path("/var/lib/edgefl")),
    ],
)
def test_shipped_profile_loads_with_its_model(
    name: str, runtime: str, cap_mb: int, threads: int, state_dir: Path
) -> None:
    # check_files=True on purpose: the digits model is committed, and a profile pointing at a
    # missing model must fail this test.
    profile = load_profile(PROFILES / name)
    assert profile.path == PROFILES / name
    assert profile.model.path.resolve() == DIGITS_MODEL.resolve()
    assert profile.model.path.is_file()
    assert profile.model.runtime == runtime
    assert profile.model.num_threads == threads
    assert profile.memory.cap_mb == cap_mb
    assert profile.cap_bytes == cap_mb * 1024 * 1024
    assert profile.memory.reserve_mb < profile.memory.cap_mb
    assert profile.device.state_dir == state_dir
    assert profile.pipeline.mean == (0.0,)
    assert profile.pipeline.std == (16.0,)
    assert check_device_id(profile.device.id) == profile.device.id


def test_own_model_big_backbone_profile_loads_with_its_model() -> None:
    """The 96 MiB profile for a 1280-wide float MobileNet, dashboard on (issue 14 item 5)."""
    profile = load_profile(PROFILES / "gateway_aarch64_256mb_mobilenet.toml")
    model = PROFILES.parent / "models" / "mobilenet_v2_035_96_float32.tflite"
    assert profile.model.path.resolve() == model.resolve() and profile.model.path.is_file()
    assert (profile.memory.cap_mb, profile.memory.reserve_mb) == (96, 4)  # H17: 8 declined without -OO
    assert profile.dashboard.enabled and profile.dashboard.host == "127.0.0.1"
    assert (profile.pipeline.mean, profile.pipeline.std, profile.pipeline.batch) == ((127.5,), (127.5,), 8)
    assert profile.training.store_capacity == 1024


def test_dev_profile_details() -> None:
    profile = load_profile(PROFILES / "dev_x86.toml")
    assert profile.device.id == "dev-x86-0"
    assert profile.dashboard == DashboardConfig(enabled=True, host="127.0.0.1", port=0, token=None)
    assert (profile.broker.host, profile.broker.port, profile.broker.tls) == ("127.0.0.1", 1883, False)
    assert profile.source.kind == "mqtt"


def test_gateway_profiles_use_tls_to_a_placeholder_coordinator() -> None:
    for name in (
        "gateway_aarch64_256mb.toml",
        "gateway_aarch64_256mb_mobilenet.toml",
        "gateway_armv7_512mb.toml",
        "rpi4.toml",
    ):
        broker = load_profile(PROFILES / name).broker
        assert (broker.scheme, broker.host, broker.port, broker.tls) == (
            "mqtts",
            "coordinator.invalid",
            8883,
            True,
        )


# --------------------------------------------------------------------------------------------------
# Defaults, paths, the API shape
# --------------------------------------------------------------------------------------------------


def test_minimal_profile_takes_defaults(write: Writer, tmp_path: Path, model_file: Path) -> None:
    profile = load_profile(write(""))
    assert profile.path == tmp_path / "profile.toml"
    assert profile.device.id == "dev-1"
    assert profile.device.fleet == "default"
    assert profile.device.state_dir == tmp_path / "state" / "dev-1"  # one folder per device id
    assert profile.model.path == model_file
    assert (profile.model.num_threads, profile.model.runtime, profile.model.sha256) == (1, "auto", None)
    assert profile.pipeline.mode == "fused"
    assert profile.pipeline.batch == 8
    assert (profile.pipeline.mean, profile.pipeline.std) == ((0.0,), (1.0,))
    assert profile.broker == AgentBrokerConfig()  # session_expiry_s 3600: restarts lose nothing queued
    assert (profile.broker.host, profile.broker.port) == ("127.0.0.1", 1883)
    # safe on a 3.1.1 broker that never says its limit; accepts the coordinator's 256 KiB head chunks
    assert (profile.broker.max_packet_bytes, profile.broker.max_incoming_packet_bytes) == (65_536, 1_048_576)
    assert profile.status.interval_s == 2.0
    assert (profile.memory.cap_mb, profile.memory.reserve_mb, profile.memory.min_system_available_mb) == (
        96,
        8,
        32,
    )
    assert profile.cap_bytes == 100_663_296
    assert profile.training.store_capacity == 4096
    assert profile.training.clip_norm is None
    assert profile.source.kind == "none"
    assert profile.dashboard.enabled is False


def test_value_objects_are_frozen_and_slotted(write: Writer) -> None:
    profile = load_profile(write(""))
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.memory.cap_mb = 1  # type: ignore[misc]
    assert not hasattr(profile.memory, "__dict__")


def test_relative_paths_resolve_against_the_profile_directory(tmp_path: Path) -> None:
    sub = tmp_path / "conf"
    (tmp_path / "models").mkdir()
    sub.mkdir()
    (tmp_path / "models" / "b.tflite").write_bytes(b"x")
    np.savez(tmp_path / "replay.npz", x=np.zeros((2, 8, 8), np.uint8), y=np.zeros(2, np.int64))
    (sub / "p.toml").write_text(
        '[device]\nid = "a"\nstate_dir = "st"\n[model]\npath = "../models/b.tflite"\n'
        '[source]\nkind = "replay"\npath = "../replay.npz"\n',
        encoding="utf-8",
    )
    profile = load_profile(sub / "p.toml")
    assert profile.model.path.resolve() == (tmp_path / "models" / "b.tflite").resolve()
    assert profile.model.path.is_absolute()
    assert profile.device.state_dir == sub / "st"
    assert profile.source.path is not None
    assert profile.source.path.resolve() == (tmp_path / "replay.npz").resolve()


def test_absolute_paths_are_kept(write: Writer, model_file: Path) -> None:
    # not a CA bundle: with the files checked, check-config would load it and refuse it
    profile = load_profile(
        write(f'[broker]\nurl = "mqtts://b:8883"\nca_file = "{model_file}"\n'), check_files=False
    )
    assert profile.broker.ca_file == model_file


def test_parse_profile_from_a_mapping(tmp_path: Path, model_file: Path) -> None:
    data = {"device": {"id": "x"}, "model": {"path": "m.tflite"}, "memory": {"cap_mb": 64}}
    profile = parse_profile(data, tmp_path)
    assert profile.path == Path("<inline>")
    assert profile.model.path == model_file
    assert profile.memory.cap_mb == 64
    named = parse_profile(data, tmp_path, path=tmp_path / "x.toml")
    assert named.path == tmp_path / "x.toml"


def test_broker_url_helpers() -> None:
    assert (BrokerConfig(url="mqtt://broker.lan").host, BrokerConfig(url="mqtt://broker.lan").port) == (
        "broker.lan",
        1883,
    )
    tls = BrokerConfig(url="mqtts://[::1]:8884")
    assert (tls.scheme, tls.host, tls.port) == ("mqtts", "::1", 8884)
    nodes = BrokerConfig(url="mqtt://a", alternates=("mqtt://b:1884", "mqtt://[::1]"))
    assert nodes.alternate_addresses == [("b", 1884), ("::1", 1883)]


def test_tls_follows_the_scheme(write: Writer) -> None:
    assert load_profile(write('[broker]\nurl = "mqtts://b"\n')).broker.tls is True
    assert load_profile(write('[broker]\nurl = "mqtts://b"\ntls = true\n')).broker.tls is True
    assert load_profile(write('[broker]\nurl = "mqtt://b"\ntls = false\n')).broker.tls is False


def test_sha256_is_checked_against_the_model(write: Writer, model_file: Path) -> None:
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()
    profile = load_profile(write(""), {"model.sha256": digest.upper()})
    assert profile.model.sha256 == digest
    wrong = "0" * 64
    assert problems_of(
        write(f'sha256 = "{wrong}"\n', head='[device]\nid = "d"\n[model]\npath = "m.tflite"\n')
    ) == [f"model.sha256 = '{wrong}': does not match the file (its sha256 is {digest})"]
    # Without file checks the digest is only checked for form.
    assert load_profile(write(""), {"model.sha256": wrong}, check_files=False).model.sha256 == wrong


def test_replay_source_must_be_an_npz_with_x_and_y(write: Writer, tmp_path: Path) -> None:
    np.savez(tmp_path / "good.npz", x=np.arange(64, dtype=np.uint8).reshape(1, 8, 8), y=np.array([3]))
    np.savez(tmp_path / "nolabels.npz", x=np.zeros(3))
    (tmp_path / "text.npz").write_text("hello", encoding="utf-8")
    good = load_profile(write('[source]\nkind = "replay"\npath = "good.npz"\nrate_hz = 5\nloop = true\n'))
    assert (good.source.path, good.source.rate_hz, good.source.loop) == (tmp_path / "good.npz", 5.0, True)
    assert problems_of(write('[source]\nkind = "replay"\npath = "nolabels.npz"\n')) == [
        "source.path = 'nolabels.npz': the .npz has no array 'y'"
    ]
    (problem,) = problems_of(write('[source]\nkind = "replay"\npath = "text.npz"\n'))
    assert problem.startswith("source.path = 'text.npz': not an .npz archive (")
    assert problems_of(write('[source]\nkind = "replay"\n')) == [
        "source.path: required when source.kind = 'replay'"
    ]


# --------------------------------------------------------------------------------------------------
# Every error kind, with its exact message
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("[memory]\ncap_mb = 0\n", "memory.cap_mb = 0: must be > 0"),
        ("[memory]\ncap_mb = 64\nreserve_mb = 64\n", "memory.reserve_mb = 64: must be < memory.cap_mb (64)"),
        ("[memory]\nreserve_mb = -1\n", "memory.reserve_mb = -1: must be > 0"),
        ("[memory]\nmin_system_available_mb = -5\n", "memory.min_system_available_mb = -5: must be >= 0"),
        ("[memory]\ncap_mb = 96.0\n", "memory.cap_mb = 96.0: must be an integer"),
        ('[memory]\ncap_mb = "96"\n', "memory.cap_mb = '96': must be an integer"),
        ("[memory]\ncap_mb = true\n", "memory.cap_mb = true: must be an integer"),
        ("[memory]\nfoo = 1\n", "memory.foo: unknown key"),
        ("[bogus]\nx = 1\n", "[bogus]: unknown table"),
        ("[broker]\nqos = 3\n", "broker.qos = 3: must be 0, 1 or 2"),
        (
            '[broker]\nurl = "http://b:80"\n',
            "broker.url = 'http://b:80': must start with mqtt:// or mqtts://",
        ),
        (
            '[broker]\nurl = "mqtt://b:0"\n',
            "broker.url = 'mqtt://b:0': port must be an integer between 1 and 65535",
        ),
        (
            '[broker]\nurl = "mqtt://b:70000"\n',
            "broker.url = 'mqtt://b:70000': port must be an integer between 1 and 65535",
        ),
        (
            '[broker]\nurl = "mqtt://u:p@b:1883"\n',
            "broker.url = 'mqtt://u:p@b:1883': must not contain credentials;"
            " use broker.username and broker.password",
        ),
        (
            '[broker]\ntopic_prefix = "a/+"\n',
            "broker.topic_prefix = 'a/+': must not contain the MQTT wildcards '+' or '#'",
        ),
        (
            '[broker]\ntopic_prefix = "$SYS"\n',
            "broker.topic_prefix = '$SYS': must not start with '$' (reserved for broker topics)",
        ),
        ("[broker]\nkeepalive_s = 0\n", "broker.keepalive_s = 0: must be between 1 and 65535"),
        (
            "[broker]\nmax_packet_bytes = 268435456\n",
            "broker.max_packet_bytes = 268435456: must be between 1 and 268435455",
        ),
        (
            "[broker]\nmax_incoming_packet_bytes = 0\n",
            "broker.max_incoming_packet_bytes = 0: must be between 1 and 268435455",
        ),
        (
            "[status]\ninterval_s = 0.01\n",
            "status.interval_s = 0.01: must be between 0.05 and 3600 seconds",
        ),
        ("[broker]\nprotocol = 5\n", "broker.protocol = 5: must be one of 'auto', '5', '3.1.1'"),
        (
            '[broker]\nalternates = ["mqtt://b:1884", "http://c"]\n',
            "broker.alternates[1] = 'http://c': must start with mqtt:// or mqtts://",
        ),
        (
            '[broker]\nalternates = ["mqtts://b"]\n',
            "broker.alternates[0] = 'mqtts://b': must use broker.url's scheme (mqtt://): one TLS setting"
            " serves every node",
        ),
        (
            '[broker]\nalternates = "mqtt://b"\n',
            "broker.alternates = 'mqtt://b': must be an array of strings",
        ),
        ('[broker]\npassword = "hunter2"\n', "broker.password = '***': requires broker.username"),
        (
            '[broker]\nurl = "mqtts://b"\ntls = false\n',
            "broker.tls = false: contradicts the mqtts:// url (TLS is used exactly for mqtts://)",
        ),
        ('[broker]\nca_file = "m.tflite"\n', "broker.ca_file = 'm.tflite': requires an mqtts:// url"),
        (
            '[broker]\nurl = "mqtts://b"\nclient_cert = "m.tflite"\n',
            "broker.client_cert = 'm.tflite': requires broker.client_key",
        ),
        (
            '[broker]\nurl = "mqtts://b"\nca_file = "/nope/ca.pem"\n',
            "broker.ca_file = '/nope/ca.pem': file not found",
        ),
        ('[device]\nid = "a/b"\n', "device.id = 'a/b': must be 1-64 characters from A-Z a-z 0-9 _ . -"),
        ('[device]\nid = "a"\nfleet = ".."\n', "device.fleet = '..': must not be '.' or '..'"),
        ('[pipeline]\nmode = "fast"\n', "pipeline.mode = 'fast': must be one of 'fused', 'unfused', 'auto'"),
        ("[pipeline]\nbatch = 0\n", "pipeline.batch = 0: must be > 0"),
        ("[pipeline]\nbatch = 4097\n", "pipeline.batch = 4097: must be <= 4096"),
        (
            "[pipeline]\nstd = [1.0, 0.0, 2.0]\nmean = [0, 0, 0]\n",
            "pipeline.std = [1.0, 0.0, 2.0]: every value must be > 0",
        ),
        (
            "[pipeline]\nmean = [0.5, 0.5]\n",
            "pipeline.mean = [0.5, 0.5]: must have as many values as pipeline.std (1)",
        ),
        ("[pipeline]\nmean = []\n", "pipeline.mean = []: must not be empty"),
        (
            "[pipeline]\nstd = [nan]\n",
            "pipeline.std = [nan]: must be an array of finite numbers (must be finite)",
        ),
        ('[pipeline]\nstd = "1"\n', "pipeline.std = '1': must be an array of numbers"),
        (
            "[training]\nchunk_floor = 300\n",
            "training.chunk_floor = 300: must be <= training.chunk_size (256)",
        ),
        ("[training]\nstore_capacity = 0\n", "training.store_capacity = 0: must be > 0"),
        ("[training]\nclip_norm = 0.0\n", "training.clip_norm = 0.0: must be > 0"),
        ("[training]\nmin_examples = 0\n", "training.min_examples = 0: must be an integer >= 1"),
        (
            "[training]\nstore_capacity = 64\nmin_examples = 65\n",
            "training.min_examples = 65: must be <= training.store_capacity (64): the store never holds more",
        ),
        ("[training]\nclip_norm = inf\n", "training.clip_norm = inf: must be finite"),
        ("[training]\nseed = -1\n", "training.seed = -1: must be >= 0"),
        ("[source]\nrate_hz = -1.5\n", "source.rate_hz = -1.5: must be >= 0"),
        ("[source]\nloop = 1\n", "source.loop = 1: must be true or false"),
        ('[source]\nkind = "camera"\n', "source.kind = 'camera': must be one of 'none', 'replay', 'mqtt'"),
        ("[dashboard]\nport = 70000\n", "dashboard.port = 70000: must be between 0 and 65535"),
        (
            '[dashboard]\nhost = "0.0.0.0"\n',
            "dashboard.host = '0.0.0.0': a non-loopback host requires dashboard.token",
        ),
        (
            '[dashboard]\nhost = ""\n',
            "dashboard.host = '': must not be empty (use 0.0.0.0 to listen on all interfaces)",
        ),
        (
            '[dashboard]\ntoken = "short"\n',
            "dashboard.token = '***': must be at least 16 characters without whitespace",
        ),
        ("[model]\nnum_threads = 0\n", "model.num_threads = 0: must be > 0"),
        ("[model]\nnum_threads = 65\n", "model.num_threads = 65: must be <= 64"),
        ('[model]\nsha256 = "xyz"\n', "model.sha256 = 'xyz': must be 64 hexadecimal digits"),
        ('[model]\nruntime = "onnx"\n', "model.runtime = 'onnx': must be one of 'auto', 'litert', 'tflite'"),
        ('[model]\nembedding_tensor = ""\n', "model.embedding_tensor = '': must not be empty"),
    ],
)
def test_error_message(write: Writer, extra: str, expected: str) -> None:
    # [model] and [device] appear in some cases, so those cases get their own valid head.
    head = ""
    if not extra.startswith("[device]"):
        head += '[device]\nid = "dev-1"\n'
    if extra.startswith("[model]"):
        extra = extra.replace("[model]\n", '[model]\npath = "m.tflite"\n', 1)
    else:
        head += '[model]\npath = "m.tflite"\n'
    assert problems_of(write(extra, head=head)) == [expected]


def test_top_level_keys_must_be_tables(tmp_path: Path, model_file: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(
        'bogus = 1\nmemory = 5\n[device]\nid = "a"\n[model]\npath = "m.tflite"\n', encoding="utf-8"
    )
    assert problems_of(path) == ["bogus: unknown key", "memory = 5: must be a table"]


def test_required_keys(write: Writer) -> None:
    assert problems_of(write("", head="")) == ["device.id: required", "model.path: required"]


def test_missing_model_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[device]\nid = "a"\n[model]\npath = "/x.tflite"\n', encoding="utf-8")
    assert problems_of(path) == ["model.path = '/x.tflite': file not found"]
    path.write_text('[device]\nid = "a"\n[model]\npath = "gone.tflite"\n', encoding="utf-8")
    assert problems_of(path) == [
        f"model.path = 'gone.tflite': file not found (resolved to '{tmp_path / 'gone.tflite'}')"
    ]
    path.write_text(f'[device]\nid = "a"\n[model]\npath = "{tmp_path}"\n', encoding="utf-8")
    assert problems_of(path) == [f"model.path = '{tmp_path}': not a file"]
    # Profiles written for another machine can skip the file checks.
    assert load_profile(path, check_files=False).model.path == tmp_path


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    assert problems_of(missing) == [f"{missing}: file not found"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[device\nid = 1\n", encoding="utf-8")
    (problem,) = problems_of(bad)
    assert problem.startswith(f"{bad}: invalid TOML (")


def test_error_is_chained_from_the_toml_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("a = = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_profile(bad)
    assert type(info.value.__cause__).__name__ == "TOMLDecodeError"


def test_all_problems_are_reported_together(write: Writer) -> None:
    path = write(
        "[memory]\ncap_mb = 0\nfoo = 1\n"
        '[broker]\nqos = 3\nurl = "ftp://x"\n'
        "[bogus]\n"
        '[dashboard]\nhost = "192.168.1.10"\n',
        head='[device]\nid = "no spaces"\n[model]\npath = "/x.tflite"\n',
    )
    problems = problems_of(path)
    assert problems == [
        "[bogus]: unknown table",
        "device.id = 'no spaces': must be 1-64 characters from A-Z a-z 0-9 _ . -",
        "model.path = '/x.tflite': file not found",
        "broker.url = 'ftp://x': must start with mqtt:// or mqtts://",
        "broker.qos = 3: must be 0, 1 or 2",
        "memory.foo: unknown key",
        "memory.cap_mb = 0: must be > 0",
        "dashboard.host = '192.168.1.10': a non-loopback host requires dashboard.token",
    ]
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert str(info.value) == "; ".join(problems)


def test_a_bad_key_does_not_cause_follow_on_problems(write: Writer) -> None:
    # cap_mb is mistyped: reserve_mb is not compared against the default cap in its place.
    assert problems_of(write('[memory]\ncap_mb = "lots"\nreserve_mb = 200\n')) == [
        "memory.cap_mb = 'lots': must be an integer"
    ]


# --------------------------------------------------------------------------------------------------
# Overrides and coercion
# --------------------------------------------------------------------------------------------------


def test_overrides_from_the_command_line_are_coerced(write: Writer, tmp_path: Path) -> None:
    np.savez(tmp_path / "r.npz", x=np.zeros((1, 8, 8), np.uint8), y=np.zeros(1, np.int64))
    profile = load_profile(
        write("[memory]\ncap_mb = 64\n[dashboard]\nenabled = false\n"),
        {
            "device.id": "dev-2",
            "broker.url": "mqtt://127.0.0.1:18830",
            "memory.cap_mb": "96",
            "memory.reserve_mb": " 4 ",
            "dashboard.enabled": "TRUE",
            "pipeline.mean": "0.5,0.25,0",
            "pipeline.std": "[2.0, 2, 2]",  # the TOML array syntax is accepted like a comma list
            "training.clip_norm": "1.5",
            "source.kind": "replay",
            "source.path": str(tmp_path / "r.npz"),
            "source.loop": "false",
            "broker.protocol": "5",
        },
    )
    assert profile.device.id == "dev-2"
    assert (profile.broker.host, profile.broker.port) == ("127.0.0.1", 18830)
    assert (profile.memory.cap_mb, profile.memory.reserve_mb) == (96, 4)
    assert profile.dashboard.enabled is True
    assert profile.pipeline.mean == (0.5, 0.25, 0.0)
    assert profile.pipeline.std == (2.0, 2.0, 2.0)
    assert profile.training.clip_norm == 1.5
    assert (profile.source.kind, profile.source.path, profile.source.loop) == (
        "replay",
        tmp_path / "r.npz",
        False,
    )
    assert profile.broker.protocol == "5"


def test_overrides_with_python_values_and_empty_string_for_none(write: Writer, model_file: Path) -> None:
    profile = load_profile(
        write('[model]\nembedding_tensor = "emb"\n', head='[device]\nid = "a"\n'),
        {"model.path": model_file, "memory.cap_mb": 200, "model.embedding_tensor": "", "pipeline.std": 16},
    )
    assert profile.memory.cap_mb == 200
    assert profile.model.embedding_tensor is None
    assert profile.pipeline.std == (16.0,)


def test_relative_override_paths_resolve_against_the_working_directory(
    write: Writer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "other.tflite").write_bytes(b"x")
    monkeypatch.chdir(cwd)
    profile = load_profile(write(""), {"model.path": "other.tflite", "device.state_dir": "st"})
    assert profile.model.path == cwd / "other.tflite"
    assert profile.device.state_dir == cwd / "st"


def test_bad_overrides_are_reported_with_the_rest(write: Writer) -> None:
    assert problems_of(
        write("[memory]\ncap_mb = 0\n"),
        overrides={
            "memory.reserve_mb": "eight",
            "dashboard.enabled": "yes please",
            "pipeline.mean": "0,x",
            "memory.foo": "1",
            "bogus.x": "1",
            "nodot": "1",
            "device.id": 5,
        },
    ) == [
        "memory.foo: unknown key",
        "bogus.x: unknown table [bogus]",
        "nodot: override key must be 'table.key'",
        "device.id = 5: must be a string",
        "pipeline.mean = '0,x': must be a comma-separated list of numbers",
        "memory.reserve_mb = 'eight': must be an integer",
        "memory.cap_mb = 0: must be > 0",
        "dashboard.enabled = 'yes please': must be true or false",
    ]


def test_required_field_cannot_be_unset_by_override(write: Writer) -> None:
    assert problems_of(write(""), overrides={"device.id": None}) == ["device.id = None: must be set"]


# --------------------------------------------------------------------------------------------------
# Secrets and the dashboard rule
# --------------------------------------------------------------------------------------------------

TOKEN = "0123456789abcdef-token"


def test_secrets_are_not_in_repr_or_dict(write: Writer) -> None:
    profile = load_profile(
        write(
            '[broker]\nusername = "gw"\npassword = "hunter2-secret"\n'
            f'[dashboard]\nenabled = true\nhost = "0.0.0.0"\ntoken = "{TOKEN}"\n'
        )
    )
    assert profile.broker.password == "hunter2-secret"
    assert profile.dashboard.token == TOKEN
    for text in (repr(profile), str(profile), repr(profile.broker), repr(profile.dashboard)):
        assert "hunter2" not in text
        assert TOKEN not in text
    assert "username='gw'" in repr(profile.broker)
    rendered = profile_to_dict(profile)
    assert "hunter2" not in json.dumps(rendered)
    assert TOKEN not in json.dumps(rendered)
    assert table(rendered, "broker")["password"] == "***"
    assert table(rendered, "dashboard")["token"] == "***"


def test_secrets_are_masked_in_error_messages(write: Writer) -> None:
    problems = problems_of(write('[broker]\npassword = "hunter2-secret"\n[dashboard]\ntoken = "x y"\n'))
    assert problems == [
        "broker.password = '***': requires broker.username",
        "dashboard.token = '***': must be at least 16 characters without whitespace",
    ]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "gateway.lan", "fe80::1"])
def test_non_loopback_dashboard_without_token_is_rejected(write: Writer, host: str) -> None:
    assert problems_of(write(f'[dashboard]\nenabled = true\nhost = "{host}"\n')) == [
        f"dashboard.host = '{host}': a non-loopback host requires dashboard.token"
    ]
    profile = load_profile(write(f'[dashboard]\nenabled = true\nhost = "{host}"\ntoken = "{TOKEN}"\n'))
    assert profile.dashboard.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost"])
def test_loopback_dashboard_needs_no_token(write: Writer, host: str) -> None:
    assert load_profile(write(f'[dashboard]\nenabled = true\nhost = "{host}"\n')).dashboard.token is None


# --------------------------------------------------------------------------------------------------
# profile_to_dict
# --------------------------------------------------------------------------------------------------


def test_profile_to_dict_round_trips(write: Writer, tmp_path: Path) -> None:
    profile = load_profile(write("[pipeline]\nmean = [1, 2]\nstd = [3, 4]\n[training]\nclip_norm = 2.5\n"))
    rendered = profile_to_dict(profile)
    assert list(rendered) == [
        "device",
        "model",
        "pipeline",
        "broker",
        "memory",
        "training",
        "source",
        "dashboard",
        "security",
        "status",
        "personal",
    ]
    assert rendered["pipeline"] == {
        "mode": "fused",
        "batch": 8,
        "raw_dtype": "uint8",
        "mean": [1.0, 2.0],
        "std": [3.0, 4.0],
    }
    assert rendered["memory"] == {"cap_mb": 96, "reserve_mb": 8, "min_system_available_mb": 32}
    assert table(rendered, "model")["path"] == str(tmp_path / "m.tflite")
    json.dumps(rendered)  # JSON-serialisable
    data = {t: {k: v for k, v in table(rendered, t).items() if v is not None} for t in rendered}
    again: Profile = parse_profile(data, Path("/elsewhere"), path=profile.path)
    assert again == profile


# --------------------------------------------------------------------------------------------------
# validators
# --------------------------------------------------------------------------------------------------


def test_check_device_id() -> None:
    assert check_device_id("gw-01.site_a") == "gw-01.site_a"
    assert check_device_id("x" * 64) == "x" * 64
    for bad in ("", "x" * 65, "a b", "a/b", "a+b", "a#", "$SYS", "é", ".", ".."):
        with pytest.raises(ValueError):
            check_device_id(bad)
    with pytest.raises(ValueError, match=r"^must be a string$"):
        check_device_id(7)


def test_check_topic_prefix() -> None:
    assert check_topic_prefix("acme/edgefl") == "acme/edgefl"
    cases = {
        "": "must not be empty",
        "/a": "must not start or end with '/'",
        "a/": "must not start or end with '/'",
        "a//b": r"must not contain an empty topic level \('//'\)",
        "a#": "must not contain the MQTT wildcards",
        "a\x00b": "must not contain NUL",
        "x" * 65_536: "must be at most 65535 bytes in UTF-8",
    }
    for value, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_topic_prefix(value)


def test_check_qos() -> None:
    assert [check_qos(q) for q in (0, 1, 2)] == [0, 1, 2]
    for bad in (3, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"^must be 0, 1 or 2$"):
            check_qos(bad)


def test_check_positive_int() -> None:
    assert check_positive_int("n", 5) == 5
    with pytest.raises(ValueError) as info:
        check_positive_int("num_examples", 0)
    assert str(info.value) == "must be > 0"
    assert info.value.__notes__ == ["while checking num_examples"]
    for bad in (True, 2.0, "3", None):
        with pytest.raises(ValueError) as info:
            check_positive_int("n", bad)
        assert str(info.value) == "must be an integer"


def test_check_finite_float() -> None:
    assert check_finite_float(3) == 3.0
    assert isinstance(check_finite_float(3), float)
    assert check_finite_float(-0.5) == -0.5
    for bad, message in (
        (float("nan"), "must be finite"),
        (float("-inf"), "must be finite"),
        (True, "must be a number"),
        ("1", "must be a number"),
    ):
        with pytest.raises(ValueError, match=f"^{message}$"):
            check_finite_float(bad)


def test_parse_broker_url() -> None:
    assert parse_broker_url("mqtt://127.0.0.1:1883") == ("mqtt", "127.0.0.1", 1883)
    assert parse_broker_url("mqtt://broker") == ("mqtt", "broker", 1883)
    assert parse_broker_url("MQTTS://broker/") == ("mqtts", "broker", 8883)
    assert parse_broker_url("mqtts://[::1]:8884") == ("mqtts", "::1", 8884)
    cases = {
        "tcp://b:1883": "must start with mqtt:// or mqtts://",
        "mqtt://": "must name a host",
        "mqtt://:1883": "must name a host",
        "mqtt://b:": "port must be an integer between 1 and 65535",
        "mqtt://b:x": "port must be an integer between 1 and 65535",
        "mqtt://b:1883/topic": "no path, query or fragment",
        "mqtt://b:1883?x=1": "no path, query or fragment",
        "mqtt://[::1": "is not a valid URL",
        "mqtt://user@b": "must not contain credentials",
    }
    for url, message in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_broker_url(url)
    with pytest.raises(ValueError, match="must be a string"):
        parse_broker_url(None)


def test_is_loopback_host() -> None:
    assert [is_loopback_host(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "LOCALHOST")] == [
        True
    ] * 5
    assert [is_loopback_host(h) for h in ("", "0.0.0.0", "::", "10.0.0.1", "host.lan")] == [False] * 5


def test_security_table(write: Writer, tmp_path: Path) -> None:
    key = tmp_path / "dev.key"
    key.write_text("11" * 32)
    profile = load_profile(
        write(
            f'[security]\nsigning_key_file = "{key}"\ncoordinator_public_key = "{"ab" * 32}"\n'
            "require_signatures = true\noutbox_max_bytes = 4096\n"
        )
    )
    assert profile.security.signing_key_file == key
    assert profile.security.require_signatures is True
    assert "ab" * 32 not in repr(profile.security)
    assert problems_of(write("[security]\nrequire_signatures = true\n")) == [
        "security.require_signatures = true: needs security.coordinator_public_key"
    ]
    assert problems_of(write('[security]\ncoordinator_public_key = "xyz"\noutbox_max_bytes = 0\n')) == [
        "security.coordinator_public_key = 'xyz': not an Ed25519 public key: expected 64 hex digits or a PEM"
        " block (-----BEGIN ...-----)",
        "security.outbox_max_bytes = 0: must be > 0",
    ]
