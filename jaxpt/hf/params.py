"""The tensor mapping between a Hugging Face checkpoint and jaxpt's params, one table both ways (the layout
table of :mod:`jaxpt.hf`), and the sharded load: each device's block read from a memory map.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from jaxpt.hf.families import ConvertError
from jaxpt.hf.safetensors import SafetensorsFolder
from jaxpt.model import parametrization
from jaxpt.training import state as state_lib



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
    The one table both directions and :func:`check_tensor_names` read; its rows are :mod:`jaxpt.hf`'s layout table."""
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
    memory-mapped tensor and cast on the host (:mod:`jaxpt.hf`).

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
