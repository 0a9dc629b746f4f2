# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""One conversion, end to end: teacher -> Aaren student folder that loads with ``AutoModelForCausalLM``.

Steps (each resumable with ``resume=True`` after an interruption, even a kill -9):

1. resolve the teacher (hub name, local folder, or the packaged SmolLM2-135M-Instruct) and check its model_type;
2. build the ``AarenConfig`` from the teacher and the mixer options, copy the teacher's weights (adapters);
3. initialise the new mixer parameters from the teacher's statistics (:mod:`.init`);
4. stage 1: per-layer attention transfer (:mod:`.stage1`), layers split across processes;
5. stage 2: end-to-end logit distillation (:mod:`.stage2`), data-parallel across processes;
6. evaluate against the teacher and the StreamingLLM baseline (:mod:`.evaluate`);
7. write the output folder atomically: weights (safetensors) + config with ``auto_map`` + modeling files,
   tokenizer, ``generation_config.json``, ``README.md`` (model card), ``evaluation.json``, ``conversion.json``,
   ``conversion.log``.

Work files (checkpoints, the log while running, captured activations when they do not fit in memory) live in
``<output>.work/`` and are removed after success unless ``keep_work``, or after a failure before training started
(nothing to resume). ``<output>.lock`` (the owner's pid) keeps a second run off the same output while one runs.

Nothing of the user's is replaced: ``overwrite`` replaces only an empty folder or one this tool wrote (it holds
``MARKER``, listing what was written, and nothing else), never the current or home folder or a folder holding the
teacher or the data; the old output stays until the new one is complete. The saved JSON, log and model card name
the teacher and the data by paths relative to the output folder, not by this machine's absolute paths.

Processes: ``Accelerator()`` decides: one CPU process, one GPU, or many under ``accelerate launch`` / ``torchrun``
(on CPUs, ``torchrun --nproc_per_node N -m aaren_hf.conversion.cli ...`` gives N gloo processes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import torch

from . import train_state as ts
from .stage1 import Stage1Options, run_stage1
from .stage2 import Stage2Options, run_stage2
from .recipes import DEFAULT_MIXER, override_mixer

__all__ = ["ConvertOptions", "ConversionError", "convert", "default_output_name", "resolve_teacher",
           "options_from_recipe", "load_teacher", "build_student"]

LOGGER_NAME = "aaren_hf.conversion"
RUN_FILE = "run.json"
MARKER = ".aaren-convert.json"  # in every output folder: what aaren-convert wrote there (--overwrite checks it)
# options that may differ between a run and its resumption
NOT_FINGERPRINTED = {"resume", "overwrite", "keep_work", "progress", "output", "eval", "eval_quick",
                     "eval_windows", "recall_trials", "recall_distances", "cpu"}


class ConversionError(RuntimeError):
    """A conversion cannot start or continue; the message says what to do."""


def expected_errors() -> tuple:
    """Errors that mean "fix the input": reported as one line (aaren-convert's --debug shows the traceback)."""
    from .assets import AssetError
    from .data import DataSourceError

    return ConversionError, DataSourceError, AssetError


@dataclass
class ConvertOptions:
    teacher: Optional[str] = None  # hub name, local folder, or None: the packaged SmolLM2-135M-Instruct
    output: Optional[str] = None  # default: ./<teacher name>-aaren
    recipe: Optional[str] = None  # name of the recipe these options came from (for the record)
    data: tuple = ("python-docs",)
    seq_len: int = 512
    train_windows: int = 64
    heldout_windows: int = 16
    seed: int = 0
    mixer: dict = field(default_factory=lambda: dict(DEFAULT_MIXER))
    init_windows: int = 4
    kmeans_iterations: int = 8
    decay_spread: float = 2.0
    stage1: Stage1Options = field(default_factory=Stage1Options)
    stage2: Stage2Options = field(default_factory=Stage2Options)
    eval: bool = True
    eval_quick: bool = False
    eval_windows: Optional[int] = None  # held-out windows for the evaluation (None: all of heldout_windows)
    recall_fraction: float = 0.25  # share of stage-1 and stage-2 windows that bury keys to recall (recall.py)
    long_seq_len: int = 2048  # stage-2 window length (several times the mixer's window) and long evaluation length
    recall_trials: int = 3
    recall_distances: Optional[tuple] = None  # None: 4, 16 and 32 x the student's window
    resume: bool = False
    overwrite: bool = False
    keep_work: bool = False
    progress: bool = True
    cpu: bool = False  # force CPU even where a GPU is visible

    def to_json(self) -> dict:
        out = asdict(self)
        out["data"] = list(self.data)
        out["recall_distances"] = list(self.recall_distances) if self.recall_distances else None
        return out

    def fingerprint(self) -> dict:
        return {k: v for k, v in self.to_json().items() if k not in NOT_FINGERPRINTED}


# ----------------------------------------------------------------------------------------------------------------
# Recipes, teacher, names
# ----------------------------------------------------------------------------------------------------------------


def options_from_recipe(name: str, **overrides) -> ConvertOptions:
    """ConvertOptions with a recipe's defaults (teacher, mixer, data, budget); ``overrides`` win. Stage options
    may be given as dicts (``stage1={"steps": 10}``) or as Stage1Options/Stage2Options."""
    from .recipes import get_recipe

    recipe = get_recipe(name)
    b = recipe.budget
    seq_len = b.seq_len
    stage1 = Stage1Options(steps=b.stage1_steps, lr=b.stage1_lr)
    for attr, key in (("stage1_windows", "windows"), ("stage1_batch_size", "batch_size")):
        if getattr(b, attr, None) is not None:
            setattr(stage1, key, getattr(b, attr))
    stage2 = Stage2Options(steps=b.stage2_steps, lr=b.stage2_lr, batch_size=b.batch_size)
    opts = ConvertOptions(
        teacher=None, recipe=recipe.name, data=tuple(recipe.data), seq_len=seq_len,
        train_windows=max(1, b.data_tokens // seq_len), heldout_windows=b.heldout_windows,
        mixer=dict(recipe.mixer), stage1=stage1, stage2=stage2,
    )
    if b.recall_trials is not None:
        opts.recall_trials = b.recall_trials
    if b.long_seq_len is not None:
        opts.long_seq_len = b.long_seq_len
    return apply_overrides(opts, **overrides)


def apply_overrides(opts: ConvertOptions, **overrides) -> ConvertOptions:
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("stage1", "stage2") and isinstance(value, dict):
            setattr(opts, key, replace(getattr(opts, key), **value))
        elif key == "mixer" and isinstance(value, dict):
            opts.mixer = override_mixer(opts.mixer, value)
        elif key in {f.name for f in fields(ConvertOptions)}:
            setattr(opts, key, value)
        else:
            raise TypeError(f"unknown conversion option {key!r}")
    return opts


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.count("/") > 1


def resolve_teacher(teacher: Optional[str], recipe: Optional[str] = None) -> str:
    """What to pass to ``from_pretrained``: a local folder as given, a hub name as given, or (None) the recipe's
    teacher / the packaged SmolLM2-135M-Instruct."""
    if teacher is None:
        if recipe is not None:
            from .recipes import get_recipe

            return str(get_recipe(recipe).resolve_teacher())
        from .assets import packaged_teacher_path

        return str(packaged_teacher_path())
    path = Path(teacher).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConversionError(f"teacher {teacher!r} is not a model folder (no config.json in it)")
        return str(path.resolve())
    if _looks_like_path(teacher):
        raise ConversionError(
            f"teacher folder {teacher!r} does not exist. Pass a folder holding config.json and the weights, a hub "
            f"name such as HuggingFaceTB/SmolLM2-135M-Instruct, or leave --teacher out for the packaged teacher."
        )
    return teacher


def conversion_record(model_dir) -> dict:
    """What ``conversion.json`` in a converted model folder records ({} where the folder has none: a model not
    converted here). ConversionError when the file cannot be read."""
    path = Path(model_dir) / "conversion.json"
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path} cannot be read ({err}): convert the model again, or move the file away and "
                              "pass --teacher and --data") from None
    if not isinstance(record, dict):
        raise ConversionError(f"{path} holds no record of a conversion; pass --teacher explicitly")
    return record


def teacher_of(model_dir, record: Optional[dict] = None) -> str:
    """The teacher a converted model folder was distilled from, as its conversion.json (or the ``record`` read from
    it) says (a local teacher relative to the folder, the packaged one through its recipe), resolved for loading.
    ConversionError when the folder does not say."""
    record = conversion_record(model_dir) if record is None else record
    if not record:
        raise ConversionError(f"{model_dir} has no conversion.json naming its teacher")
    recorded = record.get("options", {})
    teacher, recipe = None, None
    relative = recorded.get("teacher")
    if relative and (Path(model_dir) / relative).is_dir():
        teacher = str(Path(model_dir) / relative)
    elif relative is None and recorded.get("recipe"):
        recipe = recorded["recipe"]
    else:
        teacher = record.get("teacher")
    if teacher is None and recipe is None:
        raise ConversionError(f"{Path(model_dir) / 'conversion.json'} names no teacher")
    return resolve_teacher(teacher, recipe)


def teacher_display_name(teacher: str) -> str:
    return Path(str(teacher).rstrip("/")).name


def default_output_name(teacher: str) -> str:
    return f"{teacher_display_name(teacher)}-aaren"


def check_teacher_type(teacher: str) -> object:
    """Load only the teacher's config and check that an adapter exists for it."""
    from transformers import AutoConfig

    from .adapters import SUPPORTED_TEACHERS

    try:
        config = AutoConfig.from_pretrained(teacher, trust_remote_code=False)
    except (OSError, ValueError) as error:  # not found, malformed config.json, or a model_type transformers lacks
        advice = (f"Check its config.json; supported teacher types: {', '.join(SUPPORTED_TEACHERS)}"
                  if Path(teacher).is_dir() else "Without access to the Hugging Face hub, pass a local folder, or "
                  "leave --teacher out for the packaged SmolLM2-135M-Instruct")
        raise ConversionError(f"cannot load the teacher's config from {teacher!r}: {_first_line(error)}. {advice}") \
            from error
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TEACHERS:
        raise ConversionError(
            f"teacher model_type {model_type!r} is not supported; supported teacher types: "
            f"{', '.join(SUPPORTED_TEACHERS)}"
        )
    return config


def check_positions(config, opts) -> None:
    """A student with a learned position table (GPT-2) cannot see windows longer than it: refuse before any data
    is read, not with an IndexError after it."""
    from .adapters import aaren_config_from_teacher

    try:
        student = aaren_config_from_teacher(config, **opts.mixer)
    except ValueError as error:
        raise ConversionError(f"teacher {config.model_type!r} cannot be converted with these options: {error}") \
            from error
    if student.position_embedding_type != "learned":
        return
    limit = student.max_position_embeddings
    if opts.seq_len > limit:  # stage 2 and the evaluation crop to seq_len, never beyond
        raise ConversionError(f"--seq-len {opts.seq_len} exceeds the teacher's position table ({config.model_type}: "
                              f"{limit} positions); pass --seq-len {limit} or less")


def _os_reason(error: OSError) -> str:
    return (error.strerror or str(error)) + (f" ({error.filename})" if error.filename else "")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")


def load_teacher(teacher: str, dtype=torch.float32, device="cpu"):
    """Tokenizer and model of the teacher; never runs code shipped with the teacher (``trust_remote_code=False``).
    Unreadable files (missing, truncated, not a model) raise ConversionError naming the folder."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    what = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(teacher, trust_remote_code=False)
        what = "weights"
        model = AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype, attn_implementation="sdpa",
                                                     trust_remote_code=False)
    except (OSError, SafetensorError, ValueError) as error:
        raise ConversionError(
            f"cannot load the teacher's {what} from {teacher}: {type(error).__name__}: {_first_line(error)}. Check "
            f"that the folder holds complete files (a download or copy may have been cut short; compare sizes with "
            f"the source) or download it again"
        ) from error
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tokenizer, model


def build_student(teacher_model, mixer_options: dict):
    """An AarenForCausalLM with the teacher's weights mapped in; the new mixer parameters keep their default
    initialisation (:func:`.init.initialize_student` sets them)."""
    import aaren_hf  # noqa: F401  (registers the Auto classes)
    from aaren_hf import AarenForCausalLM

    from .adapters import aaren_config_from_teacher, map_teacher_state_dict
    from .init import new_parameter_names

    try:
        config = aaren_config_from_teacher(teacher_model.config, **mixer_options)
    except ValueError as error:  # AarenConfig's own check, e.g. a memory_shared_layer beyond the teacher's layers
        raise ConversionError(f"the mixer options do not fit this teacher: {error}") from None
    student = AarenForCausalLM(config)
    mapped = map_teacher_state_dict(teacher_model, config)
    missing, unexpected = student.load_state_dict(mapped, strict=False)
    allowed = set(new_parameter_names(student))
    if config.tie_word_embeddings:
        allowed.add("lm_head.weight")
    left = [k for k in missing if k not in allowed]
    if left or unexpected:
        raise ConversionError(f"teacher weights do not fill the student: missing {left[:5]}, unexpected {unexpected[:5]}")
    student.to(next(teacher_model.parameters()).device)
    return student


# ----------------------------------------------------------------------------------------------------------------
# Logging and files
# ----------------------------------------------------------------------------------------------------------------


def _setup_logger(work: Optional[Path], main: bool, rank: int) -> logging.Logger:
    logger = logging.getLogger(f"{LOGGER_NAME}.run{os.getpid()}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
    if main:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        logger.addHandler(stream)
        if work is not None:
            file = logging.FileHandler(work / "convert.log", encoding="utf-8")
            file.setFormatter(fmt)
            logger.addHandler(file)
    else:
        logger.addHandler(logging.NullHandler())
    return logger


def _close_logger(logger: logging.Logger) -> None:
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)


def _local_paths(opts: ConvertOptions, teacher_id: str) -> list[tuple[str, Path]]:
    """(what, resolved path) of the local teacher folder and data files/folders of this run."""
    from .data import _source_kind

    paths = []
    if Path(teacher_id).is_dir():
        paths.append(("the teacher folder", Path(teacher_id).resolve()))
    for source in opts.data:
        if _source_kind(source) == "path":
            paths.append(("the data", Path(source).expanduser().resolve()))
    return paths


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_location(output: Path, work: Path, opts: ConvertOptions, teacher_id: str) -> None:
    """Refuse an output (or its work folder) that is, holds or sits inside the current folder, the home folder,
    the teacher or the data: replacing it would delete them, and writing inside the teacher or the data mixes the
    student's files into them (a data folder would feed the next run its own model card)."""
    for name, place in (("the current folder", Path.cwd().resolve()), ("your home folder", Path.home().resolve())):
        if _within(place, output):
            raise ConversionError(f"--output {output} is {name} or contains it; aaren-convert writes a new folder "
                                  f"and may replace it: give a new folder name, e.g. --output ./{output.name}-aaren")
    for what, path in _local_paths(opts, teacher_id):
        for folder in (output, work):
            if _within(path, folder) or _within(folder, path):
                relation = "is or contains" if _within(path, folder) else "is inside"
                name = f"--output {output}" if folder == output else f"the work folder {folder} of --output {output}"
                raise ConversionError(
                    f"{name} {relation} {what} ({path}); the conversion would write over or into it. Choose an "
                    f"--output outside it, e.g. --output {path.parent / (path.name + '-aaren')}"
                )


def _unlisted_files(output: Path) -> list[str]:
    """Files in an existing output folder that aaren-convert did not write (all of them without a marker)."""
    present = sorted(p.relative_to(output).as_posix() for p in output.rglob("*") if not p.is_dir())
    try:
        written = set(json.loads((output / MARKER).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return present
    return [f for f in present if f != MARKER and f not in written]


def check_replaceable(output: Path) -> None:
    """An existing output may be replaced only when it is empty or holds nothing but what aaren-convert wrote."""
    if not output.exists():
        return
    if not output.is_dir():
        raise ConversionError(f"--output {output} exists and is not a folder; choose another --output")
    foreign = _unlisted_files(output)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConversionError(
            f"--overwrite: {output} holds files aaren-convert did not write ({shown}), so it is not replaced. "
            f"--overwrite replaces only an empty folder or an earlier aaren-convert output: choose another --output, "
            f"or move those files away (delete the folder yourself if it is an output of an older aaren-convert)"
        )


def _teacher_fingerprint(teacher_id: str) -> dict:
    folder = Path(teacher_id)
    if not folder.is_dir():
        return {"hub": teacher_id}  # a hub revision is not fingerprinted: the cache holds one snapshot per name
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.suffix.lower() != ".md")
    return {p.name: ts.file_fingerprint(p) for p in files}


def _fingerprints(opts: ConvertOptions, teacher_id: str) -> dict:
    from .data import source_fingerprints

    return {"teacher": _teacher_fingerprint(teacher_id), "data": source_fingerprints(list(opts.data))}


def _changed_inputs(before: dict, now: dict) -> list[str]:
    changes = []
    old_t, new_t = before.get("teacher", {}), now["teacher"]
    for name in sorted(set(old_t) | set(new_t)):
        if old_t.get(name) != new_t.get(name):
            state = "added" if name not in old_t else "removed" if name not in new_t else "content differs"
            changes.append(f"teacher {name}: {state}")
    if before.get("data") != json.loads(json.dumps(now["data"])):
        old_files = {f[0]: f[1:] for src in before.get("data", []) for f in src.get("files", [])}
        new_files = {f[0]: f[1:] for src in now["data"] for f in src.get("files", [])}
        names = sorted(n for n in set(old_files) | set(new_files) if old_files.get(n) != list(new_files.get(n, [])))
        changes.append("data: " + (", ".join(names[:5]) if names else "the sources") + " changed")
    return changes


def _prepare_work(opts: ConvertOptions, output: Path, work: Path, teacher_id: str) -> tuple[ts.RunLock, bool]:
    """Main process: check the output and work folders against overwrite/resume, take the lock, write run.json.
    Returns the lock (held) and whether this run created the work folder."""
    check_output_location(output, work, opts, teacher_id)
    if output.exists() and not opts.overwrite and not opts.resume:
        raise ConversionError(f"output folder {output} already exists; choose another --output or pass --overwrite")
    if opts.overwrite or opts.resume:
        check_replaceable(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        lock = ts.RunLock(output.with_name(output.name + ".lock")).acquire()
    except ts.LockHeld as error:
        raise ConversionError(str(error)) from None
    except OSError as error:
        raise ConversionError(f"cannot write next to --output {output}: {_os_reason(error)}; choose "
                              f"an --output in a folder you can write to") from None
    try:
        return lock, _prepare_run_file(opts, work, teacher_id)
    except BaseException:
        lock.release()
        raise


class _Absent:
    def __repr__(self):
        return "(not recorded)"


_ABSENT = _Absent()


def _flat(options: dict) -> dict:
    """Options with nested ones (mixer, stage1, stage2) as "mixer.window_size", so that a difference names the one
    option that differs."""
    flat = {}
    for key, value in options.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            flat[key] = value
    return flat


def _prepare_run_file(opts: ConvertOptions, work: Path, teacher_id: str) -> bool:
    run_file = work / RUN_FILE
    if opts.resume:
        if not run_file.is_file():
            raise ConversionError(
                f"--resume: no interrupted conversion to resume in {work} (no {RUN_FILE}); run without --resume"
            )
        previous = json.loads(run_file.read_text())
        theirs, mine = _flat(previous["options"]), _flat(json.loads(json.dumps(opts.fingerprint())))
        diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k, _ABSENT) != mine.get(k, _ABSENT))
        if diff:
            details = "; ".join(f"{k}: {theirs.get(k, _ABSENT)!r} -> {mine.get(k, _ABSENT)!r}" for k in diff[:6])
            # an option the run never recorded came with a later version: what the run did instead is unknown
            unknown = [k for k in diff if k not in theirs]
            older = (f" The interrupted run was started by an older aaren-convert, before {', '.join(unknown)} "
                     f"existed; it cannot be resumed by this one.") if unknown else ""
            raise ConversionError(
                f"--resume: the options differ from the interrupted run in {work} ({details}).{older} Resume with "
                f"the same options, or start over with --overwrite."
            )
        # a run.json written before fingerprints were recorded has no "inputs": nothing to compare
        changed = _changed_inputs(previous["inputs"], _fingerprints(opts, teacher_id)) if "inputs" in previous else []
        if changed:
            raise ConversionError(
                f"--resume: the files behind the same options changed since the interrupted run in {work} "
                f"({'; '.join(changed[:6])}); resuming would mix the old and new ones. Put the original files back, "
                f"or start over with --overwrite."
            )
        return False
    if work.exists():
        if not run_file.is_file() and any(work.iterdir()):
            raise ConversionError(f"{work} exists and is not an aaren-convert work folder (no {RUN_FILE}); move it "
                                  f"away or choose another --output")
        if not opts.overwrite:
            raise ConversionError(
                f"{work} holds an interrupted conversion; pass --resume to continue it, or --overwrite to start over"
            )
        shutil.rmtree(work)  # safe: the lock says no live run uses it
    try:
        work.mkdir(parents=True)
    except OSError as error:
        raise ConversionError(f"cannot create the work folder {work}: {_os_reason(error)}; choose an --output in a "
                              f"folder you can write to") from None
    ts.atomic_write_json(work / RUN_FILE, {"options": opts.fingerprint(), "inputs": _fingerprints(opts, teacher_id),
                                          "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    return True


def _publish_folder(tmp: Path, final: Path) -> None:
    """Move a finished folder onto ``final`` (an existing one is replaced only after the new one is complete)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _portable(value, places: list[tuple[str, str]]):
    """``value`` (str, or dicts/lists of them) with this machine's absolute paths replaced by paths relative to the
    output folder (``places``: longest first), so the saved JSON, log and card can be published."""
    if isinstance(value, str):
        for absolute, relative in places:
            # a whole path component only: /a/out must not turn /a/out2 into .2
            value = re.sub(re.escape(absolute) + r"(?![\w.-])", lambda _: relative, value)
        return value
    if isinstance(value, dict):
        return {k: _portable(v, places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v, places) for v in value]
    return value


def _relative_options(opts: ConvertOptions, places: list[tuple[str, str]]) -> dict:
    """The options as saved with the model: local teacher and data paths relative to the output folder (what
    `aaren-convert eval` reads back), whatever folder the conversion was started from."""
    from .data import _source_kind

    def portable(given: str) -> str:
        return _portable(str(Path(given).expanduser().resolve()), places)

    options = opts.to_json()
    if opts.teacher and Path(opts.teacher).expanduser().is_dir():
        options["teacher"] = portable(opts.teacher)
    options["data"] = [portable(d) if _source_kind(d) == "path" else d for d in opts.data]
    options["output"] = "."
    return options


def _portable_places(output: Path, work: Path, opts: ConvertOptions, teacher_id: str) -> list[tuple[str, str]]:
    from .assets import cache_root

    places = {str(output.parent): ".."}
    if Path.home() != Path("/"):
        places[str(Path.home())] = "~"
    typed = {str(Path(t).expanduser().resolve()): str(Path(t).expanduser().absolute())
             for t in (opts.teacher, *opts.data) if t}
    packaged = cache_root().resolve()
    for _, path in _local_paths(opts, teacher_id):
        # the packaged teacher lives in this user's cache: its name says more, and reveals nothing
        relative = path.name if packaged in path.parents else os.path.relpath(path, output)
        places[str(path)] = places[typed.get(str(path), str(path))] = relative
    places.update({str(work): f"{output.name}.work", str(output): "."})
    return sorted(places.items(), key=lambda item: -len(item[0]))


def _broadcast_parameters(module, names: list[str], src: int = 0) -> None:
    import torch.distributed as dist

    params = dict(module.named_parameters())
    for name in names:
        dist.broadcast(params[name].data, src=src)


def _device_of(accelerator) -> torch.device:
    return accelerator.device if accelerator.device.type != "cpu" else torch.device("cpu")


def long_length(length: int, student_config) -> int:
    """A long-window length, capped by a learned position table (GPT-2: 1024)."""
    if student_config.position_embedding_type == "learned":
        return min(length, student_config.max_position_embeddings)
    return length


def _load_long_windows(tokenizer, opts: ConvertOptions, run_train_documents, L: int) -> Optional[torch.Tensor]:
    """Training windows of ``long_seq_len`` tokens from the run's training documents only: holding out at least
    as many tokens takes the same or a longer prefix of the seed's document order (data.load_token_windows), so
    every held-out document of the run stays held out (checked). None when the text is too short."""
    from .data import DataSourceError, load_token_windows

    try:
        long = load_token_windows(tokenizer, list(opts.data), seq_len=L, num_train=None,
                                  num_heldout=-(-opts.heldout_windows * opts.seq_len // L), seed=opts.seed)
    except DataSourceError:
        return None
    if not set(long.train_documents) <= set(run_train_documents):
        raise ConversionError("internal: the long training windows would include held-out documents")
    return long.train[: max(1, opts.train_windows * opts.seq_len // L)] if long.train.shape[0] else None


def training_windows(tokenizer, opts: ConvertOptions, train, long_train, window: int, say):
    """(stage-1 windows, stage-2 windows): the text windows with ``recall_fraction`` of them replaced by sequences
    that bury keys in training text and ask for them later (recall.make_recall_windows; the wordings the
    evaluation asks with are never used). Stage 2 trains on ``long_seq_len`` tokens when there is text for it, so
    the recall distances (4-32 x the window) fit and the window cannot cover them."""
    from .recall import make_recall_windows

    n1 = min(opts.stage1.windows or train.shape[0], train.shape[0])
    stage1, stage2 = train, long_train if long_train is not None else train
    if opts.recall_fraction <= 0 or window == 0:
        return stage1, stage2

    def recall(n, length, seed, **kw):
        try:
            return make_recall_windows(tokenizer, train, n, length, window, seed=seed, **kw) if n else None
        except ValueError as error:  # windows too short for a key, a gap of a few W and a question
            say(f"data: no recall-bearing windows of {length} tokens ({error})")
            return None

    # a 512-token window holds gaps of 2-6 x a 64-token window; stage 2's long windows the full 4-32 x
    rec1 = recall(int(round(opts.recall_fraction * n1)), train.shape[1], opts.seed, min_multiple=2, max_multiple=6,
                  max_items=2)
    if rec1 is not None:
        stage1 = torch.cat([train[: n1 - rec1.shape[0]], rec1, train[n1:]])
    rec2 = recall(int(round(opts.recall_fraction * stage2.shape[0])), stage2.shape[1], opts.seed + 1)
    if rec2 is not None:
        stage2 = torch.cat([stage2[: stage2.shape[0] - rec2.shape[0]], rec2])
        stage2 = stage2[torch.randperm(stage2.shape[0], generator=torch.Generator().manual_seed(opts.seed))]
    count = lambda rec: 0 if rec is None else rec.shape[0]  # noqa: E731
    say(f"data: recall-bearing windows: {count(rec1)} of {n1} in stage 1, {count(rec2)} of {stage2.shape[0]} in "
        f"stage 2 ({stage2.shape[1]} tokens each)")
    return stage1, stage2


def _load_windows(tokenizer, opts: ConvertOptions, say):
    from .data import load_token_windows

    windows = load_token_windows(tokenizer, list(opts.data), seq_len=opts.seq_len, num_train=None,
                                 num_heldout=opts.heldout_windows, seed=opts.seed)
    if windows.heldout.shape[0] < opts.heldout_windows:
        raise ConversionError(f"the held-out documents give only {windows.heldout.shape[0]} windows of "
                              f"{opts.seq_len} tokens; lower --heldout-windows or add data")
    train = windows.train
    if train.shape[0] < opts.train_windows:
        say(f"data: only {train.shape[0]} training windows of {opts.seq_len} tokens available "
            f"({opts.train_windows} asked); using all of them")
    train = train[: opts.train_windows]
    return train, windows.heldout, {**windows.info, "train_documents": windows.train_documents}


# ----------------------------------------------------------------------------------------------------------------
# The conversion
# ----------------------------------------------------------------------------------------------------------------


def convert(opts: ConvertOptions, accelerator=None) -> Optional[Path]:
    """Run one conversion. Returns the output folder on the main process (None elsewhere)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # On a machine without a GPU, a plain Accelerator() under torchrun stays a single process; cpu=True gives the
    # gloo process group (MULTI_CPU).
    accelerator = accelerator or Accelerator(cpu=opts.cpu or not torch.cuda.is_available())
    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    started = time.time()

    teacher_id = _share_string(resolve_teacher(opts.teacher, opts.recipe) if main else None, accelerator)
    output = Path(opts.output or default_output_name(teacher_id)).expanduser().resolve()
    work = output.with_name(output.name + ".work")
    existed = next(p for p in output.parents if p.exists())  # folders below it that this run makes go on failure
    lock, created = _claim_output(opts, output, work, teacher_id, accelerator)
    logger = _setup_logger(work, main, rank)
    say = logger.info
    training = False  # from here on the work folder holds what a --resume continues from

    def progress(total, desc, initial=0):
        return ts.Progress(total, desc, enabled=main and opts.progress, initial=initial)

    try:
        say(f"aaren-convert: teacher {teacher_id} -> {output} ({world} process(es), device {accelerator.device})")
        say(f"options: {json.dumps(opts.fingerprint(), default=str)}")
        check_positions(check_teacher_type(teacher_id), opts)
        set_seed(opts.seed)
        inputs = _load_inputs(teacher_id, opts, accelerator, say)
        training = True
        init_report = _initialize(inputs, opts, work, accelerator, say)
        student, stage1_summary, stage2_summary = _train(inputs, opts, work, accelerator, say, progress)
        student.eval()
        if not main:
            return None
        results = None
        if opts.eval:
            results = run_evaluation(student, inputs.teacher, inputs.tokenizer, inputs.heldout, opts,
                                     inputs.data_info, say)
        places = _portable_places(output, work, opts, teacher_id)
        record = {
            "teacher": _teacher_name(teacher_id),
            "options": _relative_options(opts, places),
            "data": inputs.data_info,
            "init": init_report,
            "stage1": stage1_summary,
            "stage2": _strip_history(stage2_summary),
            "seconds": round(time.time() - started, 1),
            "processes": world,
            "torch": torch.__version__,
        }
        _write_output(student, inputs.tokenizer, inputs.teacher, output, work, record, results, opts, say,
                      teacher_id, places)
        say(f"done in {time.time() - started:.0f} s: {output}")
        _close_logger(logger)
        if not opts.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        return output
    except BaseException as exc:
        if main and not isinstance(exc, expected_errors()):  # expected ones: the caller prints the one line
            logger.exception("conversion failed")
        _close_logger(logger)
        if main and created and not training:  # a failed start: nothing to resume, so a corrected rerun may start
            _undo_start(work, lock, output, existed)
        raise
    finally:
        if lock is not None:
            lock.release()


def _claim_output(opts: ConvertOptions, output: Path, work: Path, teacher_id: str,
                  accelerator) -> tuple[Optional[ts.RunLock], bool]:
    """The main process checks the output, takes the lock and prepares the work folder (:func:`_prepare_work`);
    every process raises its error, if any."""
    error, lock, created = None, None, False
    if accelerator.is_main_process:
        try:
            lock, created = _prepare_work(opts, output, work, teacher_id)
        except ConversionError as exc:
            error = str(exc)
    error = _share_string(error, accelerator)
    if error:
        raise ConversionError(error)
    return lock, created


def _undo_start(work: Path, lock: ts.RunLock, output: Path, existed: Path) -> None:
    """Remove what a run that failed before training made: the work folder, the lock and the empty folders above
    the output up to ``existed``."""
    shutil.rmtree(work, ignore_errors=True)
    lock.release()
    for folder in [output.parent, *output.parent.parents]:
        if folder == existed or any(folder.iterdir()):
            break
        folder.rmdir()


@dataclass
class _Inputs:
    tokenizer: object
    teacher: torch.nn.Module
    student: torch.nn.Module  # the teacher's weights mapped in, new parameters not yet initialised
    train: torch.Tensor  # text windows of seq_len tokens
    heldout: torch.Tensor
    data_info: dict
    stage1_train: torch.Tensor  # the training windows with recall-bearing ones mixed in (training_windows)
    stage2_train: torch.Tensor
    kept: list  # layers that keep the teacher's local attention exactly (hybrid teachers), neither trained


def _load_inputs(teacher_id: str, opts: ConvertOptions, accelerator, say) -> _Inputs:
    """The teacher, the data windows and the student built from the teacher."""
    t0 = time.time()
    tokenizer, teacher = load_teacher(teacher_id, device=_device_of(accelerator))
    say(f"teacher: {teacher.config.model_type}, {teacher.config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M parameters ({time.time() - t0:.1f} s)")

    with accelerator.main_process_first():
        train, heldout, data_info = _load_windows(tokenizer, opts, say)
    say(f"data: {list(opts.data)}: {train.shape[0]} training and {heldout.shape[0]} held-out windows of "
        f"{opts.seq_len} tokens ({data_info.get('documents')} documents, held out by document)")

    student = build_student(teacher, opts.mixer)
    recency = student.config.memory_recency
    say(f"student: {json.dumps(opts.mixer)}; " + (f"memory_recency {recency:.3g}; " if recency else "") +
        f"{sum(p.numel() for p in student.parameters()) / 1e6:.1f}M parameters")
    from .adapters import unchanged_layers

    kept = unchanged_layers(teacher.config, student.config)  # a hybrid teacher's local layers, kept exactly
    if kept:
        say(f"student: layers {kept} keep the teacher's local attention exactly (window "
            f"{student.config.sliding_window}); converted to Aaren: "
            f"{[i for i in range(student.config.num_hidden_layers) if i not in kept]}")
    long_train, L = None, long_length(opts.long_seq_len, student.config)
    if L > opts.seq_len and opts.stage2.steps > 0:
        with accelerator.main_process_first():
            long_train = _load_long_windows(tokenizer, opts, data_info.pop("train_documents"), L)
        if long_train is None:
            say(f"data: too little text for stage-2 windows of {L} tokens; stage 2 uses {opts.seq_len}")
    data_info.pop("train_documents", None)
    stage1_train, stage2_train = training_windows(tokenizer, opts, train, long_train, student.config.window_size, say)
    return _Inputs(tokenizer, teacher, student, train, heldout, data_info, stage1_train, stage2_train, kept)


def _initialize(inputs: _Inputs, opts: ConvertOptions, work: Path, accelerator, say) -> Optional[dict]:
    """Set the student's new parameters from the teacher's statistics (main process, then broadcast), or load them
    from the work folder when a resumed run made them already. Returns the init report."""
    from .init import initialize_student, new_parameter_names

    main, student = accelerator.is_main_process, inputs.student
    init_file, init_json = work / "init.safetensors", work / "init.json"
    new_names = new_parameter_names(student)
    # decided by the main process: another process looking itself could see a file written meanwhile
    have_init = _share_string("yes" if main and init_file.is_file() and init_json.is_file() else "",
                              accelerator) == "yes"
    if have_init:
        ts.load_tensors_into(student, init_file)
        say("init: loaded from the work folder (resumed)")
        return json.loads(init_json.read_text())
    init_report = None
    if main:
        t0 = time.time()
        init_report = initialize_student(
            student, inputs.teacher, inputs.train[: opts.init_windows], seed=opts.seed,
            kmeans_iterations=opts.kmeans_iterations, decay_spread=opts.decay_spread, log=say)
        init_report["seconds"] = round(time.time() - t0, 1)
        params = dict(student.named_parameters())
        ts.atomic_save_tensors(init_file, {n: params[n] for n in new_names})
        ts.atomic_write_json(init_json, init_report)
        say(f"init: {init_report['seconds']:.0f} s")
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        _broadcast_parameters(student, new_names, src=0)
    return init_report


def _train(inputs: _Inputs, opts: ConvertOptions, work: Path, accelerator, say, progress):
    """Stage 1 then stage 2 (each skipped at 0 steps): ``(student, stage-1 summary, stage-2 summary)``."""
    student, teacher, heldout = inputs.student, inputs.teacher, inputs.heldout
    stage1_summary = None
    if opts.stage1.steps > 0:
        stage1_summary = run_stage1(student, teacher, inputs.stage1_train, heldout, opts.stage1, seed=opts.seed,
                                    work_dir=work, frozen_layers=inputs.kept, accelerator=accelerator, log=say,
                                    progress_factory=progress)
        if accelerator.is_main_process:
            ts.atomic_write_json(work / "stage1.json", stage1_summary)
        before, after = stage1_summary["mean_heldout_fvu_before"], stage1_summary["mean_heldout_fvu_after"]
        if after is not None:
            say(f"stage 1 done: mean held-out FVU {before:.3f} -> {after:.3f} ({stage1_summary['seconds']:.0f} s)")
    stage2_summary = None
    if opts.stage2.steps > 0:
        student, stage2_summary = run_stage2(student, teacher, inputs.stage2_train, heldout, opts.stage2,
                                             seed=opts.seed, work_dir=work, accelerator=accelerator, log=say,
                                             progress_factory=progress, frozen_layers=inputs.kept)
    return student, stage1_summary, stage2_summary


def _strip_history(summary: Optional[dict]) -> Optional[dict]:
    if summary is None:
        return None
    out = dict(summary)
    history = out.pop("history", None) or []
    if history:  # keep a thinned loss curve
        stride = max(1, len(history) // 50)
        out["loss_curve"] = [h[:3] for h in history[::stride]]
    return out


def _share_string(value: Optional[str], accelerator) -> Optional[str]:
    """Send a short string from the main process to every process (as bytes in a tensor; no pickling)."""
    if accelerator.num_processes == 1:
        return value
    import torch.distributed as dist

    data = (value or "").encode() if accelerator.is_main_process else b""
    size = torch.tensor([len(data) + (1 if value is not None and accelerator.is_main_process else 0)])
    dist.broadcast(size, src=0)
    n = int(size)
    if n == 0:
        return None
    buf = torch.zeros(n, dtype=torch.uint8)
    if accelerator.is_main_process:
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return bytes(buf[: n - 1].tolist()).decode()


def run_evaluation(student, teacher, tokenizer, heldout, opts: ConvertOptions, data_info: dict, say) -> Optional[dict]:
    from .evaluate import evaluate, format_table

    windows = heldout[: opts.eval_windows] if opts.eval_windows else heldout
    t0 = time.time()
    say(f"evaluation: {windows.shape[0]} held-out windows of {windows.shape[1]} tokens"
        + (" (quick)" if opts.eval_quick else ""))
    long, L = None, long_length(opts.long_seq_len, student.config)
    if L > windows.shape[1]:
        from .evaluate import long_heldout_windows

        try:
            long = long_heldout_windows(tokenizer, list(opts.data), seq_len=opts.seq_len,
                                        num_heldout=opts.heldout_windows, long_length=L,
                                        seed=opts.seed)
        except ValueError as error:
            say(f"evaluation: no long windows ({error})")
    results = evaluate(student, teacher, tokenizer, windows, sinks=max(1, student.config.num_sink_tokens),
                       recall_distances=tuple(opts.recall_distances) if opts.recall_distances else None,
                       recall_trials=opts.recall_trials, quick=opts.eval_quick, seed=opts.seed,
                       text_source=", ".join(map(str, opts.data)), log=say, long_windows=long, max_long_windows=4,
                       window=[], retention=True)
    say(f"evaluation: {time.time() - t0:.0f} s")
    say("\n" + format_table(results))
    return results


def _teacher_name(teacher_id: str) -> str:
    from .model_card import teacher_hub_info

    return teacher_hub_info(teacher_id)["hub_name"] or teacher_display_name(teacher_id)


def _write_output(student, tokenizer, teacher, output: Path, work: Path, record: dict, results: Optional[dict],
                  opts: ConvertOptions, say, teacher_id: str, places: list) -> None:
    import copy

    from .model_card import finish_folder, teacher_hub_info, write_model_card

    record, results = _portable(record, places), _portable(results, places)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
        generation = copy.deepcopy(getattr(teacher, "generation_config", None))
        if generation is not None:
            student.generation_config = generation
        student.config.architectures = ["AarenForCausalLM"]
        student.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "generation_config.json").is_file() and student.generation_config is not None:
            student.generation_config.save_pretrained(tmp)
        ts.atomic_write_json(tmp / "conversion.json", record)
        if results is not None:
            ts.atomic_write_json(tmp / "evaluation.json", results)
        info = _portable(_recipe_info(record, student, opts), places)
        hub = teacher_hub_info(teacher_id)  # read from the real folder: the card shows only portable names
        info.update({k: v for k, v in (("base_model", hub["hub_name"]), ("teacher_source", hub["source"]),
                                       ("context", getattr(teacher.config, "max_position_embeddings", None)))
                     if v})
        write_model_card(tmp, info, results, model_name=output.name)
        log_file = work / "convert.log"
        if log_file.is_file():
            text = _portable(log_file.read_text(encoding="utf-8", errors="replace"), places)
            ts.atomic_write(tmp / "conversion.log", lambda name: Path(name).write_text(text, encoding="utf-8"))
        dropped = finish_folder(tmp, type(tokenizer).__name__)
        if dropped:
            say(f"tokenizer: the teacher's tokenizer_config.json names custom code ({dropped}); the conversion used "
                f"transformers' {type(tokenizer).__name__}, so the student states that class and drops the map")
        written = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir())
        ts.atomic_write_json(tmp / MARKER, {"written_by": "aaren-convert", "files": written})
        check_replaceable(output)  # again: files may have been put there while the conversion ran
        _publish_folder(tmp, output)
    except BaseException as error:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError):
            raise ConversionError(f"cannot write the output {output}: {_os_reason(error)}. The trained model is kept "
                                  f"in {work}: make room or fix the permissions, then rerun the same command with "
                                  f"--resume") from None
        raise
    say(f"saved {output}")


def _recipe_info(record: dict, student, opts: ConvertOptions) -> dict:
    s1, s2 = record.get("stage1"), record.get("stage2")
    T = opts.seq_len
    stages = [{"name": "init", "what": "query slots = k-means of the teacher's queries; decay from mean attention "
                                       "distance; window gates from the attention mass inside the window",
               "calibration windows": opts.init_windows}]
    if s1:
        stages.append({"name": "stage 1: attention transfer", "steps per layer": opts.stage1.steps,
                       "windows": min(opts.stage1.windows or opts.train_windows, opts.train_windows),
                       "lr": opts.stage1.lr,
                       "mean held-out FVU": f"{s1['mean_heldout_fvu_before']:.3f} -> {s1['mean_heldout_fvu_after']:.3f}"
                       if s1.get("mean_heldout_fvu_after") is not None else None})
    if s2:
        stages.append({"name": "stage 2: logit distillation (KL)", "steps": opts.stage2.steps,
                       "batch (windows)": opts.stage2.batch_size, "lr": opts.stage2.lr,
                       "trainable": opts.stage2.trainable, "ce weight": opts.stage2.ce_weight,
                       "held-out KL": (f"{s2['heldout_kl_before']:.3f} -> {s2['heldout_kl_after']:.3f}"
                                       if s2.get("heldout_kl_after") is not None and s2.get("heldout_kl_before")
                                       is not None else None)})
    tokens = (opts.stage2.steps * opts.stage2.batch_size * T if s2 else 0)
    tokens += (min(opts.stage1.windows or opts.train_windows, opts.train_windows) * T if s1 else 0)
    info = {
        "teacher": record["teacher"],
        "data": ", ".join(map(str, opts.data)),
        "tokens": tokens,
        "stages": stages,
        "options": {"seq_len": T, "seed": opts.seed, **opts.mixer},
        "student_config": student.config.to_dict(),
        "command": " ".join(["aaren-convert", *sys.argv[1:]]) if Path(sys.argv[0]).name in ("aaren-convert", "cli.py")
        else None,
        "conversion time": f"{record['seconds'] / 60:.1f} min on {record['processes']} process(es)",
    }
    if opts.recipe:
        info["recipe"] = opts.recipe
    return {k: v for k, v in info.items() if v is not None}
