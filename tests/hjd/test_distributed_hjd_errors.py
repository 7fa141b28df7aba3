"""Bad inputs to ``launch/hjd.py``: one clear ``error:`` line, a non-zero exit, and never a store that
looks complete. Mostly in-process (``main()`` returns the exit code); the exit codes and the cross-rank
agreement on an error are checked once each as real processes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from frod_ds.io.hf_checkpoint import HFCheckpoint
from frod_ds.model.store_reader import FactorStore
from launch.hjd import main
from tests.support.helpers_ckpt import REPO, run_hjd, shard_of, write_tiny_llama

Q0 = "model.layers.0.self_attn.q_proj.weight"


def _no_complete_store(out) -> bool:
    manifest = out / "manifest.json"
    return not manifest.exists() or json.loads(manifest.read_text())["complete"] is False


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.fixture
def model(tmp_path):
    return write_tiny_llama(tmp_path / "model")


def test_hjd_missing_shard_is_a_user_error(model, tmp_path, capsys):
    shard = shard_of(model, Q0)
    shard.unlink()
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert shard.name in line and "download" in line
    assert not out.exists()


def test_hjd_truncated_shard_exits_2_as_a_process(model, tmp_path):
    shard = shard_of(model, "model.layers.1.mlp.up_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    out = tmp_path / "store"
    proc = run_hjd(["--model", str(model), "--out", str(out)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = _error_lines(proc.stderr)
    assert f"{shard} is truncated or corrupt" in line
    assert _no_complete_store(out) and not out.exists()


@pytest.mark.parametrize("targets", ["q_proj,qkv_proj", "lm_head"])
def test_hjd_targets_training_cannot_take_are_refused(model, tmp_path, capsys, targets):
    """A store of other linears (lm_head, a fused qkv_proj) could never be trained with: model.targets takes the
    LLaMA decoder linears only. Refused with the arguments, naming them, before anything is read or written."""
    out = tmp_path / "store"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model), "--out", str(out), "--targets", targets])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"--targets {targets.split(',')[-1]}: not LLaMA decoder linears (q_proj" in line
    assert not out.exists()


def test_hjd_no_target_found(model, tmp_path, capsys):
    """A LLaMA linear the checkpoint lacks (every gate_proj removed, the index too) is named."""
    index = json.loads((model / "model.safetensors.index.json").read_text())
    for shard in {f for k, f in index["weight_map"].items() if ".gate_proj." in k}:
        kept = {k: v for k, v in load_file(str(model / shard)).items() if ".gate_proj." not in k}
        save_file(kept, str(model / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if ".gate_proj." not in k}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj,gate_proj"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "gate_proj" in line and "--targets" in line, line
    assert not out.exists()


def test_hjd_bad_flags_and_not_a_model(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "s")]) == 2
    assert "no model.safetensors.index.json" in _error_lines(capsys.readouterr().err)[0]
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "s"), "--pi", "0"]) == 2
    assert "--pi" in _error_lines(capsys.readouterr().err)[0]
    with pytest.raises(SystemExit) as stop:  # a check's setting on a build: meant for --verify, refused
        main(["--model", str(tmp_path), "--out", str(tmp_path / "s"), "--tol", "1e-3"])
    assert stop.value.code == 2 and "--tol is a setting of --verify DIR's checks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a value no check takes: named as such first
        main(["--model", str(tmp_path), "--out", str(tmp_path / "s"), "--tol", "-1"])
    assert stop.value.code == 2 and "--tol must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_hjd_existing_store_with_other_config_needs_overwrite(model, tmp_path, capsys):
    out = tmp_path / "store"
    base = ["--model", str(model), "--out", str(out), "--targets", "q_proj", "--device", "cpu"]
    assert main(base) == 0
    assert main(base + ["--pi", "0.01"]) == 2
    assert "different configuration (pi: 0.001 there, 0.01 now)" in _error_lines(capsys.readouterr().err)[0]
    assert FactorStore.open(out).pi == 1e-3, "the old store is untouched"
    assert main(base + ["--pi", "0.01", "--overwrite"]) == 0
    assert FactorStore.open(out).pi == 0.01
    (out / "notes.txt").write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    assert main(["--model", str(model), "--out", str(other), "--targets", "q_proj"]) == 2
    assert "not empty" in _error_lines(capsys.readouterr().err)[0]


def test_hjd_verify_passes_then_catches_another_model_and_corruption(model, tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj", "v_proj"]) == 0
    assert main(["--verify", str(out), "--model", str(model), "--samples", "3"]) == 0
    # a check that could not fail (no member) or would fail a good store (no tolerance) is refused as a usage error
    for bad, said in (
        ("--samples=0", "--samples must be an integer >= 1"),
        ("--samples=-1", "--samples must be"),
        ("--tol=-1", "--tol must be a finite number > 0"),
        ("--tol=nan", "--tol must be"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main(["--verify", str(out), "--model", str(model), bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, bad
    other = write_tiny_llama(tmp_path / "other", seed=3)
    capsys.readouterr()
    assert main(["--verify", str(out), "--model", str(other)]) == 1
    err = capsys.readouterr().err
    assert "fingerprint" in err
    (line,) = _error_lines(err)  # the details, then one error line naming the store and what to do
    assert f"factor store {out} failed verification" in line and "check --model" in line
    assert "--overwrite" not in line, "a good store of another model is not to be replaced"
    # A U tensor overwritten in place: the fingerprint still matches, the reconstruction does not.
    store = FactorStore.open(out)
    member = store.categories["v_proj"][1]
    part = store.file_of(member + ".U")
    tensors = load_file(part)
    tensors[member + ".U"] = torch.flip(tensors[member + ".U"], dims=[0]).contiguous()
    save_file(tensors, part)
    assert main(["--verify", str(out), "--model", str(model), "--samples", "3"]) == 1
    assert f"{member}: reconstruction error" in capsys.readouterr().err
    assert main(["--verify", str(tmp_path / "nowhere"), "--model", str(model)]) == 2


def test_hjd_nan_on_one_rank_stops_every_rank_and_leaves_no_store(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    bad = "model.layers.2.self_attn.k_proj.weight"  # layer 2 belongs to rank 1 of 2
    shard = shard_of(model, bad)
    tensors = load_file(shard)
    tensors[bad][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "store"
    proc = run_hjd(["--model", str(model), "--out", str(out), "--targets", "q_proj", "k_proj"], nproc=2)
    assert proc.returncode != 0
    (line,) = _error_lines(proc.stderr)  # from rank 0 only, although rank 1 found it
    assert bad in line and "NaN" in line
    assert not out.exists(), "a store this run created and refused is not left behind"


def test_hjd_refuses_a_weight_of_zeros_naming_it_and_leaves_no_store(tmp_path, capsys):
    """A zero weight decomposes "exactly" into a zero U_i, which FRoD can never move: refused, not stored."""
    model = write_tiny_llama(tmp_path / "model")
    bad = "model.layers.1.self_attn.q_proj.weight"
    shard = shard_of(model, bad)
    tensors = load_file(shard)
    tensors[bad] = torch.zeros_like(tensors[bad])
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "store"
    capsys.readouterr()
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj", "k_proj"]) != 0
    (line,) = _error_lines(capsys.readouterr().err)
    assert bad in line and "all zeros" in line
    assert not out.exists()
    tensors[bad][3, 5] = 1e-3  # one entry is enough: a rank-1 member with a non-zero U_i column
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj", "k_proj"]) == 0
    U = FactorStore.open(out).load_U(bad.removesuffix(".weight"))
    assert U.abs().sum() > 0


def test_hjd_verify_reports_a_changed_byte_in_any_member_file(model, tmp_path, capsys):
    """``--verify`` checks the checksum of every file (every member), not only the sampled reconstructions."""
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj", "--part-mb", "0.000001"]) == 0
    store = FactorStore.open(out)
    last = store.categories["q_proj"][-1]
    part = store.file_of(last + ".sigma")
    data = bytearray(part.read_bytes())
    data[-1] ^= 0x10  # the last σ entry of the last member: outside --samples 1's pick most of the time
    part.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["--verify", str(out), "--model", str(model), "--samples", "1", "--seed", "1"]) == 1
    err = capsys.readouterr().err
    assert f"q_proj: factor store file {part} is corrupt" in err


def test_a_factor_write_on_a_full_disk_is_the_full_disk_line(tmp_path):
    """A factor file's write fails in the writer thread, seen when HJD waits for it: the same one line as a full
    disk anywhere else (which write fills the disk first depends on timing)."""
    import errno
    from types import SimpleNamespace

    from frod_ds.hjd.stage import _Recorder
    from frod_ds.runtime.errors import FrodError

    target = tmp_path / "v_proj.V.safetensors"

    class Writes:
        phase_seconds: dict = {}

        def wait(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))

    recorder = _Recorder.__new__(_Recorder)  # no manifest writer: the error comes before any record
    recorder.cfg, recorder.manifest, recorder.writer = SimpleNamespace(out=tmp_path), None, None
    recorder.pending = ("v_proj", Writes(), 0.0)
    with pytest.raises(FrodError) as raised:
        recorder.record_pending()
    assert str(raised.value) == (
        f"cannot write {target}: No space left on device; free space on that disk (or "
        "choose another location) and re-run the same command"
    )


def _scaled(model, name: str, factor: float):
    """Multiply one weight of ``model`` by ``factor`` in its shard (finite: no NaN check catches it)."""
    shard = shard_of(model, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name] * factor
    save_file(tensors, shard, metadata={"format": "pt"})


def _true_error(model, category: str, method: str = "householder") -> list[float]:
    """Independent of the stage's probe: the fp32 HJD (``method``'s route) of the category's weights, rebuilt densely
    in fp64, relative to each weight (what a store of these weights would hold)."""
    from frod_ds.hjd.math import decompose

    ckpt = HFCheckpoint(model)
    names = sorted(k for k in ckpt.keys() if k.endswith(f"{category}.weight"))
    Ws = [ckpt.get(n) for n in names]
    res = decompose(Ws, dtype=torch.float32, method=method)
    return [
        float((U.double() * s.double() @ res.V.double().T - W.double()).norm() / W.double().norm())
        for W, U, s in zip(Ws, res.U, res.sigma)
    ]


@pytest.mark.parametrize(
    "category, factor, route, off",
    [("k_proj", 1e20, "householder", 0), ("q_proj", 1e-30, "gram", 1)],
)
def test_hjd_refuses_factors_the_probe_finds_off_and_keeps_none_of_them(
    model, tmp_path, capsys, category, factor, route, off
):
    """One layer of a category scaled by a finite factor. k_proj (16×32 per layer) ×1e20: the stack's QR cannot hold
    the small layers, whose reconstruction is off by orders of magnitude; q_proj ×1e-30: the column norms of the tiny
    layer's factors underflow in fp32, its factors are all zero (both checked independently). The stage refuses
    before the store is recorded complete, names the member, and leaves no store; a store that existed keeps its
    complete categories and loses the refused one's files."""
    _scaled(model, f"model.layers.1.self_attn.{category}.weight", factor)
    truth = _true_error(model, category, route)
    assert truth[off] > 0.5 and truth[1 - off] < 1e-4, truth
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"HJD of {category} does not reconstruct model.layers.{off}.self_attn.{category}.weight" in line, line
    assert "random probe vectors" in line and "float32" in line
    assert not out.exists()
    other = "v_proj"
    base = ["--model", str(model), "--out", str(out), "--device", "cpu", "--targets", other, category]
    assert main([*base, "--categories", other]) == 0
    assert main([*base, "--categories", category]) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["completed_categories"] == [other] and manifest["complete"] is False
    assert not any(p.name.startswith(category) for p in out.iterdir()), "the refused category's files are gone"


def test_hjd_refuses_a_category_whose_every_member_overflows_the_compute_precision(model, tmp_path, capsys):
    """Every v_proj ×1e30: the fp64 probe reconstructs (HJD is scale-equivariant: V takes the scale), but the fp32
    reconstruction error overflows (checked here in fp32 independently), and a run in fp32 on such weights learns
    nothing. Refused, naming the category, a member and its largest entry; no store is left."""
    names = [f"model.layers.{i}.self_attn.v_proj.weight" for i in (0, 1)]
    for name in names:
        _scaled(model, name, 1e30)
    W = load_file(shard_of(model, names[0]))[names[0]]
    assert torch.isfinite(W).all() and not torch.isfinite(W.float().square().sum())
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "HJD of v_proj: the reconstruction error of model.layers." in line, line
    assert "overflows in float32" in line and "entries up to" in line, line
    assert not out.exists()


def test_hjd_of_a_well_posed_category_at_a_huge_scale_passes_the_probe(tmp_path, capsys):
    """q_proj (32×32 per layer: each member full rank, a well-conditioned stack) with one layer ×1e20 reconstructs
    at fp32 level on the Gram route the stage takes there (independently checked), so the same probe that refuses
    the case above lets it through; --verify agrees."""
    model = write_tiny_llama(tmp_path / "model", num_hidden_layers=2)
    _scaled(model, "model.layers.1.self_attn.q_proj.weight", 1e20)
    assert max(_true_error(model, "q_proj", "gram")) < 1e-5
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu", "--targets", "q_proj"]) == 0
    store = FactorStore.open(out)
    assert store.complete and store.record("q_proj").method == "gram"
    assert main(["--verify", str(out), "--model", str(model), "--samples", "2"]) == 0


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_hidden_layers": 4}, "the weights hold decoder layers 0-2, the config gives num_hidden_layers 4"),
        ({"hidden_size": 64}, "layers.0.mlp.down_proj.weight has shape [32, 48], the config gives [64, 48]"),
        ({"num_key_value_heads": 4}, "k_proj.weight has shape [16, 32], the config gives [32, 32]"),
        ({"vocab_size": 65}, "lm_head.weight has shape [64, 32], the config gives [vocab_size, hidden_size] [65, 32]"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": 10**30}, "hidden_size of 31 digits is beyond any model (at most 16777216)"),
        ({"vocab_size": 2**24 + 1}, "vocab_size 16777217 is beyond any model (at most 16777216)"),
        ({"num_hidden_layers": None}, "it names no num_hidden_layers, which transformers would fill with its defaults"),
        ({"vocab_size": None, "intermediate_size": None}, "it names no intermediate_size, vocab_size, which"),
    ],
)
def test_hjd_refuses_a_config_that_does_not_describe_the_weights(model, tmp_path, capsys, change, needle):
    """HJD reads only the weights, but the store records the config and training builds the model from it: a
    config.json of other sizes, or silent on one (None: the key removed), is refused before anything is written (a
    missing or torn one is noted, see the failure corpus)."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **change}.items() if v is not None}
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert needle in line, line
    assert not out.exists()


def test_hjd_names_a_damaged_tensor_against_the_config_before_its_category(model, tmp_path, capsys):
    """One v_proj of another width (a damaged checkpoint) is named with the config's shape, not answered with
    "split the category" (the category check ran first)."""
    name = "model.layers.1.self_attn.v_proj.weight"
    shard = shard_of(model, name)
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{name} has shape [16, 31], the config gives [16, 32]" in line and "split" not in line, line
    assert not out.exists()


def _files(root):
    import hashlib

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")}


def test_overwrite_keeps_the_old_store_until_the_new_one_is_built(model, tmp_path, capsys):
    """``--overwrite`` with weights the build refuses (one q_proj scaled so far that its probe fails) leaves the
    store it was to replace byte for byte (it was deleted before the build began); one that succeeds replaces it
    and leaves no copy beside it."""
    import shutil

    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
    before = _files(out)
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    _scaled(broken, "model.layers.1.self_attn.q_proj.weight", 1e30)
    capsys.readouterr()
    assert main(["--model", str(broken), "--out", str(out), "--device", "cpu", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert len(_error_lines(err)) == 1 and "the store it was to replace is back" in err, err
    # the line names the tensor out of scale, whichever member's probe failed first, with its largest |entry|
    name = "model.layers.1.self_attn.q_proj.weight"
    peak = load_file(shard_of(broken, name))[name].abs().max().item()
    assert f"{name} is out of scale (entries up to {peak:.1e}, the category's other members" in err, err
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "model", "store"]
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu", "--pi", "0.01", "--overwrite"]) == 0
    assert FactorStore.open(out).complete and _files(out) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "model", "store"]


@pytest.mark.parametrize("planted", ["folder", "link", "file", "store copy"])
def test_overwrite_never_takes_a_users_thing_at_the_aside_name_for_its_own(model, tmp_path, capsys, planted):
    """``.store.replaced`` beside the store is where ``--overwrite`` keeps the store it replaces; a user's folder,
    a link to one, a file, or a copy of a store (its record and all) at that name is no aside frod set for this
    store (it has no stamp naming it): refused in one line before anything is touched, the store and the user's
    things as they were. An aside frod left (a replacement killed after setting the store aside) is taken back."""
    import shutil

    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
    before = _files(out)
    aside, users = tmp_path / ".store.replaced", tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine\n")
    (users / "q_proj.V.safetensors").write_text("mine too\n")
    if planted == "folder":
        shutil.copytree(users, aside)
    elif planted == "store copy":  # a backup of another store, record and all
        assert main(["--model", str(model), "--out", str(tmp_path / "other"), "--device", "cpu", "--pi", "0.5"]) == 0
        shutil.copytree(tmp_path / "other", aside)
        kept = _files(aside)
    elif planted == "link":
        aside.symlink_to(users, target_is_directory=True)
    else:
        aside.write_text("mine\n")
    capsys.readouterr()
    for pi in ("0.5", "1e-300"):  # a build that would succeed, one that fails
        assert main(["--model", str(model), "--out", str(out), "--device", "cpu", "--overwrite", "--pi", pi]) == 2
        (line,) = _error_lines(capsys.readouterr().err)
        assert f"keeps the store it replaces in {aside}" in line and "move it away" in line, line
        assert _files(out) == before
        assert (users / "notes.txt").read_text() == "mine\n" and (users / "q_proj.V.safetensors").is_file()
        if planted == "folder":
            assert sorted(p.name for p in aside.iterdir()) == ["notes.txt", "q_proj.V.safetensors"]
        elif planted == "file":
            assert aside.read_text() == "mine\n"
        elif planted == "store copy":
            assert _files(aside) == kept
    aside.unlink() if planted in ("link", "file") else shutil.rmtree(aside)
    from frod_ds.hjd.store_files import set_aside

    set_aside(out)  # a replacement killed once the store was set aside: the next build takes it back
    assert _files(out) != before and (aside / "manifest.json").is_file()
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu", "--overwrite", "--pi", "1e-300"]) == 2
    assert _files(out) == before and not aside.exists()


def test_overwrite_of_a_store_at_a_mount_point_is_refused_before_anything_moves(model, tmp_path, capsys, monkeypatch):
    """``--out`` a mount point (a tmpfs holding an earlier store): the store cannot be moved aside beside it, so
    ``--overwrite`` refuses in one line before anything is moved (the files left where they were, none deleted)."""
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu"]) == 0
    before = _files(out)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(out) or real(p))
    capsys.readouterr()
    assert main(["--model", str(model), "--out", str(out), "--device", "cpu", "--overwrite", "--pi", "0.5"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{out} is a mount point (or on another file system)" in line and "nothing was moved" in line, line
    assert _files(out) == before and not (tmp_path / ".store.replaced").exists()


def test_hjd_verify_of_an_unfinished_store_names_it_and_says_to_resume(model, tmp_path, capsys):
    """A store whose HJD was cut short (its manifest not complete): the error line names that and points to the
    same command, which resumes; --overwrite would throw the finished categories away."""
    out = tmp_path / "store"
    assert main(["--model", str(model), "--out", str(out), "--targets", "q_proj", "v_proj"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(complete=False, completed_categories=["q_proj"])
    (out / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["--verify", str(out), "--model", str(model)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"factor store {out} is incomplete (done: ['q_proj'])" in line, line
    assert line.endswith(f"finish it: frod hjd --model {model} --out {out} resumes") and "--overwrite" not in line


def test_hjd_into_its_own_model_folder_names_the_input(model, capsys):
    """``--out`` the ``--model`` folder: named as the command's input (it said only "holds no factor store")."""
    before = sorted(p.name for p in model.iterdir())
    assert main(["--model", str(model), "--out", str(model), "--device", "cpu"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"is --model {model}, an input of this command" in line, line
    assert sorted(p.name for p in model.iterdir()) == before


def test_ranks_given_different_flags_are_refused_before_anything_is_written(model, tmp_path, monkeypatch):
    """A launcher script passing rank 1 another ``--pi``: each rank would write its members' factors at its own π
    under a manifest stating rank 0's, a store that verifies but is not what it says. Refused on every rank."""
    monkeypatch.setenv("RANK_ARGS_LAUNCH", "hjd.py")
    monkeypatch.setenv("RANK1_EXTRA", "--pi 0.9")
    out = tmp_path / "store"
    script = REPO / "tests" / "support" / "rank_args.py"
    proc = run_hjd(["--model", str(model), "--out", str(out), "--device", "cpu", "--pi", "0.5"], nproc=2, script=script)
    assert proc.returncode != 0, proc.stderr[-2000:]
    (line,) = _error_lines(proc.stderr)
    assert "the ranks were not started alike: --pi: '0.5' on rank 0, '0.9' on rank 1" in line, line
    assert "Traceback" not in proc.stderr and not out.exists()
