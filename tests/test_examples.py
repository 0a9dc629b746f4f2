"""The example scripts in examples/, on tiny offline checkpoints (a random AarenForCausalLM + a byte-level BPE
tokenizer trained here with the `tokenizers` library).

Most examples run in this process through their ``main(argv)`` (torch is imported once); ``--help`` and the
"downloaded back" check run in fresh interpreters. Nothing here touches the network: push_to_hub is exercised
up to the point of contacting the Hub (its checks, --dry-run, the no-token error, and the exact create_repo /
upload_folder calls it would make, recorded by stand-ins) -- the upload itself is NOT exercised offline.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  (registers the Auto classes)
from aaren_hf import AarenConfig, AarenForCausalLM
from helpers import bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE_NAMES = ["generate", "finetune_lora", "push_to_hub", "long_context"]

TEXT = """The quick brown fox jumps over the lazy dog.
def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
Python is a programming language that lets you work quickly and integrate systems more effectively.
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
"""

CARD = """---
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- aaren
- linear-attention
---
# tiny-aaren

A tiny random Aaren model for tests.
"""


def load_example(name):
    """Import examples/<name>.py as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"aaren_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tokenizer():
    return bpe_tokenizer(TEXT, chat_template=("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                              "{% if add_generation_prompt %}<s>assistant:{% endif %}"))


def make_tiny_folder(path, **overrides):
    """What aaren-convert produces, in miniature: weights + remote code + tokenizer + model card."""
    tokenizer = make_tokenizer()
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AarenForCausalLM(AarenConfig(**kwargs))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Path(path, "README.md").write_text(CARD)
    return Path(path)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_folder(tmp_path_factory.mktemp("ckpt") / "tiny-aaren")


@pytest.fixture(scope="module")
def student_folder(tmp_path_factory):
    """A miniature of what the recipe converts to: window, sink and memory, stored in bfloat16 and 4-bit codes."""
    return make_tiny_folder(tmp_path_factory.mktemp("ckpt") / "tiny-student", window_size=8, num_sink_tokens=1,
                            memory_size=4, kv_cache_dtype="bfloat16", memory_bits=4, memory_hadamard=True)


@pytest.fixture
def folder_copy(tiny_folder, tmp_path):
    return Path(shutil.copytree(tiny_folder, tmp_path / "tiny-aaren"))


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Trainer / PartialState are process-wide singletons: start each test from a clean state."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _write_docs(path, n=30):
    docs = [f"{TEXT} Document number {i}." for i in range(n)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


# ----------------------------------------------------------------------------------------------------------------
# --help
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_help(name):
    """Each example parses its arguments before importing torch: --help is instant and exits 0."""
    result = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_readme_mentions_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for name in EXAMPLE_NAMES:
        assert f"examples/{name}.py" in readme


# ----------------------------------------------------------------------------------------------------------------
# generate.py
# ----------------------------------------------------------------------------------------------------------------


def test_generate_batch_and_stream(tiny_folder, capsys):
    gen = load_example("generate")
    out = gen.main(["--model", str(tiny_folder), "--max-new-tokens", "4", "The capital of France is", "def f"])
    text = capsys.readouterr().out
    assert ">>> The capital of France is" in text and ">>> def f" in text
    assert "state bytes:" in text and "fixed size from the first token on" in text
    assert out.sequences.shape[0] == 2
    # one prompt: streamed with TextStreamer
    gen.main(["--model", str(tiny_folder), "--max-new-tokens", "3", "--chat", "Hello"])
    text = capsys.readouterr().out
    assert ">>> Hello" in text and "1 prompt(s)" in text and "state bytes:" in text


def test_generate_compile_decodes_the_same_tokens(tiny_folder, capsys):
    """--compile: generate with a static cache (compiled on a GPU; on this CPU transformers does not compile): the
    tokens of the default run, and the cache it returns is the static one."""
    gen = load_example("generate")
    runs = [gen.main(["--model", str(tiny_folder), "--max-new-tokens", "5", "--no-stream", *flag, "Hello", "def f"])
            for flag in ([], ["--compile"])]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert [r.past_key_values.is_compileable for r in runs] == [False, True]


def test_generate_left_padded_batch_matches_single_prompts(tiny_folder):
    gen = load_example("generate")
    model, tokenizer = gen.load(str(tiny_folder))
    prompts = ["The capital of France is", "def"]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    batch = gen.build_inputs(tokenizer, prompts)
    assert tokenizer.padding_side == "left" and (batch["attention_mask"][1] == 0).any()
    batched = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1]:]
    for row, prompt in enumerate(prompts):
        single = gen.build_inputs(tokenizer, [prompt])
        alone = model.generate(**single, **kwargs)[0, single["input_ids"].shape[1]:]
        assert batched[row].tolist() == alone.tolist()


def test_generate_missing_default_folder_says_how_to_convert(tmp_path, monkeypatch):
    gen = load_example("generate")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="aaren-convert"):
        gen.main(["--max-new-tokens", "1"])


# ----------------------------------------------------------------------------------------------------------------
# A folder "downloaded back" loads with its own code in a fresh interpreter, without aaren_hf
# ----------------------------------------------------------------------------------------------------------------

REMOTE_SCRIPT = r"""
import json, runpy, sys
sys.modules["aaren_hf"] = None  # the package is installed in this venv: make it unimportable
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

folder, generate_py = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(folder, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(folder, padding_side="left", trust_remote_code=True)
inputs = tok(["The capital of France is", "def"], return_tensors="pt", padding=True)
with torch.no_grad():
    logits = model(input_ids=inputs["input_ids"][:1, -3:]).logits
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
result = {
    "module": type(model).__module__, "base": type(base).__name__, "cache": type(out.past_key_values).__name__,
    "new_tokens": out.sequences.shape[1] - inputs["input_ids"].shape[1], "logits": logits[0, -1, :8].tolist(),
    "state_bytes": out.past_key_values.state_bytes(), "aaren_hf_loaded": sys.modules.get("aaren_hf") is not None,
}
print("RESULT " + json.dumps(result), flush=True)
# the example's own remote-code path, in the same package-less interpreter
sys.argv = [generate_py, "--model", folder, "--trust-remote-code", "--max-new-tokens", "3", "Hello"]
runpy.run_path(generate_py, run_name="__main__")
"""


def test_downloaded_copy_loads_with_remote_code_without_the_package(tiny_folder, tmp_path):
    # the layout snapshot_download produces: <cache>/models--owner--name/snapshots/<revision>/
    snapshot = tmp_path / "hub" / "models--someone--tiny-aaren" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_folder, snapshot)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON", "TRANSFORMERS"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-I", "-c", REMOTE_SCRIPT, str(snapshot), str(EXAMPLES / "generate.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    info = json.loads(line[len("RESULT "):])
    assert info["module"].startswith("transformers_modules."), info  # the folder's own code, not aaren_hf
    assert not info["aaren_hf_loaded"]
    assert info["base"] == "AarenModel" and info["cache"] == "AarenCache" and info["new_tokens"] == 4
    assert info["state_bytes"] > 0
    # same numbers as the packaged class
    model = AarenForCausalLM.from_pretrained(tiny_folder).eval()
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_folder)(["The capital of France is"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids[:, -3:]).logits[0, -1, :8]
    assert torch.allclose(torch.tensor(info["logits"]), expected, atol=1e-5)
    assert "transformers_modules." in result.stdout and "state bytes:" in result.stdout  # generate.py's output
    assert "Do you wish to run the custom code" not in result.stdout  # trust_remote_code reached AutoTokenizer too


# ----------------------------------------------------------------------------------------------------------------
# push_to_hub.py (the upload itself is not exercised: no network here)
# ----------------------------------------------------------------------------------------------------------------


def test_push_dry_run_lists_files_and_card(tiny_folder, capsys):
    push = load_example("push_to_hub")
    result = push.main([str(tiny_folder), "--dry-run"])
    out = capsys.readouterr().out
    expected = {"README.md", "config.json", "generation_config.json", "model.safetensors", "configuration_aaren.py",
                "modeling_aaren.py", "aaren_scan.py", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= set(result["files"])
    assert set(result["files"]) == {p.name for p in tiny_folder.iterdir() if p.is_file()}
    for name, size in result["files"].items():
        assert size == (tiny_folder / name).stat().st_size
        assert name in out
    assert result["private"] is True and result["repo_id"] == "tiny-aaren"
    assert "private" in out
    for line in ("base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "license: apache-2.0", "- aaren"):
        assert line in out


def test_push_dry_run_skips_hidden_and_cache_files(folder_copy):
    push = load_example("push_to_hub")
    (folder_copy / ".cache" / "huggingface").mkdir(parents=True)
    (folder_copy / ".cache" / "huggingface" / "x.lock").write_text("")
    (folder_copy / "__pycache__").mkdir()
    (folder_copy / "__pycache__" / "modeling_aaren.cpython-311.pyc").write_bytes(b"\0")
    files = push.upload_files(folder_copy)
    assert not any(f.startswith((".", "__pycache__")) for f in files)
    assert "modeling_aaren.py" in files


def test_push_refuses_folder_without_auto_map(folder_copy):
    push = load_example("push_to_hub")
    config = json.loads((folder_copy / "config.json").read_text())
    config["auto_map"].pop("AutoModel")
    (folder_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="auto_map lacks AutoModel"):
        push.main([str(folder_copy), "--dry-run"])
    del config["auto_map"]
    (folder_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="auto_map lacks AutoConfig, AutoModel, AutoModelForCausalLM"):
        push.main([str(folder_copy), "--dry-run"])


def test_push_refuses_pickle_bin(folder_copy):
    push = load_example("push_to_hub")
    torch.save({"w": torch.zeros(1)}, folder_copy / "pytorch_model.bin")
    with pytest.raises(SystemExit, match=r"pickle files would be uploaded: pytorch_model\.bin"):
        push.main([str(folder_copy), "--dry-run"])


def test_push_refuses_missing_code_weights_and_card_fields(folder_copy):
    push = load_example("push_to_hub")
    (folder_copy / "aaren_scan.py").unlink()  # imported by modeling_aaren.py
    (folder_copy / "model.safetensors").unlink()
    (folder_copy / "README.md").write_text("---\nlicense: apache-2.0\n---\n# no base_model, no tags\n")
    problems, _ = push.check_folder(folder_copy)
    text = "\n".join(problems)
    assert "aaren_scan.py" in text and "safetensors" in text
    assert "'base_model'" in text and "'tags'" in text and "'license'" not in text
    (folder_copy / "README.md").write_text("# a card without metadata\n")
    assert any("YAML" in p for p in push.check_folder(folder_copy)[0])


@pytest.fixture
def no_network(monkeypatch):
    """Every HfApi call and every socket connection raises: proves the code under test stays offline."""
    from huggingface_hub import HfApi

    def forbidden(*args, **kwargs):
        raise AssertionError("network access attempted")

    for name in ("create_repo", "upload_folder", "create_commit", "whoami", "repo_info", "model_info",
                 "preupload_lfs_files", "list_repo_files", "repo_exists"):
        monkeypatch.setattr(HfApi, name, forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)
    monkeypatch.setattr(socket, "getaddrinfo", forbidden)


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    from huggingface_hub import constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))


def test_push_without_token_explains_login_and_stays_offline(tiny_folder, no_token, no_network):
    push = load_example("push_to_hub")
    from huggingface_hub import get_token

    assert get_token() is None
    with pytest.raises(SystemExit) as error:
        push.main([str(tiny_folder)])
    message = str(error.value.code)
    assert "no Hugging Face token" in message and "hf auth login" in message and "HF_TOKEN" in message
    # and --dry-run needs no token at all
    push.main([str(tiny_folder), "--dry-run"])


def test_push_makes_private_repo_and_uploads_exactly_the_listed_files(tiny_folder, monkeypatch, no_token, no_network):
    """The calls push_to_hub would send (recorded by stand-ins: the upload itself is not exercised offline)."""
    push = load_example("push_to_hub")
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    calls = {}

    class RepoUrl(str):
        repo_id = "someone/tiny-aaren"

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs, self.token)
        return RepoUrl("https://huggingface.co/someone/tiny-aaren")

    def upload_folder(self, **kwargs):
        calls["upload_folder"] = kwargs
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_tests")
    result = push.main([str(tiny_folder)])
    repo_id, kwargs, token = calls["create_repo"]
    assert repo_id == "tiny-aaren" and kwargs["private"] is True and kwargs["exist_ok"] and token == "hf_fake_token_for_tests"
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "someone/tiny-aaren" and Path(upload["folder_path"]) == tiny_folder
    everything = [p.name for p in tiny_folder.iterdir()] + ["extra.bin", "sub/x.json"]
    selected = set(filter_repo_objects(everything, allow_patterns=upload["allow_patterns"]))
    assert selected == set(result["files"])


# ----------------------------------------------------------------------------------------------------------------
# long_context.py
# ----------------------------------------------------------------------------------------------------------------


def test_long_context_tiny(capsys):
    lc = load_example("long_context")
    result = lc.main(["--tiny", "--tokens", "3000", "--chunk", "512", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert len(result["state_bytes"]) == 1 and result["state_bytes"][0] > 0  # constant while streaming
    assert len(result["generated"]) == 4
    assert "tokens/s" in out and "teacher KV cache" in out and "2,999" in out
    # 2 * layers * kv_heads * head_dim * T * bytes
    config = lc.tiny_model_and_tokenizer()[0].config
    assert result["teacher_kv_bytes"] == 2 * 2 * 2 * config.head_dim * 3004 * 2


def test_long_context_loads_the_model_with_the_memory_recency_asked_for(student_folder, capsys):
    lc = load_example("long_context")
    for flag, shown in (([], "memory 4 (recency 0.0)"), (["--memory-recency", "0.5"], "memory 4 (recency 0.5)")):
        lc.main(["--model", str(student_folder), "--tokens", "40", "--chunk", "16", "--random", "--max-new-tokens",
                 "2"] + flag)
        assert shown in capsys.readouterr().out


def test_long_context_chunked_prefill_then_generate_equals_plain_generate():
    """What long_context.py does (prefill in chunks with the returned cache, then generate() from the cache) gives
    the tokens of one plain generate() over the whole input."""
    lc = load_example("long_context")
    torch.manual_seed(0)
    model, _ = lc.tiny_model_and_tokenizer()
    model.eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 300))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **kwargs)
        cache = None
        for start in range(0, 299, 64):
            cache = model(input_ids=ids[:, start:min(start + 64, 299)], past_key_values=cache, use_cache=True).past_key_values
        continued = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **kwargs)
    assert continued.tolist() == plain.tolist()


# ----------------------------------------------------------------------------------------------------------------
# finetune_lora.py
# ----------------------------------------------------------------------------------------------------------------


def test_lora_target_names():
    ft = load_example("finetune_lora")
    plain = AarenForCausalLM(AarenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4))
    assert ft.default_target_modules(plain) == ["mixer.k_proj", "mixer.o_proj", "mixer.v_proj", "mlp.down_proj",
                                                "mlp.gate_proj", "mlp.up_proj"]
    rich = AarenForCausalLM(AarenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, mlp_type="plain", decay="input", window_size=8,
                                        window_gate="input"))
    assert ft.default_target_modules(rich) == ["mixer.decay_proj", "mixer.gate_proj", "mixer.k_proj", "mixer.o_proj",
                                               "mixer.q_proj", "mixer.v_proj", "mlp.fc_in", "mlp.fc_out"]
    assert ft.resolve_target_modules(rich, ["mixer.gate_proj,v_proj"]) == ["mixer.gate_proj", "v_proj"]
    assert "lm_head" in ft.valid_target_names(plain)


def test_lora_invalid_target_lists_valid_names():
    ft = load_example("finetune_lora")
    model = AarenForCausalLM(AarenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4))
    # q_proj exists only with query slots or a window; self_attn.* is the teacher's naming
    with pytest.raises(ValueError) as error:
        ft.resolve_target_modules(model, ["q_proj", "self_attn.k_proj", "mixer.v_proj"])
    message = str(error.value)
    assert "['q_proj', 'self_attn.k_proj']" in message
    for name in ("mixer.k_proj", "mixer.v_proj", "mixer.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert name in message


def test_lora_cli_rejects_unknown_target(tiny_folder, capsys):
    ft = load_example("finetune_lora")
    with pytest.raises(SystemExit):
        ft.main(["--model", str(tiny_folder), "--threads", "0"])
    assert "--threads must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"not found in this AarenForCausalLM\. Valid names: .*mixer\.k_proj"):
        ft.main(["--model", str(tiny_folder), "--target-modules", "c_attn"])
    ft.main(["--model", str(tiny_folder), "--list-targets"])
    assert "mlp.up_proj" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # raised inside peft
def test_finetune_tiny_run_saves_adapter_that_reloads_and_merges(student_folder, tmp_path, capsys):
    ft = load_example("finetune_lora")
    out_dir = tmp_path / "run"
    previous = torch.get_num_threads()
    threads = 1 if previous != 1 else 2  # not what torch already uses, so that --threads shows
    try:
        docs = _write_docs(tmp_path / "docs.jsonl")
        result = ft.main(["--model", str(student_folder), "--text-file", str(docs),
                          "--max-steps", "3", "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "2",
                          "--lr", "1e-2", "--output-dir", str(out_dir), "--threads", str(threads)])
        assert result["threads"] == threads
        assert torch.get_num_threads() == previous  # given back: main() also runs inside other programs
    finally:
        torch.set_num_threads(previous)
    text = capsys.readouterr().out
    assert "held-out perplexity before" in text and "after" in text
    assert result["merge_diff"] < 1e-4
    assert result["ppl_after"] != result["ppl_before"]

    from peft import AutoPeftModelForCausalLM

    adapter = Path(result["adapter_dir"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(result["targets"])
    assert Path(config["base_model_name_or_path"]) == student_folder.resolve()
    # the window and memory at full precision: stored in 16 and 4 bits, weights that differ by float rounding may
    # round a state entry apart (finetune_lora.merge_difference)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True,
                                                          **ft.FULL_PRECISION_STATE).eval()
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained (lora_B starts at zero)
    ids = torch.randint(3, peft_model.config.vocab_size, (2, 12))
    with torch.no_grad():
        with_adapter = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(input_ids=ids).logits, with_adapter, atol=1e-5)

    # both folders are ready for push_to_hub (code, auto_map, safetensors, card with metadata) once they name their
    # base model: the converted model (whose hub name only the user knows), not its teacher
    push = load_example("push_to_hub")
    for folder in (result["merged_dir"], result["adapter_dir"]):
        problems, _ = push.check_folder(folder)
        assert problems and all("--base-model" in p for p in problems), problems
        assert push.check_folder(folder, base_model="you/tiny-aaren")[0] == []
    card = (Path(result["merged_dir"]) / "README.md").read_text()
    assert "SmolLM2" not in card and "- lora" in card
    # as published: no pickles (Trainer's training_args.bin), normal file modes, no local paths in the cards
    written = [p for p in out_dir.rglob("*") if p.is_file()]
    assert not [p.name for p in written if p.suffix in (".bin", ".pt", ".pkl")]
    assert {p.stat().st_mode & 0o777 for p in written} == {0o644}
    for folder in (result["merged_dir"], result["adapter_dir"]):
        text = (Path(folder) / "README.md").read_text()
        assert str(tmp_path) not in text and str(student_folder) not in text


@pytest.mark.slow
def test_finetune_runs_unchanged_on_two_processes(tiny_folder, tmp_path):
    """`torchrun --nproc_per_node 2` on CPU (gloo): each process trains on its share, the main one saves, reloads
    and merges. Slow (two interpreters): not part of scripts/test.sh."""
    out_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(EXAMPLES / "finetune_lora.py"),
         "--model", str(tiny_folder), "--text-file", str(_write_docs(tmp_path / "docs.jsonl")), "--max-steps", "2",
         "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "2", "--output-dir", str(out_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "(2 process(es))" in result.stdout
    assert result.stdout.count("held-out perplexity before:") == 2  # printed by the main process only (start, end)
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (out_dir / "merged" / "model.safetensors").is_file()
