"""The one policy for reading bytes ckptops did not write (tasks/storage/bounded.py): each refusal
is one ``Malformed`` or ``UsageError`` line naming the file and the limit, never a traceback or a
hang."""

import json
import os
import threading

import pytest

from tasks.errors import CkptopsError, Malformed, UsageError
from tasks.storage.bounded import MAX_DEPTH, bounded_int, load_json, load_yaml, read_bounded


def test_a_file_over_its_limit_is_refused_naming_the_file_and_the_limit(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_bytes(b"x" * 1001)
    with pytest.raises(Malformed, match=r"run_config\.yaml: the run config is larger than 1,000 bytes"):
        read_bounded(path, 1000, "the run config")
    path.write_bytes(b"x" * 1000)
    assert read_bounded(path, 1000, "the run config") == b"x" * 1000


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / ".metadata"
    os.mkfifo(fifo)
    refused = []

    def read() -> None:
        try:
            read_bounded(fifo, 1 << 20, "the index")
        except CkptopsError as e:
            refused.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "a FIFO with no writer blocked the reader"
    assert refused == [f"{fifo}: a FIFO, not a regular file; give the file itself"]


def test_a_link_is_refused_where_the_name_must_be_the_file(tmp_path):
    (tmp_path / "target").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert read_bounded(tmp_path / "link", 10, "a dump") == b"{}"
    with pytest.raises(UsageError, match="link: a symbolic link"):
        read_bounded(tmp_path / "link", 10, "a dump", follow=False)


def test_json_nested_past_the_parser_s_stack_is_one_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(Malformed, match=rf"dump\.json: the dump nests deeper than {MAX_DEPTH} levels"):
        load_json(deep, tmp_path / "dump.json", "the dump")


def test_json_deeper_than_the_limit_but_parseable_is_refused_too(tmp_path):
    value = {"a": 1}
    for _ in range(MAX_DEPTH):
        value = {"a": value}
    with pytest.raises(Malformed, match="nests deeper"):
        load_json(json.dumps(value), tmp_path / "d.json", "the dump")
    shallow = {"entries": [{"frames": [{"line": 3}]}]}
    assert load_json(json.dumps(shallow), tmp_path / "d.json", "the dump") == shallow


def test_json_that_is_not_json_names_the_file(tmp_path):
    with pytest.raises(Malformed, match=r"d\.json: the dump is not JSON"):
        load_json(b"{\xff", tmp_path / "d.json", "the dump")


def test_yaml_nested_past_the_parser_s_stack_is_one_line(tmp_path):
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(Malformed, match="run_config.yaml: the run config nests deeper"):
        load_yaml(deep, tmp_path / "run_config.yaml", "the run config")
    indented = "".join(f"{'  ' * i}k{i}:\n" for i in range(MAX_DEPTH + 5))
    with pytest.raises(Malformed, match="nests deeper"):
        load_yaml(indented, tmp_path / "run_config.yaml", "the run config")


def test_yaml_aliases_are_walked_once(tmp_path):
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    laughs += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    loaded = load_yaml("\n".join(laughs), tmp_path / "p.yaml", "the profile")
    assert len(loaded) == 9


def test_yaml_that_is_not_yaml_names_the_file_and_line(tmp_path):
    with pytest.raises(Malformed, match=r"p\.yaml: the profile is not YAML at line 2"):
        load_yaml("job:\n  name: bad: colon\n", tmp_path / "p.yaml", "the profile")


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (10**30, "outside 0..1,000"),
        (10**5000, "a 16610-bit integer, outside"),
        (-1, "outside"),
        ("12", "not an integer"),
        (True, "not an integer"),
    ],
    ids=["huge", "unprintable", "negative", "text", "bool"],
)
def test_an_integer_out_of_range_or_of_another_type_is_refused(tmp_path, value, said):
    with pytest.raises(Malformed, match=f"time_created_ns is .*{said}"):
        bounded_int(value, tmp_path / "dump", "time_created_ns", 0, 1000)
    assert bounded_int(7, tmp_path / "dump", "time_created_ns", 0, 1000) == 7


def test_a_large_limit_reserves_nothing_for_a_small_file(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(b"small")
    assert read_bounded(path, 1 << 50, "the index") == b"small"
