"""generate() and the recurrent cache: decoding modes, padding, continuing from a cache, streaming, pipelines,
constant state size, per-row cache operations, unsupported modes."""

import pytest
import torch

import aaren_hf  # noqa: F401  before transformers: see helpers.py
from transformers import (
    CompileConfig,
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    TextStreamer,
    pipeline,
)

import aaren_hf.modeling_aaren as modeling
from aaren_hf import AarenCache
from helpers import MIXER_CASES, VOCAB, left_pad, one_thread, random_ids, tiny_model  # noqa: F401 (fixture)

PADDING_CASES = ["paper", "everything", "window_sinks_gate_input", "memory_gate_input_decay", "memory_aaren_gqa",
                 "memory_kv_bf16", "memory_per_layer", "memory_shared"]


def make_tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built offline: "w2 w17 w5" -> [2, 17, 5]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   padding_side="left")


@pytest.fixture(scope="module")
def model():
    return tiny_model(**MIXER_CASES["window_sinks"])


@pytest.fixture(scope="module")
def prompt():
    return random_ids(2, 6, seed=11)


def greedy_by_hand(model, ids, n):
    """Greedy decoding without any cache: the full sequence is recomputed for every token."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Decoding modes
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_matches_uncached_argmax_loop(model, prompt):
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, greedy_by_hand(model, prompt, 8))
    no_cache = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(out, no_cache)


def test_sampling_is_reproducible_and_cache_consistent(model, prompt):
    def sample(seed, **kw):
        torch.manual_seed(seed)
        return model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=0, **kw)

    a, b, c = sample(0), sample(0), sample(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # the seed matters (2 x 10 tokens over 64 words)
    assert torch.equal(a, sample(0, use_cache=False))  # cached and uncached logits draw the same tokens
    many = sample(3, num_return_sequences=3)
    assert many.shape == (6, 16)
    assert torch.equal(many, sample(3, num_return_sequences=3, use_cache=False))
    assert torch.equal(many[:3, :6], prompt[:1].expand(3, -1)) and torch.equal(many[3:, :6], prompt[1:].expand(3, -1))


def test_beam_search_and_num_return_sequences(model, prompt):
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    beams = model.generate(prompt, **kw)
    assert torch.equal(beams, model.generate(prompt, use_cache=False, **kw))  # reorder_cache is right
    top3 = model.generate(prompt, num_return_sequences=3, **kw)
    assert top3.shape == (6, 12)
    assert torch.equal(top3[::3], beams)  # the best beam of each prompt comes first
    assert len({tuple(row) for row in top3[:3].tolist()}) == 3  # and the others are different hypotheses


def test_inputs_embeds_generation(model, prompt):
    from_ids = model.generate(prompt, max_new_tokens=5, do_sample=False)
    embeds = model.get_input_embeddings()(prompt)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, prompt.shape[1]:])


def test_prefill_in_chunks(model, prompt):
    whole = model.generate(prompt, max_new_tokens=5, do_sample=False)
    chunked = model.generate(prompt, max_new_tokens=5, do_sample=False, prefill_chunk_size=4)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("padded", [False, True])
def test_continue_from_returned_cache(model, padded):
    if padded:
        ids, mask = left_pad([random_ids(1, 7, seed=1)[0], random_ids(1, 3, seed=2)[0]])
    else:
        ids, mask = random_ids(2, 7, seed=3), torch.ones(2, 7, dtype=torch.long)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert isinstance(first.past_key_values, AarenCache)
    mask2 = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1)
    second = model.generate(first.sequences, attention_mask=mask2, past_key_values=first.past_key_values,
                            max_new_tokens=6, do_sample=False)
    once = model.generate(ids, attention_mask=mask, max_new_tokens=11, do_sample=False)
    assert torch.equal(second, once)


def test_text_streamer_and_pipeline(model):
    tok = make_tokenizer()
    text = "w5 w9 w33 w2"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 9, 33, 2]]
    out = model.generate(ids, max_new_tokens=7, do_sample=False)
    new_text = tok.decode(out[0, ids.shape[1]:])

    class Capture(TextStreamer):
        def __init__(self):
            super().__init__(tok, skip_prompt=True)
            self.pieces = []

        def on_finalized_text(self, text, stream_end=False):
            self.pieces.append(text)

    streamer = Capture()
    model.generate(ids, max_new_tokens=7, do_sample=False, streamer=streamer)
    assert "".join(streamer.pieces).strip() == new_text
    assert len([p for p in streamer.pieces if p]) > 1  # it streamed, not one final dump

    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    result = pipe(text, max_new_tokens=7, do_sample=False, return_full_text=False)
    assert result[0]["generated_text"] == new_text
    batch = pipe([text, "w7 w8"], max_new_tokens=3, do_sample=False, batch_size=2, return_full_text=False)
    alone = model.generate(tok("w7 w8", return_tensors="pt").input_ids, max_new_tokens=3, do_sample=False)
    assert batch[1][0]["generated_text"] == tok.decode(alone[0, 2:])  # left-padded inside the pipeline


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("case", PADDING_CASES)
def test_left_padded_batch_equals_each_prompt_alone(case, num_beams):
    model = tiny_model(**MIXER_CASES[case])
    prompts = [random_ids(1, n, seed=20 + n)[0] for n in (7, 2, 5)]
    ids, mask = left_pad(prompts)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=num_beams)
    batch = model.generate(ids, attention_mask=mask, **kw)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], **kw)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(p):]), f"prompt {i} (length {len(p)})"


def test_assisted_decoding_and_prompt_lookup_fail_clearly(model, prompt):
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(prompt[:1], assistant_model=tiny_model(**MIXER_CASES["window_sinks"]), max_new_tokens=3)
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(prompt[:1], prompt_lookup_num_tokens=2, max_new_tokens=3)


# ---------------------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,new_tokens", [
    ("paper", 500),
    ("window_sinks", 300),
    ("memory_learned", 300),
    # about 9 s of CPU, but over 20 s of wall time on a busy 2-core machine
    pytest.param("window_sinks", 5000, marks=pytest.mark.slow),
])
def test_state_size_does_not_grow_with_generated_tokens(case, new_tokens):
    """One generate() into a cache we hold; a logits processor records state_bytes() at each step. The window_sinks
    case holds all three parts of the state: Aaren (o, lse), the window keys/values and the sinks."""
    model = tiny_model(num_hidden_layers=1, **MIXER_CASES[case])
    cache = AarenCache(model.config)
    sizes = []  # sizes[i]: after the forward that predicts new token i + 1, i.e. after 2 + i tokens

    class RecordStateBytes(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sizes.append(cache.state_bytes())
            return scores

    out = model.generate(random_ids(1, 2, seed=4), past_key_values=cache, max_new_tokens=new_tokens,
                         do_sample=False, logits_processor=LogitsProcessorList([RecordStateBytes()]),
                         return_dict_in_generate=True)
    assert out.sequences.shape[1] == 2 + new_tokens and out.past_key_values is cache and len(sizes) == new_tokens
    assert sizes[0] > 0
    # the same after the 2-token prompt (the window's empty entries included), after 10 and after all (up to 5,000)
    # generated tokens, and at every step in between
    assert set(sizes) == {sizes[-1]}


def test_generate_never_builds_a_dynamic_cache(model, prompt, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("generate() built a DynamicCache")

    monkeypatch.setattr(DynamicCache, "__init__", refuse)
    for kw in (dict(do_sample=False), dict(do_sample=True), dict(num_beams=2), dict(num_return_sequences=2,
                                                                                      do_sample=True)):
        out = model.generate(prompt, max_new_tokens=3, return_dict_in_generate=True, **kw)
        assert type(out.past_key_values) is AarenCache, kw
    out = model.generate(prompt, max_new_tokens=3, return_dict_in_generate=True, use_cache=False)
    assert out.past_key_values is None


def _filled_cache(model):
    """Three rows with different contents and lengths (row 1 left-padded)."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (9, 4, 7)])
    cache = AarenCache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache, mask


def _snapshot(cache):
    return [{k: t.clone() for k, t in layer.tensors().items()} for layer in cache.layers], cache.real_tokens.clone()


def _next_logits(model, cache, tokens, mask):
    with torch.no_grad():
        full_mask = torch.cat([mask, torch.ones(len(tokens), 1, dtype=torch.long)], 1)
        return model(tokens[:, None], attention_mask=full_mask, past_key_values=cache, use_cache=True).logits[:, -1]


@pytest.mark.parametrize("op", ["reorder_cache", "batch_repeat_interleave", "batch_select_indices"])
def test_cache_batch_operations_act_per_row(model, op):
    rows = {"reorder_cache": [2, 0, 1], "batch_repeat_interleave": [0, 0, 1, 1, 2, 2],
            "batch_select_indices": [2, 0]}[op]
    arg = {"reorder_cache": torch.tensor(rows), "batch_repeat_interleave": 2,
           "batch_select_indices": torch.tensor(rows)}[op]
    cache, mask = _filled_cache(model)
    layers, real = _snapshot(cache)
    assert set(layers[0]) == {"aaren_o", "aaren_lse", "window_k", "window_v", "window_pos", "sink_k", "sink_v",
                              "sink_pos"}
    assert real.tolist() == [9, 4, 7]
    getattr(cache, op)(arg)
    for before, layer in zip(layers, cache.layers):
        for name, tensor in layer.tensors().items():
            assert torch.equal(tensor, before[name][rows]), f"{op}: {name}"
    assert torch.equal(cache.real_tokens, real[rows])

    # and the rows decode as before: same next-token logits as the untouched rows
    tokens = torch.tensor([5, 6, 7])
    reference, mask_ref = _filled_cache(model)
    want = _next_logits(model, reference, tokens, mask_ref)[rows]
    got = _next_logits(model, cache, tokens[rows], mask[rows])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Compiled decoding: cache_implementation="static"
# ---------------------------------------------------------------------------------------------------------------


def _written_inputs(graph, inputs):
    """Indices of the inputs a graph writes in place: run on clones under a dispatch mode that notes the storage of
    every argument an operator's schema marks as written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    written = set()

    class NoteWrites(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    written.add(value.untyped_storage().data_ptr())
            return func(*args, **kwargs)

    clones = [x.clone() for x in inputs]
    with torch.no_grad(), NoteWrites():
        graph(*clones)
    return [i for i, x in enumerate(clones) if x.untyped_storage().data_ptr() in written]


@pytest.mark.parametrize("case,rows", [("window_sinks", 2), ("memory_int4_hadamard", 2), ("memory_shared", 2),
                                       ("gemma_block", 2), ("window_sinks", 1), ("memory_int4_hadamard", 1)])
def test_a_static_cache_decodes_with_one_graph_a_cuda_graph_can_replay(case, rows, monkeypatch):
    """generate(cache_implementation="static") compiles the decode step (transformers' auto-compile, allowed on a
    CPU here) as a GPU runs it. What CUDA graphs need of it: one graph serves every step of two generate calls with
    prompts of other lengths (recompiling is an error), with the tokens a CPU decodes eagerly (left padding; the
    kernels on each side are checked against their references elsewhere); none of its inputs is a Python number (a
    CUDA graph is recorded per value of one); it writes every tensor of the cache in place, and each input it writes
    is marked as a fixed address (CUDA graphs skip a graph that writes any other input). Traced by a backend that
    keeps the graph and runs it as it is."""
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model(chunk_size=16, **MIXER_CASES[case])
    graphs = []

    def keep(graph, inputs):
        graphs.append((graph, list(inputs)))
        return graph.forward

    config = CompileConfig(backend=keep, fullgraph=True, mode=None)
    config._compile_all_devices = True  # transformers' switch to compile on a CPU too
    torch._dynamo.reset()
    try:
        for lengths in ((13, 10), (8, 11)):
            ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in lengths[:rows]])
            with monkeypatch.context() as on_cpu:  # the tokens a CPU decodes, eagerly
                on_cpu.setattr(modeling, "launch_bound", lambda device: False)
                eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                     cache_implementation="static", compile_config=config,
                                     return_dict_in_generate=True)
            assert torch.equal(out.sequences, eager)
    finally:
        torch._dynamo.reset()
    cache = out.past_key_values
    assert cache.is_compileable and cache.seen_tokens == 8 + 3 * (rows - 1) + 7
    assert cache.real_tokens.tolist() == [15, 18][:rows]
    assert len(graphs) == 1
    graph, inputs = graphs[0]
    assert all(isinstance(x, torch.Tensor) for x in inputs)
    written = _written_inputs(graph, inputs)
    # every non-empty tensor of the layers (a sliding layer holds no sinks), real_tokens and the compiled steps' count
    held = sum(t.numel() > 0 for layer in cache.layers for t in layer.tensors().values()) + 2
    assert len(written) == held
    assert all(getattr(inputs[i], "_dynamo_static_input_type", None) for i in written)


def test_a_static_cache_made_under_inference_mode_decodes_compiled_outside_it(monkeypatch):
    """A prompt under torch.inference_mode() leaves inference tensors, which take no in-place write outside it, and
    inside a graph nobody can ask: the static cache holds normal tensors after each eager call. Compiled steps under
    no_grad then give the eager steps' logits."""
    monkeypatch.setattr(modeling, "launch_bound", lambda device: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = tiny_model(chunk_size=16, **MIXER_CASES["memory_int4_hadamard"])
    ids = random_ids(2, 16, seed=2)
    eager, static = AarenCache(model.config), AarenCache(model.config, static=True)
    with torch.inference_mode():
        for cache in (eager, static):
            model(ids[:, :12], past_key_values=cache, use_cache=True)
    assert all(not t.is_inference() for layer in static.layers for t in layer.tensors().values())
    torch._dynamo.reset()
    step = torch.compile(lambda i, c: model(i, past_key_values=c, use_cache=True).logits, fullgraph=True,
                         backend="eager")
    try:
        with torch.no_grad():
            for t in range(12, 16):
                want = model(ids[:, t:t + 1], past_key_values=eager, use_cache=True).logits
                torch.testing.assert_close(step(ids[:, t:t + 1], static), want, atol=1e-5, rtol=0)
    finally:
        torch._dynamo.reset()
    assert static.seen_tokens == 16


def test_a_static_cache_refuses_lengths_past_a_learned_position_table():
    model = tiny_model(**MIXER_CASES["gpt2_like_window"])
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="learned position table"):
        model.generate(random_ids(1, 4), max_new_tokens=limit, cache_implementation="static")
    with pytest.raises(ValueError, match="'static' to compile"):
        model.generate(random_ids(1, 4), max_new_tokens=2, cache_implementation="offloaded")


@pytest.mark.requires_gpu
@pytest.mark.parametrize("case", ["window_sinks", "memory_int4_hadamard"])
def test_gpu_static_cache_decodes_in_cuda_graphs(case):
    """On CUDA, generate(cache_implementation="static") with transformers' default compile (inductor, CUDA graphs):
    the eager tokens, and no graph skipped CUDA graphs."""
    from torch._dynamo.utils import counters

    model = tiny_model(chunk_size=16, **MIXER_CASES[case]).cuda()
    ids, mask = left_pad([random_ids(1, 13, seed=2)[0], random_ids(1, 10, seed=3)[0]])
    ids, mask = ids.cuda(), mask.cuda()
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    torch._dynamo.reset()
    counters.clear()
    try:
        for _ in range(2):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 cache_implementation="static")
            assert torch.equal(out, eager)
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
