"""``make bench``: verification and promotion, beside plain references measured in the same run.

The checkpoint is a real one from the local training job, made large (a 213M-parameter GPT with
Adam state, about 2.6 GB in two data files) and kept in data/bench/ for later runs. Every row reads
the same files from the page cache (a warm-up read comes first), so the rows compare the work
done per byte, not the disk. Each row is the median of several runs.
"""

import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.table import Table

from infra.local_job.launch import run_local_job
from tasks.checkpoint import signing
from tasks.checkpoint.layout import iter_dir_name
from tasks.checkpoint.lock import job_lock
from tasks.checkpoint.promote import choose_target, point_to
from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.verify import verify_and_record, verify_checkpoint
from tasks.storage.digest import BLAKE3, SHA256, Hashing

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "data" / "bench"
REPEATS = 5
# Saved with the distributed optimizer, as production jobs save (the drill bench loads it on two
# ranks, each with half of the Adam state).
LARGE = "large-distopt"
LARGE_MODEL = [
    "--hidden-size",
    "1536",
    "--num-layers",
    "4",
    "--num-attention-heads",
    "12",
    "--vocab-size",
    "32768",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--use-distributed-optimizer",
]
console = Console(highlight=False)


def checkpoint(name: str, iterations: int, extra: list[str], train_iters: int | None = None) -> Path:
    """The save of ``iterations`` of a bench job saving every ``iterations`` up to ``train_iters``
    (default: that one save), trained once and kept in data/bench."""
    save = BENCH / name
    train_iters = train_iters or iterations
    if not (save / iter_dir_name(train_iters) / "metadata.json").exists():
        with console.status(f"training the {name} bench checkpoint (local job, CPU)..."):
            run_local_job(
                save, train_iters=train_iters, save_interval=iterations, timeout_seconds=1800, extra=extra
            )
    return save / iter_dir_name(iterations)


def data_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.iterdir() if p.is_file() and p.name != "manifest.json")


def median_seconds(action, repeats: int = REPEATS) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def shell(command: list[str]):
    return lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)


def main() -> int:
    large = checkpoint(LARGE, 2, LARGE_MODEL)
    small = checkpoint("small", 4, [])
    files = data_files(large)
    size = sum(os.path.getsize(f) for f in files)
    (large / "manifest.json").unlink(missing_ok=True)
    shell(["cat", *files])()  # warm the page cache
    options = VerifyOptions(job="bench")
    cores = os.cpu_count()

    rows = []

    def row(name, seconds, nbytes=size):
        rows.append(
            {
                "step": name,
                "bytes": nbytes,
                "seconds": seconds,
                "gbps": nbytes / seconds / 1e9 if nbytes else None,
            }
        )

    with console.status("measuring the references and verification..."):
        row(
            "cat > /dev/null (plain read)",
            median_seconds(
                lambda: subprocess.run(
                    f"cat {' '.join(files)} > /dev/null", shell=True, check=True, timeout=600
                )
            ),
        )
        row(
            f"b3sum --num-threads {cores}",
            median_seconds(shell(["b3sum", "--num-threads", str(cores), *files])),
        )
        row("sha256sum", median_seconds(shell(["sha256sum", *files]), repeats=1))
        first = median_seconds(lambda: _verified(large, options))
        row("ckptops verify, first time (CRC + XXH3 + structure + values)", first)
        for digest in (BLAKE3, SHA256):
            hashed = replace(options, hashing=Hashing(digest))
            row(
                f"ckptops verify, first time, verify.digest {digest}",
                median_seconds(lambda h=hashed: _verified(large, h)),
            )
        elements, scan_values = _value_scan(large)
        row("of which the value statistics alone (one core, from memory)", scan_values, elements)
        with job_lock(large.parent, 10) as held:  # the manifest, once: the reference for the next row
            verify_and_record(large, options, held)
        row("ckptops verify, against the manifest", median_seconds(lambda: _verified(large, options)))
        (large / "manifest.json").unlink()
        row(
            "ckptops verify CLI, end to end (process start included)",
            median_seconds(
                shell([str(Path(sys.executable).with_name("ckptops")), "verify", "--read-only", str(large)]),
                repeats=3,
            ),
        )

    with console.status("measuring signing..."):
        signing_seconds = _signing(large, replace(options, hashing=Hashing(BLAKE3)))
        for step, seconds in signing_seconds.items():
            rows.append({"step": step, "bytes": 0, "seconds": seconds, "gbps": None})

    with console.status("measuring promotion..."):
        promotion = {}
        for name, directory in (("small", small), ("large", large)):
            with job_lock(directory.parent, 10) as held:  # promotion reads the manifest
                verify_and_record(directory, VerifyOptions(job="bench"), held)
            save_dir = directory.parent
            nbytes = sum(os.path.getsize(f) for f in data_files(directory))

            def promote_step(save_dir=save_dir, iteration=int(directory.name[5:])):
                with job_lock(save_dir, 10):
                    target, _ = choose_target(save_dir, VerifyOptions(job="bench"), iteration)
                    point_to(save_dir, target, options.trust)

            promotion[name] = median_seconds(promote_step, repeats=20)
            rows.append(
                {
                    "step": f"promotion, {name} checkpoint (lock, decide, atomic pointer)",
                    "bytes": nbytes,
                    "seconds": promotion[name],
                    "gbps": None,
                }
            )

    table = Table(
        title=f"make bench: {size / 1e9:.2f} GB checkpoint ({len(files)} files), page cache warm, "
        f"{cores} cores, median of {REPEATS}"
    )
    for column in ("step", "GB", "seconds", "GB/s", "x plain read"):
        table.add_column(column, justify="left" if column == "step" else "right")
    plain = rows[0]["seconds"]
    for r in rows:
        table.add_row(
            r["step"],
            f"{r['bytes'] / 1e9:.3f}",
            f"{r['seconds']:.3f}",
            "" if r["gbps"] is None else f"{r['gbps']:.2f}",
            "" if r["gbps"] is None else f"{r['seconds'] / plain:.2f}",
        )
    console.print(table)
    ratio = first / plain
    console.print(
        f"full verification / plain read = {ratio:.2f} (target <= 1.5): "
        f"{'met' if ratio <= 1.5 else 'NOT met'}"
    )
    console.print(
        "signing: " + ", ".join(f"{step} {seconds * 1e3:.2f} ms" for step, seconds in signing_seconds.items())
    )
    console.print(
        f"promotion: small {promotion['small'] * 1e3:.2f} ms, large {promotion['large'] * 1e3:.2f} ms "
        f"(target: independent of size)"
    )
    (BENCH / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _value_scan(directory: Path) -> tuple[int, float]:
    """The values pass on its own: every tensor record's element bytes (read into memory first)
    fed through ``ValueScan`` in the verifier's 1 MiB pieces on one thread; (bytes, seconds)."""
    from tasks.checkpoint.dcp import build_index, load_dcp_metadata, read_record
    from tasks.checkpoint.scan import WINDOW
    from tasks.checkpoint.values import ValueScan

    index = build_index(load_dcp_metadata(directory / ".metadata"))
    pieces = []
    for fqn, item in index.tensors.items():
        for chunk in item.chunks:
            record = index.records[(fqn, tuple(chunk.offsets))]
            tensor = torch.load(io.BytesIO(read_record(directory, record)), weights_only=True)
            pieces.append((tensor.dtype, bytearray(tensor.contiguous().view(torch.uint8).numpy().tobytes())))

    def run():
        for dtype, data in pieces:
            scan = ValueScan(dtype, 0, len(data))
            view = memoryview(data)
            for start in range(0, len(data), WINDOW):
                scan.feed(view[start : start + WINDOW])

    return sum(len(d) for _, d in pieces), median_seconds(run)


def _signing(directory: Path, options: VerifyOptions) -> dict[str, float]:
    """Signing a verified manifest and checking its signature (model signing's statement, an
    ECDSA P-256 key), each the median of 20: what sign and every read of a manifest add."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    manifest = _verified(directory, options).manifest
    data = manifest.to_json().encode()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        key = ec.generate_private_key(ec.SECP256R1())
        private, public = folder / "bench.pem", folder / "bench.pub"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        private.chmod(0o600)
        public.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        settings = SimpleNamespace(key_file=private, key_secret=None, public_keys=[public], required=True)
        trust = signing.Trust.from_settings(settings)
        files = len(manifest.files)
        name = signing.name_of(manifest.job, manifest.iteration)
        signature, _ = signing.signature_for(manifest, data, trust, "bench", name)
        return {
            f"sign a manifest of {files} files (ECDSA P-256)": median_seconds(
                lambda: signing.signature_for(manifest, data, trust, "bench", name), repeats=20
            ),
            "check its signature (every read of a manifest)": median_seconds(
                lambda: signing.check_signature(signature, "bench", "bench", manifest, data, trust, name),
                repeats=20,
            ),
        }


def _verified(directory: Path, options: VerifyOptions):
    result = verify_checkpoint(directory, options)
    if not result.ok:
        raise SystemExit(f"bench checkpoint failed verification: {result.line()}")
    return result


if __name__ == "__main__":
    sys.exit(main())
