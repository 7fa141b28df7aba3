"""The model ``frod eval`` scores: a FRoD adapter over its base (``--checkpoint``) or a plain Hugging Face
checkpoint (``--model``), with its tokenizer; what is wrong with either said in one line before any row is scored."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from frod_ds.eval.predict import EvalError

__all__ = ["ModelFlags", "resolve_dtype", "load_model", "check_token_ids"]


class ModelFlags(Protocol):
    """What of ``frod eval``'s flags (``frod_ds.eval.run.EvalConfig``) names the model and its tokenizer."""

    checkpoint: str | None
    base_model: str | None
    factor_store: str | None
    model: str | None
    tokenizer: str | None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _unreadable_shard(model: str) -> str:
    """The first safetensors shard of ``model`` that safetensors cannot open (safetensors' errors name no file)."""
    from safetensors import safe_open

    from frod_ds.io.model_dir import resolve_model_dir

    for shard in sorted(Path(resolve_model_dir(model)).glob("*.safetensors")):
        try:
            with safe_open(str(shard), "pt"):
                pass
        except Exception:  # noqa: BLE001 - any unreadable shard is the one to name
            return shard.name
    return "a weight file"


def load_model(config: ModelFlags, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode on `device`, tokenizer) from --checkpoint (FRoD adapter) or --model (plain HF)."""
    from frod_ds.model import adapter

    if config.checkpoint:
        if not adapter.is_adapter_checkpoint(config.checkpoint):
            raise EvalError(adapter.not_an_adapter(config.checkpoint, "--checkpoint"))
        model, tokenizer = adapter.load_frod_model(
            config.checkpoint,
            base_model=config.base_model,
            factor_store=config.factor_store,
            dtype=dtype,
            device=str(device),
        )
    else:
        assert config.model is not None
        from frod_ds.io.model_source import hub_load_failure, missing_model_dir
        from frod_ds.runtime.paths import expand_home

        if missing := missing_model_dir(config.model):  # a mistyped folder: not a Hub id to ask the Hub about
            raise EvalError(missing)
        if adapter.is_adapter_checkpoint(config.model):
            raise EvalError(f"--model {config.model} is a FRoD adapter checkpoint; pass it with --checkpoint")
        from frod_ds.io.hf_checkpoint import INDEX_NAME, SINGLE_NAME, HFCheckpoint
        from frod_ds.io.model_dir import check_config_file, check_model_folder

        folder = expand_home(config.model)  # ~ as the shell would make of it: a folder, not a Hub id
        if folder.is_dir():  # a store, a PEFT adapter, a data build; a config of no or another model
            check_model_folder(folder)
            has_safetensors = any((folder / n).is_file() for n in (INDEX_NAME, SINGLE_NAME))
            if has_safetensors:
                HFCheckpoint(folder).config()
            elif any(folder.glob("*.bin")):  # torch.load of a foreign pickle: never, and no traceback
                raise EvalError(
                    f"--model {config.model} holds PyTorch .bin weights only; frod-ds reads safetensors checkpoints "
                    "(they cannot run code when read): convert them first, e.g. save_pretrained(safe_serialization="
                    "True) in a trusted environment"
                )
            else:
                check_config_file(folder)
        from transformers import AutoModelForCausalLM

        from frod_ds.prep.tokens import load_tokenizer

        source = str(folder) if folder.is_dir() else config.model
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
        except BrokenPipeError:  # its progress bar's console reader went away: the command's to stop, not the model
            raise
        except OSError as e:  # transformers says what is missing or unreadable with an OSError
            if not folder.is_dir():  # no folder, and no Hub repo to be had either
                raise EvalError(hub_load_failure(config.model, e)) from None
            raise EvalError(f"cannot load --model {config.model}: {e}") from None
        except Exception as e:  # a damaged shard: safetensors' error names no file
            if type(e).__name__ != "SafetensorError":
                raise
            raise EvalError(
                f"--model {config.model}: {_unreadable_shard(config.model)} cannot be read ({e}); the "
                "checkpoint is damaged (truncated or overwritten), copy it again"
            ) from None
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        bad = adapter.nonfinite_tensor(dict(model.named_parameters()))
        if bad is not None:  # its logits would be NaN and every score a tie
            raise EvalError(f"--model {config.model}: {bad}; the checkpoint is damaged, copy it again")
    return model.eval(), tokenizer


def check_token_ids(
    rows: dict[str, list[dict[str, Any]]], tokenizer: Any, model: torch.nn.Module, config: ModelFlags
) -> None:
    """``EvalError`` when the tokenizer turns the rows (prompts, choices, answers) or its special tokens into an id
    the model's embedding has no row for (a tokenizer of a larger vocabulary): the forward would fail mid-run."""
    embedding = model.get_input_embeddings().num_embeddings
    texts = [t for task_rows in rows.values() for r in task_rows for t in (r.get("prompt"), r.get("answer"))]
    texts += [c for task_rows in rows.values() for r in task_rows for c in r.get("choices") or ()]
    ids = tokenizer([t for t in texts if isinstance(t, str) and t], add_special_tokens=False)["input_ids"]
    top = max([max(x, default=-1) for x in ids] + list(tokenizer.all_special_ids) + [-1])
    if top >= embedding:
        from frod_ds.prep.tokens import token_past

        which = config.tokenizer or "the model's own tokenizer"
        raise EvalError(
            token_past(tokenizer, embedding)
            or f"the tokenizer ({which}) produces token id {top}, but the model's embedding has {embedding} rows; "
            "use the tokenizer the model was trained with"
        )
