"""Hugging Face checkpoints in and out: ``python -m jaxpt.tools.convert hf-to-jaxpt | jaxpt-to-hf``.

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from jaxpt import checkpoint as ckpt_lib, config as config_lib, mesh as mesh_lib
from jaxpt.checkpoint import CheckpointError
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.infer.restore import restore
from jaxpt.model import ModelConfig, parametrization
from jaxpt.run import lineage
from jaxpt.training import state as state_lib
from jaxpt.util import cli, fs
from jaxpt.util.errors import ConfigError



@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family jaxpt reads and writes: a Llama-layout decoder (RMSNorm, RoPE, GQA, SwiGLU) and
    what it adds (module docstring's family table).

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architecture: the ``transformers`` class an export of this family names (``architectures``).
      attention_bias: its q/k/v projections carry biases (``ModelConfig.attention_bias``; Qwen2).
      qk_norm: it normalizes each head of q and k before RoPE (``ModelConfig.qk_norm``; Qwen3).
      sliding_window_keys: the keys that switch its sliding window on (``sliding_window`` alone for Mistral;
        ``use_sliding_window`` and ``max_window_layers`` too for Qwen); empty: it has none.
    """

    model_type: str
    architecture: str
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window_keys: tuple[str, ...] = ()


#: The families :func:`model_config_from_hf` reads and :func:`hf_config_from_model` writes, by ``model_type``.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralForCausalLM", sliding_window_keys=("sliding_window",)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", attention_bias=True,
                    sliding_window_keys=("use_sliding_window", "sliding_window", "max_window_layers")),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qk_norm=True,
                    sliding_window_keys=("use_sliding_window", "sliding_window", "max_window_layers")),
}
#: ``model_type`` values read by :func:`model_config_from_hf`.
ARCHITECTURES = tuple(FAMILIES)
#: Families jaxpt's model cannot represent, with what it lacks (named in the refusal).
UNSUPPORTED: dict[str, str] = {
    "gemma": "a GeGLU MLP (gelu), RMSNorm scaled by (1 + w) and embeddings scaled by sqrt(hidden_size)",
    "gemma2": "a GeGLU MLP, (1 + w) RMSNorm, norms after attention and MLP, logit soft-capping and alternating "
              "sliding-window layers",
    "gemma3_text": "a GeGLU MLP, (1 + w) RMSNorm, norms after attention and MLP and local/global attention layers "
                   "with two RoPE bases",
    "phi": "LayerNorm with biases, a GELU MLP with biases, parallel attention and MLP and partial rotary embeddings",
    "phi3": "fused qkv_proj / gate_up_proj tensors and LongRoPE scaling",
    "mixtral": "mixture-of-experts MLPs (the converter maps dense models only)",
    "qwen2_moe": "mixture-of-experts MLPs with a gated shared expert (the converter maps dense models only)",
    "qwen3_moe": "mixture-of-experts MLPs (the converter maps dense models only)",
    "olmo2": "q/k RMSNorm over all heads together and norms after (not before) attention and MLP",
    "gpt2": "LayerNorm, learned absolute positions, a GELU MLP and biases everywhere",
    "gpt_neox": "LayerNorm, parallel attention and MLP, partial rotary embeddings and biases",
}
#: Safetensors dtype names (format spec, ``safetensors`` README) -> numpy dtypes; bfloat16 via ml_dtypes.
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
#: Step of the converted checkpoint; a continued run's global steps count on from it.
CONVERTED_STEP = 0


class ConvertError(ConfigError):
    """A checkpoint or config the converter cannot translate faithfully (the message names the key)."""


# ------------------------------------------------------------------------------------------ safetensors


def _np_dtype(name: str) -> np.dtype:
    if name not in _ST_DTYPES:
        raise ConvertError(f"safetensors dtype {name!r} is not supported")
    if name == "BF16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_ST_DTYPES[name])


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` files (one file, or shards named by
    ``model.safetensors.index.json``), each opened as a read-only ``np.memmap`` (no bytes read until indexed).

    Format (``safetensors`` README): 8-byte little-endian header size N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data (offsets relative to its start).

    Every file's header is checked as the ``safetensors`` library checks it (:func:`check_header`) before a tensor is
    mapped: a header with bad offsets or sizes would otherwise map the wrong bytes.

    Raises:
      ConvertError: no safetensors file, a malformed header (naming the file and the tensor), or a tensor named twice.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = str(folder)
        files = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
        if not files:
            raise ConvertError(f"{self.folder}: no *.safetensors file (PyTorch .bin checkpoints are not read: "
                               "save the model with safe_serialization=True)")
        self._where: dict[str, tuple[str, dict, int]] = {}
        for f in files:
            path = os.path.join(self.folder, f)
            header, n = read_header(path)
            for name, info in header.items():
                if name in self._where:
                    raise ConvertError(f"{self.folder}: tensor {name!r} is in two files")
                self._where[name] = (path, info, 8 + n)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name in the folder's safetensors files, sorted."""
        return sorted(self._where)

    def get(self, name: str) -> np.ndarray:
        """A read-only memory map of tensor ``name`` in its stored dtype and shape.

        Raises:
          ConvertError: no such tensor.
        """
        if name not in self._where:
            raise ConvertError(f"{self.folder}: no tensor {name!r}")
        path, info, base = self._where[name]
        begin, end = info["data_offsets"]
        dtype, shape = _np_dtype(info["dtype"]), tuple(info["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + begin, shape=shape)


#: The largest header a safetensors file may have (the ``safetensors`` library's limit).
MAX_HEADER_BYTES = 100_000_000


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """``(tensors, header bytes N)`` of a safetensors file, checked by :func:`check_header` (``__metadata__`` left out).

    Raises:
      ConvertError: naming ``path`` and what is wrong.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 8:
            raise ConvertError(f"{path}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(fh.read(8), "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ConvertError(f"{path}: header of {n} bytes in a file of {size} (or over {MAX_HEADER_BYTES})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path}: the header is not JSON ({e})") from None
    return check_header(header, size - 8 - n, path), n


def check_header(header: Any, data_bytes: int, where: str) -> dict[str, dict]:
    """The tensors of a safetensors header, checked as the ``safetensors`` library checks them: a JSON object of
    ``{"dtype": known, "shape": [non-negative ints], "data_offsets": [begin, end]}`` entries (and a string-valued
    ``__metadata__``) whose byte ranges hold exactly their shape's bytes and tile the ``data_bytes`` after the header,
    in order, with no gap or overlap.

    Raises:
      ConvertError: naming ``where``, the tensor and the rule it breaks.
    """
    if not isinstance(header, dict):
        raise ConvertError(f"{where}: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ConvertError(f"{where}: __metadata__ must map strings to strings")
    spans = []
    for name, info in header.items():
        ok = (isinstance(info, dict) and info.get("dtype") in _ST_DTYPES and isinstance(info.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(isinstance(o, int) and o >= 0 for o in info["data_offsets"]))
        if not ok:
            raise ConvertError(f"{where}: tensor {name!r}: a malformed entry {info!r}")
        begin, end = info["data_offsets"]
        expected = math.prod(info["shape"]) * _np_dtype(info["dtype"]).itemsize
        if end - begin != expected:
            raise ConvertError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its "
                               f"dtype and shape {info['shape']} need {expected}")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ConvertError(f"{where}: tensor {name!r} starts at byte {begin} of the data, not {at}: the offsets "
                               "leave a gap or overlap")
        at = end
    if at != data_bytes:
        raise ConvertError(f"{where}: the tensors cover {at} bytes of data, the file holds {data_bytes}")
    return header


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> numpy array, C order written) as one safetensors file (format above)."""
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    inverse = {np.dtype(v) if k != "BF16" else None: k for k, v in _ST_DTYPES.items()}
    offset = 0
    for name in names:
        a = tensors[name]
        kind = "BF16" if a.dtype.name == "bfloat16" else inverse.get(a.dtype)
        if kind is None:
            raise ValueError(f"write_safetensors: dtype {a.dtype} of {name!r} has no safetensors name")
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


# ------------------------------------------------------------------------------------------ configs


def _rope_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's RoPE fields from an HF config: transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    spec = {**scaling, **params}
    kind = spec.get("rope_type", spec.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    key = "rope_parameters" if params else "rope_scaling"
    if kind not in ("linear", "llama3", "yarn"):
        raise ConvertError(f"{key}.rope_type = {kind!r}: jaxpt computes default, linear, llama3 and yarn RoPE")
    out.update(rope_scaling=kind, rope_scaling_factor=float(spec["factor"]))
    if kind in ("llama3", "yarn"):
        out["rope_original_max_len"] = int(spec.get("original_max_position_embeddings")
                                           or hf.get("original_max_position_embeddings") or 0)
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(spec.get("high_freq_factor", 4.0)))
    if kind == "yarn":
        if spec.get("mscale") or spec.get("mscale_all_dim") or spec.get("truncate") is False:
            raise ConvertError(f"{key}: yarn with mscale/mscale_all_dim/truncate=False is not what jaxpt computes")
        out.update(rope_beta_fast=float(spec.get("beta_fast") or 32.0),
                   rope_beta_slow=float(spec.get("beta_slow") or 1.0),
                   rope_attention_factor=float(spec.get("attention_factor") or 0.0))
    return out


_MISSING = object()


def _int(hf: Mapping[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """``config.json``'s integer ``key`` (``default`` when absent or null, if given), at least ``minimum``.

    Raises:
      ConvertError: absent without a default, not an integer (a string, a float with a fraction, a bool), or below
        ``minimum``; naming the key and the value.
    """
    v = hf.get(key)
    if v is None:
        if default is _MISSING:
            raise ConvertError(f"config.json has no {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < minimum:
        raise ConvertError(f"config.json {key} = {v!r}: not an integer >= {minimum}")
    return int(v)


def _float(hf: Mapping[str, Any], key: str, default: float) -> float:
    """``config.json``'s number ``key`` (``default`` when absent), finite and positive.

    Raises:
      ConvertError: not a finite positive number, naming the key and the value.
    """
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConvertError(f"config.json {key} = {v!r}: not a finite positive number")
    return float(v)


def model_config_from_hf(hf: Mapping[str, Any], *, max_seq_len: int = 0, scan_layers: bool = False,
                         tensors: SafetensorsFolder | None = None):
    """The :class:`jaxpt.model.ModelConfig` of an HF ``config.json`` (a dict), float32 params and compute.

    Args:
      hf: the parsed ``config.json`` of a family in :data:`FAMILIES`.
      max_seq_len: the model's ``max_seq_len``; 0: ``max_position_embeddings`` (capped by a sliding window, within
        which full causal attention equals sliding-window attention).
      scan_layers: the stacked-layers layout (``ModelConfig.scan_layers``).
      tensors: the checkpoint's tensors, whose names must be exactly those the config implies
        (:func:`check_tensor_names`: a bias or a norm the config does not announce is refused, not dropped).

    Raises:
      ConvertError: naming the HF key: an unknown ``model_type`` (for a known family jaxpt cannot represent, naming
        what it lacks), ``hidden_act`` other than silu, ``mlp_bias``, an ``attention_bias`` that adds an o_proj bias
        (Llama, Qwen3), a ``partial_rotary_factor`` below 1, Qwen3 without ``head_dim``, ``layer_types`` other than
        full and sliding attention, a sliding window below ``max_seq_len``, a RoPE type jaxpt does not compute, or
        (with ``tensors``) a tensor name the mapping does not consume or one it misses.
    """
    kind = hf.get("model_type")
    if kind in UNSUPPORTED:
        raise ConvertError(f"config.json model_type = {kind!r}: jaxpt's model lacks {UNSUPPORTED[kind]}; it reads "
                           f"{ARCHITECTURES}")
    if kind not in FAMILIES:
        raise ConvertError(f"config.json model_type = {kind!r}: jaxpt reads {ARCHITECTURES} (Llama-layout decoders "
                           "with RMSNorm, RoPE and a SwiGLU MLP)")
    family = FAMILIES[kind]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"config.json hidden_act = {act!r}: jaxpt's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        raise ConvertError("config.json mlp_bias = True: jaxpt's MLP has no biases")
    if hf.get("attention_bias") and not family.attention_bias:
        raise ConvertError(f"config.json attention_bias = True: a {kind} model then has biases on q/k/v and o_proj; "
                           "jaxpt's attention has q/k/v biases (ModelConfig.attention_bias) but none on the output "
                           "projection")
    if float(hf.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConvertError(f"config.json partial_rotary_factor = {hf['partial_rotary_factor']!r}: jaxpt rotates "
                           "every dimension of each head")
    D, H = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    # Qwen3's config class defaults head_dim to 128, not hidden_size / heads: a config without it is ambiguous.
    head_dim = _int(hf, "head_dim") if family.qk_norm else _int(hf, "head_dim", D // H)
    max_pos = _int(hf, "max_position_embeddings", 4096)
    window, window_key = _sliding_window(hf, family)
    L = max_seq_len or (min(max_pos, window) if window else max_pos)
    if window and L > window:
        raise ConvertError(f"config.json {window_key} = {window}: jaxpt attends over the whole row, which equals "
                           f"sliding-window attention only up to {window} tokens; --max-seq-len {L} is longer")
    cfg = ModelConfig(
        vocab_size=_int(hf, "vocab_size"), d_model=D, num_layers=_int(hf, "num_hidden_layers"), num_heads=H,
        num_kv_heads=_int(hf, "num_key_value_heads", H), head_dim=head_dim,
        mlp_dim=_int(hf, "intermediate_size"), max_seq_len=L, norm_eps=_float(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=family.attention_bias,
        qk_norm=family.qk_norm, scan_layers=scan_layers, **_checked_rope(hf))
    if tensors is not None:
        check_tensor_names(tensors, cfg)
    return cfg


def _sliding_window(hf: Mapping[str, Any], family: Family) -> tuple[int | None, str]:
    """``(window, the key that set it)`` of a config whose layers (some or all) attend within a sliding window,
    else ``(None, "")``. Mistral: ``sliding_window`` when not null. Qwen2/Qwen3: only with ``use_sliding_window``,
    and only layers ``>= max_window_layers`` slide (transformers' ``Qwen2Config``); ``layer_types``, when given,
    says per layer. Llama has none.

    Raises:
      ConvertError: a ``layer_types`` entry other than ``full_attention``/``sliding_attention``, or a window that
        is not a positive integer.
    """
    keys = family.sliding_window_keys
    if not keys:
        return None, ""
    if "use_sliding_window" in keys and not hf.get("use_sliding_window", False):
        return None, ""
    if hf.get("sliding_window") is None:
        return None, ""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")}, key=str)
        if odd:
            raise ConvertError(f"config.json layer_types has {odd}: jaxpt's layers are all full causal attention")
        sliding = "sliding_attention" in layer_types
    elif "max_window_layers" in keys:
        sliding = _int(hf, "max_window_layers", 28, minimum=0) < _int(hf, "num_hidden_layers")
    else:
        sliding = True
    return (_int(hf, "sliding_window"), "sliding_window") if sliding else (None, "")


def _checked_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_rope_from_hf`, with a value that is not a number (or a missing ``factor``) a ConvertError naming the
    RoPE settings, not a traceback."""
    try:
        out = _rope_from_hf(hf)
    except (TypeError, ValueError, KeyError) as e:
        raise ConvertError(f"config.json RoPE settings (rope_theta, rope_scaling / rope_parameters): {e!r}") from None
    bad = {k: v for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise ConvertError(f"config.json RoPE settings: not finite: {bad}")
    return out


def export_family(cfg, source_model_type: str | None = None) -> Family:
    """The HF family a jaxpt model exports as: ``qk_norm`` -> Qwen3, ``attention_bias`` -> Qwen2, otherwise Llama, or
    Mistral when the model was converted from one (``source_model_type``: the checkpoint's recorded source,
    :func:`source_model_type`). A Mistral is a Llama whose layers attend within a sliding window; exported with no
    window it computes what jaxpt computes, as a Llama would, but keeps its family's name.

    Raises:
      ConvertError: a mixture-of-experts model (``ModelConfig.mlp``), or ``attention_bias`` with ``qk_norm`` (no
        family has q/k/v biases, a q/k norm and no o_proj bias).
    """
    if cfg.mlp != "swiglu":
        raise ConvertError(f"ModelConfig.mlp = {cfg.mlp!r}: only the dense SwiGLU model exports to Hugging Face")
    if parametrization.tied_multiplier(cfg):
        raise ConvertError(
            "ModelConfig.parametrization = 'mup' with ModelConfig.tie_embeddings = True: the logits' multiplier "
            f"1/m = {parametrization.output_multiplier(cfg):g} cannot be folded into a tied lm_head (it would scale "
            "the embedding too), and no Hugging Face family has an output multiplier; export an untied µP model")
    if cfg.attention_bias and cfg.qk_norm:
        raise ConvertError("ModelConfig.attention_bias = True with ModelConfig.qk_norm = True: no Hugging Face "
                           "family has both without an o_proj bias (Qwen3's attention_bias adds one)")
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.attention_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["mistral" if source_model_type == "mistral" else "llama"]


def hf_config_from_model(cfg, tokenizer=None, source_model_type: str | None = None) -> dict[str, Any]:
    """The ``config.json`` (float32) of the HF model equal to a jaxpt :class:`ModelConfig`, in the family
    :func:`export_family` picks (``source_model_type`` as it takes it).

    RoPE is written both as transformers 5's ``rope_parameters`` and as 4.x's ``rope_theta``/``rope_scaling``.
    Mistral and Qwen are written with no sliding window (``max_position_embeddings`` is ``max_seq_len``, within
    which jaxpt's full attention is the model).

    Raises:
      ConvertError: as :func:`export_family`.
    """
    family = export_family(cfg, source_model_type)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        rope.update(rope_type=cfg.rope_scaling, factor=cfg.rope_scaling_factor)
    if cfg.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = cfg.rope_original_max_len
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling == "yarn":
        rope.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor > 0:
            rope["attention_factor"] = cfg.rope_attention_factor
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
    out = {
        "architectures": [family.architecture], "model_type": family.model_type, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": "float32", "dtype": "float32",
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling == "none" else legacy,
        "rope_parameters": rope, "use_cache": True,
    }
    if family.model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if family.model_type == "qwen3":
        out["attention_bias"] = False   # Qwen3's would add biases to q/k/v and o_proj
    if family.sliding_window_keys:
        out["sliding_window"] = None
    if "use_sliding_window" in family.sliding_window_keys:
        out.update(use_sliding_window=False, max_window_layers=cfg.num_layers)
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
        out.update({k: (i if i >= 0 else None) for k, i in ids.items()})  # -1: none (Qwen has no BOS)
    return out


def source_model_type(meta: Mapping[str, Any], stages: Sequence[Mapping[str, Any]] = ()) -> str | None:
    """The HF ``model_type`` a checkpoint's model was converted from, or None (trained in jaxpt): its meta's
    ``source`` (a converted checkpoint), its stage's (a stage started from one), else the newest stage of its run's
    ``run.json`` ``stages`` that records one (a later stage of such a run)."""
    for record in (meta, meta.get("stage") or {}, *reversed(list(stages))):
        source = (record or {}).get("source") or {}
        if source.get("model_type"):
            return str(source["model_type"])
    return None


# ------------------------------------------------------------------------------------------ the mapping


def _param_path_names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


class _Tensor(NamedTuple):
    """One per-layer HF tensor: its name after ``model.layers.<i>.``, and the two layout maps (numpy views where
    the layout allows: a reshape and a transpose, no copy)."""

    hf_name: str
    to_jaxpt: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _layer_tensors(cfg) -> dict[tuple[str, ...], _Tensor]:
    """The per-layer mapping of a model of ``cfg``: block param path (e.g. ``('attn', 'wq')``) -> :class:`_Tensor`.
    The one table both directions and :func:`check_tensor_names` read; its rows are the module docstring's."""
    D, H, K, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = lambda a: a.T  # noqa: E731
    same = lambda a: a  # noqa: E731
    out = {
        ("attn", "wq"): _Tensor("self_attn.q_proj.weight", lambda a: a.reshape(H, Hd, D).transpose(2, 0, 1),
                                lambda a: a.reshape(D, H * Hd).T),
        ("attn", "wk"): _Tensor("self_attn.k_proj.weight", lambda a: a.reshape(K, Hd, D).transpose(2, 0, 1),
                                lambda a: a.reshape(D, K * Hd).T),
        ("attn", "wv"): _Tensor("self_attn.v_proj.weight", lambda a: a.reshape(K, Hd, D).transpose(2, 0, 1),
                                lambda a: a.reshape(D, K * Hd).T),
        ("attn", "wo"): _Tensor("self_attn.o_proj.weight", lambda a: a.reshape(D, H, Hd).transpose(1, 2, 0),
                                lambda a: a.reshape(H * Hd, D).T),
        ("mlp", "w_gate"): _Tensor("mlp.gate_proj.weight", t, t),
        ("mlp", "w_up"): _Tensor("mlp.up_proj.weight", t, t),
        ("mlp", "w_down"): _Tensor("mlp.down_proj.weight", t, t),
        ("attn_norm", "scale"): _Tensor("input_layernorm.weight", same, same),
        ("mlp_norm", "scale"): _Tensor("post_attention_layernorm.weight", same, same),
    }
    if cfg.attention_bias:
        for name, heads in (("q", H), ("k", K), ("v", K)):
            out[("attn", f"{name}_bias")] = _Tensor(f"self_attn.{name}_proj.bias",
                                                    lambda a, n=heads: a.reshape(n, Hd), lambda a: a.reshape(-1))
    if cfg.qk_norm:
        out[("attn", "q_norm", "scale")] = _Tensor("self_attn.q_norm.weight", same, same)
        out[("attn", "k_norm", "scale")] = _Tensor("self_attn.k_norm.weight", same, same)
    return out


def _hf_layer_views(tensors: SafetensorsFolder, cfg, layer: int) -> dict[tuple, Callable[[], np.ndarray]]:
    """Per block param name -> a thunk giving the HF tensor as a numpy *view* in jaxpt's layout."""
    p = f"model.layers.{layer}."
    return {names: (lambda m=m: m.to_jaxpt(tensors.get(p + m.hf_name))) for names, m in _layer_tensors(cfg).items()}


def expected_tensor_names(cfg) -> set[str]:
    """Every tensor name the HF checkpoint of a model of ``cfg`` has: those :func:`load_hf_params` reads."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if cfg.tie_embeddings else {"lm_head.weight"})
    per_layer = [m.hf_name for m in _layer_tensors(cfg).values()]
    return names | {f"model.layers.{i}.{n}" for i in range(cfg.num_layers) for n in per_layer}


#: Tensors a checkpoint may hold beyond the mapping, ignored: RoPE's inverse frequencies, a buffer some older
#: checkpoints saved, which jaxpt computes from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def check_tensor_names(tensors: SafetensorsFolder, cfg) -> None:
    """The checkpoint holds exactly the tensors a model of ``cfg`` maps (:func:`expected_tensor_names`), apart from
    RoPE frequency buffers and, with tied embeddings, an ``lm_head.weight`` equal to the embedding (compared a block
    of rows at a time).

    Raises:
      ConvertError: naming the tensors the mapping would drop (a bias, a norm, a layer more than
        ``num_hidden_layers``, ...) or the ones it needs and the checkpoint lacks (at most five of each, and the count).
    """
    want, have = expected_tensor_names(cfg), set(tensors.names())
    extra = {n for n in have - want if not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_embeddings and "lm_head.weight" in extra and _same_tensor(tensors, "lm_head.weight",
                                                                        "model.embed_tokens.weight"):
        extra.discard("lm_head.weight")
    missing = want - have
    def show(names):
        return ", ".join(sorted(names)[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
    if extra:
        raise ConvertError(f"{tensors.folder}: {len(extra)} tensor(s) that the config.json does not announce and "
                           f"jaxpt would drop: {show(extra)} (biases need attention_bias / a family with them; "
                           "tie_word_embeddings needs lm_head equal to embed_tokens)")
    if missing:
        raise ConvertError(f"{tensors.folder}: {len(missing)} tensor(s) the config.json implies are missing: "
                           f"{show(missing)}")


def _same_tensor(tensors: SafetensorsFolder, a: str, b: str, rows: int = 4096) -> bool:
    x, y = tensors.get(a), tensors.get(b)
    if x.shape != y.shape:
        return False
    return all(np.array_equal(x[i:i + rows], y[i:i + rows]) for i in range(0, x.shape[0], rows))


class _Stacked:
    """A lazy ``[num_layers, ...]`` stack of per-layer views (the scanned layout), sliced before it is read."""

    def __init__(self, views: Sequence[Callable[[], np.ndarray]]):
        self.views = views
        first = views[0]()
        self.shape, self.dtype = (len(views), *first.shape), first.dtype

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        layers = range(len(self.views))[index[0]]
        return np.stack([self.views[i]()[index[1:]] for i in layers])


def hf_source(tensors: SafetensorsFolder, cfg, names: tuple) -> Any:
    """The HF tensor (a numpy view, or a lazy stack for scanned layers) behind the jaxpt param at ``names``
    (its path in the model's ``nnx.State``, e.g. ``('blocks', 3, 'attn', 'wq')``).

    Raises:
      ConvertError: the tensor is missing, or a param jaxpt has and HF does not.
    """
    if names == ("embedding",):
        return tensors.get("model.embed_tokens.weight")
    if names == ("output",):
        return tensors.get("lm_head.weight").T
    if names == ("final_norm", "scale"):
        return tensors.get("model.norm.weight")
    if names[0] == "blocks":
        if cfg.scan_layers:
            return _Stacked([_hf_layer_views(tensors, cfg, i)[names[1:]] for i in range(cfg.num_layers)])
        return _hf_layer_views(tensors, cfg, int(names[1]))[names[2:]]()
    raise ConvertError(f"jaxpt param {'.'.join(map(str, names))} has no Hugging Face counterpart")


def load_hf_params(tensors: SafetensorsFolder, cfg, mesh, rules):
    """The model's params (an ``nnx.State`` of jax.Arrays, ``cfg.param_dtype``) read from ``tensors`` straight
    into their shardings on ``mesh`` (``rules``: logical-axis rules): each device's block is cut from the
    memory-mapped tensor and cast on the host (see the module docstring).

    Raises:
      ConvertError: a tensor is missing or of another shape than ``cfg`` implies.
    """
    import jax
    from flax import nnx


    _, abs_params = state_lib.abstract_model(cfg)
    shardings = state_lib.param_shardings(abs_params, mesh, rules)
    dtype = np.dtype(cfg.jnp_param_dtype)

    def place(path, var, sharding):
        names = _param_path_names(path)
        names = names[:-1] if names[-1] == "value" else names
        src = hf_source(tensors, cfg, names)
        if tuple(src.shape) != tuple(var.shape):
            raise ConvertError(f"{'.'.join(map(str, names))}: the checkpoint's tensor has shape {tuple(src.shape)} "
                               f"in jaxpt's layout, the config implies {tuple(var.shape)}")
        return jax.make_array_from_callback(var.shape, sharding.get_value() if isinstance(sharding, nnx.Variable)
                                            else sharding, lambda idx: np.asarray(src[idx], dtype=dtype))

    return jax.tree_util.tree_map_with_path(
        lambda p, v, s: v.replace(place(p, v, s)), abs_params, shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable))


def hf_tensors_from_params(params, cfg) -> dict[str, np.ndarray]:
    """The HF state-dict tensors (float32 numpy, HF layout, names as :func:`expected_tensor_names`) of jaxpt params
    (an ``nnx.State``, any sharding; gathered to the host a tensor at a time). Under µP the output multiplier is
    folded into ``lm_head`` (the HF model then computes the same logits with no multiplier)."""
    import jax
    from flax import nnx

    flat = {}
    for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = _param_path_names(path)
        names = names[:-1] if names[-1] == "value" else names
        flat[names] = v
    get = lambda names: np.asarray(jax.device_get(flat[names][...]), np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": get(("embedding",)), "model.norm.weight": get(("final_norm", "scale"))}
    if not cfg.tie_embeddings:  # µP's 1/m logit multiplier folded in (jaxpt.model.parametrization)
        out["lm_head.weight"] = get(("output",)).T * np.float32(parametrization.output_multiplier(cfg))
    table = _layer_tensors(cfg)
    for names, m in table.items():
        stacked = get(("blocks", *names)) if cfg.scan_layers else None
        for i in range(cfg.num_layers):
            a = stacked[i] if cfg.scan_layers else get(("blocks", i, *names))
            out[f"model.layers.{i}.{m.hf_name}"] = m.to_hf(a)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------ the commands


def _converted_config(cfg, tokenizer_path: str, document_boundary: str = "eos"):
    """A TrainConfig with the converted model (and tokenizer path and the base's document-boundary policy), via gin
    as every run's config is built."""
    bindings = [f"ModelConfig.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]
    if tokenizer_path:
        bindings.append(f"DataConfig.tokenizer_path = {tokenizer_path!r}")
    bindings.append(f"DataConfig.document_boundary = {document_boundary!r}")
    if config_lib.TrainConfig.seq_len > cfg.max_seq_len:  # a short-context base: rows no longer than it attends
        bindings.append(f"TrainConfig.seq_len = {cfg.max_seq_len}")
    return config_lib.parse([], bindings)


#: A base model's document-boundary convention by ``model_type``, used when its tokenizer files do not say
#: (``tokenizer_config.json``'s ``add_bos_token``, or a ``tokenizer.json`` post-processor, say first): Llama and
#: Mistral tokenizers put BOS before every text (``LlamaTokenizer``'s ``add_bos_token`` defaults to True) and their
#: pretraining documents end with EOS; Qwen's add nothing and its documents end with ``<|endoftext|>``.
FAMILY_BOUNDARY = {"llama": "bos_eos", "mistral": "bos_eos", "qwen2": "eos", "qwen3": "eos"}


def _base_tokenizer(local_dir: str, output: str, model_type: str):
    """The base model's tokenizer copied into ``output`` (or None when the folder has none) and its
    document-boundary policy (module docstring).

    Raises:
      ConvertError: a tokenizer file that cannot be loaded (for a ``tokenizer.json``: no EOS named, naming the file
        and what to add), or a copy that does not load with the same sha256.
    """
    names = [n for n in ("tokenizer.model", "tokenizer.json") if os.path.isfile(os.path.join(local_dir, n))]
    family = FAMILY_BOUNDARY.get(model_type, "eos")
    if not names:
        return None, family
    try:
        source = Tokenizer.load(os.path.join(local_dir, names[0]))
    except ValueError as e:
        raise ConvertError(f"--model {local_dir}: {e}") from None
    config = os.path.join(local_dir, "tokenizer_config.json")
    said = source.kind == "huggingface"
    if not said and os.path.isfile(config):
        try:
            said = isinstance(json.loads(fs.read_text(config)).get("add_bos_token"), bool)
        except (ValueError, AttributeError):
            said = False
    adds_bos = (source.adds_bos if said else family == "bos_eos") and source.bos_id >= 0
    copied = Tokenizer.load(source.write(output))
    if copied.sha256 != source.sha256:
        raise ConvertError(f"--model {local_dir}: the tokenizer copied into {output} loads as another tokenizer "
                           f"(sha256 {copied.sha256[:12]}, the source's {source.sha256[:12]})")
    return copied, "bos_eos" if adds_bos else "eos"


def write_params_checkpoint(output: str, train_cfg, params, mesh, tokenizer, source: Mapping[str, Any]) -> None:
    """Save ``params`` (an ``nnx.State`` of ``train_cfg.model``) as the params-only jaxpt checkpoint of step
    :data:`CONVERTED_STEP` under ``output/checkpoints`` (its meta: the operative config, the model, the tokenizer's
    path and sha256 or None, ``params_only: True`` and ``source``), and ``output/model.gin``: the model's settings
    and the tokenizer path, to pass as ``--config`` to a continued run."""
    import orbax.checkpoint as ocp


    cfg = train_cfg.model
    text = config_lib.operative_config_str(train_cfg)
    meta = {
        "config_gin": text, "model": dataclasses.asdict(cfg), "mesh": mesh_lib.mesh_shape(mesh),
        "model_layout": {"scan_layers": cfg.scan_layers},
        "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256} if tokenizer else None,
        "params_only": True, "source": dict(source),
        "libraries": ckpt_lib.library_versions(), "config_fields": config_lib.config_fields(),
    }
    state = {"step": np.asarray(CONVERTED_STEP, np.int32), "params": params}
    manager = ocp.CheckpointManager(fs.join(output, "checkpoints"), item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(create=True,
                                                                         enable_async_checkpointing=False))
    manager.save(CONVERTED_STEP, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()
    manager.close()
    model_lines = [ln for ln in text.splitlines() if ln.startswith("ModelConfig.")]
    gin_text = (f"# Converted from {source.get('path')} by jaxpt.tools.convert.\n"
                f"# Continue pretraining from it: --gin \"TrainConfig.init_from = '{output}'\"\n"
                + "\n".join(model_lines) + "\n")
    if tokenizer:
        gin_text += f"DataConfig.tokenizer_path = {str(tokenizer.path)!r}\n"
    if train_cfg.seq_len != config_lib.TrainConfig.seq_len:
        gin_text += (f"# Rows no longer than the model's context (the default, {config_lib.TrainConfig.seq_len}, "
                     "is longer)\n" f"TrainConfig.seq_len = {train_cfg.seq_len}\n")
    policy = train_cfg.data.document_boundary
    gin_text += (f"# The base model's document boundaries ({_POLICY_WORDS[policy]}); jaxpt.data.boundary.\n"
                 f"DataConfig.document_boundary = {policy!r}\n")
    fs.write_text_atomic(fs.join(output, "model.gin"), gin_text)


_POLICY_WORDS = {"eos": "EOS after each document", "bos": "BOS before each document",
                 "bos_eos": "BOS before and EOS after each document", "none": "no special token around documents"}


def hf_to_jaxpt(model_dir: str | os.PathLike, output: str | os.PathLike, *, mesh=None, max_seq_len: int = 0,
                scan_layers: bool = False) -> str:
    """Convert the HF folder ``model_dir`` into ``output`` (module docstring). Returns ``output`` (absolute).

    Args:
      mesh: where the params are placed while converting (a ``jax.sharding.Mesh`` or sizes such as
        ``"fsdp=8"``); default ``fsdp`` over every device (each device holds 1/N of each tensor).
      max_seq_len, scan_layers: as :func:`model_config_from_hf`.

    ``model_dir`` and ``output`` may be local or ``gs://`` (module docstring: a remote ``model_dir`` is read from
    a per-host local copy, :func:`jaxpt.util.fs.local_tree`).

    Raises:
      ConvertError: an untranslatable config (:func:`model_config_from_hf`), a missing or misshapen tensor, or
        an ``output`` that already holds checkpoints.
      FileNotFoundError: no ``config.json`` in ``model_dir``.
    """
    import jax


    model_dir, output = fs.absolute(os.fspath(model_dir)), fs.absolute(os.fspath(output))
    if not fs.isfile(fs.join(model_dir, "config.json")):
        raise FileNotFoundError(f"--model {model_dir}: no config.json")
    try:
        hf = json.loads(fs.read_text(fs.join(model_dir, "config.json")))
    except ValueError as e:
        raise ConvertError(f"--model {model_dir}: config.json is not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConvertError(f"--model {model_dir}: config.json is not a JSON object")
    local_dir = fs.local_tree(model_dir)  # safetensors are memory-mapped: a local file (module docstring)
    tensors = SafetensorsFolder(local_dir)
    cfg = model_config_from_hf(hf, max_seq_len=max_seq_len, scan_layers=scan_layers, tensors=tensors)
    ckpts = fs.join(output, "checkpoints")
    if fs.isdir(ckpts) and fs.listdir(ckpts):
        raise ConvertError(f"--output {output}: already holds checkpoints/")
    fs.makedirs(output)
    tokenizer, policy = _base_tokenizer(local_dir, output, hf["model_type"])
    train_cfg = _converted_config(cfg, str(tokenizer.path) if tokenizer else "", policy)
    if not isinstance(mesh, jax.sharding.Mesh):
        mesh = mesh_lib.mesh_from_config(mesh or {"fsdp": jax.device_count()})
    params = load_hf_params(tensors, cfg, mesh, train_cfg.logical_axis_rules)
    write_params_checkpoint(output, train_cfg, params, mesh, tokenizer,
                            source={"format": "huggingface", "path": model_dir, "model_type": hf["model_type"]})
    return output


def _tokenizer_files(tokenizer, output: str, max_len: int, document_boundary: str = "eos") -> None:
    """The run's tokenizer as ``AutoTokenizer`` loads it, giving jaxpt's ids (``add_special_tokens=False``), with
    BOS added to every text (``add_special_tokens=True``) iff the run's ``document_boundary`` puts BOS at a
    document's start (``add_bos_token``; EOS is never added: a prompt does not end a document).

    SentencePiece: the model and a ``tokenizer_config.json`` that loads it as a ``LlamaTokenizer`` with jaxpt's
    special tokens and the model's own dummy-prefix setting (``add_prefix_space``; transformers adds one by
    default); transformers converts it without the model's normalizer, as jaxpt encodes it
    (:mod:`jaxpt.data.tokenizer`). Known difference: jaxpt escapes a literal U+2581 in the text to its three byte
    pieces (lossless), which transformers' converted tokenizer reads as a space; ids jaxpt produced decode the same
    in both. Hugging Face ``tokenizer.json``: the file, its post-processor set to the policy's BOS, and a
    ``tokenizer_config.json`` naming the special tokens (:meth:`jaxpt.data.hf_tokenizer.HFTokenizer.write`)."""
    add_bos = "bos" in document_boundary and tokenizer.bos_id >= 0
    if tokenizer.kind == "huggingface":
        tokenizer.write(output, add_bos_token=add_bos, model_max_length=max_len)
        return
    from sentencepiece import sentencepiece_model_pb2
    proto = fs.read_bytes(os.fspath(tokenizer.path))  # the path may be gs:// (an epath.Path)
    dummy_prefix = sentencepiece_model_pb2.ModelProto.FromString(proto).normalizer_spec.add_dummy_prefix
    with open(os.path.join(output, "tokenizer.model"), "wb") as f:
        f.write(proto)
    piece = lambda i: tokenizer.id_to_piece(i) if i >= 0 else None  # noqa: E731
    special = {"bos_token": piece(tokenizer.bos_id), "eos_token": piece(tokenizer.eos_id),
               "unk_token": piece(tokenizer.unk_id), "pad_token": piece(tokenizer.pad_id)}
    special = {k: v for k, v in special.items() if v is not None}
    with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "add_eos_token": False,
                   "legacy": False, "add_prefix_space": bool(dummy_prefix), "clean_up_tokenization_spaces": False,
                   "model_max_length": max_len, **special}, f, indent=1)
    with open(os.path.join(output, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=1)


def jaxpt_to_hf(workdir: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
                max_shard_bytes: int = 5 << 30) -> str:
    """Write the checkpoint ``<workdir>/checkpoints/<step>`` (newest committed by default) as an HF folder of the
    model's family (:func:`export_family`; its recorded source read from the checkpoint's meta and the run's
    ``run.json``) in float32 (module docstring). Returns ``output`` (absolute).

    Tensors are gathered to the host one at a time and written in files of at most ``max_shard_bytes``
    (several files get ``model.safetensors.index.json``).

    ``workdir`` and ``output`` may be local or ``gs://``: a remote ``output`` is written into a local temporary
    directory, then each file is uploaded through :mod:`jaxpt.util.fs` (and the temporary directory removed).

    Raises:
      CheckpointError: as :func:`jaxpt.restore`. ConvertError: as :func:`export_family`.
    """

    output = fs.absolute(os.fspath(output))
    r = restore(workdir, step)
    cfg = r.config.model
    hf = hf_config_from_model(cfg, r.tokenizer, source_model_type(r.meta, _run_stages(os.fspath(workdir))))
    if not fs.is_remote(output):
        os.makedirs(output, exist_ok=True)
        _write_hf_folder(r, cfg, hf, output, max_shard_bytes)
        return output
    import tempfile
    with tempfile.TemporaryDirectory(prefix="jaxpt-export-") as tmp:
        _write_hf_folder(r, cfg, hf, tmp, max_shard_bytes)
        fs.copytree(tmp, output)
    return output


def _run_stages(workdir: str) -> list:
    """The ``stages`` of ``workdir``'s ``run.json`` (:mod:`jaxpt.run.lineage`), or [] (none, or unreadable)."""
    try:
        stages = json.loads(fs.read_text(fs.join(workdir, lineage.RUN_FILE))).get("stages")
    except (OSError, ValueError, AttributeError):
        return []
    return [s for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []


def _write_hf_folder(r, cfg, hf: Mapping[str, Any], output: str, max_shard_bytes: int) -> None:
    """The HF folder of the restored run ``r`` written into the local directory ``output``."""
    tensors = hf_tensors_from_params(r.params, cfg)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    if len(shards) == 1:
        write_safetensors(os.path.join(output, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(output, fname), shard)
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                       "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    with open(os.path.join(output, "generation_config.json"), "w") as f:
        json.dump({k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}, f, indent=1)
    if r.tokenizer.path is not None:
        _tokenizer_files(r.tokenizer, output, cfg.max_seq_len, r.config.data.document_boundary)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.convert`` (subcommands ``hf-to-jaxpt``, ``jaxpt-to-hf``)."""
    parser = argparse.ArgumentParser(prog="python -m jaxpt.tools.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-jaxpt", help="an HF Llama/Mistral/Qwen2/Qwen3 folder -> a jaxpt checkpoint + model.gin")
    a.add_argument("--model", required=True, help="folder with config.json and *.safetensors (local or gs://)")
    a.add_argument("--output", required=True, help="jaxpt checkpoint folder to write (local or gs://)")
    a.add_argument("--mesh", default=None, help="e.g. fsdp=8 (default: fsdp over all devices)")
    cli.add_flag(a, "--max-seq-len", "--max_seq_len", type=int, default=0, help="default: max_position_embeddings")
    cli.add_flag(a, "--scan-layers", "--scan_layers", action="store_true",
                 help="stacked-layers layout (ModelConfig.scan_layers)")
    b = sub.add_parser("jaxpt-to-hf", help="a jaxpt run's checkpoint -> a transformers-loadable folder")
    b.add_argument("--workdir", required=True)
    b.add_argument("--step", type=int, default=None)
    b.add_argument("--output", required=True, help="local or gs:// (written locally, then uploaded)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status (2: bad input)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-jaxpt":
            out = hf_to_jaxpt(args.model, args.output, mesh=args.mesh, max_seq_len=args.max_seq_len,
                              scan_layers=args.scan_layers)
        else:
            out = jaxpt_to_hf(args.workdir, args.output, step=args.step)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
