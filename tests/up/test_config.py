"""``impvm up --config``: a configuration problem prints one line naming the field and exits 2,
before anything starts; a good file parses into the API's own specs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from impvm.devstack.seed import make_private_key
from impvm.up.config import APP_SECRET, WEBHOOK_SECRET, ConfigError
from impvm.up.loader import load_config, parse_config


@pytest.fixture(scope="module")
def pem() -> bytes:
    return make_private_key().encode()


def good(tmp: Path, pem: bytes) -> dict:
    key = tmp / "app.pem"
    key.write_bytes(pem)
    key.chmod(0o600)
    hook = tmp / "webhook-secret"
    hook.write_text("s3cret\n")
    hook.chmod(0o600)
    return {
        "dataDir": "state",
        "github": {
            "app": {"id": 1, "installationId": 2, "privateKeyFile": "app.pem"},
            "webhookSecretFile": "webhook-secret",
        },
        "operator": {"listen": "127.0.0.1:8088"},
        "agent": {"runtime": "qemu", "vcpu": 4, "memoryMiB": 8192},
        "classes": {"small": {"vcpu": 2, "memoryMiB": 2048, "diskGiB": 10}},
        "templates": {
            "runner": {
                "classRef": {"name": "small"},
                "image": "registry.example.com/runner@sha256:" + "a" * 64,
                "runnerLayer": "registry.example.com/layer@sha256:" + "b" * 64,
            }
        },
        "pools": {
            "ci": {
                "templateName": "runner",
                "labels": ["imp"],
                "platform": {"type": "github-actions", "scope": {"org": "my-org"}},
                "scaling": {
                    "mode": "webhook",
                    "minIdle": 1,
                    "maxConcurrent": 5,
                    "scaleUpStep": 1,
                    "cooldownSeconds": 30,
                },
            }
        },
    }


def write(tmp: Path, cfg: dict | str) -> Path:
    path = tmp / "impvm.yaml"
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return path


def test_good_file_resolves_paths_and_fills_pool_defaults(tmp_path: Path, pem: bytes) -> None:
    cfg = load_config(write(tmp_path, good(tmp_path, pem)))
    assert cfg.data_dir == tmp_path / "state"
    assert cfg.github.app.private_key_file == tmp_path / "app.pem"
    assert cfg.github.api_url is None  # github.com
    assert cfg.listen() == ("127.0.0.1", 8088)
    pool = cfg.pools["ci"]
    assert pool.platform.credentials_secret == APP_SECRET
    assert pool.scaling is not None and pool.scaling.webhook is not None
    assert pool.scaling.webhook.secret_ref is not None
    assert pool.scaling.webhook.secret_ref.name == WEBHOOK_SECRET
    assert cfg.kubernetes.etcd_fsync is True and cfg.kubernetes.api_port == 6443


def _set(cfg: dict, dotted: str, value: object) -> None:
    *parents, last = dotted.split(".")
    d = cfg
    for p in parents:
        d = d[p]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("agent.runtmie", "qemu"), "agent.runtmie: unknown field"),
        (("pools.ci.scaling.minIdel", 1), "pools.ci.scaling.minIdel: unknown field"),
        (("github.app.privateKeyFile", KeyError), "github.app.privateKeyFile: required field"),
        (("github.app.id", "abc"), "github.app.id: Input should be a valid integer"),
        (("agent.runtime", "docker"), "agent.runtime: Input should be 'qemu' or 'process'"),
        (("operator.listen", "8080"), "operator.listen: Value error, want HOST:PORT"),
        (("agent.guestSubnet", "10.0.0.0/8"), "agent.guestSubnet: Value error, want a /16 to /28"),
        (("agent.guestNetwork", "bridge"), "agent.guestNetwork: Input should be 'isolated' or"),
        (("agent.guestNetwork", "host"), "agent.guestNetwork: Value error, 'host' was renamed"),
        (("agent.guestDns", ["notanip"]), "agent.guestDns: Value error,"),
        (("pools.ci.scaling.minIdle", -1), "pools.ci.scaling.minIdle: Input should be greater"),
        (("pools.ci.platform.scope.org", "-bad-"), "pools.ci.platform.scope.org: String should"),
        (("pools.ci.templateName", "Not_A_Name"), "pools.ci.templateName: String should match"),
        (("github.app.privateKeyFile", "missing.pem"), "github.app.privateKeyFile: "),
        (("github.webhookSecretFile", KeyError), "pools.ci.scaling.mode: webhook needs"),
        (("agent.qemuKernel", "no-such-vmlinuz"), "agent.qemuKernel: "),
        (("operator.pollCallsPerHour", float("inf")), "operator.pollCallsPerHour: Input should"),
        (("operator.pollRateLimitShare", 0.005), "operator.pollRateLimitShare: Input should be"),
    ],
)
def test_one_line_naming_the_field(
    tmp_path: Path, pem: bytes, change: tuple[str, object], message: str
) -> None:
    cfg = good(tmp_path, pem)
    _set(cfg, *change)
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, cfg))
    text = str(exc.value)
    assert "\n" not in text
    assert text.startswith(str(tmp_path / "impvm.yaml") + ": ") or text.startswith("github."), text
    assert message in text, text


def test_bad_yaml_names_the_place(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config("github:\n  app: [1, 2\n", source="impvm.yaml")
    assert str(exc.value).startswith("impvm.yaml: invalid YAML at line 3")
    with pytest.raises(ConfigError) as exc:
        parse_config("- a list\n", source="impvm.yaml")
    assert "top level must be a mapping" in str(exc.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_private_key_readable_by_group_or_others_is_refused(
    tmp_path: Path, pem: bytes, mode: int
) -> None:
    cfg = good(tmp_path, pem)
    (tmp_path / "app.pem").chmod(mode)
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, cfg))
    want = f"impvm.yaml: github.app.privateKeyFile: {tmp_path / 'app.pem'} is accessible by group"
    assert want in str(exc.value)
    assert f"(mode {mode:04o})" in str(exc.value) and "chmod 600" in str(exc.value)


def test_key_file_problems(tmp_path: Path, pem: bytes) -> None:
    cfg = good(tmp_path, pem)
    path = write(tmp_path, cfg)
    (tmp_path / "app.pem").write_text("not a key\n")
    with pytest.raises(ConfigError, match="is not an unencrypted PEM private key"):
        load_config(path)
    (tmp_path / "app.pem").unlink()
    (tmp_path / "app.pem").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(path)
    cfg["github"]["app"]["privateKeyFile"] = str(tmp_path / "webhook-secret" / "app.pem")
    with pytest.raises(ConfigError, match=r"github.app.privateKeyFile: .*Not a directory"):
        load_config(write(tmp_path, cfg))
    # the message never carries the key
    (tmp_path / "app.pem").rmdir()
    (tmp_path / "app.pem").write_bytes(pem[:-40])
    (tmp_path / "app.pem").chmod(0o600)
    cfg["github"]["app"]["privateKeyFile"] = "app.pem"
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, cfg))
    assert "MII" not in str(exc.value)


def _impvm_up(config: Path, *, no_dac_override: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "impvm.cli", "up", "--config", str(config)]
    if no_dac_override:
        # root without the capabilities that let it read any file: file modes apply to it
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_cli_exits_2_with_one_line(tmp_path: Path, pem: bytes) -> None:
    cfg = good(tmp_path, pem)
    cfg["agent"]["runtmie"] = "qemu"
    proc = _impvm_up(write(tmp_path, cfg))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"{tmp_path / 'impvm.yaml'}: agent.runtmie: unknown field\n"
    assert proc.stdout == ""
    proc = _impvm_up(tmp_path / "nope.yaml")
    assert (proc.returncode, proc.stderr) == (2, f"{tmp_path / 'nope.yaml'}: no such file\n")
    assert not (tmp_path / "state").exists()  # nothing started, nothing written


def test_the_setting_that_removes_guest_isolation_says_so_in_its_name(
    tmp_path: Path, pem: bytes
) -> None:
    """``host`` (user-mode networking, nothing between guest and host) is refused with what it
    became; ``unisolated`` is accepted, named for what it removes."""
    cfg = good(tmp_path, pem)
    cfg["agent"]["guestNetwork"] = "host"
    proc = _impvm_up(write(tmp_path, cfg))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (
        f"{tmp_path / 'impvm.yaml'}: agent.guestNetwork: Value error, 'host' was renamed "
        "'unisolated' (it isolates nothing); want isolated\n"
    )
    cfg["agent"]["guestNetwork"] = "unisolated"
    assert load_config(write(tmp_path, cfg)).agent.guest_network == "unisolated"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root)")
def test_cli_key_file_unreadable_by_the_service(tmp_path: Path, pem: bytes) -> None:
    """A key file the service cannot read: another user's 0600 file."""
    cfg = good(tmp_path, pem)
    path = write(tmp_path, cfg)
    os.chown(tmp_path / "app.pem", 65534, 65534)
    proc = _impvm_up(path, no_dac_override=True)
    assert proc.returncode == 2, proc.stderr
    want = f"{path}: github.app.privateKeyFile: {tmp_path / 'app.pem'}: permission denied\n"
    assert proc.stderr == want


@pytest.mark.controlplane
def test_pool_the_api_server_rejects_is_a_config_error(tmp_path: Path, pem: bytes) -> None:
    """Rules only the API server checks (its CEL rules) are asked of it by a server-side dry
    run before anything runs: one line naming the pool and the field, exit 2, nothing left
    running."""
    cfg = good(tmp_path, pem)
    cfg["kubernetes"] = {"apiPort": 0, "etcdFsync": False}
    cfg["pools"]["ci"]["scaling"].update(minIdle=6, maxConcurrent=5)
    proc = _impvm_up(write(tmp_path, cfg))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{tmp_path / 'impvm.yaml'}: pools.ci: "), lines[0]
    assert "spec.scaling.minIdle" in lines[0]
    assert "scaling.minIdle must be less than or equal to scaling.maxConcurrent" in lines[0]
    assert "impvm: stopping" not in proc.stdout  # the operator and agent never started
    etcd = tmp_path / "state" / "controlplane" / "etcd"
    assert etcd.is_dir()
    out = subprocess.run(["pgrep", "-f", str(etcd)], capture_output=True, text=True)
    assert out.stdout == "", "the control plane was left running"
