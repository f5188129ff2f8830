"""Defend a model size, a token count and a layout with numbers before a run; its command line is
``python -m jaxpt.tools.plan``.

Three questions, three parts of this module:

1. **How big, how long?** From a compute budget ``C`` in FLOPs (``--flops``), a parameter count
   (``--params``) or a model config (``--config``), the compute-optimal parameters ``N`` and tokens ``D``:

   * *Chinchilla rule* (the headline): ``D = 20 N`` and ``C = 6 N D``, so ``N = sqrt(C / 120)``. This is
     what Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", arXiv:2203.15556)
     tabulate in Table 3 from their approaches 1 and 2 (e.g. 67B params / 1.5T tokens for 5.76e23 FLOPs,
     Chinchilla itself is 70B / 1.4T), where N and D grow as ``C^0.5`` each.
   * *Approach 3* (Hoffmann et al. sec. 3.3, eq. 2 and 4): minimise the parametric loss
     ``L(N, D) = E + A / N^alpha + B / D^beta`` (E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28) under
     ``C = 6 N D``. The closed form is ``N_opt = G (C/6)^a``, ``D_opt = (C/6)^b / G`` with
     ``G = (alpha A / (beta B))^(1 / (alpha + beta))``, ``a = beta / (alpha + beta)``,
     ``b = alpha / (alpha + beta)``. With the published constants it gives *smaller* models on more
     tokens than the rule (about 33B params / 2.9T tokens at 5.76e23, ``a ~ 0.45``): the paper itself
     reports approach 3 as the outlier of its three methods (Table 2), and Besiroglu et al. 2024
     ("Chinchilla Scaling: A replication attempt", arXiv:2404.10102) trace it to the fit. We print it for
     contrast, never as the headline.
   * *Kaplan et al. 2020* ("Scaling Laws for Neural Language Models", arXiv:2001.08361, fig. 14 and
     sec. 6.1): ``N_opt = 1.3e9 * C_min^0.73`` with ``C_min`` in PF-days (8.64e19 FLOPs) and ``N`` counting
     non-embedding parameters; ``D = C / 6N``. It puts far more of the budget into parameters.

   Training FLOPs are ``6 N D`` (Kaplan et al. sec. 2.1); with a model config they are
   :func:`jaxpt.training.flops.flops_per_token` times ``D`` (matmul params plus causal attention, the MFU
   convention), and ``6 N D`` with total ``N`` is printed beside it. Wall-clock days on a named slice
   (``--hardware v5p-256 --mfu 0.45``) are ``FLOPs / (chips * peak * MFU) / 86400``.

2. **Does it fit?** :func:`estimate_memory` gives per-device bytes for params, gradients, AdamW state,
   activations saved for the backward pass under the remat policy, and the logits buffers, each divided
   by the mesh axes its logical axes are sharded over (the same rules :mod:`jaxpt.mesh` applies), and
   compares the total with the device's memory.

   With ``--rules FILE`` (fitted by ``python -m jaxpt.tools.scaling rules`` on a learning-rate x batch-size x compute
   grid, :mod:`jaxpt.lab.rules`; DeepSeek-AI 2024, sec. 3.1), it also prints the rules' peak learning rate and
   global batch (tokens; rows with ``--config``) at the planned compute, the compute range they were fitted on, and
   whether the plan is an extrapolation beyond it.

3. Layout throughput is measured, not estimated: see :mod:`jaxpt.tools.sweep`.

4. **How often to checkpoint?** From the job's mean time between failures ``M`` (``--mtbf-hours``) and the
   seconds one save blocks training ``delta`` (``--save-seconds``): Young's ``sqrt(2 delta M)`` (1974) and
   Daly's first-order ``sqrt(2 delta M) - delta`` (2006, the recommendation), the expected work lost per
   failure and the goodput at that interval, and at the configured ``CheckpointConfig.save_every_steps``
   (with ``--config`` and ``--step-seconds``).

Examples::

    python -m jaxpt.tools.plan --flops 5.76e23 --hardware v5p-256 --mfu 0.45
    python -m jaxpt.tools.plan --params 7e9 --json
    python -m jaxpt.tools.plan --config configs/quickstart.gin --mesh fsdp=-1 --hardware v5e-8
    python -m jaxpt.tools.plan --mtbf-hours 24 --save-seconds 30 --restart-seconds 300 --step-seconds 2
    python -m jaxpt.tools.plan --config configs/quickstart.gin --config configs/models/mixtral_8x7b.gin \
        --config configs/slices/v5p-128.gin --mesh expert=8,fsdp=-1 --hardware v5p-128

A mixture of experts (``ModelConfig.mlp = 'moe'``) counts its active params per token for FLOPs (and MFU),
all its expert params for memory, and gets an estimate of its all-to-all time on the slice for its
expert-parallel size (:func:`all_to_all_estimate`), to weigh before adopting it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from jaxpt import mesh as mesh_lib
from jaxpt.lab import rules as rules_lib
from jaxpt.model.decoder import count_params
from jaxpt.model.moe import expert_capacity
from jaxpt.run.resolve import resolve_vocab as resolve
from jaxpt.training import flops as flops_lib
from jaxpt.training.memory import DTYPE_BYTES, estimate_memory

#: FLOPs in one petaflop/s-day (Kaplan et al. 2020 use PF-days as the compute unit).
PF_DAY = 1e15 * 86400
#: Tokens per parameter of the compute-optimal rule (Hoffmann et al. 2022, Table 3: 70B on 1.4T).
TOKENS_PER_PARAM = 20.0
GIB = 2 ** 30


# --------------------------------------------------------------------------------------------------
# Compute-optimal allocation.


@dataclasses.dataclass(frozen=True)
class ParametricLoss:
    """``L(N, D) = E + A / N^alpha + B / D^beta`` (Hoffmann et al. 2022, eq. 2). Loss in nats per token.

    Defaults are the paper's approach-3 fit (sec. 3.3, eq. 4): E=1.69, A=406.4, B=410.7, alpha=0.34,
    beta=0.28, with ``N`` total parameters and ``D`` training tokens.
    """

    E: float = 1.69
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28

    def loss(self, n_params: float, n_tokens: float) -> float:
        """Predicted loss (nats/token) of ``n_params`` parameters trained on ``n_tokens`` tokens."""
        return self.E + self.A / n_params ** self.alpha + self.B / n_tokens ** self.beta

    @property
    def G(self) -> float:
        """``(alpha A / (beta B))^(1 / (alpha + beta))`` (Hoffmann et al. eq. 4)."""
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    @property
    def a(self) -> float:
        """Exponent of ``N_opt`` in ``C``: ``beta / (alpha + beta)``."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of ``D_opt`` in ``C``: ``alpha / (alpha + beta)``."""
        return self.alpha / (self.alpha + self.beta)

    def optimal(self, flops: float) -> tuple[float, float]:
        """``(N_opt, D_opt)`` minimising :meth:`loss` subject to ``6 N D = flops`` (closed form, eq. 4)."""
        c6 = flops / 6.0
        return self.G * c6 ** self.a, c6 ** self.b / self.G

    def budget_for_params(self, n_params: float) -> float:
        """The FLOPs for which ``n_params`` is the optimal size: inverts ``N_opt = G (C/6)^a``."""
        return 6.0 * (n_params / self.G) ** (1.0 / self.a)


#: Hoffmann et al. 2022 approach-3 constants.
CHINCHILLA = ParametricLoss()


def chinchilla_rule(flops: float, tokens_per_param: float = TOKENS_PER_PARAM) -> tuple[float, float]:
    """``(N, D)`` with ``D = r N`` and ``6 N D = flops``, i.e. ``N = sqrt(flops / (6 r))``.

    The ~20 tokens-per-parameter rule read off Hoffmann et al. 2022, Table 3 (approaches 1 and 2 give
    ``N, D ~ C^0.5``).
    """
    n = math.sqrt(flops / (6.0 * tokens_per_param))
    return n, tokens_per_param * n


def kaplan_allocation(flops: float) -> tuple[float, float]:
    """``(N, D)`` by Kaplan et al. 2020 (fig. 14, sec. 6.1): ``N = 1.3e9 * (C / PF-day)^0.73``, ``D = C / 6N``.

    ``N`` counts non-embedding parameters, as in that paper.
    """
    n = 1.3e9 * (flops / PF_DAY) ** 0.73
    return n, flops / (6.0 * n)


def kaplan_budget_for_params(n_params: float) -> float:
    """FLOPs for which Kaplan et al.'s rule picks ``n_params`` (inverse of :func:`kaplan_allocation`)."""
    return PF_DAY * (n_params / 1.3e9) ** (1.0 / 0.73)


# --------------------------------------------------------------------------------------------------
# Hardware.


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One chip type. ``peak_flops``: dense bf16 FLOP/s per chip (:data:`jaxpt.training.flops.PEAK_FLOPS_BF16`);
    ``memory_bytes``: HBM per chip (vendor figure; the runtime reserves a little of it);
    ``cores_per_chip``: TensorCores per chip, which TPU v4/v5p slice names count (v5p-256 = 128 chips);
    ``ici_bytes_per_s``: a chip's interconnect bandwidth, both directions of all its links together (Google
    Cloud TPU system-architecture pages, in Gbit/s: v4 2400, v5e 1600, v5p 4800, v6e 3584; NVIDIA NVLink:
    A100 600 GB/s, H100/H200 900 GB/s), for the all-to-all estimate (:func:`all_to_all_estimate`)."""

    name: str
    peak_flops: float
    memory_bytes: float
    cores_per_chip: int = 1
    ici_bytes_per_s: float | None = None


ACCELERATORS: dict[str, Accelerator] = {
    "v4": Accelerator("TPU v4", flops_lib.PEAK_FLOPS_BF16["tpu v4"], 32 * GIB, 2, 2400e9 / 8),
    "v5e": Accelerator("TPU v5e", flops_lib.PEAK_FLOPS_BF16["tpu v5e"], 16 * GIB, 1, 1600e9 / 8),
    "v5litepod": Accelerator("TPU v5e", flops_lib.PEAK_FLOPS_BF16["tpu v5e"], 16 * GIB, 1, 1600e9 / 8),
    "v5p": Accelerator("TPU v5p", flops_lib.PEAK_FLOPS_BF16["tpu v5p"], 95 * GIB, 2, 4800e9 / 8),
    "v6e": Accelerator("TPU v6e", flops_lib.PEAK_FLOPS_BF16["tpu v6e"], 32 * GIB, 1, 3584e9 / 8),
    "a100": Accelerator("A100 80GB", flops_lib.PEAK_FLOPS_BF16["a100"], 80 * GIB, 1, 600e9),
    "h100": Accelerator("H100 SXM", flops_lib.PEAK_FLOPS_BF16["h100"], 80 * GIB, 1, 900e9),
    "h200": Accelerator("H200 SXM", flops_lib.PEAK_FLOPS_BF16["h200"], 141 * GIB, 1, 900e9),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named slice: ``accelerator`` times ``num_chips``."""

    name: str
    accelerator: Accelerator
    num_chips: int

    @property
    def peak_flops(self) -> float:
        """Peak bf16 FLOP/s of the whole slice."""
        return self.num_chips * self.accelerator.peak_flops


def parse_hardware(name: str) -> Slice:
    """``'v5p-256'`` -> 128 v5p chips (v4/v5p names count TensorCores, two per chip); ``'v5e-64'``,
    ``'v6e-256'`` count chips; ``'h100-8'`` is 8 GPUs.

    Raises:
      ValueError: unknown accelerator or malformed name (``--hardware``), or a core count that is not
        a whole number of chips.
    """
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    if not m or m.group(1) not in ACCELERATORS:
        raise ValueError(f"--hardware {name!r}: expected NAME-COUNT with NAME one of "
                         f"{', '.join(sorted(ACCELERATORS))} (e.g. v5p-256, v5e-64, h100-8)")
    acc, count = ACCELERATORS[m.group(1)], int(m.group(2))
    if count <= 0 or count % acc.cores_per_chip:
        raise ValueError(f"--hardware {name!r}: {count} is not a whole number of {acc.name} chips "
                         f"({acc.cores_per_chip} cores per chip)")
    return Slice(name, acc, count // acc.cores_per_chip)


def training_days(flops: float, hw: Slice, mfu: float) -> float:
    """Wall-clock days to spend ``flops`` on ``hw`` at model FLOPs utilization ``mfu`` (0..1]."""
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu}: must be in (0, 1]")
    return flops / (hw.peak_flops * mfu) / 86400.0


# --------------------------------------------------------------------------------------------------
# Checkpoint interval from failure rates.


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints, ``sqrt(2 * delta * M)``, in seconds.

    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974:
    per checkpoint segment of length ``tau`` the overhead is ``delta / tau`` (saving) plus ``tau / (2 M)``
    (half a segment redone per failure, failures every ``M`` on average); the sum is least at
    ``tau = sqrt(2 delta M)``.

    Args:
      save_s: ``delta``, seconds the training is blocked by one checkpoint save (> 0).
      mtbf_s: ``M``, mean time between failures of the whole job, seconds (> 0).

    Raises:
      ValueError: a non-positive argument.
    """
    _check_positive(save_s=save_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum, ``sqrt(2 delta M) - delta`` for ``delta < 2 M``, else ``M``; seconds.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
    Generation Computer Systems 22(3), 2006 (its first-order estimate): Young's interval counts the save time
    inside the segment; Daly's model counts compute only, hence ``- delta``. For ``delta >= 2 M`` (saving
    costs more than two mean failure intervals) Daly recommends ``tau = M``.

    Raises:
      ValueError: a non-positive argument.
    """
    _check_positive(save_s=save_s, mtbf_s=mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    return math.sqrt(2.0 * save_s * mtbf_s) - save_s


def expected_lost_s(interval_s: float, save_s: float, restart_s: float = 0.0) -> float:
    """Expected seconds lost to one failure at checkpoint interval ``interval_s`` (compute seconds between
    saves): half a segment of ``interval_s + save_s`` redone (failures uniform within a segment; the
    first-order term of Young 1974 and Daly 2006) plus ``restart_s`` to restart and restore."""
    return 0.5 * (interval_s + save_s) + restart_s


def goodput_at(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Fraction (0..1] of wall time spent on training that is kept, at checkpoint interval ``interval_s``.

    Daly 2006's model of a run with exponentially distributed failures of mean ``M``: the expected wall time of a solve
    of ``T_s`` compute seconds is ``T_w = M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau``; goodput is
    ``T_s / T_w = tau / (M e^(R/M) (e^((tau + delta)/M) - 1))``.

    Args:
      interval_s: ``tau``, compute seconds between checkpoints (> 0).
      save_s: ``delta``, seconds one save blocks training (>= 0).
      mtbf_s: ``M``, mean time between failures of the job (> 0).
      restart_s: ``R``, seconds from a failure to training again (restart, restore, recompile; >= 0).

    Raises:
      ValueError: ``interval_s`` or ``mtbf_s`` not positive, or a negative ``save_s``/``restart_s``.
    """
    _check_positive(interval_s=interval_s, mtbf_s=mtbf_s)
    if save_s < 0 or restart_s < 0:
        raise ValueError(f"save_s = {save_s}, restart_s = {restart_s}: must be >= 0")
    return interval_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s))


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} = {v}: must be positive")


def checkpoint_plan(mtbf_hours: float, save_s: float, restart_s: float = 0.0, step_s: float | None = None,
                    configured_every_steps: int | None = None) -> dict[str, Any]:
    """The recommended checkpoint interval (Daly first order; Young beside it), the expected loss per
    failure and the goodput at it, and the same figures at the configured interval when known.

    Args:
      mtbf_hours: mean time between failures of the whole job, hours.
      save_s: seconds one checkpoint save blocks training.
      restart_s: seconds from a failure until training again (restart, restore, compile).
      step_s: seconds per training step; converts the interval to steps.
      configured_every_steps: ``CheckpointConfig.save_every_steps`` to compare with (needs ``step_s``).

    Returns:
      ``{"mtbf_s", "save_s", "restart_s", "young_interval_s", "recommended_interval_s",
      "recommended_lost_per_failure_s", "recommended_goodput"}`` plus, with ``step_s``,
      ``"recommended_every_steps"`` and, with ``configured_every_steps``, ``"configured_interval_s"``,
      ``"configured_lost_per_failure_s"`` and ``"configured_goodput"``.

    Raises:
      ValueError: a non-positive MTBF, save time or step time, or a negative restart time.
    """
    mtbf_s = mtbf_hours * 3600.0
    tau = daly_interval(save_s, mtbf_s)
    out: dict[str, Any] = {"mtbf_s": mtbf_s, "save_s": save_s, "restart_s": restart_s,
                           "young_interval_s": young_interval(save_s, mtbf_s), "recommended_interval_s": tau,
                           "recommended_lost_per_failure_s": expected_lost_s(tau, save_s, restart_s),
                           "recommended_goodput": goodput_at(tau, save_s, mtbf_s, restart_s)}
    if step_s is not None:
        _check_positive(step_s=step_s)
        out["step_s"] = step_s
        out["recommended_every_steps"] = max(1, round(tau / step_s))
        if configured_every_steps:
            conf = configured_every_steps * step_s
            out.update(configured_every_steps=configured_every_steps, configured_interval_s=conf,
                       configured_lost_per_failure_s=expected_lost_s(conf, save_s, restart_s),
                       configured_goodput=goodput_at(conf, save_s, mtbf_s, restart_s))
    return out


def format_checkpoint_plan(p: dict[str, Any]) -> str:
    """The checkpoint-interval recommendation as text (the same numbers as ``--json``)."""
    lines = [f"checkpoint interval for MTBF {p['mtbf_s'] / 3600:.3g} h, save {p['save_s']:.3g} s, restart "
             f"{p['restart_s']:.3g} s:",
             f"  recommended (Daly 2006, first order, sqrt(2 delta M) - delta): {p['recommended_interval_s']:.1f} s "
             f"of compute between saves" + (f" = every {p['recommended_every_steps']} steps at "
                                            f"{p['step_s']:.3g} s/step" if "step_s" in p else ""),
             f"  (Young 1974, sqrt(2 delta M): {p['young_interval_s']:.1f} s)",
             f"  expected loss per failure {p['recommended_lost_per_failure_s']:.1f} s; goodput "
             f"{p['recommended_goodput']:.2%} (Daly 2006 exponential-failure model)"]
    if "configured_interval_s" in p:
        lines.append(f"  configured: every {p['configured_every_steps']} steps = {p['configured_interval_s']:.1f} s; "
                     f"loss per failure {p['configured_lost_per_failure_s']:.1f} s; goodput "
                     f"{p['configured_goodput']:.2%}")
    return "\n".join(lines)


def all_to_all_estimate(cfg, sizes: Mapping[str, int], hw: Slice | None, mfu: float = 0.4) -> dict[str, Any] | None:
    """Token exchange of expert parallelism per train step, per device; None for a dense model.

    Each MoE layer moves its dispatched tokens, ``[E, G, C, D]`` per device in the compute dtype (``G`` the
    device's rows, ``C`` :func:`jaxpt.model.moe.expert_capacity`; dropless: ``G L k`` token rows), all-to-all
    over the ``expert`` axis of size ``ep``: a device keeps ``1/ep`` of it and sends the rest. Per layer
    that is 2 all-to-alls forward (dispatch, combine) and 2 backward, plus 2 more when a remat policy
    recomputes the forward pass. Time: bytes sent / ``ici_bytes_per_s / 2`` (a chip's egress: half its
    bidirectional bandwidth), a lower bound that assumes every link busy and the ``expert`` axis within one
    slice; set beside the step's compute time at ``mfu``.

    Returns ``{"expert_parallel", "bytes_per_device", "all_to_alls", "seconds" (None without hardware),
    "compute_seconds" (None without hardware), "fraction_of_compute"}``.
    """
    m = cfg.model
    if not m.num_moe_layers:
        return None
    ep = sizes.get("expert", 1)
    rows = cfg.global_batch_size / mesh_lib.data_parallel_size(sizes, cfg.logical_axis_rules)
    S = m.moe_group_size or cfg.seq_len
    tokens_in = (rows * cfg.seq_len * m.moe_top_k if m.moe_dropless
                 else m.moe_num_experts * rows * (cfg.seq_len // S) * expert_capacity(m, S))
    per_exchange = tokens_in * m.d_model * DTYPE_BYTES[m.compute_dtype] * (ep - 1) / ep
    count = m.num_moe_layers * (6 if m.remat_policy != "none" else 4)
    total = per_exchange * count
    out = {"expert_parallel": ep, "bytes_per_device": total, "all_to_alls": count, "seconds": None,
           "compute_seconds": None, "fraction_of_compute": None}
    if hw is not None and hw.accelerator.ici_bytes_per_s:
        out["seconds"] = total / (hw.accelerator.ici_bytes_per_s / 2)
        tokens_per_device = cfg.global_batch_size * cfg.seq_len / math.prod(sizes.values())
        out["compute_seconds"] = (flops_lib.flops_per_token(m, cfg.seq_len) * tokens_per_device
                                  / (hw.accelerator.peak_flops * mfu))
        out["fraction_of_compute"] = out["seconds"] / out["compute_seconds"]
    return out


# --------------------------------------------------------------------------------------------------
# Plans.


def _allocations(flops: float) -> dict[str, dict[str, float]]:
    n_rule, d_rule = chinchilla_rule(flops)
    n3, d3 = CHINCHILLA.optimal(flops)
    nk, dk = kaplan_allocation(flops)
    return {
        "chinchilla_rule": {"params": n_rule, "tokens": d_rule, "loss": CHINCHILLA.loss(n_rule, d_rule)},
        "chinchilla_approach3": {"params": n3, "tokens": d3, "loss": CHINCHILLA.loss(n3, d3)},
        "kaplan": {"params": nk, "tokens": dk, "params_kind": "non-embedding"},
    }


def plan_flops(flops: float) -> dict[str, Any]:
    """Plan for a compute budget (FLOPs). Headline ``params``/``tokens``: the 20-tokens rule."""
    if not flops > 0:
        raise ValueError(f"--flops {flops}: must be positive")
    alloc = _allocations(flops)
    head = alloc["chinchilla_rule"]
    return {"input": {"flops": flops}, "params": head["params"], "tokens": head["tokens"], "flops": flops,
            "flops_method": "6ND", "allocations": alloc}


def plan_params(n_params: float) -> dict[str, Any]:
    """Plan for a parameter count: tokens by the 20-tokens rule, FLOPs = 6ND; the budgets at which the
    approach-3 fit and Kaplan et al. would pick this size, with their token counts."""
    if not n_params > 0:
        raise ValueError(f"--params {n_params}: must be positive")
    tokens = TOKENS_PER_PARAM * n_params
    c3 = CHINCHILLA.budget_for_params(n_params)
    ck = kaplan_budget_for_params(n_params)
    alloc = {
        "chinchilla_rule": {"params": n_params, "tokens": tokens, "flops": 6 * n_params * tokens,
                            "loss": CHINCHILLA.loss(n_params, tokens)},
        "chinchilla_approach3": {"params": n_params, "tokens": c3 / (6 * n_params), "flops": c3,
                                 "loss": CHINCHILLA.loss(n_params, c3 / (6 * n_params))},
        "kaplan": {"params": n_params, "tokens": ck / (6 * n_params), "flops": ck, "params_kind": "non-embedding"},
    }
    return {"input": {"params": n_params}, "params": n_params, "tokens": tokens, "flops": 6 * n_params * tokens,
            "flops_method": "6ND", "allocations": alloc}


def plan_config(cfg, sizes: Mapping[str, int], hw: Slice | None, tokens: float | None = None,
                mfu: float = 0.4) -> dict[str, Any]:
    """Plan for a model config on a mesh: params by kind, Chinchilla tokens for its size (or ``tokens``),
    FLOPs with attention (:func:`jaxpt.training.flops.flops_per_token`: active params of a mixture of experts), the
    per-device memory estimate (all expert params), and for a mixture of experts the all-to-all estimate
    (:func:`all_to_all_estimate`). Chinchilla's tokens follow the total param count."""
    m = cfg.model
    counts = count_params(m)
    n = counts["total"]
    base = plan_params(n)
    d = tokens if tokens is not None else base["tokens"]
    fpt = flops_lib.flops_per_token(m, cfg.seq_len)
    mem = estimate_memory(cfg, sizes, hw.accelerator.memory_bytes if hw else None)
    return {**base, "tokens": d, "flops": fpt * d, "flops_method": "flops_per_token (6 N_matmul + attention)",
            "flops_6nd": 6.0 * n * d, "param_counts": counts, "flops_per_token": fpt,
            "configured_tokens": cfg.steps * cfg.global_batch_size * cfg.seq_len, "seq_len": cfg.seq_len,
            "mesh": mesh_lib.format_mesh(sizes), "memory": mem.as_dict(), "remat_policy": m.remat_policy,
            "all_to_all": all_to_all_estimate(cfg, sizes, hw, mfu)}


def add_hardware(plan: dict[str, Any], hw: Slice | None, mfu: float) -> dict[str, Any]:
    """Add ``hardware`` and ``days`` (wall-clock at ``mfu``) to a plan."""
    if hw is None:
        return plan
    return {**plan, "hardware": {"name": hw.name, "accelerator": hw.accelerator.name, "chips": hw.num_chips,
                                 "peak_flops": hw.peak_flops, "memory_per_chip": hw.accelerator.memory_bytes},
            "mfu": mfu, "days": training_days(plan["flops"], hw, mfu)}


# --------------------------------------------------------------------------------------------------
# Terminal output.


def _si(x: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _duration(days: float) -> str:
    if days >= 1:
        return f"{days:.1f} days"
    if days * 24 >= 1:
        return f"{days * 24:.1f} hours"
    return f"{days * 1440:.1f} minutes"


def format_plan(plan: dict[str, Any]) -> str:
    """Human-readable plan (the same numbers as ``--json``)."""
    lines = [f"headline (Chinchilla rule, ~{TOKENS_PER_PARAM:.0f} tokens/param, Hoffmann et al. 2022 Table 3): "
             f"{_si(plan['params'])} params, {_si(plan['tokens'])} tokens, {plan['flops']:.3g} FLOPs "
             f"({plan['flops_method']})"]
    a = plan["allocations"]
    r3, k = a["chinchilla_approach3"], a["kaplan"]
    lines.append(f"  Chinchilla approach 3 (L = E + A/N^0.34 + B/D^0.28, closed form): {_si(r3['params'])} params, "
                 f"{_si(r3['tokens'])} tokens, predicted loss {r3['loss']:.3f} "
                 f"(rule: {a['chinchilla_rule']['loss']:.3f})")
    lines.append(f"  Kaplan et al. 2020 (N = 1.3e9 C^0.73, C in PF-days): {_si(k['params'])} non-embedding params, "
                 f"{_si(k['tokens'])} tokens")
    if "param_counts" in plan:
        pc = plan["param_counts"]
        lines.append(f"model: {pc['total']:,} params ({pc['matmul']:,} in matmuls per token); {plan['flops_per_token']:.4g} "
                     f"FLOPs/token; 6ND = {plan['flops_6nd']:.3g}; configured run: {_si(plan['configured_tokens'])} tokens")
    a2a = plan.get("all_to_all")
    if a2a:
        line = (f"expert parallelism {a2a['expert_parallel']}: {a2a['all_to_alls']} all-to-alls per step, "
                f"{a2a['bytes_per_device'] / GIB:.3f} GiB sent per device")
        if a2a["seconds"] is not None:
            line += (f", >= {a2a['seconds'] * 1e3:.1f} ms on the interconnect vs {a2a['compute_seconds'] * 1e3:.1f} ms "
                     f"of compute at MFU {plan.get('mfu', 0.4):.2f} ({a2a['fraction_of_compute']:.0%})")
        lines.append(line)
    if "days" in plan:
        hw = plan["hardware"]
        lines.append(f"wall clock on {hw['name']} ({hw['chips']} x {hw['accelerator']}, "
                     f"{hw['peak_flops']:.3g} FLOP/s peak) at MFU {plan['mfu']:.2f}: {_duration(plan['days'])}")
    if "memory" in plan:
        lines.append(_format_memory(plan["memory"], plan["mesh"], plan["remat_policy"]))
    if "lr_batch_rules" in plan:
        lines.append(rules_lib.format_recommendation(plan["lr_batch_rules"]))
    return "\n".join(lines)


def _format_memory(mem: dict[str, Any], mesh: str, policy: str) -> str:
    parts = ", ".join(f"{k} {mem[k] / GIB:.3f}" for k in ("params", "grads", "opt_state", "update", "gathered_params",
                                                           "activations", "logits"))
    if mem.get("pipeline"):
        pp = mem["pipeline"]
        parts += (f", stash {mem['stash'] / GIB:.3f} (per stage of {pp['stages']}: {pp['microbatches']} micro-batches"
                  f" x {pp['repeats']} repeats, bubble {pp['bubble_fraction']:.1%})")
    line = f"memory per device (mesh {mesh}, remat {policy!r}), GiB: {parts}; total {mem['total'] / GIB:.3f}"
    if mem["fits"] is None:
        return line + " (no --hardware: device memory unknown)"
    verdict = "fits" if mem["fits"] else "DOES NOT FIT"
    return (line + f" -> {verdict} in {mem['usable_fraction']:.0%} of "
            f"{mem['device_bytes'] / GIB:.0f} GiB")


def resolve_vocab(cfg):
    """``cfg`` with ``ModelConfig.vocab_size`` resolved from the tokenizer when it is 0
    (:func:`jaxpt.run.resolve.resolve_vocab`).

    Raises:
      ConfigError: vocab size 0 and no tokenizer at ``DataConfig.tokenizer_path``.
    """
    return resolve(cfg)
