"""FRoD vs PEFT LoRA (r=16, r=32) vs full fine-tuning on a real model and real data, one GPU, resumable.

    python -m data_prep build --source llm-adapters:/data/llm_adapters --template llm-adapters --out data/la
    python -m studies.real_study --model models/smollm2-135m --data data/la --out $S --max-minutes 9    # 1st command
    python -m studies.real_study --model models/smollm2-135m --data data/la --out $S --max-minutes 9    # goes on in $S
    python -m studies.real_study ... --out $S2 --resume-from $S       # goes on from a copy of $S's records, into $S2
    python -m studies.real_study --model M --data D --out /tmp/s --lrs frod=3e-3,1e-2,3e-2       # another sweep
    python -m studies.real_study --model M --data D --out /tmp/s --train-limit 64 --eval-limit 4 \\
        --heldout 16 --batch-size 8 --device cpu                                               # CPU rehearsal
    python -m studies.real_study --replot $S/real_study.json         # tables and PNGs again, from the JSON alone

Every method trains with the same loop, loss mask, tokenizer, batches (same order) and schedule for the
same number of steps (``--epochs`` of the train rows less a held-out slice); each sweeps an equal number of
LRs (plus up to ``--extend`` past an end its choice sits at); each picks its LR on the held-out slice of the
train rows; the chosen runs are scored on the test sets under log-likelihood and LLM-Adapters' generation
protocol. A command does what fits ``--max-minutes`` (counted from its start) and records every finished
run in ``--out``; the same command again (or ``--resume-from`` a copy) skips what is recorded, and refuses a
directory of a study with other settings. Writes under ``--out``: the records (``study.json``, ``base.json``,
``invocations.json``, ``records/*.json``: no weights, a few MB in all), ``real_study.json`` (the combined
report, rewritten after every event), ``real_study.log``, ``loss_vs_step.png``, ``accuracy_vs_step.png``,
``lr_sweep.png``. User mistakes: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from studies.config import StudyConfig, StudyError, parse_lrs


def parse_args(argv: list[str]) -> StudyConfig | Path:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a("--replot", metavar="JSON", help="only redo the Markdown table and the plots of a results file, beside it")
    a("--model", help="HF checkpoint directory with its tokenizer (e.g. SmolLM2-135M-Instruct)")
    a("--data", help="data_prep output: DATA/train.jsonl and DATA/eval/<task>.jsonl (the test sets)")
    a("--train", help="training rows (default DATA/train.jsonl)")
    a("--eval-dir", help="test rows, one <task>.jsonl per task (default DATA/eval)")
    a("--out", help="new or empty directory for the study, or the directory of this study to go on with")
    a(
        "--resume-from",
        metavar="DIR",
        help="a study directory (e.g. an unpacked copy) whose records are copied "
        "into --out first; it must be of the same study",
    )
    a(
        "--extend",
        type=int,
        default=1,
        help="LRs a method may add, one at a time, past the end of its sweep that "
        "its choice sits at (each a step of the sweep's own ratio, put on the 1/3 x 10^k grid); 0: never",
    )
    a("--methods", default="frod,lora16,lora32,full", help="comma list of frod, full, lora<r>")
    a(
        "--lrs",
        action="append",
        default=[],
        metavar="METHOD=LR,LR,...",
        help="a method's LR sweep (FRoD: σ LRs); repeatable; defaults frod 1e-3,3e-3,1e-2; lora 1e-4,3e-4,1e-3; "
        "full 3e-5,1e-4,3e-4",
    )
    a("--batch-size", type=int, default=64, help="examples per optimizer step (no accumulation)")
    a("--cutoff", type=int, default=256, help="max tokens per example (the prompt's start is cut, never the answer)")
    a("--epochs", type=float, default=1.0, help="passes over the training rows (all methods alike)")
    a("--schedule", default="cosine", help="LR decay after warmup: cosine, linear or constant")
    a("--warmup-ratio", type=float, default=0.1, help="fraction of steps of linear warmup")
    a("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    a("--train-on-inputs", action="store_true", help="loss on the prompt tokens too (default: answer + EOS only)")
    a("--seed", type=int, default=0, help="data order, held-out split, LoRA init, FRoD support")
    a("--heldout", type=int, default=512, help="train rows held out for LR selection")
    a("--train-limit", type=int, help="use only the first N training rows (after the held-out split)")
    a("--eval-limit", type=int, help="first N test rows per task for the final evaluations (default: all)")
    a("--curve-limit", type=int, default=128, help="test rows per task for the accuracy-vs-step curve")
    a("--checkpoints", type=int, default=4, help="evaluations per run, evenly spaced, the last at the final step")
    a("--eval-batch", type=int, default=64, help="rows per log-likelihood batch")
    a("--gen-batch", type=int, default=128, help="rows per generation batch (x beams sequences)")
    a("--protocols", default="loglik,llm-adapters", help="test protocols: loglik and/or llm-adapters")
    a(
        "--gen-impl",
        default="auto",
        help="llm-adapters scorer: auto or project, both the library's "
        "frod_ds.eval.predict.score_llm_adapters_rows (recorded in the study)",
    )
    a("--num-beams", type=int, default=4, help="beams of the llm-adapters protocol: LLM-Adapters' 4, the only value")
    a(
        "--max-new-tokens",
        type=int,
        default=32,
        help="new tokens of the llm-adapters protocol: LLM-Adapters' 32, the only value",
    )
    a("--select-by", default="accuracy", help="held-out criterion: accuracy (ties: answer loss) or answer_loss")
    a("--smooth-frac", type=float, default=0.05, help="trailing-mean window for steps-to-loss, as a fraction of steps")
    a("--no-base-eval", action="store_true", help="skip the base model's test evaluation")
    a(
        "--max-minutes",
        type=float,
        default=8.5,
        help="time budget of this command, from its start: runs that do not fit are left for the next command",
    )
    a(
        "--eval-reserve-minutes",
        type=float,
        default=2.0,
        help="budget kept for the test evaluations: a run starts only if it is predicted to end before that",
    )
    a(
        "--workers",
        type=int,
        default=0,
        help="runs trained at a time in worker processes sharing the device (0: 3 on CUDA, 1 on CPU)",
    )
    a("--device", default="auto", help="auto, cuda or cpu")
    a("--frod-sparsity", type=float, default=0.02, help="FRoD density s of S")
    a("--frod-s-ratio", type=float, default=0.1, help="S LR / σ LR (the paper's 10:1)")
    a("--lora-alpha-ratio", type=float, default=2.0, help="LoRA alpha = ratio x r (2: alpha 32 for r=16, 64 for r=32)")
    args = p.parse_args(argv)
    if args.replot:
        if not Path(args.replot).is_file():
            raise StudyError(f"--replot {args.replot}: no such results file")
        return Path(args.replot)
    if not args.model or not args.out:
        raise StudyError("--model and --out are required (or --replot JSON)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or len(set(methods)) != len(methods):
        raise StudyError(f"--methods {args.methods!r}: give distinct methods, e.g. frod,lora16,lora32,full")
    cfg = StudyConfig(
        model=args.model,
        data=args.data,
        train=args.train,
        eval_dir=args.eval_dir,
        out=args.out,
        methods=methods,
        lrs=parse_lrs(args.lrs, methods),
        batch_size=args.batch_size,
        cutoff=args.cutoff,
        epochs=args.epochs,
        schedule=args.schedule,
        warmup_ratio=args.warmup_ratio,
        max_grad_norm=args.max_grad_norm,
        train_on_inputs=args.train_on_inputs,
        seed=args.seed,
        heldout=args.heldout,
        train_limit=args.train_limit,
        eval_limit=args.eval_limit,
        curve_limit=args.curve_limit,
        checkpoints=args.checkpoints,
        eval_batch=args.eval_batch,
        gen_batch=args.gen_batch,
        protocols=tuple(x.strip() for x in args.protocols.split(",") if x.strip()),
        gen_impl=args.gen_impl,
        num_beams=args.num_beams,
        max_new_tokens=args.max_new_tokens,
        select_by=args.select_by,
        smooth_frac=args.smooth_frac,
        base_eval=not args.no_base_eval,
        max_minutes=args.max_minutes,
        eval_reserve_minutes=args.eval_reserve_minutes,
        workers=args.workers,
        device=args.device,
        frod_sparsity=args.frod_sparsity,
        frod_s_ratio=args.frod_s_ratio,
        lora_alpha_ratio=args.lora_alpha_ratio,
        resume_from=args.resume_from,
        extend=args.extend,
    )
    cfg.validate()
    return cfg


def replot(path: Path) -> None:
    import json

    from studies.report import markdown_tables, write_plots

    doc = json.loads(path.read_text())
    print(markdown_tables(doc))
    for p in write_plots(doc, path.parent):
        print(f"wrote {p}")


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # --max-minutes counts from here
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
        if isinstance(cfg, Path):
            replot(cfg)
            return 0
        from studies.runner import run_study

        run_study(cfg, [Path(__file__).name, *argv], started)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
