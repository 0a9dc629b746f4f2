"""The C decode step of a mixer layer (kernels/mixer: aaren/step.c and window/step.c in one call) against its
reference, the PyTorch decode path of AarenMixer.forward: the same output to float rounding and, after every step, the
same state: the Aaren state to float rounding (expf/logf and dot products in another order), everything else (window,
sinks, memory slots in the same order) bit for bit. And a prompt's one call (kernels/mixer/prefill.c) against the
calls it replaces."""

import shutil
from pathlib import Path

import pytest
import torch

from aaren_hf.kernels import cbuild
from aaren_hf.kernels import mixer as mixer_kernel
from aaren_hf.modeling_aaren import AarenLayerState
from helpers import MIXER_CASES, STEP_CASES, kernel_beside_reference, step_inputs, tiny_model

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the mixer runs the PyTorch step (tested in test_model.py)")

ROUNDED = ("aaren_o", "aaren_lse")
WINDOW_CASES = [c for c, kw in MIXER_CASES.items() if kw.get("window_size")]


def test_the_kernel_builds():
    assert mixer_kernel.library() is not None


@pytest.mark.parametrize("case", list(MIXER_CASES) + ["default_like_d64"])
def test_kernel_step_with_padding_inside_a_row(case, monkeypatch):
    """Row 1 is padding for a few decode steps (the Aaren state must not move), scores large enough that a decay or
    a missed stabiliser shows; every mixer of the test cases."""
    model = tiny_model(**MIXER_CASES.get(case, {}), **STEP_CASES.get(case, {}))
    B, T = 2, 30
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(7)) * 3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:9] = False
    pos = (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)
    for mixer in [layer.mixer for layer in model.model.layers]:
        with_kernel = kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "mixer_step_cpu", rounded=ROUNDED)
        if mixer.aaren_branch:
            assert torch.isfinite(with_kernel.aaren_o).all()


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("case", WINDOW_CASES + list(STEP_CASES))
def test_kernel_step_equals_pytorch_step(case, kv_cache_dtype, monkeypatch):
    """Two states fed the same tokens one at a time, through the kernel and through the PyTorch steps, long enough
    that the memory fills and then trades entries (random retention scores; kv head 0's all tie, so the tie rule
    runs too); from the first steps on (tokens that fill sinks or still see them in the window), and with a row that
    starts with padding."""
    kwargs = {"kv_cache_dtype": kv_cache_dtype, **MIXER_CASES.get(case, {}), **STEP_CASES.get(case, {})}
    model = tiny_model(**kwargs)
    # left padding: row 1's first decode steps are padding, then tokens that fill the sinks
    x, mask, pos = step_inputs(model, 40, [slice(0, 6)])
    for mixer in [layer.mixer for layer in model.model.layers if layer.mixer.window > 1]:
        with_kernel = kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "mixer_step_cpu", rounded=ROUNDED)
        if mixer.memory_size:  # the memory did fill, and trade entries
            assert bool((with_kernel.memory_pos >= 0).all())
            assert int(with_kernel.memory_pos.max()) > mixer.num_sinks + mixer.window + mixer.memory_size


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("case", ["default_like_d64", "int8_d64"])
def test_kernel_step_reads_a_memory_with_empty_slots_between_filled_ones(case, kv_cache_dtype, monkeypatch):
    """The kernel scores only the filled memory slots. Decoding fills the slots in order, so a state with empty slots
    among filled ones (one a user or another path may hand it) is made by hand: a full memory, some slots emptied as
    an unfilled slot is (position -1, score -inf); the steps after fill them again, one per step."""
    import aaren_hf.modeling_aaren as modeling

    model = tiny_model(kv_cache_dtype=kv_cache_dtype, **STEP_CASES[case])
    x, mask, pos = step_inputs(model, 24, [])
    mixer = next(layer.mixer for layer in model.model.layers if layer.mixer.memory_size)
    state = AarenLayerState()
    monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
    with torch.no_grad():
        mixer(x[:, :16], mask[:, :16], pos[:, :16], state)
    assert bool((state.memory_pos >= 0).all())
    holes = torch.zeros_like(state.memory_pos, dtype=torch.bool)
    holes[0, 0, ::2] = True  # row 0: every other slot of kv head 0
    holes[1, -1, 1] = True  # row 1: one slot of the last kv head
    state.memory_pos = state.memory_pos.masked_fill(holes, -1)
    state.memory_score = state.memory_score.masked_fill(holes, float("-inf"))
    after = kernel_beside_reference(mixer, x[:, 16:], mask[:, 16:], pos[:, 16:], monkeypatch, "mixer_step_cpu",
                                    prompt=1, rounded=ROUNDED, start=state)
    assert bool((after.memory_pos >= 0).all())


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("case", WINDOW_CASES + list(STEP_CASES))
def test_kernel_prefill_equals_the_calls_it_replaces(case, kv_cache_dtype, monkeypatch):
    """A prompt in pieces through every mixer with a window, with its one call (``mixer_prefill_cpu``) and without
    (the per-part kernels with PyTorch between them, which test_model.py and test_kernels.py check against the
    reference): after every piece the same state bit for bit, the Aaren state too (the same C functions on the same
    data), and the same output to float rounding (the gate's sigmoid is expf's). Pieces of 1 token (the first call
    of a state, then decode steps that both sides take alike) to past the memory's size, a row that starts with
    padding, tied retention scores; then the whole prompt without a cache. (A memory stored without codes has no C
    prefill: the call declines there.)"""
    import aaren_hf.modeling_aaren as modeling

    model = tiny_model(**{"kv_cache_dtype": kv_cache_dtype, **MIXER_CASES.get(case, {}), **STEP_CASES.get(case, {})})
    x, mask, pos = step_inputs(model, 48, [slice(0, 6)])
    mixers = [layer.mixer for layer in model.model.layers
              if layer.mixer.window > 1 and (layer.mixer.memory_size == 0 or layer.mixer.memory_codes is not None)]
    if not mixers:
        pytest.skip("a memory without codes in every layer with a window")
    for mixer in mixers:
        kernel_beside_reference(mixer, x, mask, pos, monkeypatch, "mixer_prefill_cpu", pieces=(1, 9, 1, 2, 17, 18))
        with torch.no_grad():
            got = mixer(x, mask, pos)
            monkeypatch.setattr(modeling, "mixer_prefill_cpu", None)
            want = mixer(x, mask, pos)
            monkeypatch.undo()
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def whole_model_with_and_without(kernel_name, case, pieces, monkeypatch):
    """(logits [B, pieces, V] of each piece's last token, the cache), twice: with the C call ``kernel_name`` and with
    it set to None; ``memory_shared_layer`` 0, so the later layers rank by layer 0's scores too."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.modeling_aaren import AarenCache

    kwargs = {**MIXER_CASES.get(case, {}), **STEP_CASES.get(case, {})}
    if case == "default_like_d64":
        kwargs["memory_shared_layer"] = 0
    model = tiny_model(**kwargs)
    ids = torch.randint(1, 60, (2, sum(pieces)), generator=torch.Generator().manual_seed(2))
    results, kernel = [], getattr(modeling, kernel_name)
    for call in (kernel, None):
        monkeypatch.setattr(modeling, kernel_name, call)
        cache, logits, t = AarenCache(model.config), [], 0
        with torch.no_grad():
            for n in pieces:
                logits.append(model(ids[:, t:t + n], past_key_values=cache, use_cache=True).logits[:, -1])
                t += n
        results.append((torch.stack(logits, 1), cache))
    monkeypatch.setattr(modeling, kernel_name, kernel)
    return results


@pytest.mark.parametrize("case", ["memory_shared", "memory_aaren_gqa", "default_like_d64"])
def test_whole_model_decodes_as_the_reference(case, monkeypatch):
    """Through the model, where the layers hand a retention score on (``memory_shared_layer``: the later layers rank
    by the larger of their own and layer 0's), decoded token by token with the kernel and with the PyTorch steps:
    the same logits to float rounding and the same cache: which tokens every layer holds where (positions, the
    memory's choices) exactly; layer 0's values bit for bit but its Aaren state; the later layers', whose inputs
    carry layer 0's rounding, to rounding. Then a prompt that continues the cache (which gives the state new tensors,
    where the kernel's wrapper kept the old ones' pointers) and decode steps again."""
    (got, got_cache), (want, want_cache) = whole_model_with_and_without("mixer_step_cpu", case,
                                                                         [3] + [1] * 37 + [5, 1, 1, 1], monkeypatch)
    assert_same_cache(got, got_cache, want, want_cache, first_aaren_exact=False)


def test_copies_of_a_cache_the_kernel_stepped_step_on_their_own():
    """The step's wrapper keeps each state's pointers on the state: a copy of a cache that the kernel has stepped
    (``copy.deepcopy``, or each layer's ``AarenLayerState.copy``) takes further steps in its own tensors, as the
    original does in its own: the same logits from both, the original left as it was while the copies step."""
    import copy

    from aaren_hf.modeling_aaren import AarenCache

    model = tiny_model(**STEP_CASES["default_like_d64"])
    ids = torch.randint(1, 60, (2, 30), generator=torch.Generator().manual_seed(3))
    cache = AarenCache(model.config)
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache, use_cache=True)
        for t in range(20, 24):  # C steps: the wrapper now holds this cache's pointers
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        deep = copy.deepcopy(cache)
        layered = copy.copy(cache)
        layered.layers = [state.copy() for state in cache.layers]
        before = [{k: t.clone() for k, t in state.tensors().items()} for state in cache.layers]
        logits = {}
        for name, stepped in (("deepcopy", deep), ("copy", layered)):
            logits[name] = torch.stack([model(ids[:, t:t + 1], past_key_values=stepped, use_cache=True).logits
                                        for t in range(24, 30)])
        for state, kept in zip(cache.layers, before):
            assert all(torch.equal(state.tensors()[k], kept[k]) for k in kept)
        logits["original"] = torch.stack([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                                          for t in range(24, 30)])
    assert torch.equal(logits["deepcopy"], logits["original"]) and torch.equal(logits["copy"], logits["original"])


@pytest.mark.parametrize("case", ["memory_int8", "int8_d64", "default_like_d64"])
def test_whole_model_prefills_as_the_calls_it_replaces(case, monkeypatch):
    """The same through the model for prompts in pieces (and decode steps between), with the mixer's one call for a
    prompt and without it: the same logits to float rounding, the same positions everywhere, layer 0's state bit for
    bit and the later layers' to rounding (their inputs carry layer 0's gate, whose sigmoid is expf's)."""
    (got, got_cache), (want, want_cache) = whole_model_with_and_without("mixer_prefill_cpu", case,
                                                                         [5, 9, 1, 1, 17, 2, 9], monkeypatch)
    assert_same_cache(got, got_cache, want, want_cache, first_aaren_exact=True)


def assert_same_cache(got, got_cache, want, want_cache, first_aaren_exact: bool):
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    for layer, (mine, theirs) in enumerate(zip(got_cache.layers, want_cache.layers)):
        a, b = mine.tensors(), theirs.tensors()
        assert a.keys() == b.keys()
        for key in a:
            if key.endswith("_pos") or (layer == 0 and (key not in ROUNDED or first_aaren_exact)):
                assert torch.equal(a[key], b[key]), f"layer {layer}: {key}"
            elif key.endswith("_score"):  # on the 1/64 grid: a score within rounding of a grid line may take the next
                assert torch.equal(a[key].isinf(), b[key].isinf()), f"layer {layer}: {key}"
                step = (a[key] - b[key])[b[key].isfinite()].abs()
                assert bool((step <= 1 / 64).all()) and float((step == 0).float().mean()) > 0.9, f"layer {layer}: {key}"
            elif a[key].is_floating_point():
                finite = b[key][b[key].isfinite()]
                scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
                torch.testing.assert_close(a[key], b[key], atol=1e-4 * scale, rtol=1e-4, msg=f"layer {layer}: {key}")
            else:  # memory codes: a value on a rounding boundary may take the next code
                assert float((a[key] == b[key]).float().mean()) > 0.99, f"layer {layer}: {key}"
    assert bool((got_cache.layers[-1].memory_pos >= 0).all())  # the memory filled and traded entries


def declines(model, dtype=torch.float32) -> bool:
    """Whether the kernel returns None for the token after a 6-token prompt, its inputs in ``dtype`` (and if so,
    that it left the state's values as they were)."""
    mixer, state = model.model.layers[0].mixer, AarenLayerState()
    x = torch.randn(1, 7, model.config.hidden_size)
    with torch.no_grad():
        mixer(x[:, :6], torch.ones(1, 6, dtype=torch.bool), torch.arange(6).view(1, 6), state)
        q, k, v = (None if t is None else t.to(dtype) for t in mixer.project(x[:, 6:]))
        before = {n: t.clone() for n, t in state.tensors().items()}
        assert mixer.steps_one_token(state, 1)
        out = mixer.in_c(x[:, 6:], q, k, v, torch.ones(1, 1, dtype=torch.bool), torch.tensor([[6]]), state, {}, True)
    if out is None:
        assert state.tensors().keys() == before.keys()
        assert all(torch.equal(t, before[n]) for n, t in state.tensors().items())
    return out is None


def test_off_switch_and_unsupported_inputs_take_the_reference(monkeypatch):
    """The kernel returns None and touches nothing for bfloat16 inputs, a float16 cache, a head larger than
    window/step.c takes (MAX_D = 256) and more slots than aaren/step.c takes (MAX_J = 64); the model then decodes
    with the PyTorch steps. AAREN_BACKEND=torch turns it off."""
    memory = dict(window_size=3, num_sink_tokens=1, memory_size=2, num_query_slots=2)
    assert not declines(tiny_model(**memory))  # what the cases around differ from
    assert declines(tiny_model(**memory), dtype=torch.bfloat16)
    assert declines(tiny_model(**memory, kv_cache_dtype="float16"))
    assert declines(tiny_model(**dict(memory, hidden_size=512, num_attention_heads=1)))
    many = tiny_model(hidden_size=16, num_attention_heads=2, num_query_slots=65)
    assert declines(many)
    ids = torch.randint(1, 60, (1, 7))
    with torch.no_grad():
        out = many(ids[:, :4], use_cache=True)
        steps = [many(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True).logits
                 for t in range(4, 7)]
        torch.testing.assert_close(steps[-1][:, -1], many(ids).logits[:, -1], atol=1e-4, rtol=0)
    monkeypatch.setenv("AAREN_BACKEND", "torch")
    assert mixer_kernel.library() is None


def test_without_a_working_compiler_the_reference_runs(monkeypatch, tmp_path):
    """A compiler that fails (here: $CC names nothing) gives a warning that says what to do and no kernel, once;
    no compiler at all, one warning; the mixer then decodes with its PyTorch steps."""
    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("AAREN_HF_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="could not build kernels/aaren/step.c \\+ kernels/window/step.c"):
        assert mixer_kernel.library() is None
    assert mixer_kernel.library() is None  # tried once: no second warning
    # no compiler at all: one warning
    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setattr(cbuild, "_said_no_compiler", False)
    monkeypatch.delenv("CC")
    monkeypatch.setattr(cbuild.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="no C compiler") as said:
        assert mixer_kernel.library() is None
        assert mixer_kernel.library() is None
    assert len(said) == 1
    model = tiny_model(window_size=3, num_sink_tokens=1, memory_size=2)
    ids = torch.randint(1, 60, (1, 12))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(6, 12):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 6:], atol=1e-4, rtol=0)


def test_a_new_build_deletes_the_builds_no_load_used_for_keep_days(monkeypatch, tmp_path):
    """Editing a kernel's sources (or renaming its library) leaves old builds in the cache: once a new build is made,
    every build that no load has marked for KEEP_DAYS goes, of this library or another; recent ones (another
    checkout's) and files that are not builds stay, and loading a build marks it used."""
    import os
    import time

    from aaren_hf.kernels import memory as memory_kernel

    monkeypatch.setattr(cbuild, "_loaded", {})
    monkeypatch.setenv("AAREN_HF_CACHE", str(tmp_path))
    folder = tmp_path / "kernels"
    folder.mkdir()
    month_ago = time.time() - (cbuild.KEEP_DAYS + 1) * 86400
    stale, recent, renamed, other_recent, not_a_build = (folder / name for name in (
        "memory_evict-" + "0" * 16 + ".so", "memory_evict-" + "1" * 16 + ".so", "mixer_step-" + "2" * 16 + ".so",
        "window-" + "3" * 16 + ".so", "mine-old.so"))
    for path in (stale, recent, renamed, other_recent, not_a_build):
        path.write_bytes(b"")
    for path in (stale, renamed, not_a_build):
        os.utime(path, (month_ago, month_ago))
    load = lambda: cbuild.load("memory_evict", memory_kernel.SOURCES, memory_kernel.SIGNATURES, "-")  # noqa: E731
    assert load() is not None
    built = set(folder.glob("memory_evict-*.so")) - {recent}
    assert len(built) == 1 and not stale.exists() and not renamed.exists()
    assert recent.exists() and other_recent.exists() and not_a_build.exists()
    (build,) = built
    os.utime(build, (month_ago, month_ago))
    monkeypatch.setattr(cbuild, "_loaded", {})
    assert load() is not None
    assert build.stat().st_mtime > month_ago + 86400


def test_a_header_is_part_of_the_build_it_is_included_in(monkeypatch, tmp_path):
    """The build's key covers the headers the sources include (found from their #include lines, transitively): an
    edited header makes a new build, not a stale one loaded from the cache."""
    from aaren_hf.kernels import memory as memory_kernel

    root = Path(cbuild.__file__).parent
    tree = tmp_path / "kernels"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns("__pycache__"))
    sources = tuple(tree / s.relative_to(root) for s in memory_kernel.SOURCES)
    assert {h.name for h in cbuild.headers_of(sources)} == {"codes.h", "memory.h", "vec8.h"}  # vec8.h via codes.h
    monkeypatch.setenv("AAREN_HF_CACHE", str(tmp_path / "cache"))
    builds = []
    for edit in (None, "/* edited */\n"):
        if edit:
            (tree / "vec8.h").write_text(edit + (tree / "vec8.h").read_text())
        monkeypatch.setattr(cbuild, "_loaded", {})
        assert cbuild.load("memory", sources, memory_kernel.SIGNATURES, "-") is not None
        builds.append(set((tmp_path / "cache" / "kernels").glob("memory-*.so")))
    assert len(builds[0]) == 1 and len(builds[1]) == 2  # the edit two includes deep made a second build


def test_every_file_a_kernel_builds_from_ships_with_the_package():
    """A wheel holds only what setup.cfg's package_data names: a C source or header left out there would make the
    kernel fail to build on an installed copy (and the model quietly run its PyTorch code)."""
    import configparser
    import fnmatch
    from pathlib import Path

    import aaren_hf.kernels as kernels_package
    from aaren_hf.kernels import aaren as aaren_kernel
    from aaren_hf.kernels import memory as memory_kernel
    from aaren_hf.kernels import window as window_kernel

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).parent.parent / "setup.cfg")
    shipped = {package: [p.strip() for p in patterns.split(",")]
               for package, patterns in setup["options.package_data"].items()}
    files = {f for kernel in (aaren_kernel, memory_kernel, mixer_kernel, window_kernel)
             for f in (*kernel.SOURCES, *cbuild.headers_of(kernel.SOURCES))}
    assert {f.suffix for f in files} == {".c", ".h"}
    root = Path(kernels_package.__file__).parent
    for f in files:
        package = ".".join(("aaren_hf.kernels", *f.parent.relative_to(root).parts))
        patterns = shipped.get(package, [])
        assert any(fnmatch.fnmatch(f.name, p) for p in patterns), f"{f.relative_to(root)} is not in package_data"
