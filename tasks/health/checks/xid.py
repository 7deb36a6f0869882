"""Critical XIDs in the kernel log (``journalctl -k``, the current boot) since the node's last
clean XID check: an XID found but not yet acted on is found again until the node reboots.

Critical, after Azure's HPC health checks: 48 56 57 58 62 63 64 65 68 69 73 74 79 80 81 92 119
120 (the profile may change the list). 13 31 43 45 are usually the application's fault and are
only noted; any other XID is a warning.
"""

import re
import time

from tasks.health.checks import Context, failed_to_run
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict, worst

NAME = CheckName.XID
APPLICATION_XIDS = {13, 31, 43, 45}
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


def run(ctx: Context) -> HealthCheck:
    since = ctx.since if ctx.since is not None else time.time() - 24 * 3600
    output = ctx.command(
        NAME, ["journalctl", "-k", "--no-pager", "-o", "short-iso", f"--since=@{int(since)}"]
    )
    failed = failed_to_run(NAME, output)
    if failed:
        return failed
    critical = set(ctx.settings.critical_xids)
    findings = []
    for line in output.stdout.splitlines():
        match = _XID.search(line)
        if not match:
            continue
        xid, bus = int(match[2]), match[1]
        if xid in critical:
            findings.append(
                (
                    Verdict.FAIL_HARDWARE,
                    Evidence(f"critical XID {xid} on GPU {bus}: {line.strip()[:160]}", error_id=xid),
                )
            )
        elif xid not in APPLICATION_XIDS:
            findings.append((Verdict.WARN, Evidence(f"XID {xid} on GPU {bus}", error_id=xid)))
    if not findings:
        return result(
            NAME,
            Verdict.PASS,
            Evidence("no critical XID in the kernel log since the last check"),
            exit_code=0,
        )
    findings.sort(key=lambda f: -f[0].rank)
    return result(NAME, worst(v for v, _ in findings), *[e for _, e in findings], exit_code=0)
