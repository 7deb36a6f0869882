"""``make bench`` (second part): restore-drill phases beside a plain copy and a plain read.

Uses the large bench checkpoint (made by bench_verify), saved with the distributed optimizer as
production jobs save, and drills it on two ranks (DP 2), so each rank loads half of the Adam
state. Archives it to a local-directory archive once, then runs one drill from each source.
References measured in the same run, same bytes: ``cp -r`` of the checkpoint directory into
scratch, and ``cat > /dev/null`` of its files. Target: copy + verify + load within 2x of plain
copy + plain read.

Where the load's time goes: the loader loads a second time into the same process, into memory
its first load already touched. The difference between the two is what first-touch page faults
and fresh allocations cost the first load (they vary several-fold between runs on these VMs).
"""

import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from infra.local_job.launch import write_job_script
from tasks.archive.copy import archive_checkpoint
from tasks.checkpoint.promote import promote
from tasks.checkpoint.state import VerifyOptions
from tasks.cluster import process
from tasks.job.step_records import load_steps
from tasks.profile import load_profile
from tasks.relaunch.printed import fit_printed, read_printed_args
from tasks.restore.continuation import changes, fingerprint
from tasks.restore.drill import run_drill
from tasks.restore.history import drilled_layouts
from tasks.restore.launch import drill_layout, loader_args, loader_env, torchrun
from tasks.restore.report import read_report
from tests.bench.bench_verify import BENCH, LARGE, LARGE_MODEL, checkpoint, data_files, median_seconds

console = Console(highlight=False)
REPEATS = 3


# The continuation's job: the bench model with plain Adam (Megatron-LM's own load of a
# distributed-optimizer checkpoint asserts on CPU without Transformer Engine or Apex), saved at 2
# and 4, so that a continuation trains 3-4 from the save of 2 against the run's own log.
CONTINUED = "large-adam"
CONTINUED_MODEL = [a for a in LARGE_MODEL if a != "--use-distributed-optimizer"]


def bench_profile(name: str = LARGE, script: Path | None = None) -> Path:
    save = BENCH / name
    continuation = (
        f", continuation: {{script: '{script}', reference: '{save.parent / f'{save.name}-train.log'}'}}"
        if script
        else ""
    )
    path = BENCH / f"bench-profile-{name}.yaml"
    path.write_text(
        f"job: {{name: bench-{name}, save_dir: {name}, layout: {{data_parallel: 2}}}}\n"
        "verify: {lock_timeout_seconds: 60}\n"
        "archive: {url: archive, keep: 2}\n"
        "drill: {scratch_dir: scratch, budget_seconds: {shared: 3600, archive: 3600},"
        " load_timeout_seconds: 1800,"
        f" estimate_for_bytes: 7000000000000, layout: {{data_parallel: 2}}{continuation}}}\n"
    )
    return path


def continuation_bench():
    """One continuation drill of the plain-Adam bench job from the shared store: its report, and
    what the original run's log says iterations 3-4 took."""
    checkpoint(CONTINUED, 2, CONTINUED_MODEL, train_iters=4)
    save = BENCH / CONTINUED
    script = write_job_script(
        BENCH / "continued-job.sh",
        save,
        BENCH / "continued-records.jsonl",
        train_iters=4,
        save_interval=2,
        extra=CONTINUED_MODEL,
    )
    profile = load_profile(bench_profile(CONTINUED, script))
    promote(profile.job.save_dir, VerifyOptions.from_profile(profile), 60, requested=2)
    report = run_drill(profile, "shared", continue_steps=2)
    if not report.ok:
        raise SystemExit(f"bench continuation failed: {report.line()}")
    steps = load_steps(profile.drill.continuation.reference)
    return report, float(steps.step_seconds[(steps.iteration >= 3) & (steps.iteration <= 4)].sum())


def main() -> int:
    directory = checkpoint(LARGE, 2, LARGE_MODEL)
    profile = load_profile(bench_profile())
    files = data_files(directory)
    size = sum(Path(f).stat().st_size for f in files if not f.endswith("manifest.json"))
    with console.status("promoting and archiving the bench checkpoint..."):
        promote(profile.job.save_dir, VerifyOptions.from_profile(profile), 60)
        archive_checkpoint(profile.job.save_dir, profile)
    scratch = Path(profile.drill.scratch_dir) / "plain-copy"

    def plain_copy():
        shutil.rmtree(scratch, ignore_errors=True)
        subprocess.run(["cp", "-r", str(directory), str(scratch)], check=True, timeout=600)

    with console.status("measuring plain copy and plain read..."):
        scratch.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"cat {' '.join(files)} > /dev/null", shell=True, check=True)  # warm the cache
        copy_s = median_seconds(plain_copy, REPEATS)
        shutil.rmtree(scratch, ignore_errors=True)
        read_s = median_seconds(
            lambda: subprocess.run(f"cat {' '.join(files)} > /dev/null", shell=True, check=True), REPEATS
        )

    with console.status("loading twice into the same processes (where the load's time goes)..."):
        repeated = load_twice(profile, directory)
    reports = {}
    for source in ("shared", "archive"):
        drills = []
        for n in range(REPEATS):
            with console.status(
                f"restore drill {n + 1} of {REPEATS} from {source} (copy, verify, load on 2 ranks)..."
            ):
                drills.append(run_drill(profile, source))
            if not drills[-1].ok:
                raise SystemExit(f"bench drill failed: {drills[-1].line()}")
        # The drill with the median restore window, whole: its phases add up to its window.
        reports[source] = sorted(drills, key=lambda r: r.window_seconds)[len(drills) // 2]
    with console.status("a continuation drill (plain Adam) from shared: restore, then train 3-4..."):
        continued, original = continuation_bench()
        guard_fingerprint, guard_watch = continuation_guards(continued)

    table = Table(
        title=f"make bench: restore drill of a {size / 1e9:.2f} GB checkpoint, page cache warm "
        f"(the median of {REPEATS} drills per source)"
    )
    for column in ("step", "GB", "seconds", "GB/s"):
        table.add_column(column, justify="left" if column == "step" else "right")
    table.add_row("plain copy (cp -r)", f"{size / 1e9:.3f}", f"{copy_s:.3f}", f"{size / copy_s / 1e9:.2f}")
    table.add_row(
        "plain read (cat > /dev/null)", f"{size / 1e9:.3f}", f"{read_s:.3f}", f"{size / read_s / 1e9:.2f}"
    )
    for source, report in reports.items():
        for phase in report.phases:
            table.add_row(
                f"drill from {source}: {phase.name}",
                f"{phase.bytes / 1e9:.3f}",
                f"{phase.seconds:.3f}",
                f"{phase.gbps:.2f}",
            )
        table.add_row(f"drill from {source}: restore window", "", f"{report.window_seconds:.3f}", "")
    first, again = repeated.load_seconds, repeated.repeat_load_seconds[0]
    table.add_row(
        "load, first into fresh processes", f"{size / 1e9:.3f}", f"{first:.3f}", f"{size / first / 1e9:.2f}"
    )
    table.add_row(
        "load, again into the same processes",
        f"{size / 1e9:.3f}",
        f"{again:.3f}",
        f"{size / again / 1e9:.2f}",
    )
    table.add_row(
        "continuation drill (plain Adam): restore window",
        f"{continued.phases[0].bytes / 1e9:.3f}",
        f"{continued.window_seconds:.3f}",
        "",
    )
    table.add_row(
        "continuation drill: training 3-4 (start, load, 2 iterations)",
        "",
        f"{continued.continuation_seconds:.3f}",
        "",
    )
    table.add_row("the original run's iterations 3-4 (its own log)", "", f"{original:.3f}", "")
    table.add_row(
        "continuation: save directory fingerprinted, before and after", "", f"{guard_fingerprint:.3f}", ""
    )
    table.add_row("continuation: printed arguments read and compared", "", f"{guard_watch:.3f}", "")
    seed_fingerprint = seed_sized_fingerprint()
    table.add_row(
        f"continuation: fingerprint of {SEED_FILES:,} files x 3 checkpoints, before and after",
        "",
        f"{seed_fingerprint:.3f}",
        "",
    )
    console.print(table)
    total = continued.window_seconds + continued.continuation_seconds
    added = guard_fingerprint + guard_watch
    console.print(
        f"continuation guards: {added:.3f} s of the drill's {total:.2f} s (fingerprint "
        f"{guard_fingerprint:.3f} s, argument watch {guard_watch:.3f} s; target < 1 s): "
        f"{'met' if added < 1 else 'NOT met'}"
    )
    console.print(
        f"continuation of 2 iterations: {continued.continuation_seconds:.2f} s, "
        f"{continued.continuation_seconds / continued.window_seconds:.2f}x the restore window; "
        f"the original run spent {original:.2f} s on those iterations "
        f"({'certified' if continued.certified else 'not certified'})"
    )
    reference = copy_s + read_s
    for source, report in reports.items():
        ratio = report.window_seconds / reference
        console.print(
            f"{source}: (copy + verify + load) / (plain copy + plain read) = {ratio:.2f} "
            f"(target <= 2): {'met' if ratio <= 2 else 'NOT met'}"
        )
    console.print(
        f"first-touch allocation and page faults: {first - again:.2f} s of the first load's {first:.2f} s "
        f"({(first - again) / first:.0%})"
    )
    return 0


def continuation_guards(report) -> tuple[float, float]:
    """What the continuation's guards add to its drill, each the median of REPEATS: the save
    directory's fingerprint taken twice and compared, and the arguments block read from the
    continuation's kept log and compared with the checkpoint's saved args."""
    profile = load_profile(bench_profile(CONTINUED))
    save, log = profile.job.save_dir, Path(report.continuation_log)
    ours = {log}
    fingerprinted = median_seconds(lambda: changes(fingerprint(save, ours), fingerprint(save, ours)), REPEATS)
    watched = median_seconds(
        lambda: fit_printed(read_printed_args(log), save / "iter_0000002", drilled_layouts(save)), REPEATS
    )
    return fingerprinted, watched


# The seed's job writes one data file per rank (TP8 x PP8 x DP80 = 5,120) into each checkpoint,
# and keeps three.
SEED_FILES = 5120


def seed_sized_fingerprint() -> float:
    """The fingerprint taken twice and compared over a save directory of the seed's entry count
    (three checkpoints of 5,120 empty data files each): its cost is per entry, not per byte."""
    save = BENCH / "seed-sized-save"
    shutil.rmtree(save, ignore_errors=True)
    for iteration in (20, 24, 28):
        folder = save / f"iter_{iteration:07d}"
        folder.mkdir(parents=True)
        for name in [f"__{rank}_0.distcp" for rank in range(SEED_FILES)] + [".metadata", "metadata.json"]:
            (folder / name).touch()
    (save / "latest_checkpointed_iteration.txt").write_text("28")
    try:
        return median_seconds(lambda: changes(fingerprint(save, set()), fingerprint(save, set())), REPEATS)
    finally:
        shutil.rmtree(save)


def load_twice(profile, directory: Path):
    """The loader on the drill's layout, loading the checkpoint twice in one run."""
    layout = drill_layout(profile.drill, {"tensor_parallel": 1, "pipeline_parallel": 1})
    report = BENCH / "load-twice.json"
    arguments = loader_args(profile.drill, directory, report, layout) + ["--repeat", "2"]
    process.run(
        torchrun(layout, arguments), BENCH / "load-twice.log", 1800, loader_env(), "the twice-loading bench"
    )
    return read_report(report)


if __name__ == "__main__":
    sys.exit(main())
