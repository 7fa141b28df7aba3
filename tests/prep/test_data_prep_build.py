"""Building from a local mirror: outputs, manifest, determinism, source formats, every error path."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from frod_ds.prep.dataset import BuildOptions, build
from frod_ds.prep.rows import read_rows
from frod_ds.prep.tasks import TASKS, DataPrepError
from frod_ds.prep.templates import RowError, render

MIRROR = Path(__file__).parents[1] / "fixtures" / "data_prep" / "mirror"
ALL = tuple(TASKS)


def run_build(out: Path, source: Path = MIRROR, **kw) -> tuple[dict, dict]:
    return build(BuildOptions(source=str(source), out=out, tasks=kw.pop("tasks", ALL), **kw))


def file_bytes(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".frod-ds-output"
    }  # the data files; the marker is atomic.py's


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("build") / "cs"
    manifest, files = run_build(out)
    return out, manifest, files


# --- outputs -----------------------------------------------------------------------------------


def test_build_writes_train_eval_and_manifest(built):
    out, _, files = built
    expected = {"train.jsonl", "manifest.json"} | {f"eval/{t}.jsonl" for t in TASKS}
    assert set(file_bytes(out)) == expected == set(files)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary dirs left behind"


def test_manifest_counts_kept_and_dropped_per_task_and_split(built):
    _, manifest, _ = built
    kept = {t: (c["train"]["kept"], c["eval"]["kept"]) for t, c in manifest["counts"].items()}
    assert kept == {
        "boolq": (3, 2),
        "piqa": (2, 1),
        "siqa": (2, 2),
        "hellaswag": (2, 1),
        "winogrande": (2, 1),
        "obqa": (2, 1),
        "arc_easy": (2, 1),
        "arc_challenge": (1, 1),
    }
    assert manifest["dropped"] == {
        "boolq": {"train": {"missing field 'passage'": 1, "wrong type for 'answer'": 1}},
        "piqa": {"train": {"label missing": 1, "label out of range": 1, "row is not an object": 1}},
        "siqa": {"train": {"label out of range": 1, "wrong type for 'label'": 1}},
        "hellaswag": {"train": {"malformed 'endings'": 1}, "eval": {"label missing": 1}},
        "winogrande": {"train": {"label missing": 1}},
        "obqa": {"train": {"label out of range": 1}},
        "arc_challenge": {"train": {"malformed 'choices'": 1}},
    }
    assert manifest["train_rows"] == 16
    assert manifest["reference"]["rows"] == 170_420
    assert manifest["reference"]["train_rows_minus_reference"] == 16 - 170_420
    assert manifest["seed"] == 42


def test_eval_split_is_validation_or_test_for_obqa_and_arc(built):
    _, manifest, _ = built
    splits = {t: c["eval"]["split"] for t, c in manifest["counts"].items()}
    assert splits == {
        "boolq": "validation",
        "piqa": "validation",
        "siqa": "validation",
        "hellaswag": "validation",
        "winogrande": "validation",
        "obqa": "test",
        "arc_easy": "test",
        "arc_challenge": "test",
    }
    assert manifest["sources"]["obqa"]["eval"]["path"] == "obqa/test.jsonl"
    assert manifest["sources"]["piqa"]["train"]["path"] == "piqa/train.json"


def test_manifest_sha256_matches_every_file(built):
    out, manifest, files = built
    for name, data in file_bytes(out).items():
        assert files[name] == hashlib.sha256(data).hexdigest()
        if name != "manifest.json":
            assert manifest["files"][name] == files[name]
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_every_output_row_has_the_schema(built):
    out, _, _ = built
    for path in [out / "train.jsonl", *sorted((out / "eval").iterdir())]:
        for row in read_rows(path):
            assert list(row) == ["task", "id", "prompt", "answer", "choices", "label"]
            assert row["choices"][row["label"]] == row["answer"]
            assert "\nAnswer: " not in row["prompt"]


def test_train_is_a_shuffle_of_all_training_rows(built):
    out, _, _ = built
    rows = read_rows(out / "train.jsonl")
    assert Counter(r["task"] for r in rows) == {
        "boolq": 3,
        "piqa": 2,
        "siqa": 2,
        "hellaswag": 2,
        "winogrande": 2,
        "obqa": 2,
        "arc_easy": 2,
        "arc_challenge": 1,
    }
    assert len({(r["task"], r["id"]) for r in rows}) == len(rows)
    assert [r["task"] for r in rows] != sorted((r["task"] for r in rows), key=list(TASKS).index)


def test_awkward_rows_come_out_rendered_verbatim(built):
    out, _, _ = built
    rows = {(r["task"], r["id"]): r for r in read_rows(out / "train.jsonl")}
    assert rows["boolq", "boolq-train-0"] == {
        "task": "boolq",
        "id": "boolq-train-0",
        "prompt": "Reference document:\n  Sky \u2014 \u00abbleu\u00bb \U0001f30c\nsecond line {0} \nQuestion:\n"
        "is the sky blue {at night}?",
        "answer": "false",
        "choices": ["true", "false"],
        "label": 1,
    }
    # the blank line in the JSONL is skipped, so the row after it is record 4
    assert rows["boolq", "boolq-train-4"]["prompt"] == "Reference document:\ntab\there\nQuestion:\nline\u2028separator"
    assert rows["obqa", "obqa-{odd}"]["prompt"] == (
        "Please choose the correct answer to the question: What is 2+2?\n\n"
        "Option A:\nfour \nOption B:\n\nOption C:\n{x}\nOption D:\n\u00fcnf\n."
    )
    assert rows["arc_challenge", "NYSEDREGENTS_2015_4_8"]["answer"] == "Option 2"
    assert rows["piqa", "piqa-train-1"]["answer"] == "Choice B"
    evals = read_rows(out / "eval" / "hellaswag.jsonl")
    assert [(r["id"], r["answer"]) for r in evals] == [("hellaswag-validation-0", "Ending D")]


def test_output_files_are_ascii_one_row_per_line(built):
    out, _, _ = built
    data = (out / "train.jsonl").read_bytes()
    data.decode("ascii")
    assert data.count(b"\n") == 16 and data.endswith(b"\n")
    assert b"\\u2028" in data and b"\\ud83c\\udf0c" in data


# --- determinism -------------------------------------------------------------------------------


def test_same_inputs_and_seed_give_byte_identical_outputs(built, tmp_path):
    out, _, files = built
    _, files_again = run_build(tmp_path / "again")
    assert file_bytes(tmp_path / "again") == file_bytes(out)
    assert files_again == files


def test_task_order_in_tasks_flag_does_not_matter(tmp_path):
    run_build(tmp_path / "a", tasks=("boolq", "piqa", "obqa"))
    run_build(tmp_path / "b", tasks=("obqa", "boolq", "piqa"))
    assert file_bytes(tmp_path / "a") == file_bytes(tmp_path / "b")


def test_other_seed_reorders_train_only(built, tmp_path):
    out, _, _ = built
    run_build(tmp_path / "s7", seed=7)
    a, b = file_bytes(out), file_bytes(tmp_path / "s7")
    assert a["train.jsonl"] != b["train.jsonl"]
    assert sorted(a["train.jsonl"].splitlines()) == sorted(b["train.jsonl"].splitlines())
    assert all(a[k] == b[k] for k in a if k.startswith("eval/"))


# --- source formats ----------------------------------------------------------------------------


def _valid_rows(task: str, path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    good = []
    for row in rows:
        try:
            render(task, row)
            good.append(row)
        except RowError:
            pass
    return good


def test_jsonl_json_parquet_and_save_to_disk_give_identical_outputs(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tasks = ("hellaswag", "obqa")
    clean = tmp_path / "clean"
    for task in tasks:
        (clean / task).mkdir(parents=True)
        for split in ("train", TASKS[task].eval_split):
            rows = _valid_rows(task, MIRROR / task / f"{split}.jsonl")
            (clean / task / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writers = {
        "json": lambda rows, d, s: (d / f"{s}.json").write_text(json.dumps(rows, indent=1)),
        "parquet": lambda rows, d, s: pq.write_table(pa.Table.from_pylist(rows), d / f"{s}.parquet"),
        "disk": lambda rows, d, s: datasets.Dataset.from_list(rows).save_to_disk(str(d / s)),
    }
    run_build(tmp_path / "out-jsonl", source=clean, tasks=tasks)
    reference = file_bytes(tmp_path / "out-jsonl")
    for fmt, write in writers.items():
        mirror = tmp_path / fmt
        for task in tasks:
            (mirror / task).mkdir(parents=True)
            for split in ("train", TASKS[task].eval_split):
                write(_valid_rows(task, clean / task / f"{split}.jsonl"), mirror / task, split)
        run_build(tmp_path / f"out-{fmt}", source=mirror, tasks=tasks)
        got = file_bytes(tmp_path / f"out-{fmt}")
        assert {k: v for k, v in got.items() if k != "manifest.json"} == {
            k: v for k, v in reference.items() if k != "manifest.json"
        }, fmt


def test_winogrande_size_folder_is_used_when_present(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "winogrande", mirror / "winogrande" / "winogrande_xl")
    (mirror / "winogrande" / "winogrande_xl" / "train.jsonl").write_text(
        '{"sentence": "xl _", "option1": "a", "option2": "b", "answer": "1"}\n'
    )
    manifest, _ = run_build(tmp_path / "xl", source=mirror, tasks=("winogrande",), winogrande_size="xl")
    assert manifest["counts"]["winogrande"]["train"]["kept"] == 1
    assert manifest["winogrande_size"] == "xl"
    assert manifest["sources"]["winogrande"]["train"]["path"] == "winogrande/winogrande_xl/train.jsonl"
    with pytest.raises(DataPrepError, match="no train split in .*winogrande"):
        run_build(tmp_path / "l", source=mirror, tasks=("winogrande",), winogrande_size="l")


# --- validation and errors: clear message, nothing left in OUT ---------------------------------


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "temporary dir left behind"


def test_strict_names_task_file_and_row(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(DataPrepError) as info:
        run_build(out, strict=True)
    message = str(info.value)
    # row 1's question is '' (kept as published without --strict), the first row --strict refuses
    assert message.startswith(f"boolq: {MIRROR / 'boolq' / 'train.jsonl'} row index 1: blank field 'question'")
    assert "\n" not in message
    assert_nothing_written(out)


def test_strict_reports_label_value(tmp_path):
    with pytest.raises(DataPrepError, match=r"piqa: .*train\.json row index 2: label out of range \('label' is 2"):
        run_build(tmp_path / "out", strict=True, tasks=("piqa",))


def test_strict_passes_on_clean_tasks(tmp_path):
    manifest, _ = run_build(tmp_path / "out", strict=True, tasks=("arc_easy",))
    assert manifest["dropped"] == {}


def test_rows_training_would_refuse_are_dropped_and_counted(tmp_path):
    """A repeated id (the first row kept) and a row over MAX_ROW_CHARS: dropped and counted like invalid rows,
    so the build never hands training a file it refuses; --strict makes the first one an error."""
    from frod_ds.prep.row_checks import DUPLICATE_ID, OVERLONG
    from frod_ds.prep.rows import MAX_ROW_CHARS

    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "arc_easy", mirror / "arc_easy")
    lines = (mirror / "arc_easy" / "train.jsonl").read_text().splitlines()
    huge = {**json.loads(lines[0]), "id": "huge", "question": "q" * MAX_ROW_CHARS}
    (mirror / "arc_easy" / "train.jsonl").write_text("\n".join([*lines, lines[0], json.dumps(huge)]) + "\n")
    manifest, _ = run_build(tmp_path / "out", source=mirror, tasks=("arc_easy",))
    assert manifest["dropped"] == {"arc_easy": {"train": {DUPLICATE_ID: 1, OVERLONG: 1}}}
    counts = manifest["counts"]["arc_easy"]["train"]
    assert (counts["read"], counts["kept"], counts["dropped"]) == (len(lines) + 2, len(lines), 2)
    ids = [r["id"] for r in read_rows(tmp_path / "out" / "train.jsonl")]
    assert sorted(ids) == sorted(json.loads(x)["id"] for x in lines)
    with pytest.raises(
        DataPrepError,
        match=f"arc_easy: .*train.jsonl row id '{json.loads(lines[0])['id']}': {DUPLICATE_ID} \\(--strict\\)",
    ):
        run_build(tmp_path / "strict", source=mirror, tasks=("arc_easy",), strict=True)
    assert_nothing_written(tmp_path / "strict")


def test_missing_task_directory_names_it_and_suggests_tasks(tmp_path):
    mirror = tmp_path / "mirror"
    for task in ("boolq", "piqa"):
        shutil.copytree(MIRROR / task, mirror / task)
    out = tmp_path / "out"
    with pytest.raises(DataPrepError) as info:
        run_build(out, source=mirror, tasks=("boolq", "piqa", "siqa", "obqa"))
    message = str(info.value)
    assert "no directory for task(s) siqa, obqa" in message
    assert str(mirror / "siqa") in message
    assert "--tasks boolq,piqa" in message
    assert_nothing_written(out)


def test_missing_split_file_is_an_error(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", mirror / "obqa")
    (mirror / "obqa" / "test.jsonl").unlink()
    out = tmp_path / "out"
    with pytest.raises(DataPrepError, match=r"no test split in .*obqa \(expected test\.jsonl"):
        run_build(out, source=mirror, tasks=("obqa",))
    assert_nothing_written(out)


def test_ambiguous_split_files_are_an_error(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", mirror / "obqa")
    shutil.copy(mirror / "obqa" / "test.jsonl", mirror / "obqa" / "test.json")
    with pytest.raises(DataPrepError, match="test split in .* is ambiguous: test.jsonl, test.json"):
        run_build(tmp_path / "out", source=mirror, tasks=("obqa",))


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Editors on Windows start UTF-8 files with a BOM: the rows read are those of the same file without it."""
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", mirror / "obqa")
    plain, _ = run_build(tmp_path / "plain", source=mirror, tasks=("obqa",))
    for name in ("train.jsonl", "test.jsonl"):
        path = mirror / "obqa" / name
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    bom, _ = run_build(tmp_path / "bom", source=mirror, tasks=("obqa",))
    assert bom["counts"] == plain["counts"] and bom["dropped"] == plain["dropped"]
    for name in ("train.jsonl", "eval/obqa.jsonl"):
        assert (tmp_path / "bom" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


@pytest.mark.parametrize(
    "name,content,pattern",
    [
        (
            "test.jsonl",
            '{"id": "1"}\n{"id": \n',
            r"cannot read .*test\.jsonl: line 2 is not valid JSON \(Expecting value at column 8\); fix or remove",
        ),
        ("test.json", '[{"id": "1"},', r"cannot read .*test\.json: line 1 is not valid JSON"),
        ("test.parquet", "not parquet", r"cannot read .*test\.parquet: not a readable parquet file"),
        ("test.jsonl", b"\xff\xfe{}", r"cannot read .*test\.jsonl: not UTF-8 text \(line 1, byte 0: 0xff\)"),
        ("test.jsonl", b'{"id": "1"}\n{"id": "\xe9"}\n', r"test\.jsonl: not UTF-8 text \(line 2, byte 20: 0xe9\)"),
        ("test.jsonl", gzip.compress(b'{"id": "1"}\n', mtime=0), r"test\.jsonl: it is gzip-compressed; decompress it"),
        ("test.json", "42", r"cannot read .*test\.json: expected a JSON array of rows or JSON lines, got int"),
        # JSON keeps the last of a key given twice: which label the row's author meant is unknown
        (
            "test.jsonl",
            '{"id": "1"}\n{"id": "2", "label": 0, "label": 1}\n',
            r"test\.jsonl: line 2: key \"label\" is given twice",
        ),
        ("test.json", '[{"id": "1"}, {"id": "2", "id": "3"}]', r"test\.json: an object gives key \"id\" twice"),
    ],
)
def test_unreadable_file_is_an_error_and_writes_nothing(tmp_path, name, content, pattern):
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", mirror / "obqa")
    (mirror / "obqa" / "test.jsonl").unlink()
    target = mirror / "obqa" / name
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out"
    with pytest.raises(DataPrepError, match=pattern):
        run_build(out, source=mirror, tasks=("obqa",))
    assert_nothing_written(out)


def test_broken_save_to_disk_folder_is_an_error(tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "obqa", mirror / "obqa")
    (mirror / "obqa" / "test.jsonl").unlink()
    (mirror / "obqa" / "test").mkdir()
    with pytest.raises(DataPrepError, match=r"cannot read .*test: not a readable save_to_disk folder"):
        run_build(tmp_path / "out", source=mirror, tasks=("obqa",))


def test_bad_options_are_reported_together(tmp_path):
    with pytest.raises(DataPrepError) as info:
        run_build(tmp_path / "out", tasks=("boolq", "mmlu"), winogrande_size="xxl", cutoff=0)
    message = str(info.value)
    assert "unknown task 'mmlu'" in message and "unknown WinoGrande size 'xxl'" in message
    assert "--cutoff needs --tokenizer" in message and "--cutoff must be positive" in message


def test_source_directory_must_exist(tmp_path):
    with pytest.raises(DataPrepError, match="no such directory"):
        run_build(tmp_path / "out", source=tmp_path / "nope")


def test_existing_output_needs_overwrite_and_survives_a_failed_build(tmp_path):
    out = tmp_path / "out"
    run_build(out, tasks=("obqa",))
    before = file_bytes(out)
    with pytest.raises(DataPrepError, match="exists; pass --overwrite"):
        run_build(out, tasks=("piqa",))
    with pytest.raises(DataPrepError):
        run_build(out, tasks=("piqa",), overwrite=True, strict=True)
    assert file_bytes(out) == before
    run_build(out, tasks=("piqa",), overwrite=True)
    assert set(file_bytes(out)) == {"train.jsonl", "eval/piqa.jsonl", "manifest.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_keeps_a_built_file_the_user_edited_since(tmp_path):
    """A file of an earlier build whose bytes are no longer the ones its ownership record stamped was edited by
    someone else: --overwrite refuses, naming it, and leaves every file; with the edit undone (the same bytes, a new
    mtime: hashed, found unchanged) it replaces the build."""
    out = tmp_path / "out"
    run_build(out, tasks=("obqa", "piqa"))
    built = file_bytes(out)
    edited = out / "eval" / "piqa.jsonl"
    edited.write_text('{"mine": 1}\n')
    before = file_bytes(out)
    with pytest.raises(DataPrepError, match=r"holds files changed since frod-ds wrote them: eval/piqa.jsonl; refus"):
        run_build(out, tasks=("piqa",), overwrite=True)
    assert file_bytes(out) == before
    edited.write_bytes(built["eval/piqa.jsonl"])
    run_build(out, tasks=("piqa",), overwrite=True)
    assert set(file_bytes(out)) == {"train.jsonl", "eval/piqa.jsonl", "manifest.json"}


def test_overwrite_refuses_a_directory_that_is_not_a_build(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(DataPrepError, match="not written by frod-ds"):
        run_build(out, tasks=("obqa",), overwrite=True)
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_empty_output_directory_is_reused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_build(out, tasks=("obqa",))
    assert (out / "eval" / "obqa.jsonl").is_file()


# --- token lengths -----------------------------------------------------------------------------


class WhitespaceTokenizer:
    """One token per whitespace-separated word, a BOS in front; EOS id 2."""

    eos_token_id = 2

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] * add_special_tokens + [5] * len(t.split()) for t in texts]}


def test_cutoff_counts_rows_over_it_per_task(tmp_path, monkeypatch):
    from frod_ds.prep import tokens

    monkeypatch.setattr(tokens, "load_tokenizer", lambda name: WhitespaceTokenizer())
    manifest, _ = run_build(tmp_path / "out", tasks=("piqa", "winogrande"), tokenizer="ws", cutoff=32)
    report = manifest["token_lengths"]
    assert (report["tokenizer"], report["cutoff"]) == ("ws", 32)
    # piqa train: "Physical situation description:" (3) + goal + "Choice A:" (2) + sol1 + "Choice B:" (2) + sol2
    # + "Question:" (1) + question sentence (11) + "Answer:" (1) + answer (2), + BOS + EOS
    piqa_train = [3 + 4 + 2 + 4 + 2 + 0 + 1 + 11 + 1 + 2 + 2, 3 + 3 + 2 + 2 + 2 + 4 + 1 + 11 + 1 + 2 + 2]
    assert piqa_train == [32, 33]
    assert report["per_task"]["piqa"]["train"] == {"rows": 2, "max": 33, "mean": 32.5, "p95": 33, "over_cutoff": 1}
    piqa_eval = 3 + 2 + 2 + 3 + 2 + 3 + 1 + 11 + 1 + 2 + 2  # exactly at the cutoff: not over it
    assert report["per_task"]["piqa"]["eval"] == {
        "rows": 1,
        "max": piqa_eval,
        "mean": 32.0,
        "p95": 32,
        "over_cutoff": 0,
    }
    assert report["per_task"]["winogrande"]["train"]["rows"] == 2


# --- rows repeated verbatim, lone surrogates, rows with nothing to choose between -------------------------------


def _boolq_mirror(tmp_path: Path, train: list[str], eval_: list[str]) -> Path:
    mirror = tmp_path / "mirror"
    (mirror / "boolq").mkdir(parents=True)
    (mirror / "boolq" / "train.jsonl").write_text("".join(x + "\n" for x in train))
    (mirror / "boolq" / "validation.jsonl").write_text("".join(x + "\n" for x in eval_))
    return mirror


def _boolq_row(i: int, answer: bool = True) -> str:
    return json.dumps({"question": f"question {i}", "answer": answer, "passage": f"passage {i}"})


def test_rows_repeated_verbatim_are_counted_dropped_from_training_and_kept_in_test(tmp_path, capsys):
    """BoolQ rows carry no id (ids are row indices), so a verbatim repeat used to reach train.jsonl and the test file
    unnoticed. The counts equal those of the source lines (collections.Counter over them); training rows are dropped
    unless --keep-duplicates, test rows are kept as published; both are in the manifest and the report."""
    from frod_ds.prep.command import main

    train = [_boolq_row(i) for i in range(6)] + [_boolq_row(1), _boolq_row(4), _boolq_row(1)]
    eval_ = [_boolq_row(10 + i, i % 2 == 0) for i in range(4)] + [_boolq_row(11, False)]
    repeats = {role: sum(n - 1 for n in Counter(lines).values()) for role, lines in (("train", train), ("eval", eval_))}
    assert repeats == {"train": 3, "eval": 1}
    mirror = _boolq_mirror(tmp_path, train, eval_)
    out = tmp_path / "out"
    assert main(["build", "--source", str(mirror), "--tasks", "boolq", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["repeated"] == {"train": "dropped", "eval": "kept as published", "rows": {"boolq": repeats}}
    assert manifest["dropped"] == {"boolq": {"train": {"repeated row": 3}}}
    assert manifest["counts"]["boolq"]["train"]["kept"] == len(set(train)) == len(read_rows(out / "train.jsonl"))
    assert len(read_rows(out / "eval" / "boolq.jsonl")) == len(eval_)
    assert "repeated: boolq train: 3 row(s) repeat an earlier row verbatim: dropped" in report
    assert "repeated: boolq eval: 1 row(s) repeat an earlier row verbatim: kept as published" in report
    kept = tmp_path / "kept"
    assert main(["build", "--source", str(mirror), "--tasks", "boolq", "--out", str(kept), "--keep-duplicates"]) == 0
    assert len(read_rows(kept / "train.jsonl")) == len(train)
    assert json.loads((kept / "manifest.json").read_text())["repeated"]["train"] == "kept"


@pytest.mark.parametrize("role", ["train", "eval"])
def test_strict_refuses_a_repeated_row_naming_both(tmp_path, role):
    rows = [_boolq_row(0), _boolq_row(1), _boolq_row(0)]
    mirror = _boolq_mirror(tmp_path, rows if role == "train" else rows[:2], rows if role == "eval" else rows[:2])
    split = "train" if role == "train" else "validation"
    with pytest.raises(DataPrepError) as err:
        run_build(tmp_path / "out", source=mirror, tasks=("boolq",), strict=True)
    assert f"row id 'boolq-{split}-2' repeats row id 'boolq-{split}-0' verbatim (--strict" in str(err.value)
    assert_nothing_written(tmp_path / "out")
    with pytest.raises(DataPrepError, match="--keep-duplicates keeps repeated training rows, --strict refuses"):
        run_build(tmp_path / "out", source=mirror, tasks=("boolq",), strict=True, keep_duplicates=True)


def test_a_lone_surrogate_is_dropped_and_named_or_refused_under_strict(tmp_path, capsys):
    """``\\ud800`` in a source row decodes to a lone surrogate, which no tokenizer can encode (checked here with
    str.encode, what tokenizers do first): the build drops and names it; --strict refuses it."""
    bad = '{"question": "q", "answer": true, "passage": "broken \\ud800 text"}'
    with pytest.raises(UnicodeEncodeError):
        json.loads(bad)["passage"].encode("utf-8")
    mirror = _boolq_mirror(tmp_path, [_boolq_row(0), bad, _boolq_row(1)], [_boolq_row(5), _boolq_row(6)])
    manifest, _ = run_build(tmp_path / "out", source=mirror, tasks=("boolq",))
    assert manifest["dropped"] == {"boolq": {"train": {"lone surrogate (not Unicode text)": 1}}}
    assert "row id 'boolq-train-1': field 'prompt' holds a lone surrogate '\\ud800'" in capsys.readouterr().err
    for row in read_rows(tmp_path / "out" / "train.jsonl"):
        (row["prompt"] + row["answer"]).encode("utf-8")
    with pytest.raises(DataPrepError, match="row id 'boolq-train-1': field 'prompt' holds a lone surrogate"):
        run_build(tmp_path / "strict", source=mirror, tasks=("boolq",), strict=True)


def test_a_control_character_is_dropped_and_named_or_refused_under_strict(tmp_path, capsys):
    """A NUL (or any C0 control but tab and line breaks) is no dataset's text: a cut or mis-decoded file."""
    bad = json.dumps({"question": "q", "answer": True, "passage": "cut\x00 here"})
    tab = json.dumps({"question": "q2", "answer": False, "passage": "a\ttab\nand a line"})  # text, kept
    mirror = _boolq_mirror(tmp_path, [_boolq_row(0), bad, tab], [_boolq_row(5), _boolq_row(6)])
    manifest, _ = run_build(tmp_path / "out", source=mirror, tasks=("boolq",))
    assert manifest["dropped"] == {"boolq": {"train": {"control character (a damaged file)": 1}}}
    assert "row id 'boolq-train-1': field 'prompt' holds control character U+0000" in capsys.readouterr().err
    assert sorted(r["id"] for r in read_rows(tmp_path / "out" / "train.jsonl")) == ["boolq-train-0", "boolq-train-2"]
    with pytest.raises(DataPrepError, match="row id 'boolq-train-1': field 'prompt' holds control character U"):
        run_build(tmp_path / "strict", source=mirror, tasks=("boolq",), strict=True)
    assert_nothing_written(tmp_path / "strict")


@pytest.mark.parametrize("blank", ["", "   ", "\n\t "])
def test_a_question_of_whitespace_only_is_kept_as_published_and_refused_under_strict(tmp_path, blank):
    """The prompt of such a row is the template alone: it asks nothing. Rendered verbatim like every published row,
    it is refused under --strict, naming the field."""
    bad = json.dumps({"question": blank, "answer": True, "passage": "p"})
    mirror = _boolq_mirror(tmp_path, [_boolq_row(0), bad, _boolq_row(1)], [_boolq_row(5), _boolq_row(6)])
    run_build(tmp_path / "out", source=mirror, tasks=("boolq",))
    assert len(read_rows(tmp_path / "out" / "train.jsonl")) == 3
    with pytest.raises(DataPrepError, match="row index 1: blank field 'question'"):
        run_build(tmp_path / "strict", source=mirror, tasks=("boolq",), strict=True)
    assert_nothing_written(tmp_path / "strict")


def test_a_row_with_one_choice_is_dropped_from_the_build(tmp_path):
    """An ARC row with a single option renders to one choice: scoring it is a free point."""
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / "arc_easy", mirror / "arc_easy")
    test = (mirror / "arc_easy" / "test.jsonl").read_text().splitlines()
    one = json.loads(test[0])
    one.update(id="one", choices={"text": ["only"], "label": ["A"]}, answerKey="A")
    (mirror / "arc_easy" / "test.jsonl").write_text("\n".join([*test, json.dumps(one)]) + "\n")
    manifest, _ = run_build(tmp_path / "out", source=mirror, tasks=("arc_easy",))
    assert manifest["dropped"] == {"arc_easy": {"eval": {"fewer than two choices": 1}}}
    assert [r["id"] for r in read_rows(tmp_path / "out" / "eval" / "arc_easy.jsonl")] == [
        json.loads(x)["id"] for x in test if x.strip()
    ]


@pytest.mark.parametrize(
    ("task", "change", "detail"),
    [
        ("piqa", {"sol2": "@same"}, "is given 2 times"),
        ("winogrande", {"option2": "@same"}, "is given 2 times"),
        ("arc_easy", {"choices": {"text": ["a", "b", "a"], "label": ["A", "B", "C"]}, "answerKey": "B"}, "given 2"),
    ],
)
def test_a_row_whose_options_cannot_be_told_apart_is_dropped_or_refused(tmp_path, task, change, detail):
    """Two options with the same text: a training row teaching either is noise, a test row is a coin flip.
    The row (beside a good one in the mirror's training and test files) is dropped and counted in both splits;
    --strict refuses it naming the file and row."""
    mirror = tmp_path / "mirror"
    shutil.copytree(MIRROR / task, mirror / task)
    for path in sorted((mirror / task).glob("*.json*")):  # a JSON array or JSON lines
        rows = json.loads(path.read_text()) if path.suffix == ".json" else path.read_text().splitlines()
        good = rows[0] if path.suffix == ".json" else json.loads(rows[0])
        first = {"piqa": "sol1", "winogrande": "option1"}.get(task)
        bad = {**good, **{k: good[first] if v == "@same" else v for k, v in change.items()}}
        bad.pop("id", None)
        both = [good, bad]
        path.write_text(json.dumps(both) if path.suffix == ".json" else "".join(json.dumps(r) + "\n" for r in both))
    manifest, _ = run_build(tmp_path / "out", source=mirror, tasks=(task,))
    assert {role: got.get("unanswerable options") for role, got in manifest["dropped"][task].items()} == {
        "train": 1,
        "eval": 1,
    }
    with pytest.raises(DataPrepError, match=f"{task}: .* row index \\d+: .*{detail}.*\\(--strict\\)"):
        run_build(tmp_path / "strict", source=mirror, tasks=(task,), strict=True)
    assert_nothing_written(tmp_path / "strict")


def test_a_test_row_in_training_is_counted_kept_and_refused_under_strict(tmp_path, capsys):
    """A test row copied into training inflates its score: counted per task (equal to the lines the two source files
    share, computed here), both kept as published, --strict names both rows."""
    from frod_ds.prep.command import main

    train = [_boolq_row(i) for i in range(5)] + [_boolq_row(11, False), _boolq_row(12)]
    eval_ = [_boolq_row(10 + i, i % 2 == 0) for i in range(4)]
    shared = len(set(train) & set(eval_))
    assert shared == 2
    mirror = _boolq_mirror(tmp_path, train, eval_)
    out = tmp_path / "out"
    assert main(["build", "--source", str(mirror), "--tasks", "boolq", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["test_rows_in_training"] == {"rows": {"boolq": shared}, "action": "kept as published"}
    assert len(read_rows(out / "train.jsonl")) == len(train) and len(read_rows(out / "eval" / "boolq.jsonl")) == 4
    assert f"test rows in training: boolq: {shared} test row(s)" in capsys.readouterr().out
    with pytest.raises(DataPrepError, match="test row id 'boolq-validation-1' appears verbatim in training as row id"):
        run_build(tmp_path / "strict", source=mirror, tasks=("boolq",), strict=True)
    assert_nothing_written(tmp_path / "strict")


def test_training_refuses_a_build_whose_train_file_was_edited_since(tmp_path):
    """``data.train`` naming a data build (or its train.jsonl) is checked against the build's manifest, as eval and
    ``frod data stats`` check theirs: a row deleted since the build is refused, naming the file; the same edited
    file copied out of the build trains as the user's own; the unedited build passes."""
    import hashlib
    import json
    import shutil

    from frod_ds.train.data import DataError, training_file

    out = tmp_path / "d"
    run_build(out)
    train = out / "train.jsonl"
    assert training_file(out) == training_file(train) == train
    recorded = json.loads((out / "manifest.json").read_text())["files"]["train.jsonl"]
    assert recorded == hashlib.sha256(train.read_bytes()).hexdigest()
    lines = train.read_text().splitlines(True)
    train.write_text("".join(lines[:2] + lines[3:]))
    for given in (out, train):
        with pytest.raises(DataError, match=r"was changed after frod data build wrote it .*copy the file out"):
            training_file(given)
    mine = shutil.copy(train, tmp_path / "mine.jsonl")
    assert training_file(mine) == Path(mine)
    train.write_text("".join(lines))  # the edit undone: the build's own file again
    assert training_file(out) == train
