"""Running commands on a node: over SSH (paramiko), or on this host.

SSH done the careful way:
- host keys are checked against the known_hosts file the profile names; an unknown or changed
  key is refused (RejectPolicy), with a message that says which;
- the key comes from a Prefect Secret block, a key file, or the agent, and is never logged;
- a command is an argv list, quoted with shlex.join into the one string SSH carries, so a node
  name or a parameter can never become shell syntax;
- one connection per node, reused for all its checks; every connect and every command has a
  timeout, and a command past its timeout is abandoned (its channel closed) rather than waited on.
"""

import io
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from tasks.cluster.process import Output, capture
from tasks.errors import CkptopsError, UsageError

_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class Unreachable(CkptopsError):
    """The node did not answer (refused, timed out, no route, failed authentication)."""


class HostKeyRejected(CkptopsError):
    """The node's host key is unknown or changed: refused, never accepted silently."""


def check_node_name(node: str) -> str:
    if not _NODE.match(node):
        raise UsageError(f"node name {node!r}: only letters, digits, '.', '_' and '-' are allowed")
    return node


class LocalHost:
    """Commands on the host ckptops runs on (the embedded default, and pydcgm-style local checks)."""

    def __init__(self, node: str = "localhost"):
        self.node = node

    def open(self) -> "LocalHost":
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, argv: list[str], timeout: float) -> Output:
        return capture(argv, timeout)


@dataclass
class SshSettings:
    user: str
    port: int
    known_hosts: Path
    key_file: Path | None
    key_text: str | None  # from a Prefect Secret block
    use_agent: bool
    connect_timeout: float
    config_file: Path | None = None


def _address(node: str, s: SshSettings) -> tuple[str, int, str, list[str] | None]:
    """Where ``node`` is reached: the OpenSSH client config's HostName, Port, User and
    IdentityFile for it when the profile names a config (Slurm node names often differ from the
    addresses SSH needs), else the node name and the profile's port and user."""
    if s.config_file is None:
        return node, s.port, s.user, None
    try:
        found = paramiko.SSHConfig.from_path(str(s.config_file)).lookup(node)
    except OSError as e:
        raise UsageError(f"{s.config_file}: cannot read the SSH config ({e.strerror})") from None
    return (
        found.get("hostname", node),
        int(found.get("port", s.port)),
        found.get("user", s.user),
        found.get("identityfile"),
    )


def _private_key(text: str) -> paramiko.PKey:
    """A private key from text (a Secret block), whatever its type; the text is never echoed."""
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text))
        except (paramiko.SSHException, ValueError):
            continue
    raise UsageError(
        "the SSH private key from the Secret block is not an unencrypted ed25519, ECDSA or RSA key"
    )


class SshHost:
    """One SSH connection to one node, reused for every command of its checks."""

    def __init__(self, node: str, settings: SshSettings):
        self.node = check_node_name(node)
        self.settings = settings
        self.client: paramiko.SSHClient | None = None

    def __enter__(self):
        return self if self.client is not None else self.open()

    def open(self) -> "SshHost":
        """Connect (once: entering an open host's context reuses its connection)."""
        s = self.settings
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(str(s.known_hosts))
        except OSError as e:
            raise UsageError(f"{s.known_hosts}: cannot read known_hosts ({e.strerror})") from None
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        pkey = _private_key(s.key_text) if s.key_text else None
        hostname, port, user, identity = _address(self.node, s)
        try:
            client.connect(
                hostname,
                port=port,
                username=user,
                pkey=pkey,
                key_filename=str(s.key_file) if s.key_file else identity,
                allow_agent=s.use_agent,
                look_for_keys=False,
                timeout=s.connect_timeout,
                banner_timeout=s.connect_timeout,
                auth_timeout=s.connect_timeout,
            )
        except paramiko.BadHostKeyException as e:
            client.close()
            raise HostKeyRejected(
                f"{self.node}: host key changed ({e.key.get_name()} "
                f"{e.key.fingerprint}), refused; check the node before updating "
                f"{s.known_hosts}"
            ) from None
        except paramiko.SSHException as e:
            client.close()
            if "not found in known_hosts" in str(e):
                raise HostKeyRejected(
                    f"{self.node}: host key unknown, refused (not in {s.known_hosts})"
                ) from None
            raise Unreachable(f"{self.node}: SSH failed ({e})") from None
        except (TimeoutError, OSError) as e:
            client.close()
            raise Unreachable(f"{self.node}: unreachable ({getattr(e, 'strerror', None) or e})") from None
        # Keepalives: a node that dies mid-session is noticed, so no wait on it is endless.
        client.get_transport().set_keepalive(max(1, int(s.connect_timeout)))
        self.client = client
        return self

    def __exit__(self, *exc):
        if self.client is not None:
            self.client.close()
        return False

    def run(self, argv: list[str], timeout: float) -> Output:
        started = time.monotonic()
        command = shlex.join(argv)
        try:
            channel = self.client.get_transport().open_session(timeout=self.settings.connect_timeout)
            channel.settimeout(1.0)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, AttributeError) as e:
            raise Unreachable(f"{self.node}: lost the connection ({e})") from None
        stdout, stderr = bytearray(), bytearray()
        deadline = started + timeout
        try:
            while True:
                while channel.recv_ready():
                    stdout += channel.recv(1 << 16)
                while channel.recv_stderr_ready():
                    stderr += channel.recv_stderr(1 << 16)
                if (
                    channel.exit_status_ready()
                    and not channel.recv_ready()
                    and not channel.recv_stderr_ready()
                ):
                    break
                if time.monotonic() >= deadline:
                    return Output(
                        argv,
                        None,
                        stdout.decode(errors="replace"),
                        stderr.decode(errors="replace"),
                        time.monotonic() - started,
                    )
                channel.status_event.wait(0.05)
            return Output(
                argv,
                channel.recv_exit_status(),
                stdout.decode(errors="replace"),
                stderr.decode(errors="replace"),
                time.monotonic() - started,
            )
        finally:
            channel.close()
