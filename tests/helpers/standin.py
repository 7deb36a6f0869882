"""A GPU-tool stand-in for nodes without GPUs: replays a recorded output and exit code.

Installed as small launchers under the tools' names (dcgmi, nvidia-smi, all_reduce_perf,
journalctl, mpirun, scontrol, uname, ibstat) in a directory on the test sshd's PATH; the launcher
passes the tool's name.
Which node it is comes from $SSH_CONNECTION (the address the client connected to); the recording
comes from $STANDIN_ROOT/scenarios/<address>/<key>.out (else .../default/<key>.out), with
<key>.rc for the exit code and <key>.sleep for how long the real tool takes (a hang is a long
sleep). Every call is logged with its argv and connection.
"""

import json
import os
import sys
import time
from pathlib import Path


def key(tool: str, args: list[str]) -> str:
    if tool == "dcgmi":
        return {"discovery": "discovery", "diag": "diag", "nvlink": "nvlink"}.get(
            args[0] if args else "", "dcgmi"
        )
    if tool == "nvidia-smi":
        if not args:
            return "banner"
        if any("driver_version" in a for a in args):
            return "gpu-facts"
        if any("compute-apps" in a for a in args):
            return "compute-apps"
        return "row-remap" if any("remapped" in a for a in args) else "recovery"
    if tool == "scontrol":
        return "listpids" if args[:1] == ["listpids"] else "scontrol"
    return {"journalctl": "journal", "all_reduce_perf": "nccl", "mpirun": "pair"}.get(tool, tool)


def main() -> int:
    root = Path(os.environ["STANDIN_ROOT"])
    connection = os.environ.get("SSH_CONNECTION", "local 0 local 0").split()
    address = connection[2]
    tool, args = sys.argv[1], sys.argv[2:]
    name = key(tool, args)
    with open(root / "calls.log", "a") as log:
        log.write(
            json.dumps({"address": address, "client_port": connection[1], "tool": tool, "argv": args}) + "\n"
        )
    for folder in (root / "scenarios" / address, root / "scenarios" / "default"):
        out = folder / f"{name}.out"
        if out.exists():
            rc = folder / f"{name}.rc"
            sleep = folder / f"{name}.sleep"
            if sleep.exists():
                time.sleep(float(sleep.read_text()))
            sys.stdout.write(out.read_text())
            return int(rc.read_text()) if rc.exists() else 0
    sys.stderr.write(f"{tool}: no recording for {name}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main())
