"""`ray up` without a cloud: every command deploy/cluster*.yaml runs on a node, run on this machine.

`ray up --no-config-cache` needs a cloud account or SSH hosts, so the test does what it would do,
for one fake node whose home is a temporary folder:

1. Ray's own ``prepare_config`` + ``validate_config`` accept the file.
2. ``make wheel`` builds pdserve's wheel in a copy of this checkout (its tracked files).
3. file_mounts: each local path (the wheel folder, pools.yaml, a token file, a model directory)
   is copied to its remote path under the node's home with its modes, as rsync -a does; so is
   Ray's own ``~/ray_bootstrap_config.yaml`` mount (the prepared config).
4. setup_commands (once: both files have the same), then each file's head_start_ray_commands and
   worker_start_ray_commands, run one by one as Ray's SSH runner renders them (``bash --login -c
   -i``, ``~/.bashrc`` sourced, RAY_HEAD_IP and RAY_OVERRIDE_RESOURCES exported for workers), in a
   fresh ``python3 -m venv``; each must exit 0.

What it cannot do here, and what it does instead:

- Downloads. pip runs with PIP_NO_INDEX=1 and no pip config: no network. torch and Ray are not
  downloaded again: right after the command that creates ~/pdserve/venv, the test links the
  packages of the virtualenv running the tests into it (one .pth file naming a folder of
  symlinks, pdserve and pip left out), so ``pip install torch==2.13.0`` and ``ray==2.60.0`` find
  them installed and the wheel's dependencies resolve against them; the venv's own setuptools,
  older than torch asks, is removed so the linked one counts (on a node pip upgrades it from
  PyPI). pdserve itself is really installed from the wheel. Ray's ``[default]`` extra
  (dashboard, aiohttp, ...) is dropped from its line: it is not in the test virtualenv.
- GPUs. nvidia-smi is a stub. The torch line runs as on a CPU node (the shell trace shows it asks
  PyTorch's CPU index), then as on a GPU node with pip replaced by echo: which wheel it asks for
  (PyPI's CUDA build) is checked, not installed.
- apt-get. The python3-venv branch runs only where ``ensurepip`` is missing; sudo is a stub that
  fails, so a machine without ensurepip fails this test instead of installing packages.
- Starting Ray and the server. ``ray`` is a stub that records its arguments; each recorded call
  is then parsed by Ray's own click CLI (an unknown or mistyped flag fails). ``pdserve`` is the
  console script the wheel installed, run as ``pdserve serve --help``, then replaced by a stub
  that parses the serve command line with pdserve's parser and loads its config (the token from
  the synced file, ports, model directory), and starts nothing.

Nothing listens and nothing is left running.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import yaml

util = pytest.importorskip("ray.autoscaler._private.util")
command_runner = pytest.importorskip("ray.autoscaler._private.command_runner")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TOKEN = "dry-run-token-3f6c2a9e"
SEP = "\x1f"                      # between the arguments the ray stub records
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.timeout(240)

RAY_STUB = f"""#!/bin/sh
# ray stub: record the arguments (checked by Ray's own CLI parser afterwards); start nothing.
{{ for arg in "$@"; do printf '%s{SEP}' "$arg"; done; printf '\\n'; }} >> "$HOME/ray-calls.log"
"""

PDSERVE_STUB = '''#!{python}
"""pdserve stub: parse the command line and load the config as `pdserve serve` does; start nothing."""
import json
import os
import sys

try:
    import deploy.cli
    args = deploy.cli.build_parser().parse_args(sys.argv[1:])
    cfg = deploy.cli.config_from_args(args)
    with open(os.path.expanduser("~/pdserve/token")) as f:
        token_from_file = cfg.security.token.get_secret_value() == f.read().strip()
    print(json.dumps({{"cli": deploy.cli.__file__, "command": args.command, "host": cfg.server.host,
                      "port": cfg.server.port, "http_port": cfg.server.http_port, "model": cfg.model.name,
                      "ray_address": cfg.ray.address, "token_from_file": token_from_file}}))
finally:
    open(os.path.expanduser("~/pdserve/serve.done"), "w").close()
'''


def load(name: str) -> dict:
    with open(DEPLOY / name) as f:
        return yaml.safe_load(f)


def offline_env(**extra: str) -> dict:
    """This machine's environment without pip's settings, plus: no index, no config file."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON")) and k not in ("VIRTUAL_ENV", "HISTFILE")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of this checkout's tracked files, with build/dist/ made by its `make wheel`."""
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    src = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed.decode().split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    # -o: take .venv/.installed as up to date; BIN: the virtualenv running the tests.
    # PIP_NO_BUILD_ISOLATION=0 (sic: pip reads it inverted) builds with its setuptools, offline.
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", f"BIN={Path(sys.executable).parent}", "wheel"],
                            cwd=src, env=offline_env(PIP_NO_BUILD_ISOLATION="0"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return src


@pytest.fixture(scope="module")
def linked_packages(tmp_path_factory) -> Path:
    """A folder of symlinks to the test virtualenv's packages, pdserve and pip left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder = tmp_path_factory.mktemp("linked-site-packages")
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.endswith(".pth") or name == "pip" or name.startswith(
                ("pdserve", "__editable__", "pip-", "_distutils_hack", "__pycache__")):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


class Node:
    """One fake node: a home folder, the stubs on its PATH, commands run the way Ray's SSH runner does;
    ``laptop`` is the home of the machine that runs `ray up` in ``checkout``, ``setup`` what the tests check."""

    def __init__(self, root: Path, checkout: Path):
        self.home = root / "node"
        self.laptop = root / "laptop"
        self.checkout = checkout
        self.setup: dict = {}
        self.stubs = root / "stubs"
        self.home.mkdir()
        self.stubs.mkdir()
        (self.stubs / "python3").symlink_to(os.path.realpath(sys._base_executable))
        self.stub("sudo", 'echo "sudo $*" >> "$HOME/sudo.log"; exit 1')
        self.stub("hostname", "echo '10.0.0.7 192.0.2.11 '")  # a prefill machine of cluster-local.yaml
        self.gpu(False)
        # a login shell may reset PATH (/etc/profile); Ray sources ~/.bashrc after it
        (self.home / ".bashrc").write_text(f'export PATH="{self.stubs}:$PATH"\n')

    def stub(self, name: str, body: str) -> None:
        path = self.stubs / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def gpu(self, present: bool) -> None:
        self.stub("nvidia-smi", "echo 'GPU 0: NVIDIA L40S (UUID: GPU-0)'" if present else "exit 9")

    def run(self, command: str, trace: bool = False, check: bool = True) -> subprocess.CompletedProcess:
        if trace:
            command = "set -x; " + command
        line = " ".join(command_runner._with_interactive(command))  # what ssh hands the node's login shell
        env = offline_env(HOME=str(self.home), PATH=f"{self.stubs}:/usr/local/bin:/usr/bin:/bin",
                          HISTFILE=os.devnull)
        result = subprocess.run(line, shell=True, executable="/bin/bash", cwd=self.home, env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0 or not check, (command, result.stdout, result.stderr)
        return result

    def path(self, remote: str) -> Path:
        assert remote.startswith("~/"), remote
        return self.home / remote[2:]


def sync_file_mounts(node: Node, mounts: dict) -> None:
    """What `ray up` does with file_mounts: rsync -a each local path (relative to the checkout,
    or ~ = the laptop's home) to its remote path on the node."""
    for remote, local in mounts.items():
        source = node.laptop / local[2:] if local.startswith("~/") else node.checkout / local  # absolute: kept
        assert source.exists(), f"ray up would stop here: {local} does not exist"
        target = node.path(remote)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)


def pip_lines(trace: str) -> list[str]:
    return [line for line in trace.splitlines() if line.startswith("+") and "pip install" in line]


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def parse_ray_calls(log: Path) -> list[tuple[str, dict]]:
    """Each recorded `ray` call, parsed by Ray's own CLI: (subcommand, its parameters)."""
    from ray.scripts.scripts import cli
    calls = []
    for line in log.read_text().splitlines():
        name, *args = line.split(SEP)[:-1]
        command = cli.get_command(None, name)
        assert command is not None, f"ray has no command {name!r}"
        calls.append((name, command.make_context(name, args).params))  # raises on unknown/mistyped flags
    return calls


@pytest.fixture(scope="module")
def node(checkout, linked_packages, tmp_path_factory) -> Node:
    """A fake node after `ray up`'s file_mounts and setup_commands (those of cluster.yaml; cluster-local.yaml
    has the same, test_both_files_install_alike). Its ``setup`` dict keeps what the tests check."""
    node = Node(tmp_path_factory.mktemp("ray-up"), checkout)
    (node.laptop / ".pdserve" / "models").mkdir(parents=True)
    (node.laptop / ".pdserve" / "token").write_text(TOKEN + "\n")
    (node.laptop / ".pdserve" / "token").chmod(0o600)
    config = load("cluster.yaml")
    sync_file_mounts(node, config["file_mounts"])

    venv = node.path("~/pdserve/venv")
    for command in config["setup_commands"] + config["head_setup_commands"]:
        torch_line = "torch==" in command
        result = node.run(command.replace('"ray[default]==', '"ray=='), trace=torch_line)
        if torch_line:  # the same line on a GPU node: which torch it would install, not installed
            node.setup["cpu_torch"] = pip_lines(result.stderr)
            node.gpu(True)
            echoed = command.replace("~/pdserve/venv/bin/python -m pip install", "echo pip install")
            node.setup["gpu_torch"] = pip_lines(node.run(echoed, trace=True).stderr)
            node.gpu(False)
        if "-m venv" in command:  # link torch, Ray & co. instead of downloading them (see the docstring)
            site, = venv.glob("lib/python*/site-packages")
            (site / "zz-linked-test-packages.pth").write_text(f"{linked_packages}\n")
            # the venv's own setuptools (Python <= 3.11) is older than torch asks; pip would upgrade it
            node.run(f"{venv}/bin/python -m pip uninstall -q -y setuptools")
    node.setup["serve_help"] = node.run("~/pdserve/venv/bin/pdserve serve --help").stdout
    node.setup["ray_script"] = (venv / "bin" / "ray").exists()

    (venv / "bin" / "ray").write_text(RAY_STUB)
    (venv / "bin" / "ray").chmod(0o755)
    (venv / "bin" / "pdserve").write_text(PDSERVE_STUB.format(python=venv / "bin" / "python"))
    return node


def test_setup_commands_install_the_wheel_in_a_fresh_venv(node):
    venv = node.path("~/pdserve/venv")
    assert not (node.home / "sudo.log").exists()  # python3-venv was there: no apt-get
    assert (node.path("~/pdserve/token").stat().st_mode & 0o777) == 0o600
    assert node.setup["cpu_torch"] and all(CPU_INDEX in line and "torch==2.13.0" in line
                                           for line in node.setup["cpu_torch"]), node.setup
    assert node.setup["gpu_torch"] and all("torch==2.13.0" in line and "--index-url" not in line
                                           for line in node.setup["gpu_torch"]), node.setup
    assert "--http-port" in node.setup["serve_help"]  # the console script the wheel installed
    wheel_record, = venv.glob("lib/python*/site-packages/pdserve-*.dist-info/RECORD")
    assert "deploy/cli.py" in wheel_record.read_text() and "proto/" in wheel_record.read_text()
    assert not node.setup["ray_script"]  # Ray was linked, not installed: its script is the test's stub


def fresh_start(node: Node, config: dict, models: list[str], tmp_path: Path) -> None:
    """Forget the last start; the laptop holds these model directories; sync file_mounts again."""
    for state in ("ray-calls.log", "pdserve/serve.log", "pdserve/serve.pid", "pdserve/serve.done"):
        (node.home / state).unlink(missing_ok=True)
    for home in (node.home / "pdserve", node.laptop / ".pdserve"):
        shutil.rmtree(home / "models", ignore_errors=True)
        (home / "models").mkdir()
    for model in models:  # only what `pdserve serve` checks before it loads weights: config.json
        (node.laptop / ".pdserve" / "models" / model).mkdir()
        (node.laptop / ".pdserve" / "models" / model / "config.json").write_text('{"model_type": "llama"}')
    prepared = util.prepare_config(copy.deepcopy(config))
    util.validate_config(prepared)  # Ray's own checks, as `ray up` runs them
    (tmp_path / "bootstrap.json").write_text(json.dumps(prepared))
    mounts = dict(config["file_mounts"], **{"~/ray_bootstrap_config.yaml": str(tmp_path / "bootstrap.json")})
    sync_file_mounts(node, mounts)


@pytest.mark.parametrize("name, models", [("cluster.yaml", ["Tiny-Llama-3"]), ("cluster-local.yaml", [])],
                         ids=["cloud-with-a-model", "onprem-preset"])
def test_start_commands_start_ray_and_serve(node, name, models, tmp_path):
    config = load(name)
    fresh_start(node, config, models, tmp_path)

    for command in config["head_start_ray_commands"]:
        node.run(command)
    wait_for(node.path("~/pdserve/serve.done"))
    log = node.path("~/pdserve/serve.log").read_text()
    served = json.loads(log.strip().splitlines()[-1])
    assert served == {"cli": served["cli"], "command": "serve", "host": "0.0.0.0", "port": 50051, "http_port": 8000,
                      "model": str(node.path(f"~/pdserve/models/{models[0]}")) if models else "small",
                      "ray_address": "auto", "token_from_file": True}, log
    assert served["cli"].startswith(str(node.path("~/pdserve/venv")))  # pdserve from the wheel, in the venv

    environment = {}
    if config["provider"]["type"] != "local":  # the launcher hands each node type's resources to ray start
        environment["RAY_OVERRIDE_RESOURCES"] = {"prefill_node": 4}
    for command in util.with_head_node_ip(config["worker_start_ray_commands"], "127.0.0.1"):
        node.run(command_runner._with_environment_variables(command, environment))

    calls = parse_ray_calls(node.home / "ray-calls.log")
    assert [call for call, _ in calls] == ["stop", "start", "stop", "start"]
    head, worker = calls[1][1], calls[3][1]
    assert head["head"] and head["port"] == 6379 and head["dashboard_host"] == "127.0.0.1"
    assert node.path(head["autoscaling_config"]).is_file()
    assert not worker["head"] and worker["address"] == "127.0.0.1:6379"
    if config["provider"]["type"] == "local":
        assert json.loads(worker["resources"]) == {"prefill_node": 4}


def test_two_model_directories_stop_the_start(node, tmp_path):
    config = load("cluster.yaml")
    fresh_start(node, config, ["model-a", "model-b"], tmp_path)
    result = node.run(config["head_start_ray_commands"][-1], check=False)
    assert result.returncode == 1 and "one model directory at most in ~/pdserve/models" in result.stderr
    assert not node.path("~/pdserve/serve.pid").exists()


def test_a_second_ray_up_stops_the_running_server_first(node):
    """head_start_ray_commands[0]: SIGTERM to the pid in ~/pdserve/serve.pid, then wait until it is gone."""
    server = subprocess.Popen(["sleep", "60"])  # stands in for the server a first `ray up` started
    # Reaped as soon as it exits, as a daemon's parent would: an unreaped child stays a zombie, which
    # `kill -0` still finds, so the command would wait its full 60 s.
    reaper = threading.Thread(target=server.wait, daemon=True)
    reaper.start()
    try:
        node.path("~/pdserve/serve.pid").write_text(f"{server.pid}\n")
        started = time.monotonic()
        node.run(load("cluster.yaml")["head_start_ray_commands"][0])
        reaper.join(timeout=5)
        assert server.returncode == -15  # SIGTERM
        assert time.monotonic() - started < 30  # it returned when the server had gone, not after its 60 s limit
        assert not node.path("~/pdserve/serve.pid").exists()
    finally:
        server.kill()
        reaper.join()


def test_both_files_install_alike():
    """One install recipe: the on-prem file runs the cloud file's setup and serve commands."""
    cloud, local = load("cluster.yaml"), load("cluster-local.yaml")
    assert cloud["setup_commands"] == local["setup_commands"]
    assert cloud["file_mounts"] == local["file_mounts"]
    assert cloud["head_start_ray_commands"][-1] == local["head_start_ray_commands"][-1]


def test_pins_match_this_checkout():
    """The nodes get the Ray of the machine that runs `ray up`, and the Makefile's torch."""
    import ray
    setup = " ".join(load("cluster.yaml")["setup_commands"])
    assert f'"ray[default]=={ray.__version__}"' in setup
    makefile_torch = set(re.findall(r"torch==[\w.]+", (REPO / "Makefile").read_text()))
    assert makefile_torch and makefile_torch == set(re.findall(r"torch==[\w.]+", setup))


def test_nodes_install_the_nixl_extra():
    """Every node can serve ``kv_transfer.transport: nixl``: the wheel goes in with the extra that carries NIXL
    (the setup run above resolves it, offline, against the linked packages)."""
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("nixl") for requirement in extras["nixl"])
    assert '"$WHEEL[nixl]"' in " ".join(load("cluster.yaml")["setup_commands"])


def test_every_cloud_node_type_pins_one_image():
    node_types = load("cluster.yaml")["available_node_types"].values()
    images = {spec["node_config"].get("ImageId") for spec in node_types}
    assert len(images) == 1 and re.fullmatch(r"ami-[0-9a-f]{8,17}", images.pop() or "")


def test_no_secret_in_the_files():
    """The token travels as a synced file; the YAML only names its path."""
    for name in ("cluster.yaml", "cluster-local.yaml"):
        text = (DEPLOY / name).read_text()
        assert load(name)["file_mounts"]["~/pdserve/token"] == "~/.pdserve/token"
        assert not re.search(r"\b[0-9a-f]{32,}\b", text)
        assert "PDSERVE_TOKEN=\"$(cat ~/pdserve/token)\"" in text
