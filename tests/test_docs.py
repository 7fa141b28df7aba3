"""README.md and docs/*.md: generated tables equal what bench/results gives, relative links resolve, README stays short."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import readme_table

REPO = Path(__file__).resolve().parents[1]
MAX_README_LINES = 300
# Pages written on other branches (docs/slurm.md, docs/layout.md): linked from here before they land.
# Remove an entry once its page is in the tree, so the check covers it.
PENDING_PAGES = {"docs/slurm.md", "docs/layout.md"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return readme_table.doc_files(REPO)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_generated_blocks_match_the_committed_results(page: Path) -> None:
    text = page.read_text()
    opened = re.findall(r"^<!-- generated:", text, re.M)
    assert len(opened) == len(readme_table.block_names(text)), (
        f"{page.name}: a generated block's markers do not pair up")
    regenerated = readme_table.rewrite(text)
    assert regenerated == text, (f"{page.relative_to(REPO)}: a generated block differs from bench/results; "
                                 "run python bench/readme_table.py (do not edit generated blocks by hand)")


def test_every_generator_is_used_somewhere() -> None:
    used = {n for p in _pages() for n in readme_table.block_names(p.read_text())}
    assert used == set(readme_table.GENERATORS), f"unused generators: {set(readme_table.GENERATORS) - used}"


def test_a_hand_edited_number_is_rewritten() -> None:
    readme = (REPO / "README.md").read_text()
    edited = readme.replace("| **1.59×** |", "| **1.10×** |", 1)
    assert edited != readme, "the headline block no longer holds the 1-GPU ratio this test edits"
    assert readme_table.rewrite(edited) == readme


def test_headline_ratio_equals_the_two_config_jsons() -> None:
    # Independent of the generator's best-config search: the 1-GPU best configs are plain PyTorch for both.
    configs = REPO / "bench" / "results" / "train_matrix_4xh200" / "configs"
    frod = json.loads((configs / "train_step_frod_plain_1gpu.json").read_text())
    lora = json.loads((configs / "train_step_lora_plain_1gpu.json").read_text())
    others = [json.loads(p.read_text()) for p in configs.glob("train_step_*_1gpu.json")]
    assert all(d["step_s_median"] >= (frod if d["method"] == "frod" else lora)["step_s_median"] for d in others)
    ratio = frod["step_s_median"] / lora["step_s_median"]
    row = next(line for line in readme_table.headline(REPO / "bench" / "results").splitlines() if line.startswith("| 1 |"))
    assert f"**{ratio:.2f}×**" in row


def test_unknown_block_name_is_refused() -> None:
    with pytest.raises(KeyError, match="no-such-table"):
        readme_table.rewrite("<!-- generated:no-such-table -->\nx\n<!-- /generated:no-such-table -->\n")


def test_check_mode_reports_a_stale_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- generated:layer -->\nstale\n<!-- /generated:layer -->\n")
    monkeypatch.setattr(readme_table, "REPO", tmp_path)
    monkeypatch.setattr(readme_table, "doc_files", lambda repo=tmp_path: [tmp_path / "README.md"])
    assert readme_table.main(["--check"]) == 1
    assert "stale" in (tmp_path / "README.md").read_text()  # --check changes nothing
    assert readme_table.main([]) == 0
    assert readme_table.main(["--check"]) == 0


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_at_existing_files(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        rel = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
        if not path.exists() and rel not in PENDING_PAGES:
            missing.append(target)
    assert not missing, f"{page.relative_to(REPO)}: links to missing files: {missing}"


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move detail to docs/)"
