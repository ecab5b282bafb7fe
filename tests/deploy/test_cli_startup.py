"""`pdserve` start-up: --version, flag help with defaults, and a busy port refused before Ray starts."""
from __future__ import annotations

import socket

import pytest

from deploy.cli import main
from engine.parallel.group import free_port


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("pdserve ")


def test_serve_help_names_each_flags_key_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("config server.port; default 50051", "config server.http_port; default 8000",
                  "config kv_transfer.compression; default fp8", "config pools.decode.count; default 1"):
        assert words in text


@pytest.mark.parametrize("flag,key", [("--port", "server.port"), ("--http-port", "server.http_port"),
                                      ("--metrics-port", "server.metrics_port")])
def test_busy_port_is_one_line_naming_port_and_flag(capsys, monkeypatch, flag, key):
    import deploy.running

    def never(*args, **kwargs):
        raise AssertionError("the cluster must not start when a port is taken")
    monkeypatch.setattr(deploy.running, "start_cluster", never)
    with _listening() as taken:
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--http-port": "none", "--metrics-port": str(free_port())}
        ports[flag] = str(port)
        argv = ["serve", "--model", "tiny"] + [x for f, p in ports.items() for x in (f, p)]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"port {port} on 127.0.0.1 is not free" in err[0] and flag in err[0] and key in err[0]


def test_the_client_path_loads_neither_the_server_nor_torch():
    """`pdserve generate` imports the gRPC client alone: it starts in well under a second, even when
    the server is down (an import of torch costs seconds)."""
    import subprocess
    import sys
    code = ("import sys; from deploy.cli import main; from router.client import generate; "
            "heavy = [m for m in ('torch', 'ray', 'router.server', 'engine.engine') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_generate_against_a_closed_port_fails_in_one_line(capsys):
    port = free_port()
    assert main(["generate", "--address", f"127.0.0.1:{port}", "--timeout", "5", "hi"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: UNAVAILABLE"), err


@pytest.mark.parametrize("flags, message", [
    (["--config", ""], "--config: empty path (leave --config out for the embedded default)"),
    (["--config", "{tmp}/latin1.yaml"], "{tmp}/latin1.yaml: not UTF-8 text (byte 0xe9 at offset 17)"),
    (["--address", ""], "ray.address: must not be empty (unset or none = a local Ray on 127.0.0.1; auto = join "
     "the running cluster)"),
    (["--host", " "], "server.host: must not be empty (0.0.0.0 = every interface, 127.0.0.1 = this machine only)"),
])
def test_an_unusable_config_flag_is_one_line_and_exit_2(capsys, tmp_path, flags, message):
    (tmp_path / "latin1.yaml").write_bytes(b"model: {name: caf\xe9}\n")
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err == f"config error: {message.replace('{tmp}', str(tmp_path))}\n"
