# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Upload a converted Aaren folder (or a merged fine-tune) to the Hugging Face Hub, with its card and code.

    python examples/push_to_hub.py outputs/SmolLM2-135M-Instruct-aaren --dry-run     # check, list files and card
    python examples/push_to_hub.py outputs/SmolLM2-135M-Instruct-aaren                # private repo <you>/<folder>
    python examples/push_to_hub.py outputs/x-lora/merged --repo-id you/x-python --base-model you/x-aaren --public

    python examples/push_to_hub.py outputs/x-lora/adapter --base-model you/x-aaren   # a LoRA adapter folder

The folder is checked first, in both modes: config.json with auto_map for AutoConfig, AutoModel and
AutoModelForCausalLM; the modeling files it names (and those they import); safetensors weights; README.md whose
YAML metadata has base_model, license and tags; no pickle files (.bin, .pt, ...), which run code when loaded; no
symbolic link to a file outside the folder (the upload would follow it). A PEFT adapter folder (adapter_config.json)
needs adapter_model.safetensors and a base model named by its hub name, not a local path, instead of config.json.
--base-model OWNER/NAME writes the hub model this one was made from into README.md (and adapter_config.json) when
the folder does not know it (a conversion of a local teacher folder, a fine-tune of a local model).
--dry-run then prints exactly the files (with sizes) and the card that would go up, and changes and contacts nothing.

The token comes from --token, else the usual places (huggingface_hub.get_token(): the HF_TOKEN variable, then the
file written by `hf auth login`, formerly `huggingface-cli login`). The repo is created private unless --public
(an existing repo keeps its visibility), then the folder goes up in one commit (create_repo + upload_folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REQUIRED_AUTO_MAP = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")
REQUIRED_CARD_FIELDS = ("base_model", "license", "tags")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
GENERIC_NAMES = ("merged", "adapter", "model", "final", "output")

NO_TOKEN_MESSAGE = """\
error: no Hugging Face token found, so nothing can be uploaded.
Log in once with
    hf auth login            (older huggingface_hub: huggingface-cli login)
which stores a token that this script finds, or set the HF_TOKEN environment variable (a token with write access
from https://huggingface.co/settings/tokens), or pass --token. To check the folder without uploading: --dry-run."""


class FolderError(ValueError):
    """The folder is not ready to upload; the message lists every problem."""


def human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"


def upload_files(folder: Path) -> list[str]:
    """Relative paths (POSIX) that go up: every regular file except hidden ones (.git, .cache, ...), __pycache__
    and *.pyc, filtered again by huggingface_hub's own default ignore patterns."""
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file():  # follows links (a hub snapshot links to blobs)
            continue
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts) or path.suffix == ".pyc":
            continue
        files.append(rel.as_posix())
    return list(filter_repo_objects(files, ignore_patterns=DEFAULT_IGNORE_PATTERNS))


def exact_pattern(path: str) -> str:
    """An fnmatch pattern matching exactly this path (upload_folder selects files by pattern)."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _relative_imports(py_file: Path) -> set[str]:
    text = py_file.read_text(encoding="utf-8", errors="replace")
    return set(re.findall(r"^\s*from\s+\.([A-Za-z_][A-Za-z0-9_]*)\s+import", text, flags=re.MULTILINE))


def read_card(folder: Path):
    """(metadata dict, full text) of README.md; raises FolderError when it is missing or has no YAML block."""
    from huggingface_hub import ModelCard

    path = folder / "README.md"
    if not path.is_file():
        raise FolderError("README.md (the model card) is missing")
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("---"):
        raise FolderError("README.md has no YAML metadata block (--- ... --- at the top)")
    try:
        data = ModelCard(text, ignore_metadata_errors=False).data.to_dict()
    except Exception as error:  # malformed YAML
        raise FolderError(f"README.md metadata does not parse: {error}") from error
    return data, text


def outside_links(folder: Path) -> list[str]:
    """Symbolic links (not in hidden folders) whose target lies outside ``folder``: "link -> target"."""
    root = folder.resolve()
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_symlink() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            target = path.resolve()
            if target != root and root not in target.parents:
                found.append(f"{rel.as_posix()} -> {target}")
    return found


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def check_folder(folder, base_model: str | None = None) -> tuple[list[str], list[str]]:
    """(problems, warnings). Problems make the upload refuse; warnings are printed. ``base_model``: the hub name
    --base-model will write into the card (and adapter_config.json)."""
    folder = Path(folder)
    problems, warnings = [], []
    if not folder.is_dir():
        return [f"{folder} is not a folder"], []
    files = upload_files(folder)
    links = outside_links(folder)
    if links:
        problems.append(
            f"symbolic links to files outside the folder: {', '.join(links)}. The upload would follow them and send "
            "those files; copy them in (cp -L) or remove the links"
        )
    adapter = (folder / "adapter_config.json").is_file()

    pickles = [f for f in files if f.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        problems.append(
            f"pickle files would be uploaded: {', '.join(pickles)}. Pickle runs code when loaded (the Hub flags such "
            "files); the weights belong in safetensors. Delete them (e.g. Trainer's training_args.bin), or re-save "
            "with save_pretrained(..., safe_serialization=True)"
        )

    config_path = folder / "config.json"
    config = None
    if adapter:
        try:
            named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        except ValueError as error:
            problems.append(f"adapter_config.json does not parse: {error}")
            named = ""
        if _looks_local(named) and not base_model:
            problems.append(f"adapter_config.json names its base model by the local path {named!r}, which nobody "
                            "else can load: pass --base-model OWNER/NAME (the converted model on the Hub)")
        if "adapter_model.safetensors" not in files:
            problems.append("adapter_model.safetensors is missing")
    elif not config_path.is_file():
        problems.append("config.json is missing")
    else:
        try:
            config = json.loads(config_path.read_text())
        except ValueError as error:
            problems.append(f"config.json does not parse: {error}")
    if config is not None:
        if config.get("model_type") != "aaren":
            warnings.append(f"config.json model_type is {config.get('model_type')!r}, not 'aaren'")
        auto_map = config.get("auto_map") or {}
        missing = [key for key in REQUIRED_AUTO_MAP if key not in auto_map]
        if missing:
            problems.append(
                f"config.json auto_map lacks {', '.join(missing)}: users without aaren-hf could not load it with "
                "trust_remote_code=True. Re-save it with aaren_hf imported (AarenForCausalLM.save_pretrained writes "
                "all three entries and copies the modeling files)"
            )
        # every module the auto_map names, and every file those import relatively, must be in the folder
        todo = {ref.split("--")[-1].rsplit(".", 1)[0] for ref in auto_map.values() if isinstance(ref, str)}
        seen = set()
        while todo:
            module = todo.pop()
            seen.add(module)
            path = folder / f"{module}.py"
            if not path.is_file():
                problems.append(f"{module}.py (named by auto_map or imported by the modeling code) is missing")
                continue
            todo |= _relative_imports(path) - seen

    weights = [f for f in files if f.endswith(".safetensors")]
    if not weights and not adapter:
        problems.append("no safetensors weights (model.safetensors or sharded model-*.safetensors)")
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            shards = set(json.loads(index_path.read_text())["weight_map"].values())
            absent = sorted(s for s in shards if not (folder / s).is_file())
            if absent:
                problems.append(f"model.safetensors.index.json names missing shards: {', '.join(absent)}")
        except (ValueError, KeyError) as error:
            problems.append(f"model.safetensors.index.json does not parse: {error}")

    try:
        card, _ = read_card(folder)
        for field in REQUIRED_CARD_FIELDS:
            if field == "base_model" and (base_model or (card.get(field) and not _looks_local(str(card[field])))):
                continue
            if field == "base_model":
                problems.append(
                    f"README.md metadata {'names a local path as' if card.get(field) else 'lacks'} 'base_model': pass "
                    "--base-model OWNER/NAME (the hub model this one was converted or fine-tuned from) to write it "
                    "in, or add it to README.md yourself"
                )
            elif not card.get(field):
                problems.append(f"README.md metadata lacks {field!r}")
        for field, value in (("library_name", "transformers"), ("pipeline_tag", "text-generation")):
            if not card.get(field):
                warnings.append(f"README.md metadata has no {field} (suggested: {value})")
    except FolderError as error:
        problems.append(str(error))

    if not adapter and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        warnings.append("no tokenizer files: users will need the teacher's tokenizer")
    return problems, warnings


def default_repo_name(folder: Path) -> str:
    folder = folder.resolve()
    if folder.name in GENERIC_NAMES:  # outputs/x-lora/merged -> x-lora-merged
        return f"{folder.parent.name}-{folder.name}"
    return folder.name


def token_source() -> str | None:
    """Where huggingface_hub would find a token, looked up without contacting anything."""
    from huggingface_hub import constants

    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "the HF_TOKEN environment variable"
    if Path(constants.HF_TOKEN_PATH).is_file():
        return f"{constants.HF_TOKEN_PATH} (hf auth login)"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("folder", help="converted folder (aaren-convert) or merged fine-tune (finetune_lora.py)")
    parser.add_argument("--repo-id", default=None, help="NAME or OWNER/NAME (default: the folder's name under your "
                                                        "account)")
    parser.add_argument("--public", action="store_true", help="create a public repo (default: private)")
    parser.add_argument("--token", default=None, help="default: HF_TOKEN, else the `hf auth login` token")
    parser.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    parser.add_argument("--commit-message", default="Upload Aaren model (aaren-hf)")
    parser.add_argument("--base-model", default=None, metavar="OWNER/NAME",
                        help="hub model this one was made from, written into README.md (and adapter_config.json) "
                             "when the folder names none or a local path")
    parser.add_argument("--dry-run", action="store_true", help="check and print what would be uploaded; no network")
    return parser.parse_args(argv)


def with_base_model(folder: Path, base_model: str) -> dict:
    """New text of README.md (and adapter_config.json) naming ``base_model``: {file name: text}."""
    from huggingface_hub import ModelCard

    card = ModelCard(read_card(folder)[1])
    card.data.base_model = base_model
    texts = {"README.md": str(card)}
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        config = json.loads(adapter.read_text())
        config["base_model_name_or_path"] = base_model
        texts["adapter_config.json"] = json.dumps(config, indent=2) + "\n"
    return texts


def main(argv=None):
    args = parse_args(argv)
    folder = Path(args.folder)
    repo_id = args.repo_id or default_repo_name(folder)
    problems, warnings = check_folder(folder, args.base_model)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if problems:
        raise SystemExit(f"error: {folder} is not ready to upload:\n" + "\n".join(f"  - {p}" for p in problems))
    rewritten = with_base_model(folder, args.base_model) if args.base_model else {}
    files = upload_files(folder)
    sizes = {f: (folder / f).stat().st_size for f in files}

    if args.dry_run:
        visibility = "public" if args.public else "private"
        print("dry run: nothing is uploaded, nothing is contacted")
        print(f"repo: {repo_id} ({visibility}, model){'' if '/' in repo_id else ' under the token owner account'}")
        source = token_source()
        print(f"token: {'from ' + source if source else 'none found (the real upload needs `hf auth login` or HF_TOKEN)'}")
        print(f"files ({len(files)}, {human(sum(sizes.values()))}):")
        for f in files:
            print(f"  {human(sizes[f]):>10}  {f}")
        print("model card (README.md):")
        print(rewritten.get("README.md", read_card(folder)[1]).rstrip())
        return {"repo_id": repo_id, "files": sizes, "private": not args.public}

    from huggingface_hub import HfApi, get_token

    token = args.token or get_token()
    if not token:
        raise SystemExit(NO_TOKEN_MESSAGE)
    if rewritten:
        from aaren_hf.conversion.train_state import atomic_write

        for name, text in rewritten.items():
            atomic_write(folder / name, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
            print(f"{name}: base_model set to {args.base_model}")
        sizes = {f: (folder / f).stat().st_size for f in files}
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=not args.public, exist_ok=True, repo_type="model")
    print(f"repo: {url}", flush=True)
    info = api.upload_folder(
        repo_id=url.repo_id,
        folder_path=str(folder),
        allow_patterns=[exact_pattern(f) for f in files],
        commit_message=args.commit_message,
        revision=args.revision,
        repo_type="model",
    )
    print(f"uploaded {len(files)} files ({human(sum(sizes.values()))}): {getattr(info, 'commit_url', info)}")
    print(f"load with: AutoModelForCausalLM.from_pretrained({url.repo_id!r}, trust_remote_code=True)")
    return {"repo_id": url.repo_id, "files": sizes, "private": not args.public}


if __name__ == "__main__":
    main()
