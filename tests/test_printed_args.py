"""The job's arguments as Megatron-LM printed them (tasks/relaunch/printed.py): read from the
real logs of the local job (Megatron-LM's own loop), as they come and as other launchers mangle
them, and compared with the args the checkpoint saved."""

import re
from pathlib import Path

from tasks.relaunch.fit import Kind
from tasks.relaunch.launch import watch_printed
from tasks.relaunch.printed import fit_printed, read_printed_args, typed
from tests.conftest import iter_dir

OPENING = "------------------------ arguments ------------------------"
CLOSING = "-------------------- end of arguments ---------------------"


def _log(trained: Path) -> Path:
    return trained.parent / f"{trained.name}-train.log"


def test_the_real_block_is_read_whole_with_every_argument_megatron_lm_holds(trained):
    log = _log(trained)
    printed = read_printed_args(log)
    lines = log.read_text().splitlines()
    assert lines[printed.line - 1] == OPENING
    # Rank 0 prints one argument a line, indented by two spaces, sorted. Another rank's output lands
    # among them: a warning on a line of its own, or after a value with its newline on a line of
    # its own (both seen in this log from run to run).
    between = [line for line in lines[printed.line : lines.index(CLOSING)] if line.startswith("  ")]
    assert len(printed.values) == len(between) > 300
    assert printed.get("save") == str(trained) and printed.get("load") == "None"
    assert (printed.typed("num_layers"), printed.typed("global_batch_size")) == (2, 8)
    assert printed.typed("verify_integrity") is True and printed.get("no_such_argument") is None


def test_the_printed_arguments_of_the_run_fit_its_own_checkpoint(trained, tmp_path):
    fits = fit_printed(read_printed_args(_log(trained)), iter_dir(trained, 24), {})
    assert fits.refused == [] and fits.needs_approval == [] and fits.of(Kind.WARN) == []
    assert fits.compared > 60, fits.summary()  # every argument of the rules is printed


def test_srun_labels_timestamps_other_ranks_lines_and_bad_bytes_are_read_through(trained, tmp_path):
    real = _log(trained).read_text().splitlines()
    mangled = tmp_path / "job.log"
    with open(mangled, "wb") as out:
        out.write(b"\xff\xfe torn bytes from a previous writer\n")
        for number, line in enumerate(real):
            stamp = f"[2026-12-04 10:00:{number % 60:02d}.000001] " if number % 3 == 0 else ""
            out.write(f"{stamp}0: {line}\n".encode())
            if number % 7 == 0:  # another rank, with lines that look like arguments
                out.write(b"1:   num_layers ...................................... 99\n")
                out.write(b"1: \xc3\x28 [Rank 1] a line of its own\n")
    printed = read_printed_args(mangled)
    assert printed.values == read_printed_args(_log(trained)).values
    opening = mangled.read_bytes().splitlines()[printed.line - 1]
    assert opening.endswith(f"0: {OPENING}".encode())


def test_a_block_still_being_written_is_not_read_until_its_closing_line(trained, tmp_path):
    text = _log(trained).read_text()
    growing = tmp_path / "job.log"
    assert read_printed_args(growing) is None  # not there yet
    cut = text.index(CLOSING)
    growing.write_text(text[:cut])
    assert read_printed_args(growing) is None
    growing.write_text(text[: cut + 10])  # the closing line torn mid-way
    assert read_printed_args(growing) is None
    growing.write_text(text[: cut + len(CLOSING) + 1])
    assert read_printed_args(growing).get("num_layers") == "2"


def test_the_watch_returns_the_block_or_none_when_the_process_ends_or_time_is_up(trained, tmp_path):
    log = tmp_path / "job.log"
    log.write_text("starting\n")
    assert watch_printed([log], 60, starting=lambda: False) is None
    assert watch_printed([log], 0, starting=lambda: True) is None
    log.write_text(_log(trained).read_text())
    asked = []
    found = watch_printed([log], 60, starting=lambda: asked.append(1) or True)
    assert found.get("num_layers") == "2" and asked == []  # read before asking


def test_printed_values_unlike_the_checkpoints_are_refused_or_approved_by_the_rules(trained, tmp_path):
    printed = read_printed_args(_log(trained))
    printed.values |= {
        "num_layers": "3",
        "seed": "99",
        "lr": "0.002",
        "tensor_model_parallel_size": "2",
        "data_path": "None",  # the job trains on mock data: None both sides
    }
    fits = fit_printed(printed, iter_dir(trained, 24), {})
    words = {d.name: (d.kind, d.words) for d in fits.differences}
    assert words["num_layers"][0] is Kind.REFUSE
    assert re.fullmatch(
        r"architecture: num_layers \(printed at .*-train\.log:\d+\) is 3, the checkpoint was saved with 2: "
        r"the checkpoint's weights are not this model's",
        words["num_layers"][1],
    )
    assert words["layout"][0] is Kind.RESHARD and words["seed"][0] is Kind.APPROVE
    assert words["lr"][0] is Kind.WARN and "data_path" not in words


def test_a_printed_value_is_typed_as_a_literal_never_evaluated():
    assert (typed("4"), typed("6e-05"), typed("True"), typed("None")) == (4, 6e-05, True, None)
    assert typed("['a b', 'c']") == ["a b", "c"]
    assert typed("[0]*9**99") == "[0]*9**99" and typed("[1,,2]") == "[1,,2]"
    assert typed("AttnBackend.auto") == "AttnBackend.auto"
    for depth in (5_000, 100_000):  # a parser's recursion, or past the length parsed at all
        deep = "[" * depth + "]" * depth
        assert typed(deep) == deep


def test_an_output_kept_across_runs_is_read_from_where_the_relaunch_began(trained, tmp_path):
    """A Slurm output with a fixed name in --open-mode=append (or a requeued job's) holds the
    failed run's block and iterations first: from the offset taken at submission, the
    relaunch's own block is judged and its own iterations counted, not the failed run's."""
    from tasks.recovery.job import logged_iterations

    failed_run = _log(trained).read_text()
    log = tmp_path / "train.out"
    log.write_text(failed_run)
    offset = log.stat().st_size
    assert logged_iterations(log) > 0 and logged_iterations(log, offset) == 0
    # Nothing of the relaunch yet: no block, however long it is waited for.
    assert watch_printed([log], 0.0, lambda: True, offset) is None
    relaunch = re.sub(r"^(  num_layers \.+ )2$", r"\g<1>3", failed_run, flags=re.M)
    assert relaunch != failed_run
    with log.open("a") as f:
        f.write(relaunch.split(CLOSING)[0] + CLOSING + "\n")
    printed = watch_printed([log], 0.0, lambda: True, offset)
    assert printed.typed("num_layers") == 3 and read_printed_args(log).typed("num_layers") == 2
    assert logged_iterations(log, offset) == 0
