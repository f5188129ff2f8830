"""Hugging Face checkpoints in and out: ``python -m jaxpt.tools.convert hf-to-jaxpt | jaxpt-to-hf``.

    python -m jaxpt.tools.convert hf-to-jaxpt --model PATH --output DIR [--mesh fsdp=8] [--scan-layers]
        [--max-seq-len N]
    python -m jaxpt.tools.convert jaxpt-to-hf --workdir RUN [--step N] --output DIR

``hf-to-jaxpt`` reads a Llama-family folder (``config.json`` and ``*.safetensors``; ``model_type`` ``llama``,
``mistral`` or ``qwen2``) into ``DIR``: a jaxpt checkpoint at step 0 holding the params only
(``DIR/checkpoints/0``; read by :func:`jaxpt.restore` and by ``TrainConfig.init_from = 'DIR'`` for continued
pretraining, :mod:`jaxpt.run.lineage`), the matching gin config ``DIR/model.gin`` and, when the folder has a
SentencePiece ``tokenizer.model``, a copy of it (``DIR/tokenizer.model``, named by the gin config).
``jaxpt-to-hf`` writes a run's checkpoint as a folder ``transformers`` loads with ``LlamaForCausalLM``
(``config.json``, ``model.safetensors`` or shards with their index, ``generation_config.json`` and the
SentencePiece tokenizer with its ``tokenizer_config.json``).

Layout (HF Llama, ``modeling_llama.py``; ``y = x W^T``, ``W`` stored ``[out, in]``):

================================  =================================  ==============================
HF tensor                          shape                              jaxpt param
================================  =================================  ==============================
``model.embed_tokens.weight``      [V, D]                             ``embedding`` [V, D]
``layers.i.self_attn.q_proj``      [H Hd, D]                          ``attn.wq`` [D, H, Hd]
``layers.i.self_attn.k_proj/v``    [K Hd, D]                          ``attn.wk/wv`` [D, K, Hd]
``layers.i.self_attn.o_proj``      [D, H Hd]                          ``attn.wo`` [H, Hd, D]
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

What is refused (:class:`ConvertError`, naming the config key): an architecture other than the three, an
activation other than SiLU, attention or MLP biases (Qwen2 always has q/k/v biases, which jaxpt's attention
does not have), a sliding window shorter than the context kept, a RoPE type jaxpt does not compute; on export,
a mixture-of-experts model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxpt import checkpoint as ckpt_lib, config as config_lib, mesh as mesh_lib
from jaxpt.checkpoint import CheckpointError
from jaxpt.data.tokenizer import Tokenizer
from jaxpt.infer.restore import restore
from jaxpt.model import ModelConfig
from jaxpt.training import state as state_lib
from jaxpt.util import cli, fs
from jaxpt.util.errors import ConfigError

#: ``model_type`` values read by :func:`model_config_from_hf`.
ARCHITECTURES = ("llama", "mistral", "qwen2")
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
      hf: the parsed ``config.json``.
      max_seq_len: the model's ``max_seq_len``; 0: ``max_position_embeddings`` (capped by a Mistral
        ``sliding_window``, within which full causal attention equals sliding-window attention).
      scan_layers: the stacked-layers layout (``ModelConfig.scan_layers``).
      tensors: the checkpoint's tensors, to refuse biases the config does not announce (Qwen2).

    Raises:
      ConvertError: naming the HF key: an unknown ``model_type``, ``hidden_act`` other than silu,
        ``attention_bias``/``mlp_bias`` or bias tensors, a sliding window below ``max_seq_len``, or a RoPE type
        jaxpt does not compute.
    """

    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConvertError(f"config.json model_type = {kind!r}: jaxpt reads {ARCHITECTURES} (Llama-family)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConvertError(f"config.json hidden_act = {act!r}: jaxpt's MLP is SwiGLU (silu)")
    has_qkv_bias = kind == "qwen2" or bool(hf.get("attention_bias"))
    if tensors is not None:
        has_qkv_bias |= any(n.endswith("self_attn.q_proj.bias") for n in tensors.names())
    if has_qkv_bias:
        raise ConvertError(f"config.json model_type = {kind!r} / attention_bias: the checkpoint has q/k/v "
                           "projection biases (Qwen2 always does); jaxpt's attention has none, so it is refused "
                           "rather than converted with the biases dropped")
    if hf.get("mlp_bias"):
        raise ConvertError("config.json mlp_bias = True: jaxpt's MLP has no biases")
    D, H = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    head_dim = _int(hf, "head_dim", D // H)
    max_pos = _int(hf, "max_position_embeddings", 4096)
    window = _int(hf, "sliding_window", None) if hf.get("use_sliding_window", True) else None
    L = max_seq_len or (min(max_pos, window) if window else max_pos)
    if window and L > int(window):
        raise ConvertError(f"config.json sliding_window = {window}: jaxpt attends over the whole row, which equals "
                           f"sliding-window attention only up to {window} tokens; --max-seq-len {L} is longer")
    return ModelConfig(
        vocab_size=_int(hf, "vocab_size"), d_model=D, num_layers=_int(hf, "num_hidden_layers"), num_heads=H,
        num_kv_heads=_int(hf, "num_key_value_heads", H), head_dim=head_dim,
        mlp_dim=_int(hf, "intermediate_size"), max_seq_len=L, norm_eps=_float(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), scan_layers=scan_layers,
        **_checked_rope(hf))


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


def hf_config_from_model(cfg, tokenizer=None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to a jaxpt :class:`ModelConfig` (float32).

    RoPE is written both as transformers 5's ``rope_parameters`` and as 4.x's ``rope_theta``/``rope_scaling``.

    Raises:
      ConvertError: a mixture-of-experts model (``ModelConfig.mlp``).
    """
    if cfg.mlp != "swiglu":
        raise ConvertError(f"ModelConfig.mlp = {cfg.mlp!r}: only the dense SwiGLU model exports as LlamaForCausalLM")
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
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": "float32", "dtype": "float32",
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling == "none" else legacy,
        "rope_parameters": rope, "use_cache": True,
    }
    if tokenizer is not None:
        out.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                   pad_token_id=tokenizer.pad_id if tokenizer.pad_id >= 0 else None)
    return out


# ------------------------------------------------------------------------------------------ the mapping


def _param_path_names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def _hf_layer_views(tensors: SafetensorsFolder, cfg, layer: int) -> dict[str, Callable[[], np.ndarray]]:
    """Per block param name -> a thunk giving the HF tensor as a numpy *view* in jaxpt's layout."""
    D, H, K, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = f"model.layers.{layer}."
    g = tensors.get
    return {
        ("attn", "wq"): lambda: g(p + "self_attn.q_proj.weight").reshape(H, Hd, D).transpose(2, 0, 1),
        ("attn", "wk"): lambda: g(p + "self_attn.k_proj.weight").reshape(K, Hd, D).transpose(2, 0, 1),
        ("attn", "wv"): lambda: g(p + "self_attn.v_proj.weight").reshape(K, Hd, D).transpose(2, 0, 1),
        ("attn", "wo"): lambda: g(p + "self_attn.o_proj.weight").reshape(D, H, Hd).transpose(1, 2, 0),
        ("mlp", "w_gate"): lambda: g(p + "mlp.gate_proj.weight").T,
        ("mlp", "w_up"): lambda: g(p + "mlp.up_proj.weight").T,
        ("mlp", "w_down"): lambda: g(p + "mlp.down_proj.weight").T,
        ("attn_norm", "scale"): lambda: g(p + "input_layernorm.weight"),
        ("mlp_norm", "scale"): lambda: g(p + "post_attention_layernorm.weight"),
    }


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
    """HF ``LlamaForCausalLM`` state-dict tensors (float32 numpy, HF layout) from jaxpt params (an
    ``nnx.State``, any sharding; gathered to the host a tensor at a time)."""
    import jax
    from flax import nnx

    D, H, K, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    flat = {}
    for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = _param_path_names(path)
        names = names[:-1] if names[-1] == "value" else names
        flat[names] = v
    get = lambda names: np.asarray(jax.device_get(flat[names][...]), np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": get(("embedding",)), "model.norm.weight": get(("final_norm", "scale"))}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get(("output",)).T
    for i in range(cfg.num_layers):
        def layer(*names):
            return get(("blocks", *names))[i] if cfg.scan_layers else get(("blocks", i, *names))
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = layer("attn", "wq").reshape(D, H * Hd).T
        out[p + "self_attn.k_proj.weight"] = layer("attn", "wk").reshape(D, K * Hd).T
        out[p + "self_attn.v_proj.weight"] = layer("attn", "wv").reshape(D, K * Hd).T
        out[p + "self_attn.o_proj.weight"] = layer("attn", "wo").reshape(H * Hd, D).T
        out[p + "mlp.gate_proj.weight"] = layer("mlp", "w_gate").T
        out[p + "mlp.up_proj.weight"] = layer("mlp", "w_up").T
        out[p + "mlp.down_proj.weight"] = layer("mlp", "w_down").T
        out[p + "input_layernorm.weight"] = layer("attn_norm", "scale")
        out[p + "post_attention_layernorm.weight"] = layer("mlp_norm", "scale")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------ the commands


def _converted_config(cfg, tokenizer_path: str):
    """A TrainConfig with the converted model (and tokenizer path), via gin as every run's config is built."""
    bindings = [f"ModelConfig.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]
    if tokenizer_path:
        bindings.append(f"DataConfig.tokenizer_path = {tokenizer_path!r}")
    return config_lib.parse([], bindings)


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
    fs.write_text_atomic(fs.join(output, "model.gin"), gin_text)


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
    tokenizer, tok_path = None, ""
    if os.path.exists(os.path.join(local_dir, "tokenizer.model")):
        tok_path = fs.join(output, "tokenizer.model")
        fs.copy(os.path.join(local_dir, "tokenizer.model"), tok_path)
        tokenizer = Tokenizer.load(tok_path)
    train_cfg = _converted_config(cfg, tok_path)
    if not isinstance(mesh, jax.sharding.Mesh):
        mesh = mesh_lib.mesh_from_config(mesh or {"fsdp": jax.device_count()})
    params = load_hf_params(tensors, cfg, mesh, train_cfg.logical_axis_rules)
    write_params_checkpoint(output, train_cfg, params, mesh, tokenizer,
                            source={"format": "huggingface", "path": model_dir, "model_type": hf["model_type"]})
    return output


def _tokenizer_files(tokenizer, output: str, max_len: int) -> None:
    """The SentencePiece model and the ``tokenizer_config.json`` that makes ``AutoTokenizer`` load it as a
    ``LlamaTokenizer`` adding no BOS/EOS (jaxpt's ``Tokenizer.encode`` default), with jaxpt's special tokens and
    the model's own dummy-prefix setting (``add_prefix_space``; transformers adds one by default).

    Known difference: jaxpt escapes a literal U+2581 in the text to its three byte pieces (lossless), which
    transformers' converted tokenizer reads as a space; ids jaxpt produced decode the same in both."""
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
        json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                   "legacy": False, "add_prefix_space": bool(dummy_prefix), "clean_up_tokenization_spaces": False,
                   "model_max_length": max_len, **special}, f, indent=1)
    with open(os.path.join(output, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=1)


def jaxpt_to_hf(workdir: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
                max_shard_bytes: int = 5 << 30) -> str:
    """Write the checkpoint ``<workdir>/checkpoints/<step>`` (newest committed by default) as an HF
    ``LlamaForCausalLM`` folder in float32 (module docstring). Returns ``output`` (absolute).

    Tensors are gathered to the host one at a time and written in files of at most ``max_shard_bytes``
    (several files get ``model.safetensors.index.json``).

    ``workdir`` and ``output`` may be local or ``gs://``: a remote ``output`` is written into a local temporary
    directory, then each file is uploaded through :mod:`jaxpt.util.fs` (and the temporary directory removed).

    Raises:
      CheckpointError: as :func:`jaxpt.restore`. ConvertError: a model that is not a dense Llama.
    """

    output = fs.absolute(os.fspath(output))
    r = restore(workdir, step)
    cfg = r.config.model
    hf = hf_config_from_model(cfg, r.tokenizer)
    if not fs.is_remote(output):
        os.makedirs(output, exist_ok=True)
        _write_hf_folder(r, cfg, hf, output, max_shard_bytes)
        return output
    import tempfile
    with tempfile.TemporaryDirectory(prefix="jaxpt-export-") as tmp:
        _write_hf_folder(r, cfg, hf, tmp, max_shard_bytes)
        fs.copytree(tmp, output)
    return output


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
        _tokenizer_files(r.tokenizer, output, cfg.max_seq_len)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.convert`` (subcommands ``hf-to-jaxpt``, ``jaxpt-to-hf``)."""
    parser = argparse.ArgumentParser(prog="python -m jaxpt.tools.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-jaxpt", help="an HF Llama/Mistral folder -> a jaxpt checkpoint + model.gin")
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
