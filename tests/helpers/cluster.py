"""A fake GPU cluster for tests and the bench: real OpenSSH servers listening on 127.0.0.x
addresses (one node each), with GPU-tool stand-ins that replay recorded outputs."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

DATA = Path(__file__).resolve().parent.parent / "data" / "health"
STANDIN = Path(__file__).resolve().parent / "standin.py"
TOOLS = ("dcgmi", "nvidia-smi", "all_reduce_perf", "journalctl", "mpirun", "scontrol", "uname", "ibstat")
SSHD = "/usr/sbin/sshd"

# What a healthy node says (recordings; sources in tests/data/health/SOURCES.md).
HEALTHY = {
    "discovery": "dcgm3_discovery_l_8xH800_llm_action.txt",
    "compute-apps": "nvidia_smi_compute_apps_header_only.csv",
    "recovery": "synthetic_recovery_none.csv",
    "row-remap": "synthetic_row_remap_ok.csv",
    "journal": "synthetic_journal_clean.txt",
    "nvlink": "dcgm3_nvlink_s_8xH800_llm_action.txt",
    "diag": "synthetic_dcgm4_diag_r1_pass.json",
    "nccl": "nccl_allreduce_2node_dgxh100_g8_oldformat.txt",
    "pair": "nccl_allreduce_2node_16xH100_ib400_issue309.txt",
    # The conformance check's facts.
    "gpu-facts": "nvidia_smi_query_gpu_8xH100_driver_power_clocks.csv",
    "banner": "nvidia_smi_banner_8xH100_565.txt",
    "uname": "uname_r_el9_h100.txt",
    "ibstat": "ibstat_8xMT4129_ndr400_bond_gpud_all_active.txt",
}


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return path.with_suffix(".pub").read_text().split()[:2]


class FakeCluster:
    def __init__(self, root: Path, addresses: list[str], port: int):
        self.root, self.addresses, self.port = Path(root), addresses, port
        self.processes: list[subprocess.Popen] = []

    def start(self, timeout: float = 30.0) -> "FakeCluster":
        root = self.root
        (root / "bin").mkdir(parents=True, exist_ok=True)
        # The login's HOME points at an empty folder: bash run by sshd would otherwise source the
        # real user's ~/.bashrc for every command, a cost no real node adds to a check.
        (root / "home").mkdir(exist_ok=True)
        for tool in TOOLS:
            path = root / "bin" / tool
            path.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {STANDIN} {tool} "$@"\n')
            path.chmod(0o755)
        for key_name, sample in HEALTHY.items():
            self.record("default", key_name, (DATA / sample).read_text())
        self.host_key = _keygen(root / "host_key")
        self.client_key = root / "client_key"
        client_pub = _keygen(self.client_key)
        (root / "authorized_keys").write_text(" ".join(client_pub) + "\n")
        os.makedirs("/run/sshd", exist_ok=True)
        # sshd listens on at most 16 sockets (MAX_LISTEN_SOCKS): one server per 16 nodes.
        groups = [self.addresses[i : i + 16] for i in range(0, len(self.addresses), 16)]
        self.processes = [self._start_sshd(n, group) for n, group in enumerate(groups)]
        deadline = time.monotonic() + timeout
        for n, group in enumerate(groups):
            while not self._accepting(group[-1]):
                if self.processes[n].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start: {(root / f'sshd-{n}.log').read_text()[-500:]}")
                time.sleep(0.05)
        return self

    def _start_sshd(self, n: int, addresses: list[str]) -> subprocess.Popen:
        root = self.root
        listen = "\n".join(f"ListenAddress {a}:{self.port}" for a in addresses)
        config = root / f"sshd_config-{n}"
        config.write_text(f"""{listen}
HostKey {root / "host_key"}
PidFile {root / f"sshd-{n}.pid"}
AuthorizedKeysFile {root / "authorized_keys"}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxStartups 512
MaxSessions 64
SetEnv PATH={root / "bin"}:/usr/bin:/bin STANDIN_ROOT={root} HOME={root / "home"}
LogLevel VERBOSE
""")
        with open(root / f"sshd-{n}.log", "wb") as log:
            return subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def _accepting(self, address: str) -> bool:
        try:
            socket.create_connection((address, self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def record(self, node: str, key: str, output: str, rc: int = 0, sleep: float | None = None) -> None:
        folder = self.root / "scenarios" / node
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.out").write_text(output)
        (folder / f"{key}.rc").write_text(str(rc))
        if sleep is not None:
            (folder / f"{key}.sleep").write_text(str(sleep))

    def record_sample(self, node: str, key: str, sample: str, rc: int = 0) -> None:
        self.record(node, key, (DATA / sample).read_text(), rc)

    def known_hosts(
        self, path: Path, wrong_key_for: tuple[str, ...] = (), missing: tuple[str, ...] = ()
    ) -> Path:
        """known_hosts for the nodes; some with another key (a changed host), some absent."""
        other_path = self.root / "other_host_key"
        other = (
            (
                other_path.with_suffix(".pub").read_text().split()[:2]
                if other_path.exists()
                else _keygen(other_path)
            )
            if wrong_key_for
            else None
        )
        lines = []
        for address in self.addresses:
            if address in missing:
                continue
            key = other if address in wrong_key_for else self.host_key
            lines.append(f"[{address}]:{self.port} {' '.join(key)}")
        path.write_text("\n".join(lines) + "\n")
        return path

    def connections(self, address: str) -> int:
        """TCP connections the sshd accepted on ``address`` (sshd logs each at VERBOSE)."""
        needle = f" on {address} port {self.port} "
        return sum(log.read_text(errors="replace").count(needle) for log in self.root.glob("sshd-*.log"))

    def calls(self) -> list[dict]:
        import json

        log = self.root / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def stop(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, signal.SIGKILL)
        # Sessions (a stand-in still "hanging") live in their own groups: end them too, this
        # cluster's only. Every cluster's stand-ins run the same script: matched by it alone, a
        # cluster stopping on one xdist worker killed a check in flight on another (whose node
        # then answered with a signal instead of its recorded output).
        for stand_in in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if str(STANDIN) in (stand_in.info["cmdline"] or []) and (
                    stand_in.environ().get("STANDIN_ROOT") == str(self.root)
                ):
                    stand_in.kill()
        shutil.rmtree(self.root / "scenarios", ignore_errors=True)


def r3_pass_document() -> str:
    """A DCGM 4 run-level-3 diagnostic (JSON) where every test passes on 8 GPUs: what the spare
    admission set needs to see."""
    import json

    tests = [
        {
            "name": name,
            "results": [{"entity_id": i, "status": "Pass"} for i in range(8)],
            "test_summary": {"status": "Pass"},
        }
        for name in (
            "software",
            "pcie",
            "memory",
            "diagnostic",
            "targeted_stress",
            "targeted_power",
            "memory_bandwidth",
        )
    ]
    return json.dumps({"DCGM Diagnostic": {"test_categories": [{"category": "all", "tests": tests}]}})


def ssh_config(path: Path, cluster: FakeCluster, names: dict[str, str]) -> Path:
    """An OpenSSH client config mapping node names (Slurm's) to the fake nodes' addresses."""
    path.write_text("".join(f"Host {name}\n    HostName {address}\n" for name, address in names.items()))
    return path


def profile_yaml(cluster: FakeCluster, nodes: list[str], known_hosts: Path, raw_dir: Path, **extra) -> str:
    """A health profile for the fake cluster (level 1, small timeouts)."""
    import getpass

    settings = {
        "nodes": nodes,
        "transport": "ssh",
        "ssh": {
            "user": getpass.getuser(),
            "port": cluster.port,
            "known_hosts": str(known_hosts),
            "key_file": str(cluster.client_key),
            "use_agent": False,
            "connect_timeout_seconds": 5,
        },
        "gpus_per_node": 8,
        "level": 1,
        "concurrency": 16,
        "command_timeout_seconds": 10,
        "diag_timeout_seconds": {1: 3, 3: 10},
        "raw_dir": str(raw_dir),
        "nccl": {"pass_gbps": 431, "warn_gbps": 410, "timeout_seconds": 10},
        # 8 x 400G InfiniBand: the recorded 2-node runs are judged by this gate (several nodes).
        "pairs": {"pass_gbps": 360, "warn_gbps": 350},
        "drain": {"enabled": True, "max_per_run": 2, "max_per_hour": 4, "page_when_same_check_fails": 3},
    }
    for key, value in extra.items():
        settings[key] = {**settings[key], **value} if isinstance(settings.get(key), dict) else value
    import json

    return json.dumps({"job": {"name": "health-test", "save_dir": str(raw_dir)}, "health": settings})
