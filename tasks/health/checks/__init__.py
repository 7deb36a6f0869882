"""One file per check. Each exposes ``NAME`` and ``run(ctx) -> HealthCheck``; ``Context`` runs
the commands (on the node's one connection), keeps every raw output, and bounds every command."""

import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.cluster.process import Output
from tasks.health.verdict import Evidence, HealthCheck, result
from tasks.outcome import Verdict
from tasks.storage.local import atomic_write, own_folder


@dataclass
class Context:
    node: str
    host: object  # LocalHost or SshHost
    settings: object  # the profile's health section
    level: int
    raw_dir: Path
    since: float | None = None  # the node's last clean XID check (where the kernel log is read from)
    kept: list[str] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)  # what the conformance check read

    def command(self, check: str, argv: list[str], timeout: float | None = None) -> Output:
        output = self.host.run(argv, timeout or self.settings.command_timeout_seconds)
        self.kept.append(self._keep(check, output))
        return output

    def keep(self, check: str, what: str, text: str) -> str:
        """Keep a raw result that did not come from a command (the DCGM bindings' response)."""
        return self._keep(check, Output([what], 0, text, "", 0.0))

    def _keep(self, check: str, output: Output) -> str:
        """One raw file per node, check and time: exactly what the tool said, and how it ended.
        Its name is predictable, so it is written by ``atomic_write``: a link planted there is
        replaced, never written through."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        path = own_folder(self.raw_dir, self.node) / f"{stamp}-{check}-{len(self.kept)}.txt"
        exit_text = "timed out" if output.timed_out else str(output.exit_code)
        atomic_write(
            path,
            (
                f"$ {' '.join(output.argv)}\n# exit: {exit_text}, {output.seconds:.2f}s\n"
                f"# stdout\n{output.stdout}\n# stderr\n{output.stderr}\n"
            ).encode(),
        )
        return str(path)


def not_run(check: str, output: Output) -> HealthCheck | None:
    """The common ways a command fails before there is anything to judge."""
    if output.timed_out:
        return result(
            check, Verdict.TOOL_ERROR, Evidence(f"{output.argv[0]} timed out after {output.seconds:.0f}s")
        )
    if output.exit_code == 127:
        return result(
            check, Verdict.TOOL_ERROR, Evidence(f"{output.argv[0]}: command not found"), exit_code=127
        )
    return None


def failed_to_run(check: str, output: Output) -> HealthCheck | None:
    """None if the command ran and exited 0; else the TOOL_ERROR the check returns."""
    failed = not_run(check, output)
    if failed is None and output.exit_code != 0:
        failed = result(
            check,
            Verdict.TOOL_ERROR,
            Evidence(f"{output.argv[0]} exited {output.exit_code}"),
            exit_code=output.exit_code,
        )
    return failed


def csv_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]
