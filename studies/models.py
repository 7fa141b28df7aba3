"""One model per method from one base model in memory: FRoD (``apply_frod``), PEFT LoRA, full fine-tuning, stock
PEFT's FRoD as a PEFT user gets it (``peftfrod``: its own HJD, support and λ⁰), and stock PEFT's FRoD holding
frod-ds' factors, support and σ⁰ (``peftfrod_inj``, ``bench.frod_vs_peft.inject``): the same start as ``frod``.

All start from a deep copy of the same fp32 base on the same device. FRoD's HJD runs once per study (the
factored model is kept as a template and copied per run). LoRA: PEFT ``LoraConfig`` on the FRoD targets,
dropout 0, ``alpha = lora_alpha_ratio · r``, seeded so every LR starts from the same ``A``.

For evaluation every method is merged into a plain ``LlamaForCausalLM`` (FRoD: ``W' = U (diag σ + S) Vᵀ``;
LoRA: ``merge_and_unload``), so all are scored at the cost of the base model.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from frod_ds.model.apply import apply_frod, frod_modules, frod_param_groups, set_submodule
from studies.config import TARGETS, MethodSpec, StudyConfig

__all__ = [
    "load_base",
    "ModelFactory",
    "make_optimizer",
    "trainable_state",
    "load_trainable_state",
    "merged_for_eval",
    "decoder_and_head",
    "trainable_numel",
]


def load_base(model_dir: str, device: torch.device):
    """(fp32 ``LlamaForCausalLM`` on ``device`` in eval mode, tokenizer with a pad token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.requires_grad_(False)
    return model.eval(), tok


class ModelFactory:
    """Fresh trainable models of each method from ``base`` (left untouched). ``templates``: the factored models
    (FRoD's HJD, PEFT's own initialisation) by what determines them, shared across the studies of one worker."""

    def __init__(self, base: nn.Module, cfg: StudyConfig, templates: dict | None = None):
        self.base, self.cfg = base, cfg
        self.templates: dict[tuple, tuple[nn.Module, float]] = {} if templates is None else templates
        self.hjd_seconds: float | None = None

    def _template(self, key: tuple, build) -> nn.Module:
        key = (*key, self.cfg.seed, self.cfg.frod_sparsity, self.cfg.frod_pi)
        if key not in self.templates:
            t0 = time.perf_counter()
            model = build()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.templates[key] = (model, time.perf_counter() - t0)
        return self.templates[key][0]

    def frod_template(self) -> nn.Module:
        model = self._template(
            ("frod",),
            lambda: apply_frod(
                copy.deepcopy(self.base),
                TARGETS,
                sparsity=self.cfg.frod_sparsity,
                seed=self.cfg.seed,
                pi=self.cfg.frod_pi,
                hjd_dtype=torch.float64,
            ),
        )
        key = ("frod", self.cfg.seed, self.cfg.frod_sparsity, self.cfg.frod_pi)
        self.hjd_seconds = self.templates[key][1]
        return model

    def peft_frod_template(self) -> nn.Module:
        """Stock PEFT's FRoD on the base, its frozen factors, support, σ and S replaced by frod-ds' template's."""

        def build() -> nn.Module:
            from bench.frod_vs_peft import inject, peft_frod_model

            model = peft_frod_model(copy.deepcopy(self.base), list(TARGETS), self.cfg.frod_sparsity, self.cfg.frod_pi)
            inject(model, self.frod_template())
            return model

        return self._template(("peftfrod_inj",), build)

    def peft_stock_template(self, sparse_rate: float | None) -> nn.Module:
        """Stock PEFT's FRoD as ``get_peft_model(base, FrodConfig(...))`` gives it: its own HJD, support and λ⁰;
        ``sparse_rate`` None: PEFT's default. The study's seed is PEFT's ``projection_prng_key`` (seed 0: its
        default), as frod-ds' support follows the seed."""

        def build() -> nn.Module:
            from peft import FrodConfig, get_peft_model

            config = FrodConfig(
                target_modules=list(TARGETS),
                projection_prng_key=self.cfg.seed,
                progressbar=False,
                task_type="CAUSAL_LM",
                **({} if sparse_rate is None else {"sparse_rate": sparse_rate}),
            )
            return get_peft_model(copy.deepcopy(self.base), config)

        return self._template(("peftfrod", sparse_rate), build)

    def build(self, spec: MethodSpec) -> nn.Module:
        if spec.kind == "frod":
            model = copy.deepcopy(self.frod_template())
        elif spec.kind == "peftfrod_inj":
            model = copy.deepcopy(self.peft_frod_template())
        elif spec.kind == "peftfrod":
            model = copy.deepcopy(self.peft_stock_template(spec.sparse_rate))
        elif spec.kind == "full":
            model = copy.deepcopy(self.base).requires_grad_(True)
        else:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(self.cfg.seed)
            config = LoraConfig(
                r=spec.rank,
                lora_alpha=self.cfg.lora_alpha_ratio * spec.rank,
                lora_dropout=self.cfg.lora_dropout,
                target_modules=list(TARGETS),
                bias="none",
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(copy.deepcopy(self.base), config)
        return model.train()


def param_groups(spec: MethodSpec, model: nn.Module, lr: float, cfg: StudyConfig) -> list[dict]:
    """frod-ds' FRoD and the injected cross-check: σ at ``lr``, S at ``s_ratio · lr``; others (stock PEFT FRoD
    too, as a PEFT user trains it): every trainable tensor at ``lr``."""
    if spec.kind == "frod":
        return frod_param_groups(model, lr, spec.s_ratio(cfg.frod_s_ratio) * lr, cfg.weight_decay)
    if spec.kind == "peftfrod_inj":
        from bench.frod_vs_peft import param_groups as peft_groups

        return peft_groups(model, "peft", lr, spec.s_ratio(cfg.frod_s_ratio) * lr, cfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"name": "all", "params": params, "lr": lr, "weight_decay": cfg.weight_decay}]


def make_optimizer(spec: MethodSpec, model: nn.Module, lr: float, cfg: StudyConfig) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (every method alike)."""
    groups = param_groups(spec, model, lr, cfg)
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, fused=fused)


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies (on CPU) of every trainable tensor, by name."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert params.keys() == state.keys(), "trainable tensors differ from the saved state's"
    for n, p in params.items():
        p.copy_(state[n])


@torch.no_grad()
def merged_for_eval(spec: MethodSpec, model: nn.Module) -> nn.Module:
    """A plain ``LlamaForCausalLM`` computing what ``model`` computes (consumes ``model``), in eval mode."""
    if spec.kind in ("lora", "peftfrod", "peftfrod_inj"):
        model = model.merge_and_unload()
    elif spec.kind == "frod":
        for name, layer in list(frod_modules(model)):
            W = layer.merged_weight()  # (m, n) = U (diag σ + S) Vᵀ
            lin = nn.Linear(
                layer.in_features, layer.out_features, bias=layer.bias is not None, device=W.device, dtype=W.dtype
            )
            lin.weight.copy_(W)
            if layer.bias is not None:
                lin.bias.copy_(layer.bias)
            set_submodule(model, name, lin)
    return model.requires_grad_(False).eval()


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the decoder stack giving hidden states, the LM head) of a causal LM, PEFT-wrapped or not."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm.model, lm.lm_head
