"""Tiny models and independent references shared by the test files (not collected by pytest: no test_ prefix).

Import as ``from helpers import ...`` (pytest puts this folder on sys.path, as the folder has no __init__.py).

Test modules import ``aaren_hf`` before ``transformers``: run from the repository root, the top-level ``kernels/``
folder (installed as ``aaren_hf.kernels``) shadows the Hugging Face ``kernels`` package, which ``transformers``
probes by importing it; that import goes back into ``aaren_hf`` and fails if ``transformers`` is only half imported.
"""

import contextlib
import itertools
import math
import os
from pathlib import Path

import pytest
import torch

import aaren_hf  # noqa: F401  (registers the Auto classes)
from aaren_hf import AarenCache, AarenConfig, AarenForCausalLM
from aaren_hf.conversion.assets import cache_root

VOCAB = 64
PAD = 0

# One entry per mixer/block option, alone and combined. Window W = 4 or 5, so prompts of 3 and 13+ tokens are
# shorter and longer than the window.
GPT2_LIKE = dict(
    norm_type="layernorm", mlp_type="plain", hidden_act="gelu_new", position_embedding_type="learned",
    max_position_embeddings=64, attention_bias=True, mlp_bias=True, partial_rotary_factor=0.0,
)
MIXER_CASES = {
    "paper": {},
    "slots3": dict(num_query_slots=3),
    "decay_fixed": dict(decay="fixed"),
    "decay_learned": dict(decay="learned"),
    "decay_input": dict(decay="input"),
    "window": dict(window_size=4),
    "window_sinks": dict(window_size=4, num_sink_tokens=2),
    "window_gate_input": dict(window_size=4, window_gate="input"),
    "window_sinks_gate_input": dict(window_size=5, num_sink_tokens=3, window_gate="input"),
    "qk_norm": dict(qk_norm=True),
    "qk_norm_window": dict(qk_norm=True, window_size=4, num_sink_tokens=1),
    "parallel_residual": dict(parallel_residual=True),
    "gpt2_like_window": dict(GPT2_LIKE, window_size=4),
    "partial_rotary": dict(window_size=4, num_sink_tokens=2, partial_rotary_factor=0.5),
    "gqa_slots_window": dict(num_key_value_heads=2, num_query_slots=2, window_size=4, num_sink_tokens=1),
    "memory_learned": dict(window_size=3, num_sink_tokens=1, memory_size=3),
    "memory_aaren_gqa": dict(num_key_value_heads=2, num_query_slots=2, window_size=4, memory_size=2,
                             memory_rule="aaren"),
    "memory_gate_input_decay": dict(window_size=3, num_sink_tokens=2, memory_size=4, window_gate="input",
                                    decay="learned"),
    # a memory in one layer only (per-layer M; layer 0 has no retention parameters)
    "memory_per_layer": dict(window_size=3, num_sink_tokens=1, memory_size=[0, 3]),
    # layer 1 also keeps what layer 0's retention score ranks high; a recency bias on the scores (what keeps the kept
    # keys within the distances the teacher saw in a long stream)
    "memory_shared": dict(window_size=3, num_sink_tokens=1, memory_size=2, num_key_value_heads=2,
                          memory_shared_layer=0, memory_recency=0.1),
    # window, sink and memory keys/values stored (and computed on) in 16 bits in a float32 model
    "memory_kv_bf16": dict(window_size=3, num_sink_tokens=1, memory_size=3, kv_cache_dtype="bfloat16"),
    # the memory in 8-bit codes beside a 16-bit window; in 4-bit codes beside a float32 one
    "memory_int8": dict(window_size=3, num_sink_tokens=1, memory_size=3, kv_cache_dtype="bfloat16", memory_bits=8),
    "memory_int4_gqa": dict(num_key_value_heads=2, num_query_slots=2, window_size=4, num_sink_tokens=1, memory_size=3,
                            memory_bits=4),
    # 4-bit codes of the Hadamard-rotated keys/values beside a 16-bit window
    "memory_int4_hadamard": dict(window_size=3, num_sink_tokens=1, memory_size=3, kv_cache_dtype="bfloat16",
                                 memory_bits=4, memory_hadamard=True),
    "sliding_layer_memory": dict(window_size=4, num_sink_tokens=1, memory_size=2,
                                 layer_types=["linear_attention", "sliding_attention"]),
    # Gemma-3's block: (1 + w) RMSNorms, post norms, q/k norms, scaled embeddings, query_pre_attn_scalar, GELU-tanh,
    # a local layer with its own window (no sinks, no memory) and its own rotary base
    "gemma_block": dict(
        num_key_value_heads=2, qk_norm=True, rms_norm_unit_offset=True, post_norms=True, embed_scale=5.0,
        query_pre_attn_scalar=12.0, hidden_act="gelu_pytorch_tanh", window_size=4, num_sink_tokens=1, memory_size=2,
        sliding_window=5, layer_types=["linear_attention", "sliding_attention"], rope_theta_per_layer=[1e6, 1e4],
    ),
    "everything": dict(
        GPT2_LIKE, num_key_value_heads=2, num_query_slots=2, decay="input", window_size=4, num_sink_tokens=2,
        window_gate="input", qk_norm=True, parallel_residual=True, partial_rotary_factor=0.5,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine the thread pool's waits cost
    more than the work. Import this fixture into a test module to run that module single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The cache folder the suite started with, read on import, before any fixture points AAREN_HF_CACHE elsewhere.
SUITE_CACHE = cache_root()


def fresh_cache(root: Path) -> Path:
    """A new AAREN_HF_CACHE folder for what a test keeps apart (token caches, unpacked assets) whose C kernel builds
    are the suite's: a build takes a core 15-20 s, once per folder, and the tests that check builds set their own."""
    (SUITE_CACHE / "kernels").mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "kernels").exists():
        (root / "kernels").symlink_to(SUITE_CACHE / "kernels", target_is_directory=True)
    return root


@contextlib.contextmanager
def cache_at(root: Path):
    """AAREN_HF_CACHE set to :func:`fresh_cache` ``(root)`` inside the block, and back to what it was after."""
    old = os.environ.get("AAREN_HF_CACHE")
    os.environ["AAREN_HF_CACHE"] = str(fresh_cache(root))
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("AAREN_HF_CACHE", None)
        else:
            os.environ["AAREN_HF_CACHE"] = old


def bpe_tokenizer(text: str, chat_template: str = None):
    """A byte-level BPE tokenizer (300 tokens) trained offline on ``text``, with <pad>, <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


def tiny_config(**overrides) -> AarenConfig:
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        chunk_size=4, initializer_range=0.2, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )
    kwargs.update(overrides)
    return AarenConfig(**kwargs)


@torch.no_grad()
def randomize_options(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every option parameter a value far from its (often neutral) initialisation, so that a bug in that option
    changes the outputs: decay rates 0.05-0.7 per token, non-zero input projections for decay and gate, gates away
    from 0.5, norm weights away from 1."""
    gen = torch.Generator().manual_seed(seed)

    def rand(t, scale=1.0):
        return torch.randn(t.shape, generator=gen) * scale

    for name, p in model.named_parameters():
        if name.endswith("log_decay"):
            p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(0.7), generator=gen))
        elif ".mixer.decay_proj." in name or (".mixer.gate_proj." in name):
            p.copy_(rand(p, 0.3))
        elif ".mixer.retention_proj." in name:  # zero init ties every token: make the ranking matter
            p.copy_(rand(p, 2.0))
        elif name.endswith("window_gate"):
            p.copy_(rand(p))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + rand(p, 0.2))
        elif "norm" in name and name.endswith("bias"):
            p.copy_(rand(p, 0.1))


def tiny_model(seed: int = 0, **overrides) -> AarenForCausalLM:
    torch.manual_seed(seed)
    model = AarenForCausalLM(tiny_config(**overrides))
    randomize_options(model, seed)
    return model.eval()


def random_ids(batch: int, length: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def incremental_logits(model, ids: torch.LongTensor, pieces=()) -> torch.Tensor:
    """Feed ``ids`` through one AarenCache: first the given piece lengths, then one token at a time."""
    cache = AarenCache(model.config)
    out, t = [], 0
    for n in pieces:
        out.append(model(ids[:, t : t + n], past_key_values=cache, use_cache=True).logits)
        t += n
    while t < ids.shape[1]:
        out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        t += 1
    assert cache.get_seq_length() == ids.shape[1]
    return torch.cat(out, 1)


def left_pad(prompts, pad_id: int = PAD):
    """List of 1-D LongTensors -> (ids [B, T], attention_mask [B, T]) padded on the left."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = p
        mask[i, T - len(p) :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# Independent references (float64, written from the docs, not from the implementation)
# ---------------------------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding written with complex numbers: channel i pairs with i + rot/2. x [..., D]."""
    half = inv_freq.shape[0]
    if half == 0:
        return x
    angle = position.double().unsqueeze(-1) * inv_freq.double()
    z = torch.complex(x[..., :half].double(), x[..., half : 2 * half].double()) * torch.polar(
        torch.ones_like(angle), angle
    )
    return torch.cat([z.real, z.imag, x[..., 2 * half :].double()], -1)


def sylvester(D):
    """The D x D Hadamard matrix H_2 x H_2 x ... (Kronecker powers), float64, built from its definition."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def quantized(x, bits, hadamard=False):
    """x [..., D] rounded as a memory of ``bits``-bit codes holds it: per vector, scale = its largest magnitude over
    the largest code (2^(bits-1) - 1), rounded to bfloat16; codes = x / scale rounded to the nearest integer and
    clipped to the code range; the entry reads back codes * scale (AarenConfig.memory_bits). ``hadamard``: those
    codes of x H / D, read back times H (AarenConfig.memory_hadamard)."""
    if hadamard:
        h = sylvester(x.shape[-1])
        return quantized(x.double() @ h / x.shape[-1], bits) @ h
    top = 2 ** (bits - 1) - 1
    scale = (x.double().abs().amax(-1, keepdim=True) / top).float().to(torch.bfloat16).double()
    codes = torch.where(scale > 0, x.double() / scale, torch.zeros_like(x.double())).round().clamp(-top, top)
    return codes * scale


def brute_force_window(q, k, v, pos, window, num_sinks, inv_freq, scale, memory_size=0, retention=None,
                       kv_dtype=None, memory_bits=None, memory_hadamard=False):
    """T x T masked softmax: query at position p sees the real keys at positions (p - W, p] with both rotated at
    their own position, plus sinks (positions < S, outside that window), seen from position min(p, S + W - 1),
    plus (memory tier) per kv head the ``memory_size`` tokens with the highest ``retention`` [B, T, Hkv] score
    (ties: the newer) among those at positions S..p - W, at their true distance.

    q [B, T, H, D] and k [B, T, Hkv, D] not rotated; pos [B, T] with -1 at padding. ``kv_dtype``: keys (rotated)
    and values rounded to it, as a cache stored in it holds them; ``memory_bits``: memory entries then rounded by
    :func:`quantized`. Returns float64 [B, T, H, D], 0 for padding queries.
    """
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p = int(pos[b, t])
            if p < 0:
                continue
            keys, qpos = [], []
            for i in range(t + 1):
                pi = int(pos[b, i])
                if pi < 0:
                    continue
                if p - window < pi <= p:
                    keys.append(i), qpos.append(p)
                elif pi < num_sinks:
                    keys.append(i), qpos.append(min(p, num_sinks + window - 1))
            # per kv head: which keys it sees (the memory differs between kv heads)
            seen = torch.ones(len(keys), k.shape[2], dtype=torch.bool)
            recent = len(keys)
            if memory_size:
                old = [i for i in range(t + 1) if num_sinks <= int(pos[b, i]) <= p - window]
                for h in range(k.shape[2]):
                    ranked = sorted(old, key=lambda i: (float(retention[b, i, h]), int(pos[b, i])), reverse=True)
                    for i in old:
                        keys.append(i), qpos.append(p)
                        seen = torch.cat([seen, torch.zeros(1, k.shape[2], dtype=torch.bool)])
                        seen[-1, h] = i in ranked[:memory_size]
            idx = torch.tensor(keys)
            kr = rope(k[b, idx], pos[b, idx].unsqueeze(-1).expand(-1, k.shape[2]), inv_freq)  # [n, Hkv, D]
            qr = rope(q[b, t].unsqueeze(0).expand(len(keys), H, D), torch.tensor(qpos).unsqueeze(-1).expand(-1, H),
                      inv_freq)  # [n, H, D]
            vv = v[b, idx].double()
            if kv_dtype is not None:
                kr, vv = kr.float().to(kv_dtype).double(), vv.float().to(kv_dtype).double()
            if memory_bits is not None:  # the entries after the window's and the sinks' are the memory's
                kr[recent:] = quantized(kr[recent:], memory_bits, memory_hadamard)
                vv[recent:] = quantized(vv[recent:], memory_bits, memory_hadamard)
            kr = kr.repeat_interleave(G, dim=1)
            vv = vv.repeat_interleave(G, dim=1)
            scores = (qr * kr).sum(-1) * scale  # [n, H]
            scores = scores.masked_fill(~seen.repeat_interleave(G, dim=1), float("-inf"))
            out[b, t] = torch.einsum("nh,nhd->hd", torch.softmax(scores, 0), vv)
    return out


def brute_force_aaren(s, v, g=None, initial_state=None):
    """o_t = sum_{i<=t} exp(s_i + G_it) v_i / sum(...), G_it = g_{i+1} + ... + g_t, as a T x T masked softmax in
    float64. s [B, T, H] (-inf: excluded), v [B, T, H, D]. The initial state (o0, lse0) acts as a token before the
    first with score lse0 and value o0. Returns (o, (o_T, lse_T))."""
    s, v = s.double(), v.double()
    B, T, H = s.shape
    g = torch.zeros_like(s) if g is None else g.double()
    if initial_state is not None:
        o0, lse0 = initial_state
        s = torch.cat([lse0.double().unsqueeze(1), s], 1)
        v = torch.cat([o0.double().unsqueeze(1), v], 1)
        g = torch.cat([torch.zeros(B, 1, H, dtype=torch.float64), g], 1)
    n = s.shape[1]
    c = torch.cumsum(g, 1)  # weight of i seen from t: s_i + c_t - c_i
    logits = s.transpose(1, 2).unsqueeze(2) + (c.transpose(1, 2).unsqueeze(3) - c.transpose(1, 2).unsqueeze(2))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    logits = logits.masked_fill(~causal, float("-inf"))  # [B, H, t, i]
    lse = torch.logsumexp(logits, -1)
    w = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.einsum("bhti,bihd->bthd", w, v)
    if initial_state is not None:
        o, lse = o[:, 1:], lse[:, :, 1:]
    return o, (o[:, -1], lse[:, :, -1])


def recording(fn, ran: list):
    """fn, appending to ``ran`` whether each call returned a result (a kernel's None: it declined)."""
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        ran.append(result is not None)
        return result
    return wrapper


def distinct_mixers(model, where=lambda mixer: True):
    """The model's mixers (those ``where`` says), one per distinct set of settings and buffers (all of a mixer but
    its weights and layer index): layers alike but for their weights run a kernel's code the same way on the same
    shapes, and in Triton's interpreter each costs seconds. (The index only places a layer before, at or after
    ``memory_shared_layer``, which matters where a shared score is passed: :func:`kernel_beside_reference` passes
    none.)"""
    mixers = {}
    for mixer in (layer.mixer for layer in model.model.layers if where(layer.mixer)):
        settings = {name: v for name, v in vars(mixer).items() if not name.startswith("_") and name != "layer_idx"}
        mixers.setdefault(repr((settings, {name: b.tolist() for name, b in mixer.named_buffers()})), mixer)
    return list(mixers.values())


def kernel_beside_reference(mixer, x, mask, pos, monkeypatch, name, prompt=3, rounded=(), tol=1e-5, pieces=None,
                            start=None):
    """Feed ``mixer`` the same tokens twice, a prompt of ``prompt`` tokens and then one token per call (or pieces of
    the lengths ``pieces``): once with the C call ``aaren_hf.modeling_aaren.<name>`` and once with it set to None
    (what runs without it), both from a copy of the layer state ``start`` (None: an empty one). After
    each call: the outputs equal to float32 rounding (``tol`` of the largest: 1e-5; a wrong key or weight moves them by
    far more), the state tensors the same names and dtypes, equal bit for bit, or to rounding for the names in
    ``rounded``. Asserts that the kernel served a call; returns the kernel side's final state."""
    import aaren_hf.modeling_aaren as modeling
    from aaren_hf.modeling_aaren import AarenLayerState

    kernel, served = getattr(modeling, name), []
    counted = recording(kernel, served)

    with_kernel, reference = (AarenLayerState(), AarenLayerState()) if start is None else (start.copy(), start.copy())
    starts = [0, prompt, *range(prompt + 1, x.shape[1] + 1)] if pieces is None else [0, *itertools.accumulate(pieces)]
    for t in [slice(a, b) for a, b in zip(starts, starts[1:])]:
        with torch.no_grad():
            monkeypatch.setattr(modeling, name, counted)
            got = mixer(x[:, t], mask[:, t], pos[:, t], with_kernel)
            monkeypatch.setattr(modeling, name, None)
            want = mixer(x[:, t], mask[:, t], pos[:, t], reference)
        torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol,
                                   msg=lambda m: f"layer {mixer.layer_idx} {t}: {m}")
        got_state, want_state = with_kernel.tensors(), reference.tensors()
        assert got_state.keys() == want_state.keys()
        for key, tensor in got_state.items():
            assert tensor.dtype == want_state[key].dtype, key
            if key in rounded:
                scale = max(1.0, float(want_state[key].abs().max()))
                torch.testing.assert_close(tensor, want_state[key], atol=1e-5 * scale, rtol=1e-5,
                                           msg=lambda m: f"layer {mixer.layer_idx} {t} {key}: {m}")
            else:
                assert torch.equal(tensor, want_state[key]), f"layer {mixer.layer_idx} {t}: {key}"
    monkeypatch.setattr(modeling, name, kernel)
    assert any(served), f"{name} never served a step"
    return with_kernel


# more mixers for the decode-step kernels' tests: the default recipe's kind (4 slots, learned decay, GQA, rotated
# 4-bit memory codes) at a real head size; 8-bit codes
STEP_CASES = {
    "default_like_d64": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, window_size=5,
                             num_sink_tokens=1, memory_size=6, memory_bits=4, memory_hadamard=True,
                             num_query_slots=4, decay="learned"),
    "int8_d64": dict(hidden_size=128, num_attention_heads=2, window_size=3, num_sink_tokens=2, memory_size=4,
                     memory_bits=8),
}


def step_inputs(model, T, gaps, seed=5):
    """(x, mask, pos) to feed a model's mixers token by token (:func:`kernel_beside_reference`): batch 2, row 1
    padding over the slices ``gaps``. Zeroes kv head 0's retention weights, so its scores all tie and the memory's
    tie rule runs too."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "retention_proj"):
                layer.mixer.retention_proj.weight[0] = 0.0
    x = torch.randn(2, T, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * 2
    mask = torch.ones(2, T, dtype=torch.bool)
    for gap in gaps:
        mask[1, gap] = False
    return x, mask, (mask.long().cumsum(1) - 1).masked_fill(~mask, -1)


def code_test_vectors(seed):
    """Vectors for checking a memory-codes kernel against ``MemoryCodes``: shapes with widths 2-256 (every power of 2
    from 8: the C kernel codes 8 channels at a time from 8 at 8 bits, from 16 at 4) and a leading shape with no
    rows, each vector scaled by one of 1e-30 .. 1e30, then a zero vector and a channel near float32's largest."""
    gen = torch.Generator().manual_seed(seed)
    for shape in ((2, 1, 3, 37, 64), (5, 2), (9, 256), (4, 0, 16), (6, 128), (7, 32), (3, 16), (5, 8)):
        x = torch.randn(*shape, generator=gen)
        x = x * torch.logspace(-30, 30, 11)[torch.randint(0, 11, shape[:-1] + (1,), generator=gen)]
        if x.numel():
            rows = x.view(-1, shape[-1])
            rows[0], rows[-1, 0] = 0.0, 3e38
        yield x
