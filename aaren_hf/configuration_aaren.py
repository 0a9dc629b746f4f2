# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""Aaren model configuration. Self-contained: copied next to the weights when a checkpoint is saved."""

from transformers import PreTrainedConfig

DECAY_MODES = ("none", "fixed", "learned", "input")
WINDOW_GATES = ("head", "input")
NORM_TYPES = ("rmsnorm", "layernorm")
MLP_TYPES = ("gated", "plain")
POSITION_EMBEDDINGS = ("none", "learned")
MEMORY_RULES = ("learned", "aaren")
LAYER_TYPES = ("linear_attention", "sliding_attention")
KV_CACHE_DTYPES = (None, "bfloat16", "float16")
MEMORY_BITS = (None, 8, 4)
# Bumped when a checkpoint's meaning changes; code refuses checkpoints from a newer format instead of misreading them.
# 2: kv_cache_dtype (code without it would silently keep the window and memory at full precision).
# 3: memory_shared_layer (code without it would silently keep other tokens in the memory).
# 4: memory_bits (code without it would silently keep the memory at 16 bits, and fewer tokens per byte).
# 5: memory_hadamard (code without it would read rotated codes as plain ones).
# 6: memory_recency (code without it would keep old tokens in the memory, read at distances the teacher never saw).
AAREN_FORMAT_VERSION = 6


class AarenConfig(PreTrainedConfig):
    r"""
    Configuration of an Aaren causal LM. The usual Transformers names hold the usual dimensions; the rest says how
    each block is built (declarative, so converted Llama, GPT-2 and GPT-NeoX teachers share one model class).

    Mixer (the part that replaces softmax attention). The defaults are the paper's form: one learned,
    input-independent query per head, no decay, no window.
        num_query_slots (`int`, 1): learned queries per head; >1 mixes the slot outputs with weights
            softmax_j(<q_proj(x)_h, c_hj>), which needs `q_proj`.
        decay (`str`, "none"): "none" | "fixed" (per head and slot, not trained) | "learned" (per head and slot) |
            "input" (learned rate times softplus of a projection of the input).
        decay_init (`float`, 0.01): initial decay rate lambda (log-decay g = -lambda per token) when decay is on.
        window_size (`int`, 0): W > 0 adds exact softmax attention over the last W tokens (rotary positions inside
            the window), mixed with the Aaren output by a learned gate per head.
        num_sink_tokens (`int`, 0): S first tokens that stay visible to the window branch (StreamingLLM sinks).
        window_gate (`str`, "head"): "head" (one learned gate per head) or "input" (gate computed from the input).
        window_gate_init (`float`, 0.0): initial gate logit; sigmoid(logit) is the window branch's share.
        memory_size (`int` or `list[int]`, 0): M > 0 adds an exact-memory tier to the window branch: per KV head, up to M
            key/value pairs kept after they leave the window, read by the real query in the same softmax as the
            sinks and the window. What is kept is decided when a token leaves the window, by a retention score fixed
            when the token was written: of all tokens that have left the window, the M with the highest scores
            (ties: the newer) stay. A static score makes the parallel (training, prefill) path exactly equal to
            token-by-token decoding. 0 is the model without the tier, bit for bit. Needs window_size > 0.
            A list gives each layer its own M (one entry per layer, 0: no memory in that layer), e.g. to try a
            converted model with its memory spread differently (`from_pretrained(path, memory_size=[...])`).
        memory_rule (`str`, "learned"): the retention score. "learned": a linear projection of the input per KV
            head (zero-initialised: then every token ties and the memory holds the M newest tokens beyond the
            window; conversion trains it to predict which tokens the teacher's later queries attend to).
            "aaren": the highest Aaren score <k, c_hj> over the head group's learned queries, no extra parameters.
        memory_shared_layer (`int`, None): L: the layers after layer L rank tokens for their memory by the larger
            of their own retention score and layer L's (its best over KV heads), so a token that layer L recognises
            as worth keeping (a key, a name, a number) stays in their memories too. Layer L's own ranking is
            unchanged. Scores stay static, so the parallel path still equals token-by-token decoding. None: every
            layer ranks on its own. Layer L needs a memory.
        memory_recency (`float`, 0.0): lambda: a token's learned retention score gets lambda x its position when it
            is written, so a newer token outranks an older one of a score up to lambda x their distance higher.
            The score stays static (the parallel path still equals decoding), and once the stream is longer than
            (spread of the scores) / lambda + M + W tokens no kept key is older than that: a memory without it keeps
            its best tokens from anywhere in the stream, and read at true positions they end up farther back than
            the teacher ever attended (SmolLM2-135M: 8,192 tokens), where its loss jumps from 2.8 to 7.5 at 16K
            tokens; 0.0005 keeps it at 2.76 to 32K, at the cost of a passkey in ten at 2,048 tokens (README,
            "Limits"). A conversion sets 4 / the teacher's context length. Needs memory_rule="learned".
        kv_cache_dtype (`str`, None): the dtype the window, sink and memory keys/values are stored in ("bfloat16" or
            "float16"; None: the model's dtype, like a KV cache). The window branch rounds its keys and values to it
            in training and prefill too, so every path computes on the numbers the cache holds; the Aaren state,
            positions and retention scores stay float32. Halves the window and memory bytes of a float32 model.
        memory_bits (`int`, None): 8 or 4: the memory's keys and values are stored as 8- or 4-bit integers with one
            bfloat16 scale per key or value vector (its largest magnitude over the code range; 4-bit codes two to
            a byte), for 2x or 3.6x the kept tokens per byte at head_dim 64. As with kv_cache_dtype, every path
            (training, prefill, decoding) reads memory entries as stored; the window and sinks stay in
            kv_cache_dtype. None: the memory is stored like the window. Layers without a memory ignore it.
        memory_hadamard (`bool`, False): code each memory key and value after a Hadamard rotation (exact, undone on
            reading), so that a few large channels (rotary keys have them) no longer set a scale that rounds the
            other channels to zero. Matters at 4 bits (the packaged teacher with its whole cache in 4-bit codes:
            perplexity 1.37x without, 1.06x with), not at 8. Needs memory_bits and a head_dim that is a power of 2.
        layer_types (`list[str]`, None): per layer, "linear_attention" (the Aaren mixer above, named as transformers
            names recurrent layers) or "sliding_attention" (the window branch alone: exact softmax over sinks, window
            and memory, no Aaren state, no gate). None: all "linear_attention".
        sliding_window (`int`, None): the window of the "sliding_attention" layers when they are a teacher's own
            local attention (Gemma-2/3, Mistral): exact softmax over the last `sliding_window` tokens, no sinks, no
            memory, as the teacher's local layers compute it. None: "sliding_attention" layers use the Aaren layers'
            window branch settings (`window_size`, `num_sink_tokens`, `memory_size`).
        chunk_size (`int`, 32): chunk length of the parallel scan (32 measured fastest for the PyTorch path on CPU).

    Block:
        norm_type: "rmsnorm" (Llama) | "layernorm" (GPT-2, GPT-NeoX). Epsilon: `rms_norm_eps` / `layer_norm_eps`.
        mlp_type: "gated" (act(gate) * up, Llama) | "plain" (fc_in -> act -> fc_out, GPT-2, GPT-NeoX).
        attention_bias: biases on q/k/v; attention_out_bias: bias on o_proj; mlp_bias: biases in the MLP.
        qk_norm: RMSNorm on each head's query and key (Qwen3).
        parallel_residual: x + mixer(norm1(x)) + mlp(norm2(x)) (GPT-NeoX) instead of the sequential form.
        position_embedding_type: "none" | "learned" (absolute table of `max_position_embeddings`, GPT-2); inputs
            longer than the table are an error. Without a table, `max_position_embeddings` defaults to 2**20: no
            part of the model caps the context.
        rope_theta, partial_rotary_factor: rotary embedding of the window branch (factor 0: none, as for GPT-2 whose
            positions live in the learned table).
        rope_theta_per_layer (`list[float]`, None): a rotary base per layer, for teachers whose local and global
            layers use different bases (Gemma-3: 10,000 local, 1,000,000 global). None: `rope_theta` everywhere.
            (Checkpoints store each layer's inverse frequencies, rope scaling included; this sets their default.)
        query_pre_attn_scalar (`float`, None): attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma)
            instead of head_dim ** -0.5 (None). Applies to the window branch and to the Aaren scores.

    Block, Gemma-2/3 options (all off by default):
        rms_norm_unit_offset (`bool`, False): every RMSNorm (block, final and q/k norms) multiplies by
            (1 + weight), computed in float32 and cast after the product, as Gemma's RMSNorm; the stored weight is
            then 0 for the identity.
        post_norms (`bool`, False): an RMSNorm on the mixer's output and one on the MLP's output, before each is
            added to the residual stream (`post_mixer_layernorm`, `post_mlp_layernorm`; Gemma's
            `post_attention_layernorm` and `post_feedforward_layernorm`). The pre-MLP norm keeps its name
            `post_attention_layernorm` (Gemma's `pre_feedforward_layernorm`).
        embed_scale (`float`, 1.0): token embeddings are multiplied by this (Gemma: sqrt(hidden_size), applied in
            the embedding's dtype). Not applied to `inputs_embeds` given by the caller, as in Gemma.
        A GELU-tanh gated MLP (Gemma) is `mlp_type="gated"` with `hidden_act="gelu_pytorch_tanh"`.
    """

    model_type = "aaren"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        hidden_act="silu",
        norm_type="rmsnorm",
        rms_norm_eps=1e-6,
        layer_norm_eps=1e-5,
        mlp_type="gated",
        attention_bias=False,
        attention_out_bias=None,
        mlp_bias=False,
        qk_norm=False,
        parallel_residual=False,
        position_embedding_type="none",
        max_position_embeddings=None,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        num_query_slots=1,
        decay="none",
        decay_init=0.01,
        window_size=0,
        num_sink_tokens=0,
        window_gate="head",
        window_gate_init=0.0,
        memory_size=0,
        memory_rule="learned",
        memory_shared_layer=None,
        memory_recency=0.0,
        kv_cache_dtype=None,
        memory_bits=None,
        memory_hadamard=False,
        layer_types=None,
        sliding_window=None,
        rope_theta_per_layer=None,
        query_pre_attn_scalar=None,
        rms_norm_unit_offset=False,
        post_norms=False,
        embed_scale=1.0,
        chunk_size=32,
        initializer_range=0.02,
        use_cache=True,
        aaren_format_version=AAREN_FORMAT_VERSION,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        if head_dim is None and isinstance(hidden_size, int) and isinstance(num_attention_heads, int):
            if num_attention_heads > 0 and hidden_size % num_attention_heads == 0:
                self.head_dim = hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.norm_type = norm_type
        self.rms_norm_eps = rms_norm_eps
        self.layer_norm_eps = layer_norm_eps
        self.mlp_type = mlp_type
        self.attention_bias = attention_bias
        self.attention_out_bias = attention_bias if attention_out_bias is None else attention_out_bias
        self.mlp_bias = mlp_bias
        self.qk_norm = qk_norm
        self.parallel_residual = parallel_residual
        self.position_embedding_type = position_embedding_type
        if max_position_embeddings is None:
            # Without a learned table nothing caps the context (decay orders the Aaren state; the window branch sees
            # bounded distances), so advertise a large limit to tools that read this field (generate, lm-eval).
            max_position_embeddings = 1024 if position_embedding_type == "learned" else 1 << 20
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        self.num_query_slots = num_query_slots
        self.decay = decay
        self.decay_init = decay_init
        self.window_size = window_size
        self.num_sink_tokens = num_sink_tokens
        self.window_gate = window_gate
        self.window_gate_init = window_gate_init
        self.memory_size = list(memory_size) if isinstance(memory_size, (list, tuple)) else memory_size
        self.memory_rule = memory_rule
        self.memory_shared_layer = memory_shared_layer
        self.memory_recency = memory_recency
        self.kv_cache_dtype = kv_cache_dtype
        self.memory_bits = memory_bits
        self.memory_hadamard = memory_hadamard
        self.layer_types = list(layer_types) if layer_types is not None else None
        self.sliding_window = sliding_window
        self.rope_theta_per_layer = [float(t) for t in rope_theta_per_layer] if rope_theta_per_layer else None
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.rms_norm_unit_offset = bool(rms_norm_unit_offset)
        self.post_norms = bool(post_norms)
        self.embed_scale = float(embed_scale)
        self.chunk_size = chunk_size
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        if not isinstance(aaren_format_version, int) or isinstance(aaren_format_version, bool):
            raise ValueError(
                f"config.json has aaren_format_version {aaren_format_version!r}, which is not a whole number: the file "
                f"was edited or damaged. Set it to the integer the checkpoint was written with ({AAREN_FORMAT_VERSION} "
                "for this aaren-hf), or save the model again."
            )
        if aaren_format_version > AAREN_FORMAT_VERSION:
            raise ValueError(
                f"This checkpoint was written by a newer aaren-hf (checkpoint format {aaren_format_version!r}; this code "
                f"reads format <= {AAREN_FORMAT_VERSION}). Upgrade with `pip install -U aaren-hf`, or load it with "
                "trust_remote_code=True and without importing aaren_hf, so that the checkpoint's own code is used."
            )
        self.aaren_format_version = aaren_format_version
        self._validate()
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # from_pretrained(path, memory_size=..., ...) sets such overrides as attributes after __init__ has checked
        # the saved values: check the result again, so that an override fails here with the same message as in
        # __init__ rather than deep inside the model.
        out = super().from_dict(config_dict, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if isinstance(config.memory_size, tuple):
            config.memory_size = list(config.memory_size)
        config._validate()
        return out

    def _validate(self):
        def positive(name, allow_zero=False):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
            if not ok:
                bound = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"AarenConfig.{name} must be an integer {bound}, got {value!r}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "num_query_slots", "chunk_size", "max_position_embeddings"):
            positive(name)
        for name in ("window_size", "num_sink_tokens"):
            positive(name, allow_zero=True)
        if isinstance(self.memory_size, (list, tuple)):
            sizes = list(self.memory_size)
            if len(sizes) != self.num_hidden_layers or not all(
                    isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in sizes):
                raise ValueError(
                    f"AarenConfig.memory_size as a list gives one integer >= 0 per layer ({self.num_hidden_layers} "
                    f"layers), got {self.memory_size!r}: fix the list, or give one integer for every layer"
                )
        else:
            positive("memory_size", allow_zero=True)
        if self.head_dim is None:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim explicitly or change one of them"
            )
        positive("head_dim")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}): each key/value head serves a whole group of query heads"
            )
        choices = {
            "decay": DECAY_MODES,
            "window_gate": WINDOW_GATES,
            "norm_type": NORM_TYPES,
            "mlp_type": MLP_TYPES,
            "position_embedding_type": POSITION_EMBEDDINGS,
            "memory_rule": MEMORY_RULES,
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "memory_bits": MEMORY_BITS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"AarenConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.num_sink_tokens > 0 and self.window_size == 0:
            raise ValueError("num_sink_tokens > 0 needs the window branch: set window_size > 0 as well")
        if self.max_memory_size > 0 and self.window_size == 0:
            raise ValueError(
                "memory_size > 0 needs the window branch (the memory holds tokens that have left the window and is "
                "read in the window's softmax): set window_size > 0 as well, or memory_size=0"
            )
        if self.memory_bits == 4 and self.head_dim % 2:
            raise ValueError(f"memory_bits=4 packs two codes to a byte and needs an even head_dim, got {self.head_dim}")
        if isinstance(self.memory_recency, bool) or not isinstance(self.memory_recency, (int, float)) or not (
                0.0 <= self.memory_recency < float("inf")):
            raise ValueError(f"memory_recency must be a finite number >= 0 (0: no recency), got "
                             f"{self.memory_recency!r}")
        self.memory_recency = float(self.memory_recency)
        if self.memory_recency > 0 and self.memory_rule != "learned":
            raise ValueError("memory_recency adds to the learned retention score: set memory_rule='learned' as well, "
                             "or memory_recency=0")
        if not isinstance(self.memory_hadamard, bool):
            raise ValueError(f"memory_hadamard must be True or False, got {self.memory_hadamard!r}")
        if self.memory_hadamard:
            if self.memory_bits is None:
                raise ValueError("memory_hadamard rotates the memory's codes: set memory_bits=8 or 4 as well, or "
                                 "memory_hadamard=False")
            if self.head_dim & (self.head_dim - 1):
                raise ValueError(f"memory_hadamard needs a head_dim that is a power of 2, got {self.head_dim}: set "
                                 "memory_hadamard=False (aaren-convert: --memory-hadamard off, or --memory-bits 8)")
        shared = self.memory_shared_layer
        if shared is not None:
            ok = isinstance(shared, int) and not isinstance(shared, bool) and 0 <= shared < self.num_hidden_layers - 1
            if not ok:
                raise ValueError(
                    f"memory_shared_layer must be None or a layer index from 0 to {self.num_hidden_layers - 2} (a "
                    f"layer with layers after it), got {shared!r}"
                )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(
                    f"layer_types must list one of {LAYER_TYPES} for each of the {self.num_hidden_layers} layers, got "
                    f"{self.layer_types!r}"
                )
            if "sliding_attention" in self.layer_types and self.window_size == 0 and self.sliding_window is None:
                raise ValueError(
                    "a 'sliding_attention' layer is the window branch alone: set window_size > 0 (aaren-convert: "
                    "--window-size), or sliding_window to the teacher's local window"
                )
            if self.memory_rule == "aaren" and self.sliding_window is None and any(
                    t == "sliding_attention" and self.layer_memory_size(i) > 0 for i, t in enumerate(self.layer_types)):
                raise ValueError(
                    "memory_rule='aaren' ranks tokens by the Aaren queries, which 'sliding_attention' layers do not "
                    "have: use memory_rule='learned'"
                )
        if self.sliding_window is not None:
            positive("sliding_window")
        if self.rope_theta_per_layer is not None:
            if len(self.rope_theta_per_layer) != self.num_hidden_layers or not all(
                    t > 0 for t in self.rope_theta_per_layer):
                raise ValueError(
                    f"rope_theta_per_layer must give a positive rotary base for each of the {self.num_hidden_layers} "
                    f"layers, got {self.rope_theta_per_layer!r}"
                )
        if self.query_pre_attn_scalar is not None and not (self.query_pre_attn_scalar > 0):
            raise ValueError(f"query_pre_attn_scalar must be > 0 (scores are scaled by its inverse square root), got "
                             f"{self.query_pre_attn_scalar!r}")
        if self.post_norms and self.parallel_residual:
            raise ValueError("post_norms (Gemma) and parallel_residual (GPT-NeoX) do not combine: set one of them")
        if self.rms_norm_unit_offset and self.norm_type != "rmsnorm":
            raise ValueError("rms_norm_unit_offset applies to RMSNorm: it needs norm_type='rmsnorm'")
        if not (self.embed_scale > 0):
            raise ValueError(f"embed_scale must be > 0, got {self.embed_scale!r}")
        if not (self.decay_init > 0):
            raise ValueError(f"AarenConfig.decay_init must be > 0 (a decay rate per token), got {self.decay_init!r}")
        if not (0.0 <= self.partial_rotary_factor <= 1.0):
            raise ValueError(f"partial_rotary_factor must be in [0, 1] (0: no rotary), got {self.partial_rotary_factor!r}")
        if shared is not None and self.layer_window(shared)[2] == 0:
            raise ValueError(
                f"memory_shared_layer={shared} names a layer without a memory (memory_size there is 0, or it is a "
                "teacher's local layer): choose a layer with memory_size > 0, or set memory_shared_layer=None"
            )
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if (self.window_size > 0 or self.sliding_window is not None) and rotary_dim % 2 != 0:
            raise ValueError(f"the rotary part of each head (head_dim * partial_rotary_factor = {rotary_dim}) must be even")

    @property
    def uses_query_projection(self) -> bool:
        """q_proj exists when slots are mixed by the input or the window branch needs per-token queries."""
        return self.num_query_slots > 1 or self.window_size > 0

    def layer_type(self, index: int) -> str:
        return "linear_attention" if self.layer_types is None else self.layer_types[index]

    def layer_window(self, index: int) -> tuple[int, int, int]:
        """(window, sink tokens, memory size) of the window branch of layer ``index`` (window 0: none)."""
        if self.layer_type(index) == "sliding_attention" and self.sliding_window is not None:
            return self.sliding_window, 0, 0
        return self.window_size, self.num_sink_tokens, self.layer_memory_size(index)

    def layer_memory_size(self, index: int) -> int:
        """The memory tier's M in layer ``index`` (``memory_size``, or its entry when it is a per-layer list)."""
        return self.memory_size[index] if isinstance(self.memory_size, (list, tuple)) else self.memory_size

    @property
    def max_memory_size(self) -> int:
        """The largest M of any layer (0: no layer has a memory)."""
        sizes = self.memory_size if isinstance(self.memory_size, (list, tuple)) else [self.memory_size]
        return max(sizes, default=0)

    def layer_uses_query_projection(self, index: int) -> bool:
        """Whether layer ``index`` has q_proj: Aaren layers as :attr:`uses_query_projection` says, window-only layers
        always."""
        return self.uses_query_projection or self.layer_type(index) == "sliding_attention"

    def layer_rope_theta(self, index: int) -> float:
        return self.rope_theta if self.rope_theta_per_layer is None else self.rope_theta_per_layer[index]

    @property
    def attention_scale(self) -> float:
        """The factor on query-key scores: query_pre_attn_scalar ** -0.5, or head_dim ** -0.5."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


__all__ = ["AarenConfig"]
