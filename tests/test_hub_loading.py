"""save_pretrained / from_pretrained: safetensors and remote-code files, loading in a fresh process without this
package (trust_remote_code), tied and untied embeddings, and clear errors for broken or newer checkpoints."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  before transformers: see helpers.py
from aaren_hf.configuration_aaren import AAREN_FORMAT_VERSION
from helpers import MIXER_CASES, one_thread, random_ids, tiny_model  # noqa: F401 (fixture)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

PACKAGE_DIR = Path(aaren_hf.__file__).parent
REMOTE_FILES = ("configuration_aaren.py", "modeling_aaren.py", "aaren_scan.py")
CASES = {
    "tied": dict(tie_word_embeddings=True, decay="input", window_size=4, num_sink_tokens=2),
    "untied": dict(MIXER_CASES["everything"], memory_size=[0, 2], tie_word_embeddings=False),  # per-layer memory
    "gemma": dict(MIXER_CASES["gemma_block"]),  # hybrid layers, Gemma-3's block options
}
PROMPT = random_ids(2, 5, seed=9)
NEW_TOKENS = 8
FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["aaren_hf"] = None  # the project must not be importable: only the checkpoint's own code may run
    import json, torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    root = sys.argv[1]
    from safetensors.torch import load_file
    expected = load_file(root + "/expected.safetensors")
    report = {}
    for name in ("tied", "untied", "gemma"):
        folder = root + "/" + name
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        out = model.generate(expected["prompt"], max_new_tokens=%d, do_sample=False, return_dict_in_generate=True)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        with torch.no_grad():
            hidden = base(expected["prompt"]).last_hidden_state
        report[name] = {
            "class": type(model).__module__ + "." + type(model).__name__,
            "base_class": type(base).__name__,
            "tokens": out.sequences.tolist(),
            "cache": type(out.past_key_values).__name__,
            "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
            "hidden_max_diff": (hidden - expected[name + "_hidden"]).abs().max().item(),
        }
    for broken in ("newer", "missing"):
        try:
            AutoModelForCausalLM.from_pretrained(root + "/" + broken, trust_remote_code=True)
            report[broken] = "loaded without error"
        except Exception as err:
            report[broken] = type(err).__name__ + ": " + str(err)
    report["aaren_hf_modules"] = sorted(k for k, m in sys.modules.items() if k.startswith("aaren_hf") and m is not None)
    print("REPORT " + json.dumps(report))
    """
    % NEW_TOKENS
)


def build(name):
    return tiny_model(seed=1, **CASES[name])


def generate(model):
    return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)


def drop_tensor(folder, key):
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[key]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both checkpoints, plus broken copies: a newer format version and a missing tensor."""
    root = tmp_path_factory.mktemp("checkpoints")
    expected = {"prompt": PROMPT}
    for name in CASES:
        model = build(name)
        model.save_pretrained(root / name)
        expected[name + "_tokens"] = generate(model)
        with torch.no_grad():
            expected[name + "_hidden"] = model.model(PROMPT).last_hidden_state
    save_file({k: v.contiguous() for k, v in expected.items()}, str(root / "expected.safetensors"))

    shutil.copytree(root / "tied", root / "newer")
    config = json.loads((root / "newer" / "config.json").read_text())
    config["aaren_format_version"] = AAREN_FORMAT_VERSION + 1
    (root / "newer" / "config.json").write_text(json.dumps(config))
    shutil.copytree(root / "tied", root / "missing")
    drop_tensor(root / "missing", "model.layers.1.mixer.queries")
    return root, expected


@pytest.fixture(scope="module")
def fresh_process(saved, tmp_path_factory):
    """Load every checkpoint in a new interpreter: isolated mode (-I: no PYTHONPATH, no user site, no script folder),
    another working directory, offline, its own HF cache, and aaren_hf blocked in sys.modules."""
    root, _ = saved
    work = tmp_path_factory.mktemp("elsewhere")
    script = work / "load.py"
    script.write_text(FRESH_PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf_home"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-I", str(script), str(root)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


# ---------------------------------------------------------------------------------------------------------------
# What save_pretrained writes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_save_pretrained_writes_safetensors_config_and_code(saved, name):
    root, _ = saved
    folder = root / name
    files = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in files
    assert not any(f.endswith(".bin") or f.endswith(".pt") for f in files), files
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "aaren" and config["aaren_format_version"] == AAREN_FORMAT_VERSION
    assert config["auto_map"] == {
        "AutoConfig": "configuration_aaren.AarenConfig",
        "AutoModel": "modeling_aaren.AarenModel",
        "AutoModelForCausalLM": "modeling_aaren.AarenForCausalLM",
    }
    for filename in REMOTE_FILES:  # the current sources, next to the weights
        assert (folder / filename).read_text() == (PACKAGE_DIR / filename).read_text()
    keys = set(load_file(str(folder / "model.safetensors")))
    expected_keys = set(build(name).state_dict())
    if name == "tied":
        expected_keys.discard("lm_head.weight")  # stored once, as the embedding
    assert keys == expected_keys


@pytest.mark.parametrize("name", list(CASES))
def test_in_process_reload_is_identical(saved, name):
    root, expected = saved
    model = AutoModelForCausalLM.from_pretrained(root / name)
    assert type(model).__name__ == "AarenForCausalLM"
    assert torch.equal(generate(model), expected[name + "_tokens"])
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (name == "tied")
    base = AutoModel.from_pretrained(root / name)
    with torch.no_grad():
        torch.testing.assert_close(base(PROMPT).last_hidden_state, expected[name + "_hidden"], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_load_keeps_rotary_frequencies_in_float32(saved, dtype):
    """A model loaded in 16 bits keeps the rotary frequencies it was saved with, as the teacher (Llama) keeps its own:
    rounded to bfloat16 (8 bits) the angles drift by up to 2^-9 of the position, a turn every few thousand tokens."""
    root, _ = saved
    saved_freq = load_file(str(root / "tied" / "model.safetensors"))["model.layers.0.mixer.rope_inv_freq"]
    assert saved_freq.dtype == torch.float32 and not torch.equal(saved_freq.to(dtype).float(), saved_freq)
    model = AutoModelForCausalLM.from_pretrained(root / "tied", dtype=dtype)
    mixer = model.model.layers[0].mixer
    assert mixer.q_proj.weight.dtype == dtype
    assert mixer.rope_inv_freq.dtype == torch.float32 and torch.equal(mixer.rope_inv_freq, saved_freq)
    with torch.no_grad():
        assert torch.isfinite(model(PROMPT).logits).all()


# ---------------------------------------------------------------------------------------------------------------
# A fresh process without the package
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_fresh_process_loads_remote_code_and_generates_same_tokens(saved, fresh_process, name):
    _, expected = saved
    report = fresh_process[name]
    assert report["class"].startswith("transformers_modules.") and report["class"].endswith(".AarenForCausalLM")
    assert report["base_class"] == "AarenModel"
    assert report["tokens"] == expected[name + "_tokens"].tolist()
    assert report["cache"] == "AarenCache"
    assert report["tied"] == (name == "tied")
    # the checkpoint's own copy runs the PyTorch code only, where this package runs its C kernels on a CPU (the
    # prompt's scan: the same to float rounding)
    assert report["hidden_max_diff"] < 1e-5
    assert fresh_process["aaren_hf_modules"] == []


def test_fresh_process_rejects_broken_and_newer_checkpoints(fresh_process):
    assert fresh_process["newer"].startswith("ValueError") and "newer aaren-hf" in fresh_process["newer"]
    assert "model.layers.1.mixer.queries" in fresh_process["missing"], fresh_process["missing"]


# ---------------------------------------------------------------------------------------------------------------
# Broken checkpoints, in process
# ---------------------------------------------------------------------------------------------------------------


def test_newer_format_version_is_refused(saved):
    root, _ = saved
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match="newer aaren-hf") as err:
            load(root / "newer")
        assert f"format {AAREN_FORMAT_VERSION + 1}" in str(err.value)


def test_missing_tensor_is_an_error(saved):
    root, _ = saved
    with pytest.raises(ValueError, match="missing from the checkpoint") as err:
        AutoModelForCausalLM.from_pretrained(root / "missing")
    assert "model.layers.1.mixer.queries" in str(err.value)
    # asking for the loading info is the way to accept a partial checkpoint knowingly
    model, info = AutoModelForCausalLM.from_pretrained(root / "missing", output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.1.mixer.queries"}
    assert torch.isfinite(model.model.layers[1].mixer.queries).all()


def test_mismatched_shape_is_an_error(saved, tmp_path):
    root, _ = saved
    folder = tmp_path / "mismatched"
    shutil.copytree(root / "untied", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mixer.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_an_error(saved, tmp_path, damage):
    root, _ = saved
    folder = tmp_path / damage
    shutil.copytree(root / "untied", folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x00garbage" * 64 if damage == "garbage" else data[: len(data) - 1000])
    with pytest.raises(OSError, match="safetensors file is corrupt or truncated") as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(folder) in str(err.value) and "Error while deserializing" in str(err.value)
