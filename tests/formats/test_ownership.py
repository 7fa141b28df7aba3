"""Who owns a folder (``frod_ds.formats.ownership``): every folder frod-ds writes records its kind and what it wrote;
``--overwrite`` (``remove_owned``, ``building_dir`` over an earlier output) removes exactly what the record lists and
refuses, listing them, when anything else is there, deleting nothing; a folder from before file lists is judged by
what its kind writes. The expected sets are written out here by hand, not read back from the module."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from frod_ds.formats.building import building_dir
from frod_ds.formats.output_dir import MARKER, match, read_record, stamps_of
from frod_ds.formats.ownership import (
    check_replaceable,
    delete_owned,
    foreign_files,
    inventory,
    mark_dir,
    record_files,
    remove_owned,
)
from frod_ds.runtime.errors import FrodError


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (directories as ``dir/``), files with the sha256 of their bytes."""
    return {
        p.relative_to(root).as_posix() + ("/" if p.is_dir() else ""): (
            "" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        )
        for p in sorted(root.rglob("*"))
    }


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


BUILD = {"train.jsonl": "t\n", "manifest.json": "{}\n", "eval/boolq.jsonl": "b\n", "eval/piqa.jsonl": "p\n"}


def data_build(out: Path) -> Path:
    with building_dir(out, "data-build") as tmp:
        write(tmp, BUILD)
    return out


def old_marker(path: Path, kind: str | None) -> None:
    """The record an older frod-ds wrote: the kind only (or not even that), no file list."""
    path.mkdir(parents=True, exist_ok=True)
    record = {"format": "frod-ds-output"} | ({"kind": kind} if kind else {})
    (path / MARKER).write_text(json.dumps(record) + "\n")


# -- the record -----------------------------------------------------------------------------------------------


def test_a_built_folder_records_its_kind_and_every_file_it_wrote(tmp_path):
    out = data_build(tmp_path / "data")
    record = read_record(out)
    assert (record.kind, record.version) == ("data-build", 2)
    assert sorted(record.files) == sorted(BUILD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temporary or lease left beside it


def test_inventory_lists_a_nested_output_as_one_folder_and_keeps_empty_folders(tmp_path):
    write(tmp_path, {"frod_import.json": "{}", "store/manifest.json": "{}", "store/q.V.safetensors": "v"})
    mark_dir(tmp_path / "store", "factor-store", ["manifest.json", "q.V.safetensors"])
    (tmp_path / "empty").mkdir()
    write(tmp_path, {"runs/a/adapter.safetensors": "a"})  # runs/ holds only a nested output: not an empty folder
    mark_dir(tmp_path / "runs" / "a", "adapter", ["adapter.safetensors"])
    assert inventory(tmp_path) == ["empty/", "frod_import.json", "runs/a/", "store/"]


@pytest.mark.parametrize(
    "entries,rel,is_dir,want",
    [
        (("train.jsonl",), "train.jsonl", False, "own"),
        (("train.jsonl",), "train.jsonl.frod-tmp", False, "own"),  # an atomic write in flight
        (("train.jsonl",), "train.jsonl.frod-tmp", True, None),  # a folder there is a user's (round 24)
        (("train.jsonl",), "train.jsonl.tmp", False, None),  # a user's file of the old temporary name
        (("train.jsonl",), "train.json", False, None),
        (("eval/*.jsonl",), "eval", True, "parent"),
        (("eval/*.jsonl",), "eval/boolq.jsonl", False, "own"),
        (("eval/*.jsonl",), "eval/notes.txt", False, None),
        (("checkpoints/",), "checkpoints/step00000002/model.pt", False, "own"),
        (("checkpoints/",), "checkpoints", False, None),  # a file where the listed folder belongs
        (("adapter-final/",), ".adapter-final.tmp-host-12-abcd_123", True, "own"),  # built under a temporary name
        (("adapter-final/",), ".adapter-final.frod-ds-lease", False, "own"),
        (("q_proj.rank[0-9]*.part[0-9]*.safetensors",), "q_proj.rank00001.part0003.safetensors", False, "own"),
        (("q_proj.rank[0-9]*.part[0-9]*.safetensors",), "k_proj.rank00001.part0003.safetensors", False, None),
        ((), MARKER, False, "own"),
        ((), "notes.txt", False, None),
    ],
)
def test_what_a_record_covers(entries, rel, is_dir, want):
    assert match(entries, rel, is_dir) == want


def test_record_files_of_a_folder_from_before_lists_keeps_its_kinds_files(tmp_path):
    """A run from before file lists (no record at all): the first entry added keeps what a run writes there."""
    write(tmp_path, {"metrics.jsonl": "{}\n", "adapter-step1/adapter.safetensors": "a"})
    record_files(tmp_path, ["recipe.yaml"], "training-run")
    files = read_record(tmp_path).files
    assert "recipe.yaml" in files and "adapter-*/" in files and "metrics.jsonl" in files
    assert foreign_files(tmp_path) == []


# -- --overwrite ----------------------------------------------------------------------------------------------


def test_overwrite_with_foreign_files_refuses_listing_them_and_deletes_nothing(tmp_path):
    out = data_build(tmp_path / "data")
    write(out, {"notes.txt": "mine", "eval/my_task.jsonl": "mine", "scratch/a.txt": "mine"})
    before = tree(tmp_path)
    with pytest.raises(FrodError) as e:
        remove_owned(out, "data-build")
    line = str(e.value)
    assert "\n" not in line
    for shown in ("notes.txt", "eval/my_task.jsonl", "scratch/"):
        assert shown in line, line
    for listed in ("train.jsonl", "eval/boolq.jsonl"):
        assert listed not in line
    assert tree(tmp_path) == before


def test_a_rebuild_over_foreign_files_is_refused_before_anything_is_built(tmp_path):
    out = data_build(tmp_path / "data")
    write(out, {"notes.txt": "mine"})
    before = tree(tmp_path)
    with pytest.raises(FrodError, match="notes.txt"):
        with building_dir(out, "data-build") as tmp:
            write(tmp, BUILD)
    assert tree(tmp_path) == before


def test_overwrite_removes_exactly_the_listed_files(tmp_path):
    """A folder whose record lists some files, a glob and a whole folder: exactly those go, then the folder."""
    out = tmp_path / "store"
    write(
        out,
        {
            "manifest.json": "{}",
            "q_proj.V.safetensors": "v",
            "q_proj.rank00000.part0000.safetensors": "u0",
            "q_proj.rank00001.part0000.safetensors": "u1",
            "logs/a.txt": "log",
            "logs/deep/b.txt": "log",
        },
    )
    parts = "q_proj.rank[0-9]*.part[0-9]*.safetensors"  # factor_store.file_globs: as HJD records them
    mark_dir(out, "factor-store", ["manifest.json", "q_proj.V.safetensors", parts, "logs/"])
    write(tmp_path, {"beside.txt": "not in the folder"})
    remove_owned(out, "factor-store")
    assert tree(tmp_path) == {"beside.txt": hashlib.sha256(b"not in the folder").hexdigest()}


@pytest.mark.parametrize("kind", ["factor-store", "data-build", "hf-export"])
def test_a_record_claiming_files_by_a_pattern_no_writer_records_is_not_trusted(tmp_path, kind):
    """A record whose list gained ``*`` (edited: no frod-ds writer records that) would make --overwrite delete a
    user's notes beside the output; such a record is trusted for nothing, and the refusal names the folder."""
    out = tmp_path / "out"
    write(out, {"manifest.json": "{}", "notes.txt": "mine"})
    mark_dir(out, kind, ["manifest.json", "*"])
    with pytest.raises(FrodError, match="holds what frod-ds did not write there"):
        remove_owned(out, kind)
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_of_an_earlier_build_replaces_it_with_the_new_one(tmp_path):
    out = data_build(tmp_path / "data")
    with building_dir(out, "data-build") as tmp:
        write(tmp, {"train.jsonl": "new\n", "manifest.json": "{}\n"})
    assert tree(out).keys() == {MARKER, "train.jsonl", "manifest.json"}
    assert (out / "train.jsonl").read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_listed_nested_output_is_judged_by_its_own_record(tmp_path):
    """A demo folder lists its data build; a file put into the data build since is foreign to the demo too."""
    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", ["demo.log", "data/"])
    write(demo, {"demo.log": "log"})
    data_build(demo / "data")
    assert foreign_files(demo) == []
    write(demo, {"data/eval/extra.jsonl": "mine"})
    assert foreign_files(demo) == ["data/eval/extra.jsonl"]
    (demo / "data/eval/extra.jsonl").unlink()
    remove_owned(demo, "demo")
    assert not demo.exists()


def test_a_demo_again_removes_its_training_run_and_keeps_what_it_did_not_write(tmp_path):
    """frod demo over its own output: the run/ folder its training wrote (recorded by training, listed by the demo)
    goes with the demo's other files; a file the user put beside them stays, and so does the demo folder."""
    from frod_ds.cli.demo import DEMO_FILES
    from frod_ds.train.run_dir import RUN_FILES, RUN_KIND, record_adapter

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    write(demo, {"demo.log": "log"})
    data_build(demo / "data")
    run = demo / "run"
    run.mkdir()
    record_files(run, RUN_FILES, RUN_KIND)
    record_adapter(run, "adapter-final")
    write(run, {"metrics.jsonl": "{}\n", "adapter-final/adapter_model.safetensors": "a"})
    assert foreign_files(demo) == []
    write(demo, {"notes.txt": "mine"})
    with pytest.raises(FrodError, match="notes.txt"):
        remove_owned(demo, "demo")  # the demo refuses to replace a folder holding the user's file
    (demo / "notes.txt").unlink()
    remove_owned(demo, "demo")
    assert not demo.exists()


def test_a_stamped_demo_refuses_an_edit_in_a_nested_output_written_in_place(tmp_path):
    """A finished demo stamps every file under it (``stamp_tree``): its replacement refuses a user's edit of its
    run's ``metrics.jsonl`` (a run is written in place and stamps nothing itself), naming it, and keeps it;
    with the edit undone the demo's files go."""
    from frod_ds.cli.demo import DEMO_FILES
    from frod_ds.formats.tree_stamps import stamp_tree
    from frod_ds.train.run_dir import RUN_FILES, RUN_KIND

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    write(demo, {"demo.log": "log"})
    run = demo / "run"
    run.mkdir()
    record_files(run, RUN_FILES, RUN_KIND)
    write(run, {"metrics.jsonl": '{"step": 1}\n'})
    stamp_tree(demo)
    write(run, {"metrics.jsonl": '{"step": 1}\nmine\n'})
    with pytest.raises(FrodError, match="changed since frod-ds wrote them: run/metrics.jsonl; refusing"):
        remove_owned(demo, "demo")
    assert (run / "metrics.jsonl").read_text().endswith("mine\n")
    run_record = json.loads((run / MARKER).read_text())
    (run / MARKER).write_text(json.dumps({**run_record, "written": stamps_of(run, ["metrics.jsonl"])}))
    stamp_tree(demo)
    stamped = (run / "metrics.jsonl").read_text()
    write(run, {"metrics.jsonl": "mine\n"})  # stamped at two levels (the run's record, the demo's): named once
    with pytest.raises(FrodError, match="changed since frod-ds wrote them: run/metrics.jsonl; refusing"):
        remove_owned(demo, "demo")
    write(run, {"metrics.jsonl": stamped})  # the same bytes again (a new mtime: hashed)
    remove_owned(demo, "demo")
    assert not demo.exists()


@pytest.mark.parametrize(
    "added",
    [
        "model/generation_config.json",
        "run/checkpoints/my-notes.txt",
        "run/mine.lnk",
        "model/mine_empty/",
        "run/checkpoints/step_mine/",
        "run/checkpoints/mine_dir.lnk",
        "model/.notes.frod-ds-lease",
        "model/sub/.frod-ds-output",
    ],
)
def test_a_stamped_demo_refuses_a_file_added_where_its_lists_name_whole_folders(tmp_path, added):
    """The demo lists ``model/`` whole, its run ``checkpoints/``: a file a user put there since the demo finished
    (a link, to a file or to a folder, an empty folder) is not the demo's, so the demo again refuses, naming it,
    and deletes nothing. A folder the demo itself left empty is the demo's."""
    from frod_ds.cli.demo import DEMO_FILES
    from frod_ds.formats.tree_stamps import stamp_tree
    from frod_ds.train.run_dir import RUN_FILES, RUN_KIND

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    write(demo, {"demo.log": "log", "model/config.json": "{}"})
    run = demo / "run"
    run.mkdir()
    record_files(run, RUN_FILES, RUN_KIND)
    write(run, {"metrics.jsonl": "{}\n", "checkpoints/latest": "step00000002"})
    (run / "checkpoints" / "emptied").mkdir()  # the demo's own
    stamp_tree(demo)
    mine = tmp_path / "mine"
    mine.mkdir()
    write(mine, {"notes.txt": "mine"})
    if added.endswith("dir.lnk"):
        (demo / added).symlink_to(mine, target_is_directory=True)
    elif added.endswith(".lnk"):
        (demo / added).symlink_to(demo / "demo.log")
    elif added.endswith("/"):
        (demo / added).mkdir()
    else:
        write(demo, {added: "mine"})
    before, theirs = tree(demo), tree(mine)
    with pytest.raises(FrodError, match=f"holds what frod-ds did not write there: {added}; refusing"):
        remove_owned(demo, "demo")
    assert tree(demo) == before and tree(mine) == theirs
    (demo / added).rmdir() if added.endswith("/") else (demo / added).unlink()
    if added.startswith("model/sub/"):
        (demo / "model" / "sub").rmdir()  # else an empty folder of the user's, refused as well
    remove_owned(demo, "demo")
    assert not demo.exists() and tree(mine) == theirs


@pytest.mark.parametrize(
    "added", ["model/notes.txt", "model/mine/", "model/.x.frod-ds-lease", "raw/config.json", "eval/notes.txt"]
)
def test_a_stopped_demo_refuses_what_a_user_added_to_a_folder_it_published_sealed(tmp_path, added):
    """A demo stopped after it published ``model/`` and ``raw/`` (its list names both whole): a file, an empty folder
    or a lease-named file a user put there, or an edit of the demo's file, is refused, not deleted with the
    folder; so is a file in a stage's folder the demo has not reached (``eval/``). A demo's own temporary folder, a
    stage's output (its own record), and a stage in progress are the demo's."""
    from frod_ds.cli.demo import DEMO_FILES, DEMO_FOLDERS
    from frod_ds.formats.sibling_names import owned_sibling
    from frod_ds.formats.tree_stamps import nest, publish_sealed, seal_folders

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    seal_folders(demo, DEMO_FOLDERS)
    nest(demo, "data")
    data_build(demo / "data")
    parts = {"raw": {"boolq/train.json": "[]", "piqa/empty/.keep": ""}, "model": {"config.json": "{}"}}
    for name, files in parts.items():
        built = owned_sibling(demo / name, "tmp")
        write(built, files)
        (built / "nothing").mkdir()
        publish_sealed(demo, name, built)
    write(demo, {"demo.log": "log"})
    write(owned_sibling(demo / "tokenizer", "tmp"), {"half.json": "{"})  # a stage stopped mid-way, beside its name
    before_ok = tree(demo)
    if added.endswith("/"):
        (demo / added).mkdir()
    elif added == "raw/config.json":
        (demo / "raw" / "boolq" / "train.json").write_text("[1]")
    else:
        write(demo, {added: "mine"})
    before = tree(demo)
    with pytest.raises(FrodError, match="holds (what frod-ds did not write there|files changed since)") as e:
        remove_owned(demo, "demo")
    assert (added if added != "raw/config.json" else "raw/boolq/train.json") in str(e.value)
    assert tree(demo) == before != before_ok
    if added == "raw/config.json":
        (demo / "raw" / "boolq" / "train.json").write_text("[]")
    else:
        (demo / added).rmdir() if added.endswith("/") else (demo / added).unlink()
    remove_owned(demo, "demo")
    assert not demo.exists()


@pytest.mark.parametrize(
    "added",
    [
        None,
        "checkpoints/notes.txt",
        "checkpoints/step00000002/notes.txt",
        "checkpoints/step00000002/mine.pt",  # a .pt name no save writes
        "tensorboard/notes.txt",
        "tensorboard/events.out.tfevents.mine",  # an event-file name SummaryWriter never gives
        "profile/step-2.rank0.txt",
    ],
)
def test_a_runs_record_names_what_a_save_writes_so_a_users_file_in_checkpoints_stays(tmp_path, added):
    """A stopped demo's training run: its record names the files a save writes (engine ``*.pt``, the seal, the
    trainable state, the identity records, the pointers beside the saves) and its logs, so the demo again removes
    every one of them and refuses, naming it, a file a user put in checkpoints/, in a save or in tensorboard/."""
    from frod_ds.cli.demo import DEMO_FILES
    from frod_ds.formats.run_identity import RUN_IDENTITY
    from frod_ds.train.checkpoints import COMPLETE, ROOT_FILES
    from frod_ds.train.identity import STORE_IDENTITY
    from frod_ds.train.run_dir import RUN_KIND, RUN_RECORD
    from frod_ds.train.trainable_state import TRAINABLE_STATE

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    run = demo / "run"
    run.mkdir()
    record_files(run, RUN_RECORD, RUN_KIND)
    save = ["mp_rank_00_model_states.pt", "rng_rank1.pt", COMPLETE, TRAINABLE_STATE, STORE_IDENTITY, RUN_IDENTITY]
    save += ["zero_pp_rank_1_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    write(run, {"metrics.jsonl": "{}\n", **{f"checkpoints/{n}": n for n in ROOT_FILES}})
    write(run, {"profile/step-000002.rank1.txt": "p", "tensorboard/events.out.tfevents.1764.host.a.7.0": "e"})
    write(run, {f"checkpoints/step0000000{s}/{n}": n for s in (1, 2) for n in save})
    write(run, {"checkpoints/step00000003/zero_pp_rank_0_mp_rank_00_optim_states.pt": "a save stopped mid-way"})
    if added is None:
        remove_owned(demo, "demo")
        assert not demo.exists()
        return
    write(run, {added: "mine"})
    before = tree(demo)
    with pytest.raises(FrodError, match=f"holds what frod-ds did not write there: run/{added}; refusing"):
        remove_owned(demo, "demo")
    assert tree(demo) == before


@pytest.mark.parametrize("finished", [True, False])
@pytest.mark.parametrize("at", ["model/mybuild", "eval"])
def test_a_frod_output_a_user_copied_into_a_demo_is_theirs(tmp_path, finished, at):
    """A data build a user copied into the demo's ``model/``, or at the name of a stage the stopped demo has not
    reached, holds a record of its own but is no output of the demo's: named and refused, not deleted. The demo's
    own stage outputs (``data/``) are passed over."""
    from frod_ds.cli.demo import DEMO_FILES, DEMO_FOLDERS
    from frod_ds.formats.sibling_names import owned_sibling
    from frod_ds.formats.tree_stamps import nest, publish_sealed, seal_folders, stamp_tree

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    seal_folders(demo, DEMO_FOLDERS)
    built = owned_sibling(demo / "model", "tmp")
    write(built, {"config.json": "{}"})
    publish_sealed(demo, "model", built)
    nest(demo, "data")
    data_build(demo / "data")
    if finished:
        stamp_tree(demo)
    if finished and at == "eval":
        at = "run/mybuild"
    data_build(demo / at)
    before = tree(demo)
    with pytest.raises(FrodError, match=f"holds what frod-ds did not write there: {at}/"):
        remove_owned(demo, "demo")
    assert tree(demo) == before
    shutil.rmtree(demo / ("run" if at.startswith("run/") else at))  # the folder the copy made, the user's too
    remove_owned(demo, "demo")
    assert not demo.exists()


def test_a_nested_output_another_command_rewrote_and_restamped_does_not_stop_the_demo(tmp_path):
    """A data build inside the demo stamps its own files; a command that rewrites them and restamps its record (as
    an eval into its earlier results does) leaves the demo replaceable: the demo's stamps skip what a nested
    record stamps."""
    from frod_ds.cli.demo import DEMO_FILES
    from frod_ds.formats.ownership import restamp
    from frod_ds.formats.tree_stamps import stamp_tree

    demo = tmp_path / "demo"
    demo.mkdir()
    mark_dir(demo, "demo", DEMO_FILES)
    write(demo, {"demo.log": "log"})
    data_build(demo / "data")
    stamp_tree(demo)
    write(demo, {"data/train.jsonl": "rewritten by frod-ds\n"})
    restamp(demo / "data", ["train.jsonl"])
    remove_owned(demo, "demo")
    assert not demo.exists()


def test_another_commands_output_inside_is_named_by_its_kind(tmp_path):
    out = data_build(tmp_path / "data")
    with building_dir(out / "kept" / "adapter-final", "adapter") as tmp:
        write(tmp, {"adapter.safetensors": "a"})
    with pytest.raises(FrodError, match=r"kept/adapter-final/ \(a trained adapter\)"):
        check_replaceable(out, "data-build")


def test_delete_owned_keeps_what_appeared_since_the_check(tmp_path):
    """What a replace does with the old folder once the new one is in place: its listed files go, a file written
    into it meanwhile stays (returned), and so does the folder holding it."""
    out = data_build(tmp_path / "data")
    write(out, {"eval/late.jsonl": "mine"})
    assert delete_owned(out) == ["eval/late.jsonl"]
    assert tree(out) == {"eval/": "", "eval/late.jsonl": hashlib.sha256(b"mine").hexdigest()}  # no record left


# -- outputs from before file lists --------------------------------------------------------------------------


def test_an_old_record_stands_for_the_files_its_kind_writes(tmp_path):
    out = tmp_path / "ev"
    old_marker(out, "eval-results")
    write(out, {"results.json": "{}", "results.md": "|", "predictions.jsonl": "{}"})
    check_replaceable(out, "eval-results")
    write(out, {"my_analysis.ipynb": "{}"})
    with pytest.raises(FrodError, match="my_analysis.ipynb"):
        check_replaceable(out, "eval-results")
    (out / "my_analysis.ipynb").unlink()
    remove_owned(out, "eval-results")
    assert not out.exists()


def test_an_unmarked_folder_recognised_by_a_file_name_holds_only_that_kinds_files(tmp_path):
    """``results.json`` alone no longer makes a folder an earlier eval's: anything eval does not write is refused."""
    out = tmp_path / "mine"
    write(out, {"results.json": "{}", "thesis.tex": "mine"})
    legacy = lambda p: (p / "results.json").is_file()  # noqa: E731 - eval's own recogniser, in short
    with pytest.raises(FrodError, match="thesis.tex"):
        check_replaceable(out, "eval-results", legacy=legacy)
    (out / "thesis.tex").unlink()
    check_replaceable(out, "eval-results", legacy=legacy)


def test_a_marker_of_no_kind_is_never_replaced(tmp_path):
    out = tmp_path / "old"
    old_marker(out, None)
    write(out, {"a.txt": "x"})
    before = tree(tmp_path)
    with pytest.raises(FrodError, match="no kind"):
        remove_owned(out, "data-build")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["to a marked folder", "loop", "dangling"])
def test_an_output_that_is_a_symbolic_link_is_refused_naming_the_link(tmp_path, kind):
    """An output path that is a link (to an earlier output of the same kind, to itself, to nothing) is refused in
    one line saying it is a link and what to pass instead, never written through; the link and its target stay."""
    real = tmp_path / "store"
    real.mkdir()
    mark_dir(real, "factor-store", ["manifest.json"])
    (real / "manifest.json").write_text("{}")
    link = tmp_path / "out"
    if kind == "to a marked folder":
        link.symlink_to(real)
        says = f"is a symbolic link to {real}: frod-ds writes only into a real directory, not through a link; pass"
    elif kind == "loop":
        link.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(link)
        says = "is a symbolic link loop: frod-ds writes only into a real directory"
    else:
        link.symlink_to(tmp_path / "gone")
        says = f"is a symbolic link to {tmp_path / 'gone'}, not there"
    links = {p.name: os.readlink(p) for p in tmp_path.iterdir() if p.is_symlink()}
    before = tree(real)
    with pytest.raises(FrodError, match=f"^--out {link} {re.escape(says)}"):
        check_replaceable(link, "factor-store")
    assert tree(real) == before and links == {p.name: os.readlink(p) for p in tmp_path.iterdir() if p.is_symlink()}


def test_a_write_once_output_refuses_a_user_file_its_edited_record_lists(tmp_path):
    """A user's file added to a published output and then written into its record's list (by hand or by a tool) is
    still the user's: the output's stamps, taken when it was published, do not name it. The replacement refuses,
    naming it, and leaves everything; the same folder without the forged entry is replaced."""
    out = tmp_path / "build"
    with building_dir(out, "data-build") as tmp:
        write(tmp, {"train.jsonl": "{}\n", "manifest.json": "{}\n"})
    (out / "notes.txt").write_text("mine\n")
    record = json.loads((out / MARKER).read_text())
    record["files"] = sorted([*record["files"], "notes.txt"])
    (out / MARKER).write_text(json.dumps(record))
    before = tree(out)
    with pytest.raises(FrodError, match=r"holds files frod-ds did not write there, though its .* lists them: notes"):
        check_replaceable(out, "data-build")
    with pytest.raises(FrodError, match="did not write there"):
        with building_dir(out, "data-build") as tmp:
            write(tmp, {"train.jsonl": "new\n"})
    assert tree(out) == before
    (out / "notes.txt").unlink()  # the entry alone names nothing there: replaced as before
    with building_dir(out, "data-build") as tmp:
        write(tmp, {"train.jsonl": "new\n"})
    assert (out / "train.jsonl").read_text() == "new\n"


def test_a_write_once_output_refuses_replacement_of_a_file_edited_since(tmp_path):
    """``building_dir`` stamps each published file's size, mtime and sha256 (checked here with hashlib); a later
    replacement refuses a folder whose file was edited (other bytes, or another size), naming it and leaving
    everything; a copy of the folder (new mtimes, same bytes) and the edit undone both pass."""
    import shutil

    out = tmp_path / "export"
    with building_dir(out, "hf-export") as tmp:
        write(tmp, {"config.json": '{"a": 1}\n', "sub/model.safetensors": "weights"})
    written = read_record(out).written
    for rel, (size, mtime_ns, sha) in written.items():
        st = (out / rel).stat()
        assert (size, mtime_ns) == (st.st_size, st.st_mtime_ns)
        assert sha == hashlib.sha256((out / rel).read_bytes()).hexdigest()
    assert sorted(written) == ["config.json", "sub/model.safetensors"]
    check_replaceable(out, "hf-export")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, copy_function=shutil.copy)  # bytes kept, mtimes new
    check_replaceable(copy, "hf-export")
    for edit in ('{"a": 2}\n', '{"a": 10}\n'):  # the same size, then another
        (out / "config.json").write_text(edit)
        before = tree(out)
        with pytest.raises(FrodError, match=r"holds files changed since frod-ds wrote them: config.json; refusing"):
            check_replaceable(out, "hf-export")
        with pytest.raises(FrodError, match="changed since frod-ds wrote them"):
            with building_dir(out, "hf-export") as tmp:
                write(tmp, {"config.json": "new\n"})
        assert tree(out) == before
    (out / "config.json").write_text('{"a": 1}\n')
    with building_dir(out, "hf-export") as tmp:
        write(tmp, {"config.json": "new\n"})
    assert (out / "config.json").read_text() == "new\n" and not (out / "sub").exists()


def test_an_earlier_output_that_cannot_be_moved_aside_is_kept_with_one_line(tmp_path, monkeypatch):
    """A mount point (EBUSY) cannot be renamed: --overwrite is refused naming why, the earlier build stays as it was
    and nothing is left beside it (the new build and the empty aside folder are gone)."""
    import errno

    from frod_ds.formats import ownership

    out = data_build(tmp_path / "data")
    before = tree(out)
    rename = os.rename

    def busy(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return rename(src, dst)

    monkeypatch.setattr(ownership.os, "rename", busy)
    with pytest.raises(FrodError) as e:
        with building_dir(out, "data-build") as tmp:
            write(tmp, {"train.jsonl": "new\n", "manifest.json": "{}\n"})
    assert str(e.value).startswith(f"cannot replace {out}: it cannot be moved aside (it is a mount point)")
    assert "\n" not in str(e.value) and tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_replaced_output_that_cannot_be_deleted_is_named_and_the_new_one_stands(tmp_path, monkeypatch, capsys):
    """The new build is in place when the old one turns out undeletable (a file made immutable, EPERM): that is no
    failure of the build, whose exit would say nothing was written; what is left of the old one is named."""
    import errno

    from frod_ds.formats import ownership

    out = data_build(tmp_path / "data")
    unlink = Path.unlink

    def immutable(path, *a, **kw):
        if path.name == "train.jsonl" and ".data.old-" in str(path):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))
        return unlink(path, *a, **kw)

    monkeypatch.setattr(ownership.Path, "unlink", immutable)
    with building_dir(out, "data-build") as tmp:
        write(tmp, {"train.jsonl": "new\n", "manifest.json": "{}\n"})
    assert (out / "train.jsonl").read_text() == "new\n"
    (aside,) = [p for p in tmp_path.iterdir() if p.name != "data"]
    assert aside.name.startswith(".data.old-") and (aside / "data" / "train.jsonl").read_text() == "t\n"
    err = capsys.readouterr().err
    assert f"{out} is written, but the output it replaced could not be deleted entirely" in err
    assert f"what is left of it is in {aside}: delete it yourself" in err


def test_a_write_once_output_refuses_a_stamped_file_replaced_by_a_link(tmp_path):
    """A user who put a link where the writer's file was (to their own file, even of the same bytes) owns that
    entry: replacing the output is refused naming it, and the link and its target are left as they were."""
    out = data_build(tmp_path / "data")
    mine = tmp_path / "mine.jsonl"
    mine.write_text((out / "train.jsonl").read_text())
    (out / "train.jsonl").unlink()
    (out / "train.jsonl").symlink_to(mine)
    with pytest.raises(FrodError, match=r"holds files changed since frod-ds wrote them: train.jsonl; refusing"):
        with building_dir(out, "data-build") as tmp:
            write(tmp, {"train.jsonl": "new\n"})
    assert (out / "train.jsonl").is_symlink() and (out / "train.jsonl").resolve() == mine
    assert mine.read_text() == BUILD["train.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "mine.jsonl"]


@pytest.mark.parametrize(
    "what, says",
    [
        ("fifo", "holds files changed since frod-ds wrote them: eval/boolq.jsonl; refusing"),
        ("folder", "holds what frod-ds did not write there: eval/boolq.jsonl/; refusing"),
    ],
)
def test_a_write_once_output_refuses_a_stamped_file_replaced_by_a_pipe_or_folder(tmp_path, what, says):
    """A named pipe or a folder where the writer's file was is the user's too: refused, naming it, left as it was."""
    out = data_build(tmp_path / "data")
    target = out / "eval" / "boolq.jsonl"
    target.unlink()
    if what == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
        (target / "notes.md").write_text("mine")
    with pytest.raises(FrodError, match=re.escape(says)):
        with building_dir(out, "data-build") as tmp:
            write(tmp, {"train.jsonl": "new\n"})
    assert target.is_fifo() if what == "fifo" else (target / "notes.md").read_text() == "mine"
    assert (out / "train.jsonl").read_text() == BUILD["train.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_published_output_folder_has_the_umasks_mode_like_a_plain_mkdir(tmp_path, mask):
    """A write-once output (a data build, an export, an eval, an adapter) is built in a temporary that mkdtemp makes
    private; published, it must have the mode any folder the user creates gets, so a group sharing a project
    directory can read it when the umask lets them."""
    old = os.umask(mask)
    try:
        (tmp_path / "plain").mkdir()
        with building_dir(tmp_path / "out", "data-build") as tmp:
            (tmp / "train.jsonl").write_text("{}\n")
    finally:
        os.umask(old)
    want = (tmp_path / "plain").stat().st_mode & 0o777
    assert want == 0o777 & ~mask and (tmp_path / "out").stat().st_mode & 0o777 == want
