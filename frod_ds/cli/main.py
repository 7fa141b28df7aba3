"""``frod``: the one command of frod-ds; each subcommand is a module of ``frod_ds.cli`` (or ``frod_ds.prep.command``).

``frod COMMAND --help`` shows a command's flags and examples. Exit codes are the command's: 0 ok, 2 bad input
(one ``error:`` line) or a stdout/stderr that could not be written (the outputs complete, the stream named), 1 a
failed check, 143 after SIGTERM. Launchers and script forms: docs/commands.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType

from frod_ds.runtime.cli_parser import Parser

__all__ = ["COMMANDS", "Command", "main", "console", "module_main", "launch_shim", "deprecated_form"]

EXAMPLES = """examples:
  frod data build --source hub --out data/cs170k
  frod hjd --model meta-llama/Llama-2-7b-hf --out factors/llama2-7b
  frod plan --model meta-llama/Llama-2-7b-hf --gpus 1
  frod train --config ds_configs/zero2.json --recipe recipes/llama2_7b_cs170k.yaml output_dir=runs/x
  frod eval --checkpoint runs/x/adapter-final --data data/cs170k --tasks all --output runs/x/eval
  frod export --checkpoint runs/x/adapter-final --out exports/x
  frod demo
  frod convert-gguf convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2-135m

several ranks: a launcher starts frod on each rank (docs/commands.md)
  torchrun --nproc-per-node 8 --no-python frod train --config ds_configs/zero3.json --recipe R.yaml output_dir=runs/x
"""


@dataclass(frozen=True)
class Command:
    module: str  # has ``main(argv) -> int``
    help: str
    fast_exit: bool = False  # leave with os._exit (frod_ds.runtime.entry.run_script says why)
    ranks: bool = False  # runs on every rank of a launcher; else one process: rank 0 runs it (``_rank_exit``)


COMMANDS: dict[str, Command] = {
    "data": Command("frod_ds.prep.command", "build, inspect or show the Commonsense170K data (JSONL rows)"),
    "hjd": Command("frod_ds.cli.hjd", "decompose a base model's targeted weights into a factor store", True, True),
    "train": Command(
        "frod_ds.cli.train", "train FRoD adapters with DeepSpeed ZeRO-2/3 (resumes output_dir)", True, True
    ),
    "eval": Command("frod_ds.cli.eval", "score a model or adapter on the commonsense tasks", True, True),
    "export": Command("frod_ds.cli.export", "export an adapter as a merged HF checkpoint or a PEFT adapter"),
    "plan": Command("frod_ds.cli.plan", "per-GPU memory of FRoD training and the fastest set-up that fits"),
    "demo": Command("frod_ds.cli.demo", "the whole pipeline on a tiny local Llama (CPU or GPUs)"),
    "convert-gguf": Command("frod_ds.cli.convert_gguf", "a GGUF model as a Hugging Face checkpoint"),
}
_LAUNCHER_FLAGS = ("--local_rank", "--local-rank")  # `deepspeed --module` puts --local_rank=N before the command


def _parser() -> argparse.ArgumentParser:
    from frod_ds import __version__

    ap = Parser(
        allow_abbrev=False,
        prog="frod",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"frod-ds {__version__}", help="print the version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, allow_abbrev=False, help=cmd.help, add_help=False)
    return ap


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(``frod``'s own arguments up to the command name, the command's arguments); launcher flags that come
    before the command name move to the command (train, eval and hjd accept ``--local_rank``)."""
    launcher = [a for a in argv[:1] if a.split("=")[0] in _LAUNCHER_FLAGS]
    if launcher and "=" not in launcher[0] and len(argv) > 1:
        launcher = argv[:2]
    rest = argv[len(launcher) :]
    if rest[:1] == ["--"] and len(rest) > 1:  # `frod -- plan …`: the end of frod's options, then the command
        rest = rest[1:]
    return rest[:1], rest[1:] + launcher


def main(argv: list[str] | None = None) -> int:
    """Run ``frod COMMAND ARGS...``; returns the command's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    head, tail = _split(args)
    ns = _parser().parse_args(head)  # --help / --version / an unknown command end here
    skip = _rank_exit(ns.command)
    if skip is not None:
        return skip
    return int(_command_module(ns.command).main(tail) or 0)


def _rank_exit(command: str) -> int | None:
    """None where this process runs ``command``; else its exit code. A rank other than 0 of a launcher (torchrun,
    the deepspeed launcher, srun with several tasks) running a one-process command leaves it to rank 0, so that one
    process writes its output (rank 0 says so in a note): 0. Rank variables no launcher of this process set (left
    over in a shell) would make it do nothing with exit 0: one error line and 2 instead."""
    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.launch_env import launcher_rank_world

    try:
        where = None if COMMANDS[command].ranks else launcher_rank_world()
    except FrodError:  # variables no launcher sets: a one-process command needs none of them, it runs
        return None
    if where is None or where[1] == 1:
        return None
    if where[0] == 0:
        if _launched():  # rank variables alone (left in a shell) start no other rank to leave it
            print(
                f"note: frod {command} runs as one process: rank 0 of the {where[1]} the launcher started runs it, "
                "the others leave it",
                file=sys.stderr,
            )
        return None
    if _launched():
        return 0
    names = "SLURM_PROCID and SLURM_STEP_NUM_TASKS" if "RANK" not in os.environ else "RANK and WORLD_SIZE"
    print(
        f"error: this process is rank {where[0]} of {where[1]} by its {names}, but no launcher started it (none of "
        f"the variables torchrun, deepspeed or srun set beside them): frod {command} runs as one process; unset "
        f"{names} (left from another job?) and run it again",
        file=sys.stderr,
    )
    return 2


def _launched() -> bool:
    """Whether a launcher started this process: torchrun (``TORCHELASTIC_RUN_ID``), DeepSpeed's launcher
    (``CROSS_RANK``) or an srun step (``SLURM_STEP_ID``)."""
    return any(os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "CROSS_RANK", "SLURM_STEP_ID"))  # set, not empty


def _command_module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name].module)


def console(old_form: str | None = None) -> None:
    """The ``frod`` console script (``[project.scripts]``) and the module forms; ``old_form``: the deprecated
    form this process was started as, named in one stderr line before the command runs."""
    from frod_ds.runtime.entry import run_script

    args = sys.argv[1:]
    head, _ = _split(args)
    known = bool(head) and head[0] in COMMANDS

    def command() -> int:  # the deprecation line too is written under run_script's console (a full stderr)
        if old_form:
            deprecated_form(old_form, f"frod {head[0] if known else 'COMMAND'}")
        return main(args)

    run_script(command, fast_exit=known and COMMANDS[head[0]].fast_exit)


def module_main(command: str) -> None:
    """A command's module run as the program (data_prep's too): ``frod command`` with the arguments given, its
    checks (one-process commands on rank 0) and its console included."""
    sys.argv[1:1] = [command]
    console()


def deprecated_form(used: str, instead: str) -> None:
    """One stderr line for an entry form that 0.2.0 keeps and 0.3.0 removes (rank 0's only under a launcher)."""
    from frod_ds._moved import REMOVED_IN
    from frod_ds.runtime.errors import FrodError
    from frod_ds.runtime.launch_env import launcher_rank_world

    try:
        where = launcher_rank_world()
    except FrodError:  # the command says so itself, as its one error line
        where = None
    if where is None or where[0] == 0:
        print(f"DeprecationWarning: `{used}` goes in {REMOVED_IN}; run `{instead}` (docs/commands.md)", file=sys.stderr)


def launch_shim(name: str, command: str) -> None:
    """The whole body of each script in ``launch/``: run as a script, it runs the command (run as a module, the
    deprecated form, after one stderr line); imported, the module stands for the command's module itself
    (``from launch import train`` is ``frod_ds.cli.train``)."""
    module = _command_module(command)
    if name == "__main__":
        from frod_ds.runtime.entry import run_script

        spec = getattr(sys.modules.get("__main__"), "__spec__", None)

        def body() -> int:  # the deprecation line too is written under run_script's console (a full stderr)
            if spec is not None:  # started by its module name, not as the file
                deprecated_form(f"python -m {spec.name}", f"frod {command}")
            skip = _rank_exit(command)
            return module.main() if skip is None else skip

        run_script(body, fast_exit=COMMANDS[command].fast_exit)
    sys.modules[name] = module
