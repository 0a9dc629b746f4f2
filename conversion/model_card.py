# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Model card (README.md) for a converted Aaren checkpoint: YAML front matter for the Hub, how to load it, the
conversion recipe and the evaluation tables of :func:`aaren_hf.conversion.evaluate.format_table`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import yaml

from .evaluate import format_table
from .train_state import atomic_write

__all__ = ["write_model_card", "render_model_card", "teacher_hub_info", "finish_folder", "escape_controls"]

TAGS = ["aaren", "linear-attention", "recurrent", "distillation"]

# Known teacher families: (pattern on the teacher's name, hub organisation, license on the Hub).
_KNOWN_TEACHERS = (
    (r"^smollm2-", "HuggingFaceTB", "apache-2.0"),
    (r"^gemma-3-", "google", "gemma"),
    (r"^smollm-", "HuggingFaceTB", "apache-2.0"),
    (r"^gpt2(-medium|-large|-xl)?$", "openai-community", "mit"),
    (r"^distilgpt2$", "distilbert", "apache-2.0"),
    (r"^pythia-", "EleutherAI", "apache-2.0"),
    (r"^qwen2\.5-(0\.5b|1\.5b|7b|14b|32b)", "Qwen", "apache-2.0"),
)


def teacher_hub_info(teacher: Optional[str]) -> dict:
    """Hub name, license and provenance of a teacher given as a hub name ("owner/name") or a local folder.

    A local folder of the packaged teacher (see ``aaren_hf.conversion.assets``) is recognised by its name and its
    ``aaren_teacher.json``; the hub name is then the model it was made from. Unknown teachers: license "unknown"."""
    info = {"hub_name": None, "license": None, "source": None}
    if not teacher:
        return info
    text = str(teacher)
    path = Path(text).expanduser()
    local = path.is_dir()
    name = path.name if local else text.rstrip("/").split("/")[-1]
    if local:
        marker = path / "aaren_teacher.json"
        if marker.is_file():
            try:
                info["source"] = json.loads(marker.read_text()).get("source")
            except (OSError, ValueError):
                pass
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        info["hub_name"] = text
    for pattern, org, license_id in _KNOWN_TEACHERS:
        if re.search(pattern, name.lower()):
            info["license"] = license_id
            if info["hub_name"] is None:
                info["hub_name"] = f"{org}/{name}"
            break
    return info


def _front_matter(recipe_info: dict) -> dict:
    teacher = recipe_info.get("teacher")
    info = teacher_hub_info(teacher)
    base_model = recipe_info.get("base_model") or info["hub_name"]
    license_id = recipe_info.get("license") or info["license"] or "unknown"
    meta = {}
    if base_model:
        meta["base_model"] = base_model
    meta["license"] = license_id
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = list(TAGS) + [t for t in recipe_info.get("tags", []) if t not in TAGS]
    return meta


def escape_controls(value):
    """``value`` (str, or dicts/lists of them) with control characters written as ``\\xNN`` / ``\\uNNNN``:
    generated text may hold escape sequences or NUL bytes that corrupt a terminal or a Markdown page."""
    if isinstance(value, str):
        return re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]",
                      lambda m: m.group().encode("unicode_escape").decode("ascii"), value)
    if isinstance(value, dict):
        return {k: escape_controls(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_controls(v) for v in value]
    return value


def _value(v) -> str:
    if isinstance(v, (dict, list, tuple)):
        return "`" + json.dumps(v, default=str) + "`"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _format_tokens(n) -> str:
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
            if n >= scale:
                return f"{n / scale:.3g}{unit} ({int(n)})"
        return str(int(n))
    return str(n)


def _student_summary(cfg: dict) -> str:
    if not cfg:
        return ""
    parts = [f"{cfg.get('num_hidden_layers')} layers", f"hidden {cfg.get('hidden_size')}",
             f"{cfg.get('num_attention_heads')} heads ({cfg.get('num_key_value_heads')} key/value heads)",
             f"{cfg.get('num_query_slots', 1)} query slot(s) per head", f"decay {cfg.get('decay', 'none')}"]
    if cfg.get("window_size"):
        parts.append(f"softmax window of {cfg['window_size']} tokens with {cfg.get('num_sink_tokens', 0)} sink(s), "
                     f"gate per {cfg.get('window_gate', 'head')}")
        memory = cfg.get("memory_size")
        if isinstance(memory, list) and any(memory):
            parts.append(f"exact memory beyond the window of {sum(memory)} tokens per key/value head in all, spread "
                         f"over the layers as {memory} (rule {cfg.get('memory_rule', 'learned')})")
        elif memory:
            parts.append(f"exact memory of {memory} tokens per key/value head beyond the window (rule "
                         f"{cfg.get('memory_rule', 'learned')})")
        if cfg.get("memory_shared_layer") is not None:
            parts.append(f"the layers after layer {cfg['memory_shared_layer']} also keep in their memory what its "
                         "retention score ranks high")
        if memory and cfg.get("memory_recency"):
            parts.append(f"a newer token outranks a kept one unless that scores {cfg['memory_recency']:.3g} x their "
                         "distance higher (memory_recency: old keys leave, as the teacher never attended that far)")
        stored = cfg.get('kv_cache_dtype') or 'the model dtype'
        if memory and cfg.get("memory_bits"):
            rotated = " of their Hadamard rotation" if cfg.get("memory_hadamard") else ""
            parts.append(f"window keys/values stored in {stored}, memory keys/values as {cfg['memory_bits']}-bit "
                         f"codes{rotated}")
        else:
            parts.append(f"window and memory keys/values stored in {stored}")
    else:
        parts.append("no softmax window")
    kept = [i for i, t in enumerate(cfg.get("layer_types") or []) if t == "sliding_attention"]
    if kept and cfg.get("sliding_window"):
        parts.append(f"layers {kept} kept as the teacher's own sliding-window attention "
                     f"({cfg['sliding_window']} tokens)")
    elif kept:
        parts.append(f"layers {kept} window attention only (no Aaren state)")
    return ", ".join(str(p) for p in parts)


def render_model_card(recipe_info: dict, results: Optional[dict], model_name: Optional[str] = None) -> str:
    """The README.md text. ``recipe_info`` keys (all optional): ``teacher`` (hub name or local folder),
    ``base_model`` / ``license`` (override what is inferred from the teacher), ``model_name``, ``data`` (text
    source), ``tokens`` (training tokens), ``stages`` (list of str or dicts), ``options`` (dict), ``student_config``
    (dict, e.g. ``config.to_dict()``), ``command``, ``notes``, ``tags``; other keys are listed as they are.
    ``results``: an :func:`~aaren_hf.conversion.evaluate.evaluate` result, or None."""
    recipe_info = dict(recipe_info or {})
    meta = _front_matter(recipe_info)
    teacher = recipe_info.get("teacher")
    teacher_label = meta.get("base_model") or (Path(str(teacher)).name if teacher else "a pretrained Transformer")
    name = model_name or recipe_info.get("model_name") or "Aaren student"
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", ""]
    lines += _introduction(recipe_info, meta, teacher_label)
    lines += _how_to_load(recipe_info)
    lines += _recipe_lines(recipe_info, teacher_label)
    lines += _evaluation_lines(results)
    lines += ["", "## Limitations", "",
              "- A converted model inherits its teacher's data, biases and license, and adds the conversion's own "
              "errors: long-range recall and knowledge-heavy tasks are where conversions lose most.",
              "- Evaluated on the text and settings stated above only."]
    return "\n".join(lines).rstrip() + "\n"


def _introduction(recipe_info: dict, meta: dict, teacher_label: str) -> list:
    """What the model is, its architecture, where the teacher came from, and what is not known here."""
    student_cfg = recipe_info.get("student_config") or {}
    hybrid = student_cfg.get("sliding_window") and "sliding_attention" in (student_cfg.get("layer_types") or [])
    replaced = ("Each global softmax attention layer is replaced by an Aaren mixer that keeps a fixed-size recurrent "
                "state (the teacher's local sliding-window layers are kept as they are, bounded already)" if hybrid
                else "Each softmax attention layer is replaced by an Aaren mixer that keeps a fixed-size recurrent "
                "state")
    lines = [
        f"An [Aaren](https://arxiv.org/abs/2405.13956) (\"Attention as an RNN\") language model converted from "
        f"**{teacher_label}** by distillation with [aaren-hf](https://pypi.org/project/aaren-hf/). {replaced}, so "
        "generation needs the same memory at every context length instead of a key/value cache that grows with it."
    ]
    summary = _student_summary(student_cfg)
    if summary:
        lines += ["", f"Architecture: {summary}."]
    source = recipe_info.get("teacher_source") or teacher_hub_info(recipe_info.get("teacher")).get("source")
    if source:
        lines += ["", f"Teacher weights: {source} (4-bit rounded weights expanded to float, not bit-identical "
                      "to the original checkpoint)." if "gguf" in str(source).lower() else
                  f"Teacher weights: {source}."]
    if not meta.get("base_model"):
        lines += ["", "base_model: not known here (the teacher was a local folder); `examples/push_to_hub.py "
                      "--base-model OWNER/NAME` adds it before uploading."]
    if meta["license"] == "unknown":
        lines += ["", "License: unknown here; check the teacher's license, which this model inherits."]
    elif meta["license"] == "gemma":
        lines += ["", "License: the [Gemma Terms of Use](https://ai.google.dev/gemma/terms), which this model "
                      "inherits from its teacher (a base model, not instruction-tuned). They are not an OSI open-source "
                      "licence: they carry use restrictions (the Gemma Prohibited Use Policy) that pass on to every "
                      "copy and derivative."]
    return lines


def _how_to_load(recipe_info: dict) -> list:
    lines = ["", "## How to load", "", "```python",
             "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             'path = "path/or/hub-name/of/this/model"',
             "tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)",
             "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
             'inputs = tokenizer("The capital of France is", return_tensors="pt")',
             "out = model.generate(**inputs, max_new_tokens=20, do_sample=False)",
             "print(tokenizer.decode(out[0], skip_special_tokens=True))", "```", "",
             "The modelling code travels with the weights (`trust_remote_code=True`); with `aaren-hf` installed, "
             "`import aaren_hf` registers the model class and `trust_remote_code` is not needed. The cache returned "
             "by `generate` is an `AarenCache` (fixed size; it cannot be cropped, so assisted decoding is not "
             "supported)."]
    student_cfg = recipe_info.get("student_config") or {}
    context = min(int(recipe_info.get("context") or 2048),
                  int(student_cfg.get("max_position_embeddings") or 1 << 20))
    lines += ["", "With [lm-evaluation-harness](https://github.com/EleutherAI/lm-evaluation-harness), pass "
              f"`max_length` (here {context}, the teacher's context):", "", "```bash",
              f"lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True,max_length={context} "
              "--tasks wikitext", "```", "",
              "Without it lm-eval takes `max_position_embeddings` as the context, which for a model without a "
              "position table is 2^20 (no limit), and puts each whole document into one forward pass."]
    return lines


def _recipe_lines(recipe_info: dict, teacher_label: str) -> list:
    """The recipe table (teacher, data, tokens, any other key), the stages, the options, the command, the notes."""
    teacher = recipe_info.get("teacher")
    lines = ["", "## Conversion recipe", "", "| | |", "|---|---|"]
    if teacher:
        lines.append(f"| teacher | {_value(teacher_label)}" + (f" (loaded from `{teacher}`)" if str(teacher) != teacher_label else "") + " |")
    known = {"teacher", "base_model", "license", "model_name", "stages", "options", "student_config", "tags",
             "notes", "command", "teacher_source", "context"}
    for key in ("data", "tokens"):
        if key in recipe_info:
            value = _format_tokens(recipe_info[key]) if key == "tokens" else _value(recipe_info[key])
            lines.append(f"| {key} | {value} |")
            known.add(key)
    for key, value in recipe_info.items():
        if key not in known and value is not None:
            lines.append(f"| {_value(key)} | {_value(value)} |")
    stages = recipe_info.get("stages") or []
    if stages:
        lines += ["", "Stages:", ""]
        for i, stage in enumerate(stages, 1):
            if isinstance(stage, dict):
                title = stage.get("name", f"stage {i}")
                rest = ", ".join(f"{k}: {_value(v)}" for k, v in stage.items() if k != "name" and v is not None)
                lines.append(f"{i}. **{title}**" + (f": {rest}" if rest else ""))
            else:
                lines.append(f"{i}. {stage}")
    options = recipe_info.get("options") or {}
    if options:
        lines += ["", "Options:", "", "| option | value |", "|---|---|"]
        lines += [f"| {_value(k)} | {_value(v)} |" for k, v in options.items()]
    if recipe_info.get("command"):
        lines += ["", "Command:", "", "```bash", str(recipe_info["command"]), "```"]
    if recipe_info.get("notes"):
        lines += ["", str(recipe_info["notes"])]
    return lines


def _evaluation_lines(results: Optional[dict]) -> list:
    lines = ["", "## Evaluation", ""]
    if not results:
        return lines + ["Not evaluated."]
    lines.append(format_table(escape_controls(results)).rstrip())
    return lines + ["", "Perplexity depends on the window length, the stride and the text: the numbers above compare "
                    "teacher, student and baseline on exactly the same windows and are not comparable to numbers "
                    "measured in another setting. The StreamingLLM baseline is the teacher itself, untrained, seeing "
                    "only its sink tokens and the last W tokens; its W is chosen so that its key/value bytes equal "
                    "the student's state bytes (equal memory)."]


def finish_folder(folder, tokenizer_class: Optional[str] = None) -> Optional[dict]:
    """Make a saved model folder publishable as it is: files 0644 and folders 0755 (some writers leave 0600), and a
    ``tokenizer_config.json`` that loads without custom code: its ``auto_map`` (code this project never runs, and
    does not copy) is dropped and the transformers class actually used is stated. Returns the dropped map."""
    folder = Path(folder)
    dropped = None
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        dropped = config.pop("auto_map", None)
        if tokenizer_class:
            config["tokenizer_class"] = tokenizer_class
        atomic_write(config_path, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                                                    + "\n", encoding="utf-8"))
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    return dropped


def write_model_card(output_dir, recipe_info: dict, results: Optional[dict], model_name: Optional[str] = None) -> Path:
    """Write ``output_dir/README.md`` atomically (temporary file in the same folder, then ``os.replace``)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    text = render_model_card(recipe_info, results, model_name=model_name or output_dir.name)
    final = output_dir / "README.md"
    atomic_write(final, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return final

