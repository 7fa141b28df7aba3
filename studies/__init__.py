"""FRoD vs PEFT LoRA vs full fine-tuning on a real model and real data (``studies/real_study.py``).

config.py    the study's typed configuration, the methods and their LR sweeps, validation
data.py      rows → the project's tokens and loss mask, answer-word masks, pre-collated batches
models.py    one model per method (apply_frod / PEFT LoRA / full), optimizer groups, merge for eval
loop.py      the one training loop every method runs: per-step losses, schedule, checkpoint hook
evaluate.py  held-out losses, log-likelihood accuracy, LLM-Adapters generation protocol (the library's scorers)
context.py   what one run or one final evaluation needs, in the main process or a worker
parallel.py  the jobs (train a run, score a run) and who runs them: the main process or GPU-sharing workers
records.py   the output directory as typed records (identity, base, runs, invocations), so a study resumes
schedule.py  which job comes next (runs centre out, extensions, test evals of each best run), from the records
report.py    smoothing, steps-to-loss, the paper's claim, plots and tables
rotation.py  tan α = ‖ΔW_off‖/‖ΔW_on‖ per category of a frod-ds or stock PEFT FRoD model (checkpoints)
tasks.py     generated tasks (arithmetic, a fact base) from a seed, with train, validation and test splits
learn.py     the learnability study (studies/learn_study.py): per task, sweeps, S-rate ratios, seeds, timing
timing.py    each method alone on the device: step time, tokens/s, peak memory, build time
learn_report.py  learn_study.json from the study directories, then report.md and plots from it
learn_convergence.py  which tasks count (the arithmetic gate) and the convergence line the README quotes
learn_plan.py    the study's units, their estimated GPU seconds, the calls they make
device_call.sh   one GPU call: stage the model, generate the tasks, run each GPU's share, pack the results
runner.py    the study under one command's time budget: setup and identity, base evals, the jobs, the
             combined report of every command's records
"""
