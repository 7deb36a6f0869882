"""The archive's own log beside the job (``.ckptops-history/archive.jsonl``: one line per committed
copy, the archive status its manifest holds) and what ``ckptops status`` says from it. The archive
itself is the authority on what is committed; the log is what was done and how it was checked."""

from pathlib import Path

from tasks.checkpoint import layout
from tasks.storage.local import append_jsonl, own_folder, read_jsonl

COPIES = "archive.jsonl"


def copies_path(save_dir: Path) -> Path:
    return Path(save_dir) / layout.HISTORY / COPIES


def copies(save_dir: Path) -> list[dict]:
    """Every committed copy of the job's checkpoints, oldest first: iteration, where, when, how
    it was checked, from where (the archive's own log; the archive itself is the authority)."""
    return read_jsonl(copies_path(save_dir))


def log_copy(save_dir: Path, iteration: int, status: dict) -> None:
    append_jsonl(own_folder(save_dir, layout.HISTORY) / COPIES, {"iteration": iteration, **status})


def status_lines(save_dir: Path) -> list[str]:
    """What ``ckptops status`` says about the archive: the newest copy in the archive's log, how it
    was checked, its encryption and Object Lock as the store reported them at the commit."""
    logged = copies(save_dir)
    if not logged:
        return []
    last = logged[-1]
    lines = [
        f"archive: {len(logged)} {'copy' if len(logged) == 1 else 'copies'} logged; "
        f"newest: iteration {last.get('iteration')} at "
        f"{last.get('url')}, committed {last.get('committed_at')}"
    ]
    check = "CRC64NVME by the store" if last.get("crc64nvme") else "read back"
    if last.get("crc64nvme"):
        check += ", read back too" if last.get("read_back") else ", not read back (not in the sample)"
    lines.append(f"archive check: {check}")
    encryption = last.get("encryption")
    if encryption:
        key = f" key {encryption['kms_key_id']}" if encryption.get("kms_key_id") else ""
        bucket_key = ", bucket key" if encryption.get("bucket_key") else ""
        lines.append(f"archive encryption: {encryption.get('sse')}{key}{bucket_key}")
    lock = last.get("object_lock")
    if lock:
        lines.append(f"archive object lock: {lock['mode']} until {lock['retain_until']}")
    return lines
