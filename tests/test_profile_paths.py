"""A profile's paths: every path of the schema is relative to the profile's folder, whichever
the working directory; a drill's scratch dir that mixes with the job's data is refused."""

import json
from pathlib import Path

import pytest

from tasks.errors import UsageError
from tasks.profile import Profile, load_profile

# Every path the schema has, relative, in a profile that lives in its own folder.
RELATIVE = {
    "job": {"name": "paths", "save_dir": "checkpoints"},
    "verify": {"engine": "slurm", "slurm": {"work_dir": "verify-work"}},
    "prefect": {"home": "prefect"},
    "archive": {"url": "archive"},
    "drill": {
        "scratch_dir": "scratch",
        "continuation": {"script": "job.sh", "reference": "train.log"},
    },
    "health": {
        "nodes": ["n1"],
        "raw_dir": "health",
        "nvrx_segment_dir": "segments",
        "ssh": {"known_hosts": "known_hosts", "key_file": "id_ed25519", "config_file": "ssh_config"},
    },
    "recovery": {"script": "job.sh", "step_records": "records.jsonl", "log_dir": "logs"},
}


def test_every_path_of_the_schema_is_the_profiles_folders(tmp_path, monkeypatch):
    folder = tmp_path / "site" / "profiles"
    folder.mkdir(parents=True)
    path = folder / "paths.yaml"
    path.write_text(json.dumps(RELATIVE))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    profile = load_profile(path)
    assert profile.verify.slurm.work_dir == folder / "verify-work"
    assert profile.drill.continuation.script == folder / "job.sh"
    assert profile.drill.continuation.reference == folder / "train.log"
    assert profile.health.nvrx_segment_dir == folder / "segments"
    found = [
        profile.job.save_dir,
        profile.prefect.home,
        profile.drill.scratch_dir,
        profile.health.raw_dir,
        profile.health.ssh.known_hosts,
        profile.health.ssh.key_file,
        profile.health.ssh.config_file,
        profile.recovery.script,
        profile.recovery.step_records,
        profile.recovery.log_dir,
    ]
    assert all(p.parent == folder for p in found), found
    assert profile.archive.url == str(folder / "archive")


def test_a_list_of_paths_in_a_section_is_the_profiles_folders(tmp_path, monkeypatch):
    """sign.public_keys: each relative path of a list, in a section, is the profile folder's
    (an absolute one stays), whichever the working directory."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    path = folder / "signed.yaml"
    settings = {
        "job": {"name": "signed", "save_dir": "/data/checkpoints"},
        "verify": {"digest": "blake3"},
        "sign": {"key_file": "keys/signer.pem", "public_keys": ["keys/signer.pub", "/etc/keys/other.pub"]},
    }
    path.write_text(json.dumps(settings))
    monkeypatch.chdir(tmp_path)
    sign = load_profile(path).sign
    assert sign.key_file == folder / "keys" / "signer.pem"
    assert sign.public_keys == [folder / "keys" / "signer.pub", Path("/etc/keys/other.pub")]


def test_a_profile_built_in_code_keeps_its_paths_as_given():
    """Without a profile file there is no folder to resolve against: paths stay as given."""
    profile = Profile.model_validate(
        {"job": {"name": "code", "save_dir": "checkpoints"}, "archive": {"url": "archive"}}
    )
    assert profile.job.save_dir == Path("checkpoints") and profile.archive.url == "archive"


@pytest.mark.parametrize(
    "drill, relation",
    [
        ({"scratch_dir": "checkpoints"}, "is job.save_dir"),
        ({"scratch_dir": "."}, "contains job.save_dir"),
        ({"scratch_dir": "checkpoints/drills"}, "lies inside job.save_dir"),
        ({"scratch_dir": "archive/scratch"}, "lies inside archive.url"),
        ({"scratch_dir": "health"}, "is health.raw_dir"),
    ],
)
def test_a_scratch_dir_mixed_with_the_jobs_data_is_refused_naming_both(tmp_path, drill, relation):
    path = tmp_path / "p.yaml"
    settings = {
        "job": {"name": "mixed", "save_dir": "checkpoints"},
        "archive": {"url": "archive"},
        "drill": drill,
        "health": {"nodes": ["n1"], "transport": "local", "raw_dir": "health"},
    }
    path.write_text(json.dumps(settings))
    with pytest.raises(UsageError) as refused:
        load_profile(path)
    line = str(refused.value)
    kind, other = relation.rsplit(" ", 1)
    there = {"job.save_dir": "checkpoints", "archive.url": "archive", "health.raw_dir": "health"}[other]
    scratch = (tmp_path / drill["scratch_dir"]).resolve()
    assert line.startswith(f"{path}: ") and "\n" not in line
    assert f"drill.scratch_dir {scratch} {kind} {other} {tmp_path / there}: " in line


def test_a_scratch_dir_of_its_own_inside_another_of_the_profiles_folders_is_fine(tmp_path):
    """A shared scratch file system holding both the Slurm engine's work dir and the drills'."""
    path = tmp_path / "p.yaml"
    settings = {
        "job": {"name": "shared-scratch", "save_dir": "checkpoints"},
        "verify": {"slurm": {"work_dir": "scratch"}},
        "drill": {"scratch_dir": "scratch/drills"},
    }
    path.write_text(json.dumps(settings))
    assert load_profile(path).drill.scratch_dir == tmp_path / "scratch" / "drills"


def _paths_typed_plainly(model, where: str = "") -> list[str]:
    """The fields of ``model`` (and of its sections) whose type holds a ``Path`` that is not the
    profile's path type: one validation would leave relative to the caller's working directory."""
    from typing import Annotated, get_args, get_origin

    from pydantic import BaseModel

    from tasks.profile import ProfilePath

    def plain(annotation) -> bool:
        if annotation is Path:
            return True
        if annotation == ProfilePath:
            return False
        if get_origin(annotation) is Annotated:
            return plain(get_args(annotation)[0])
        return any(plain(a) for a in get_args(annotation))

    resolving = get_args(ProfilePath)[1:]  # what makes a Path the profile's (pydantic keeps a
    found = []  # field's own Annotated metadata apart from its annotation)
    for name, info in model.model_fields.items():
        own = info.annotation is Path and all(m in info.metadata for m in resolving)
        if plain(info.annotation) and not own:
            found.append(f"{where}{name}")
        for inner in get_args(info.annotation) or (info.annotation,):
            for kind in get_args(inner) or (inner,):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    found += _paths_typed_plainly(kind, f"{where}{name}.")
    return found


def test_no_path_of_the_schema_escapes_the_profiles_folder():
    """A path field added later as a plain ``Path`` would resolve against the working directory:
    every path of the schema is typed ``ProfilePath`` (``source``, set by the loader, aside)."""
    assert _paths_typed_plainly(Profile) == ["source"]
