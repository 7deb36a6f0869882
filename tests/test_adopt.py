"""Bringing a team's existing job in: ``ckptops profile init`` reads the job's layout off its
newest checkpoint and its launcher off its batch script; ``ckptops profile check`` names what
the profile gets wrong on this machine and what each missing section would enable."""

import json
import shutil

import yaml

from tests.test_cli import ckptops_here


def test_init_writes_a_profile_that_check_passes_and_check_names_what_is_wrong(variety, tmp_path):
    save = shutil.copytree(variety["tp2-bf16"], tmp_path / "mine")  # TP2 on two ranks: DP1
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\nsrun python pretrain_gpt.py --exit-on-missing-checkpoint\n"
    )
    written = tmp_path / "mine.yaml"
    done = ckptops_here("profile", "init", "--save-dir", save, "--script", script, "--out", written)
    assert done.exit_code == 0 and f"next: ckptops profile check -p {written}" in done.stdout
    profile = yaml.safe_load(written.read_text())
    assert profile["job"]["layout"] == {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 1}
    assert profile["recovery"]["launcher"] == "slurm" and profile["recovery"]["script"] == str(script)
    assert "# drill: {scratch_dir: DIR} would enable ckptops drill" in written.read_text()
    again = ckptops_here("profile", "init", "--save-dir", save, "--out", written)
    assert again.exit_code == 2 and "exists; not overwritten" in again.stderr

    found = json.loads(ckptops_here("profile", "check", "-p", written, "--json").stdout)
    outcomes = {c["name"]: c["outcome"] for c in found["checks"]}
    assert outcomes["job.layout"] == "pass" and outcomes["recovery.script"] == "pass"
    assert outcomes["drill"] == "unchecked" and outcomes["recovery.step_records"] == "pass"
    # Its script hands neither CKPT_ITERATIONS_TO_SKIP nor "$@" to Megatron-LM: said, not failed.
    assert outcomes["recovery.skip_bad_data"] == "warn"

    # A wrong layout, a script that would relaunch from random weights, a scratch dir that
    # cannot be made: each a failing line naming the key; the exit says so.
    script.write_text("#!/bin/bash\nsrun python pretrain_gpt.py\n")
    profile["job"]["layout"]["data_parallel"] = 8
    (tmp_path / "file").write_text("")
    profile["drill"] = {"scratch_dir": str(tmp_path / "file" / "scratch")}
    written.write_text(yaml.safe_dump(profile))
    text = ckptops_here("profile", "check", "-p", written)
    assert text.exit_code == 1
    assert (
        "fail      job.layout: against iter_0000004's saved args: data_parallel 8 (the checkpoint: 1)"
        in text.stdout
    )
    assert f"fail      recovery.script: {script}: does not use --exit-on-missing-checkpoint" in text.stdout
    assert "fail      drill.scratch_dir: " in text.stdout
    assert "unchecked health: not set: it would enable ckptops health run" in text.stdout
    script.write_text('#!/bin/bash\nsrun python pretrain_gpt.py --exit-on-missing-checkpoint "$@"\n')
    found = json.loads(ckptops_here("profile", "check", "-p", written, "--json").stdout)
    assert {c["name"]: c["outcome"] for c in found["checks"]}["recovery.skip_bad_data"] == "pass"
