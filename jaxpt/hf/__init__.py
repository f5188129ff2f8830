"""Hugging Face checkpoints in and out (the library of ``python -m jaxpt.tools.convert hf-to-jaxpt |
jaxpt-to-hf``).

    python -m jaxpt.tools.convert hf-to-jaxpt --model PATH --output DIR [--mesh fsdp=8] [--scan-layers]
        [--max-seq-len N]
    python -m jaxpt.tools.convert jaxpt-to-hf --workdir RUN [--step N] --output DIR

``hf-to-jaxpt`` reads a folder of one of the families below (``config.json`` and ``*.safetensors``) into ``DIR``:
a jaxpt checkpoint at step 0 holding the params only (``DIR/checkpoints/0``; read by :func:`jaxpt.restore` and by
``TrainConfig.init_from = 'DIR'`` for continued pretraining, :mod:`jaxpt.run.lineage`; its meta records the source
folder and ``model_type``), the matching gin config ``DIR/model.gin`` and a copy of the model's tokenizer, named by
the gin config: its SentencePiece ``tokenizer.model`` when the folder has one (Llama 2, Mistral v0.1), else its Hugging
Face ``tokenizer.json`` (Llama 3, Qwen; copied as ``DIR/tokenizer.json`` with a ``DIR/tokenizer_config.json`` naming
the special tokens resolved from the folder's ``config.json`` / ``generation_config.json`` / ``tokenizer_config.json``,
:mod:`jaxpt.data.hf_tokenizer`). ``model.gin`` also sets the base model's document-boundary convention
(``DataConfig.document_boundary``, :data:`FAMILY_BOUNDARY`): ``'bos_eos'`` when its tokenizer puts BOS before every
text (``add_bos_token``, or a post-processor that adds it: Llama 2/3, Mistral), else ``'eos'`` (Qwen).
``jaxpt-to-hf`` writes a run's checkpoint as a folder ``transformers`` loads with the family's class
(``config.json``, ``model.safetensors`` or shards with their index, ``generation_config.json`` and the run's
tokenizer, either backend, with its ``tokenizer_config.json``: :func:`_tokenizer_files`).

Families (:data:`FAMILIES`): each is the Llama layout (pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU)
plus a small explicit difference, a :class:`jaxpt.model.ModelConfig` option rather than another model:

==============  ======================  ==========================================================================
``model_type``  exported as             read beyond the Llama layout
==============  ======================  ==========================================================================
``llama``       ``LlamaForCausalLM``    Llama 2/3/3.1/3.2: ``rope_scaling``/``rope_parameters`` (linear, llama3,
                                        yarn), ``tie_word_embeddings`` (Llama 3.2), ``head_dim``
``mistral``     ``MistralForCausalLM``  ``sliding_window`` (caps ``max_seq_len``), ``head_dim``; exported as
                                        Mistral when the run's recorded source is (:func:`source_model_type`)
``qwen2``       ``Qwen2ForCausalLM``    q/k/v projection biases (``attention_bias``; Qwen2 and Qwen2.5), the
                                        sliding window of ``use_sliding_window`` / ``max_window_layers``
``qwen3``       ``Qwen3ForCausalLM``    per-head q/k RMSNorm before RoPE (``qk_norm``), ``head_dim`` required
==============  ======================  ==========================================================================

The export picks the family from the model: ``qk_norm`` -> Qwen3, ``attention_bias`` -> Qwen2, else Llama (Mistral
as said), always with no sliding window (``max_position_embeddings`` = ``max_seq_len``).

Layout (HF Llama, ``modeling_llama.py``; ``y = x W^T``, ``W`` stored ``[out, in]``); every family's tensors are
named as Llama's, one table (:func:`_layer_tensors`) maps each in both directions:

================================  =================================  ==============================
HF tensor                          shape                              jaxpt param
================================  =================================  ==============================
``model.embed_tokens.weight``      [V, D]                             ``embedding`` [V, D]
``layers.i.self_attn.q_proj``      [H Hd, D]                          ``attn.wq`` [D, H, Hd]
``layers.i.self_attn.k_proj/v``    [K Hd, D]                          ``attn.wk/wv`` [D, K, Hd]
``layers.i.self_attn.o_proj``      [D, H Hd]                          ``attn.wo`` [H, Hd, D]
``self_attn.q_proj.bias`` (Qwen2)  [H Hd]                             ``attn.q_bias`` [H, Hd]
``self_attn.k/v_proj.bias``        [K Hd]                             ``attn.k_bias/v_bias`` [K, Hd]
``self_attn.q/k_norm`` (Qwen3)     [Hd]                               ``attn.q_norm/k_norm.scale``
``layers.i.mlp.gate/up_proj``      [F, D]                             ``mlp.w_gate/w_up`` [D, F]
``layers.i.mlp.down_proj``         [D, F]                             ``mlp.w_down`` [F, D]
``layers.i.input_layernorm``       [D]                                ``attn_norm.scale``
``layers.i.post_attention_...``    [D]                                ``mlp_norm.scale``
``model.norm.weight``              [D]                                ``final_norm.scale``
``lm_head.weight`` (untied)        [V, D]                             ``output`` [D, V]
================================  =================================  ==============================

No permutation of q/k is needed: HF's Llama applies RoPE with ``rotate_half`` on the two halves of each head
(the GPT-NeoX layout its conversion script puts Meta's interleaved weights into), as does
:func:`jaxpt.model.rope.apply_rope`. RMSNorm is ``x / sqrt(mean(x^2) + eps) * w`` in both, in float32.

Sharded loading: each jaxpt param is placed by ``jax.make_array_from_callback`` onto its sharding on the
target mesh, each device's block read from a memory map of the safetensors file (a strided view: HF's
transposes become numpy views, never copies of the whole tensor), so no device and no host buffer holds more
than one tensor's shard at a time, apart from the OS page cache.

Object storage: ``--model``, ``--workdir`` and ``--output`` may each be ``gs://`` (every path goes through
:mod:`jaxpt.util.fs`). A remote HF folder is copied once into the per-host cache (:func:`jaxpt.util.fs.local_tree`, the
same cache as ArrayRecord shards and SentencePiece models, keyed by every file's URI, size and mtime) and
memory-mapped from there: the sharded load reads each device's strided block of each tensor, which on a
memory map is a page-cache read but streamed would be one ranged request per row. The checkpoint goes to a
remote ``--output`` through Orbax/TensorStore natively, ``model.gin`` and ``tokenizer.model`` through
:mod:`jaxpt.util.fs`. ``jaxpt-to-hf`` reads a remote run's checkpoint through Orbax and, for a remote ``--output``,
writes the folder into a local temporary directory first (the same code as a local export; the folder is a few
files of at most ``max_shard_bytes`` each) and then uploads each file through :mod:`jaxpt.util.fs`.

What is refused (:class:`ConvertError`, naming the config key or the tensor): a ``model_type`` outside the table (for
a known family jaxpt cannot represent, :data:`UNSUPPORTED` says what it lacks: Gemma's GeGLU and (1 + w) norms,
Phi's LayerNorm and partial rotary, mixture-of-experts MLPs, ...), an activation other than SiLU, ``mlp_bias``,
an ``attention_bias`` that biases o_proj too (Llama, Qwen3), a ``partial_rotary_factor`` below 1, ``layer_types``
other than full and sliding attention, a sliding window shorter than the context kept, a RoPE type jaxpt does not
compute, and a checkpoint whose tensors are not exactly those its config implies (:func:`check_tensor_names`: a bias
the config does not announce is refused rather than dropped; RoPE ``inv_freq`` buffers and a tied ``lm_head`` equal
to the embedding are accepted); on export, a mixture-of-experts model, and ``attention_bias`` with ``qk_norm``.

The modules: :mod:`jaxpt.hf.families` (the family tables, ``FAMILY_BOUNDARY``, ``UNSUPPORTED``, ``ConvertError``),
:mod:`jaxpt.hf.configs` (``config.json`` both ways), :mod:`jaxpt.hf.params` (the tensor mapping, the sharded load),
:mod:`jaxpt.hf.safetensors` (the file format), :mod:`jaxpt.hf.convert` (the two conversions).
"""
