"""Builders shared by the eval tests (no tests here): a word-level tokenizer trained on the rows,
eval JSONL rows written by hand (paper-like and in LLM-Adapters' format), a random tiny LLaMA and a
tiny LLaMA that is an exact bigram model.

The bigram model has one-hot token embeddings, zeroed ``o_proj``/``down_proj`` (every block adds
nothing to the residual stream) and a final norm weight of ``1/sqrt(hidden)``, so the last hidden
state is ``e_cur`` and the logits of the next token are the column ``lm_head.weight[:, cur]``:
its preferences are whatever the test writes into that matrix.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from frod_ds.prep.rows import dumps_row

SPECIALS = ["<unk>", "<s>", "</s>"]
WORDS = (
    "the a big small red blue cat dog sits runs on mat is it true false which one Choice Option A B C D Question Answer"
).split()
PUNCT = [":", "?", ".", ","]
# Extra vocabulary for rows in LLM-Adapters' format (`word_tokenizer(LLM_ADAPTERS_VOCAB)`).
LLM_ADAPTERS_VOCAB = (
    "answer1 answer2 answer3 answer4 answer5 solution1 solution2 correct ### Response Instruction".split()
)
# LLM-Adapters' scoring prompt (its commonsense_evaluate.py; see the shared data README), written out here
# independently of any code under test.
LLM_ADAPTERS_SCORING_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request. \n\n"
    "                ### Instruction:\n                {instruction}\n\n                ### Response:\n                "
)
LLM_ADAPTERS_TASK_WORDS = {
    "boolq": ["true", "false"],
    "piqa": ["solution1", "solution2"],
    "obqa": ["answer1", "answer2", "answer3", "answer4"],
}

TASK_CHOICES = {
    "boolq": ["true", "false"],
    "piqa": ["Choice A", "Choice B"],
    "obqa": ["Option A", "Option B", "Option C", "Option D"],
}


def make_rows(task: str, n: int, seed: int = 0) -> list[dict]:
    """`n` rows of `task` with prompts of varying length, labels spread over the choices."""
    rng = random.Random(f"{task}-{seed}")
    choices = TASK_CHOICES[task]
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS[:14]) for _ in range(rng.randint(1, 12)))
        prompt = (
            f"Question:\n{words}?\n" + "\n".join(f"{c}: {rng.choice(WORDS[:10])}" for c in choices) + "\nwhich one?"
        )
        label = rng.randrange(len(choices))
        rows.append(
            {
                "task": task,
                "id": f"{task}-{i}",
                "prompt": prompt,
                "answer": choices[label],
                "choices": list(choices),
                "label": label,
            }
        )
    return rows


def make_llm_adapters_rows(task: str, n: int, seed: int = 0) -> list[dict]:
    """`n` rows of `task` as data_prep's LLM-Adapters template builds them: the scoring prompt around an
    instruction of varying length, answers ``"the correct answer is <word>"``, separator ``""``."""
    rng = random.Random(f"la-{task}-{seed}")
    words = LLM_ADAPTERS_TASK_WORDS[task]
    rows = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS[:14]) for _ in range(rng.randint(1, 12)))
        options = " ".join(f"{w.capitalize()}: {rng.choice(WORDS[:10])}" for w in words)
        instruction = (
            f"Please choose the correct answer to the question: {question}\n\n{options}"
            f"\n\nAnswer format: {'/'.join(words)}"
        )
        label = rng.randrange(len(words))
        choices = [f"the correct answer is {w}" for w in words]
        rows.append(
            {
                "task": task,
                "id": f"{task}-la-{i}",
                "prompt": LLM_ADAPTERS_SCORING_PROMPT.format(instruction=instruction),
                "separator": "",
                "answer": choices[label],
                "choices": choices,
                "label": label,
            }
        )
    return rows


def write_eval_dir(root: Path, rows_by_task: dict[str, list[dict]]) -> Path:
    """``root/eval/<task>.jsonl`` in data_prep's format; returns `root`."""
    (root / "eval").mkdir(parents=True, exist_ok=True)
    for task, rows in rows_by_task.items():
        (root / "eval" / f"{task}.jsonl").write_text("".join(dumps_row(r) + "\n" for r in rows))
    return root


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def word_tokenizer(extra: list[str] | None = None):
    """Word-level tokenizer over `WORDS` + punctuation (+ `extra` words), BOS prepended, no pad token (like LLaMA)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + PUNCT + (extra or []))}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def metaspace_tokenizer(texts: list[str]):
    """SentencePiece-style BPE (``▁`` for spaces, as LLaMA's) trained on `texts`, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama_config(vocab_size: int, hidden: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


def random_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab_size))
    with torch.no_grad():  # a less flat distribution than the default init's, so choices differ
        model.lm_head.weight.normal_(0, 1.0)
    return model.eval()


def bigram_llama(vocab_size: int, logits: torch.Tensor):
    """A LLaMA whose next-token logits are exactly ``logits[cur]`` (shape (V, V)), whatever came before."""
    from transformers import LlamaForCausalLM

    hidden = 48
    assert vocab_size <= hidden and logits.shape == (vocab_size, vocab_size)
    model = LlamaForCausalLM(llama_config(vocab_size, hidden))
    with torch.no_grad():
        # Embedding 100·e_t: RMSNorm's eps is then negligible and norm(x) = sqrt(H)·e_t.
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab_size] = 100 * torch.eye(vocab_size)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1 / math.sqrt(hidden))
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab_size] = logits.T  # column cur = logits of the next token
    return model.eval()


def preference_logits(tok) -> torch.Tensor:
    """Bigram logits, uniform except: after ":" → "Choice" (+5) and "false" (+2); after "Choice" → "B"
    (+3); after "Option" → "C" (+3); after "B" → EOS (+8).

    So loglik always picks false / Choice B / Option C, and greedy generation after "...Answer:"
    writes "Choice B" and stops.
    """
    v = tok.convert_tokens_to_ids
    logits = torch.zeros(len(tok), len(tok))
    logits[v(":"), v("Choice")] = 5.0
    logits[v(":"), v("false")] = 2.0
    logits[v("Choice"), v("B")] = 3.0
    logits[v("Option"), v("C")] = 3.0
    logits[v("B"), tok.eos_token_id] = 8.0
    return logits


def llm_adapters_preference_logits(tok) -> torch.Tensor:
    """Bigram logits over a `word_tokenizer(LLM_ADAPTERS_VOCAB)`, uniform except for one strong path:
    ":" → "false" → "," → "answer2" → "answer1" → EOS (+8 each).

    LLM-Adapters' scoring prompt ends "### Response:" + whitespace, so beam search writes
    "false, answer2 answer1" for every row: BoolQ reads false, OBQA answer2 (the first match), PIQA nothing.
    """
    v = tok.convert_tokens_to_ids
    logits = torch.zeros(len(tok), len(tok))
    path = [":", "false", ",", "answer2", "answer1", tok.eos_token]
    for a, b in zip(path, path[1:]):
        logits[v(a), v(b)] = 8.0
    return logits


def save_model(path: Path, model, tok) -> Path:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
