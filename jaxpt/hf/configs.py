"""``config.json`` to :class:`jaxpt.model.ModelConfig` and back, per family (:mod:`jaxpt.hf.families`):
what each reads beyond the Llama layout, what is refused (:class:`jaxpt.hf.families.ConvertError`, naming the
key), and the family an export is written as.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from jaxpt.hf.families import ARCHITECTURES, FAMILIES, UNSUPPORTED, ConvertError, Family
from jaxpt.hf.params import check_tensor_names
from jaxpt.hf.safetensors import SafetensorsFolder
from jaxpt.model import ModelConfig, parametrization



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
      hf: the parsed ``config.json`` of a family in :data:`jaxpt.hf.families.FAMILIES`.
      max_seq_len: the model's ``max_seq_len``; 0: ``max_position_embeddings`` (capped by a sliding window, within
        which full causal attention equals sliding-window attention).
      scan_layers: the stacked-layers layout (``ModelConfig.scan_layers``).
      tensors: the checkpoint's tensors, whose names must be exactly those the config implies
        (:func:`jaxpt.hf.params.check_tensor_names`: a bias or a norm the config does not announce is refused,
        not dropped).

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
