"""Before a relaunch: the job script's Megatron-LM flags against the args a real checkpoint
saved (the local job: Megatron-LM's own pretrain on CPU), read from the job's own batch script
and from Megatron-LM's example launch script, which we did not write."""

import importlib.util
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.local_job.launch import write_job_script
from tasks.checkpoint.facts import saved_args
from tasks.checkpoint.state import VerifyOptions
from tasks.relaunch.fit import Kind, checkpoint_fit, compare
from tasks.relaunch.script import script_args
from tasks.relaunch.versions import job_versions
from tasks.restore.history import append_drill, drilled_layouts
from tests.conftest import ROOT, iter_dir, verify_and_record_here

DATA = Path(__file__).parent / "data" / "scripts"
MEGATRON_175B = DATA / "megatron_lm_train_gpt3_175b_distributed.sh"


def test_megatron_lms_own_launch_script_is_read_as_megatron_lm_parses_it():
    found = script_args(MEGATRON_175B, {})
    values = found.values
    assert (values["num_layers"], values["hidden_size"], values["num_attention_heads"]) == (96, 12288, 96)
    assert (values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"]) == (8, 16)
    # Typed by Megatron-LM's parser: a list of ints, floats from "6.0e-5" and ".001", a flag.
    assert values["rampup_batch_size"] == [16, 16, 5859375]
    assert values["lr"] == pytest.approx(6e-5) and values["lr_warmup_fraction"] == pytest.approx(0.001)
    assert values["fp16"] is True and values["split"] == "949,50,1"
    # The comment inside the GPT_MODEL_ARGS array is not a value.
    assert values["max_position_embeddings"] == 2048
    # Paths from positional parameters stay unresolved, and say what they come from.
    assert found.unresolved["data_path"] == "the script sets it at run time ($DATA_PATH, that is $5)"
    assert "data_path" not in values


def test_megatron_lms_llama_script_quoted_flag_elements_and_branches_are_read_as_bash_runs_them():
    found = script_args(DATA / "megatron_lm_train_llama3_8b_h100_fp8.sh", {})
    values = found.values
    # Flag and value in one quoted array element, expanded unquoted: two words.
    assert values["fp8"] == "hybrid" and values["split"] == "99,1,0" and values["vocab_size"] == 128256
    # Variables of the script, a comment after a value, a commented-out flag.
    assert (values["num_layers"], values["seq_length"], values["global_batch_size"]) == (32, 8192, 128)
    assert values["rotary_base"] == 1000000 and values["add_bias_linear"] is False
    assert "pipeline_model_parallel_size" not in values and values["tensor_model_parallel_size"] == 1
    # The mock and the real data branch set two tokenizers: which one runs is not in the text.
    assert found.unresolved["tokenizer_type"] == (
        "the script sets it more than once (NullTokenizer; HuggingFaceTokenizer)"
    )
    assert found.unresolved["data_path"] == "the script sets it at run time ($DATA_ARG, that is ${4:-MOCK})"


def test_variables_resolve_from_the_script_and_the_environment_the_relaunch_inherits(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nGBS=16\nTP=${TP:-4}\nSEQ=$(cat seq.txt)\n"
        "ARGS=(\n  --global-batch-size $GBS # the batch\n  --tensor-model-parallel-size ${TP}\n)\n"
        'torchrun pretrain_gpt.py "${ARGS[@]}" --seq-length $SEQ --lr=${LR} \\\n  --num-layers 2\n'
    )
    found = script_args(script, {"TP": "2", "LR": "3e-4"})
    assert found.values["global_batch_size"] == 16
    assert found.values["tensor_model_parallel_size"] == 2  # the environment's TP wins over the default
    assert found.values["lr"] == pytest.approx(3e-4) and found.values["num_layers"] == 2
    assert found.unresolved["seq_length"].startswith("the script sets it at run time ($SEQ, that is $(cat")
    without = script_args(script, {})
    assert without.values["tensor_model_parallel_size"] == 4 and "lr" in without.unresolved


def test_what_bash_would_run_is_read_not_what_the_text_looks_like(tmp_path):
    """A blend in an unquoted variable (split into words), the script's own assignment before the
    environment and a default, a usage text and two branches (set more than once: not compared),
    a redirect after a value, a '#' inside a path."""
    script = tmp_path / "job.sh"
    script.write_text(
        '#!/bin/bash\nDATA_PATH="0.3 /d/a 0.7 /d/b"\nTP=4\ncat <<USAGE\nusage: --num-layers N\nUSAGE\n'
        'if [ "$BIG" = 1 ]; then\n  LAYERS=(--num-layers 80)\nelse\n  LAYERS=(--num-layers 32)\nfi\n'
        "torchrun pretrain_gpt.py --data-path $DATA_PATH --tensor-model-parallel-size ${TP:-8} "
        "--save /d/run#1 --seq-length 4096 2>&1 | tee log\n"
    )
    found = script_args(script, {"TP": "2"})
    assert found.values["data_path"] == ["0.3", "/d/a", "0.7", "/d/b"]
    assert found.values["tensor_model_parallel_size"] == 4
    assert found.values["save"] == "/d/run#1" and found.values["seq_length"] == 4096
    assert found.unresolved["num_layers"] == "the script sets it more than once (80; 32)"
    saved = SimpleNamespace(data_path=["0.3", "/d/a", "0.7", "/d/b"], num_layers=2, seq_length=4096)
    saved.tensor_model_parallel_size = 4
    fits = compare(8, saved, found)
    assert fits.compared == 3 and fits.refused == [] and fits.needs_approval == []
    assert [d.words for d in fits.differences] == [
        "num_layers: the script sets it more than once (80; 32): not compared"
    ]


def test_megatron_lm_taking_args_from_the_checkpoint_turns_only_what_it_forces_into_notes(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        "python pretrain_gpt.py --use-checkpoint-args --use-mp-args-from-checkpoint-args --num-layers 48 "
        "--swiglu --tensor-model-parallel-size 8\n"
    )
    saved = SimpleNamespace(
        num_layers=96, swiglu=False, tensor_model_parallel_size=4, pipeline_model_parallel_size=1
    )
    fits = compare(8, saved, script_args(script, {}))
    words = {d.name: (d.kind, d.words) for d in fits.differences}
    # Megatron-LM fills --num-layers from the checkpoint only where the script leaves it unset.
    assert words["num_layers"][0] is Kind.REFUSE
    assert words["swiglu"] == (
        Kind.NOTE,
        "--swiglu is given (swiglu True), the checkpoint was saved with swiglu False "
        "(--use-checkpoint-args: Megatron-LM takes the checkpoint's)",
    )
    assert words["tensor_model_parallel_size"][0] is Kind.NOTE and "layout" not in words


def test_every_compared_argument_is_one_megatron_lms_parser_knows():
    from tasks.relaunch.fit import KIND_OF, TAKEN_FROM_CHECKPOINT
    from tasks.relaunch.script import megatron_parser

    known = {action.dest for action in megatron_parser()._actions}
    assert set(KIND_OF) - known == set()
    assert set(TAKEN_FROM_CHECKPOINT) | set().union(*TAKEN_FROM_CHECKPOINT.values()) <= known


def test_a_wrapper_that_writes_no_compared_flag_is_said_to_compare_nothing(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("python -m nemo.collections.llm.train --config-path conf model.num_layers=32\n")
    fits = compare(8, SimpleNamespace(num_layers=2), script_args(script, {}))
    assert fits.compared == 0 and fits.refused == [] and fits.needs_approval == []
    (note,) = fits.differences
    assert note.kind is Kind.NOTE and note.words.endswith("nothing was compared")


def test_a_value_megatron_lms_parser_would_refuse_is_named_and_not_compared_never_refused(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("python pretrain_gpt.py --num-layers two --log-interval often\n")
    found = script_args(script, {})
    assert found.refused["num_layers"] == (
        "--num-layers two: Megatron-LM's parser would refuse it as read here "
        "(argument --num-layers: invalid int value: 'two')"
    )
    saved = SimpleNamespace(num_layers=2, log_interval=1)
    fits = compare(8, saved, found)
    assert fits.refused == [] and fits.needs_approval == []  # the printed arguments decide
    (note,) = [d for d in fits.differences if d.name == "num_layers"]
    assert note.kind is Kind.NOTE and note.words.endswith("invalid int value: 'two'): not compared")


# Scripts as teams write them, each read as bash runs it (probe 4 of issue 34): the saved args are
# the trained job's (2 layers, global batch 8, seed 1234, no experts).
SCRIPTS = {
    "one line": (
        'GPT_ARGS="--num-layers 2 --global-batch-size 16"; torchrun pretrain_gpt.py $GPT_ARGS\n',
        {"global_batch_size": Kind.APPROVE},
    ),
    "redirect": ("python pretrain_gpt.py --num-layers 2 > train.log 2>&1\n", {}),
    "eval": (
        'CMD="torchrun pretrain_gpt.py --seed 99 --num-layers 2"\neval "$CMD"\n',
        {"seed": Kind.APPROVE},
    ),
    "repeated": ("python pretrain_gpt.py --seed 1234 --num-layers 2 --seed 99\n", {"seed": Kind.APPROVE}),
    "heredoc": ("cat > notes.txt <<'EOF'\n--num-layers 80\nEOF\npython pretrain_gpt.py --num-layers 2\n", {}),
    "backtick": ("python pretrain_gpt.py --seed `cat seed.txt` --num-layers 2\n", {"seed": Kind.NOTE}),
    "huge pattern": (
        'python pretrain_gpt.py --moe-layer-freq "[0]*300000000"\n',
        {"moe_layer_freq": Kind.NOTE},
    ),
    "overflow": ('python pretrain_gpt.py --moe-layer-freq "[0]*9**99"\n', {"moe_layer_freq": Kind.NOTE}),
    "syntax": ('python pretrain_gpt.py --moe-layer-freq "[1,,2]"\n', {"moe_layer_freq": Kind.NOTE}),
}


@pytest.mark.parametrize("case", SCRIPTS)
def test_the_script_is_read_as_bash_runs_it_and_megatron_code_never_runs_on_its_text(tmp_path, case):
    import resource

    text, expected = SCRIPTS[case]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + text)
    saved = SimpleNamespace(num_layers=2, global_batch_size=8, seed=1234, moe_layer_freq=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fits = compare(8, saved, script_args(script, {}))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: nothing built
    found = {d.name: d.kind for d in fits.differences if d.name != "script"}
    assert found == expected, fits.lines()
    assert fits.refused == []  # nothing here is certain enough to refuse on


def _job_script(tmp_path: Path, saved, extra: list[str]) -> Path:
    """The job's own batch script as a team hands it to ckptops, for the trained job."""
    return write_job_script(
        tmp_path / "job.sh",
        tmp_path / "checkpoints",
        tmp_path / "records.jsonl",
        train_iters=saved.train_iters,
        save_interval=saved.save_interval,
        extra=extra,
    )


def _compared(trained, tmp_path, extra, drilled=None):
    saved, writer = saved_args(iter_dir(trained, 24))
    found = script_args(_job_script(tmp_path, saved, extra), {})
    return compare(24, saved, found, drilled or {}, writer, None)


def test_the_jobs_own_script_fits_its_checkpoint(trained, tmp_path):
    fits = _compared(trained, tmp_path, ["--global-batch-size", "8", "--seq-length", "32"])
    assert fits.compared == 3 and fits.differences == []  # train iters, global batch, sequence length
    assert "3 Megatron-LM arguments compared, no difference" in fits.summary()


def test_each_kind_of_difference_is_said_in_words_and_sorted_by_what_it_risks(trained, tmp_path):
    fits = _compared(
        trained,
        tmp_path,
        [
            "--num-layers",
            "3",
            "--global-batch-size",
            "16",
            "--lr",
            "2e-3",
            "--tokenizer-type",
            "GPT2BPETokenizer",
        ],
    )
    words = {d.name: (d.kind, d.words) for d in fits.differences}
    assert words["num_layers"] == (
        Kind.REFUSE,
        "architecture: --num-layers is 3, the checkpoint was saved with 2: the checkpoint's weights are "
        "not this model's",
    )
    assert words["tokenizer_type"][0] is Kind.REFUSE and "NullTokenizer" in words["tokenizer_type"][1]
    assert words["global_batch_size"][0] is Kind.APPROVE and "saved with 8" in words["global_batch_size"][1]
    assert (
        words["lr"][0] is Kind.WARN and "--lr is 0.002, the checkpoint was saved with 0.001" in words["lr"][1]
    )
    assert [d.name for d in fits.refused] == ["num_layers", "tokenizer_type"]
    assert [d.name for d in fits.needs_approval] == ["global_batch_size"]


def test_a_resharding_is_refused_until_a_passing_drill_loaded_the_job_onto_that_layout(trained, tmp_path):
    fits = _compared(trained, tmp_path, ["--tensor-model-parallel-size", "2"])
    (layout,) = fits.refused
    assert layout.kind is Kind.RESHARD and layout.words.startswith("layout: TP 1->2: a resharding no restore")
    drilled = {(2, 1): "shared-20261203T010000-ab12"}
    fits = _compared(trained, tmp_path, ["--tensor-model-parallel-size", "2"], drilled)
    assert fits.refused == []
    (layout,) = fits.needs_approval
    assert "drill shared-20261203T010000-ab12 loaded this job's checkpoint onto it" in layout.words
    # A drill onto another layout proves nothing about this one.
    fits = _compared(trained, tmp_path, ["--pipeline-model-parallel-size", "2"], drilled)
    assert [d.name for d in fits.refused] == ["layout"]
    # Experts no drill reshards: a change of EP is refused with the drilled TP too.
    fits = _compared(
        trained, tmp_path, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], drilled
    )
    (layout,) = fits.refused
    assert layout.words == "layout: TP 1->2 x EP 1->2: no restore drill reshards experts, refused"


def test_the_fit_reads_drills_from_the_jobs_history_and_the_versions_from_the_jobs_python(trained, tmp_path):
    save = tmp_path / "save"
    directory = save / "iter_0000024"
    shutil.copytree(iter_dir(trained, 24), directory)
    # The manifest records the writer's megatron-core as the job's profile pins it.
    verify_and_record_here(directory, VerifyOptions(job="fit", megatron_core_version="0.18.0"))
    saved, _ = saved_args(directory)
    drill = {
        "id": "d1",
        "ok": True,
        "source": "shared",
        "started_at": "2026-12-03T01:00:00+00:00",
        "window_seconds": 1.0,
        "budget_seconds": 600,
        "layout": {"tensor_parallel": 2, "pipeline_parallel": 1},
    }
    append_drill(save, SimpleNamespace(to_dict=lambda: drill))
    profile = SimpleNamespace(
        job=SimpleNamespace(name="test", save_dir=save),
        sign=None,
        recovery=SimpleNamespace(job_python=[sys.executable]),
    )
    script = _job_script(tmp_path, saved, ["--tensor-model-parallel-size", "2"])
    fits = checkpoint_fit(profile, directory, script, {}, drilled_layouts(save))
    assert [d.words.split(":")[0] for d in fits.needs_approval] == ["layout"]
    versions = {d.name: d for d in fits.differences if d.name in ("megatron_core", "torch", "cuda", "nccl")}
    assert versions["megatron_core"].kind is Kind.WARN
    assert versions["megatron_core"].words == (
        f"megatron-core: the relaunch runs {version('megatron-core')}, the checkpoint was written by 0.18.0"
    )
    assert versions["torch"].kind is Kind.NOTE and version("torch") in versions["torch"].words
    assert "does not record the writer's" in versions["nccl"].words


def test_the_jobs_python_that_cannot_say_its_versions_is_named_not_trusted(tmp_path):
    missing = str(tmp_path / "no-python")
    assert job_versions([missing], 5) == {"error": f"{missing} exited 127: {missing}: command not found"}
    hung = job_versions(["bash", "-c", "sleep 30", "hung"], 1)
    assert hung == {"error": "bash timed out after 1s"}
    silent = job_versions(["bash", "-c", "echo not json", "silent"], 5)
    assert silent == {"error": "bash printed no versions"}
    real = job_versions([sys.executable], 60)
    assert set(real) == {"megatron_core", "torch", "cuda", "nccl"}
    json.dumps(real)


@pytest.mark.slow  # a cold Python importing torch and megatron.training: 10-20 s
@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None, reason="NVIDIA ModelOpt is not installed")
def test_reading_a_script_does_not_import_modelopt_and_leaves_it_importable():
    """Megatron-LM's parser is imported without ModelOpt (7 CPU-s of every recovery's start, for
    nothing the parser uses); the process can still import ModelOpt afterwards."""
    probe = (
        "import sys, importlib.util\n"
        "from tasks.relaunch.script import megatron_parser\n"
        "megatron_parser()\n"
        "print('modelopt' in sys.modules, importlib.util.find_spec('modelopt') is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
