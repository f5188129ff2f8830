"""lm-evaluation-harness adapter: a jaxpt checkpoint as an lm-eval model (``--model jaxpt``).

    python -m jaxpt.tools.evaluate lm-eval --workdir workdirs/quickstart \\
        --tasks jaxpt_cloze_reference,jaxpt_heldout_rolling,jaxpt_code_next_line_greedy

or, from Python, ``lm_eval.simple_evaluate(model=JaxptLM(workdir=...), tasks=[...], task_manager=...)``; the
standard suites work the same way where their data is available locally.

The three request types of lm-eval's ``LM`` interface (lm-eval 0.4, ``lm_eval/api/model.py``). Every context starts as
the run's training documents did (``DataConfig.document_boundary``, :func:`jaxpt.data.boundary.context_start`): with
BOS under ``bos``/``bos_eos`` (a Llama or Mistral base, as lm-eval's Hugging Face model does with ``add_bos_token``);
under ``eos`` (jaxpt's default) and ``none`` as it is, an empty context being the EOS token. That first token is the
adapter's ``prefix_token_id`` (BOS or EOS).

``loglikelihood((context, continuation))``
  ``(log p(continuation | context), is_greedy)`` with the pair tokenized as
  :func:`jaxpt.eval.probes.encode_pair` does (the continuation's ids come from the joined text's encoding).
  Scored by :meth:`jaxpt.eval.scorer.Scorer.loglikelihood`, the same call
  jaxpt's own probe tasks use, so both give the same numbers for the same text. Probabilities are over the
  tokenizer's ids: a model whose ``vocab_size`` is padded past the tokenizer's is renormalised without the padded
  ids (no text holds them), and ``is_greedy`` means what generation would produce.
``loglikelihood_rolling((text,))``
  log-likelihood of every token of ``text`` after the ``prefix_token_id`` (lm-eval's convention: BOS for a Llama
  base, else EOS), in rolling windows of the run's ``seq_len`` with ``seq_len // 2`` tokens of context at least.
``generate_until((context, gen_kwargs))``
  greedy continuation (no sampling: ``do_sample`` must be false and ``temperature`` 0) by :func:`jaxpt.infer.decode.greedy`,
  stopped at EOS, at the first of the request's own ``until`` strings (cut before it), or after ``max_gen_toks``
  tokens; a context longer than ``max_length - max_gen_toks`` tokens keeps its last ones. Requests are decoded in
  batches; each gives what it would alone. A padded id is never emitted (:func:`jaxpt.infer.decode.mask_padded_ids`).

Importing this module registers the model name ``jaxpt`` with lm-eval's registry.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from jaxpt.data import boundary
from jaxpt.eval import probes
from jaxpt.eval.scorer import scorer_for_restored
from jaxpt.infer import decode
from jaxpt.infer.restore import restore
from jaxpt.util import fs


@register_model("jaxpt")
class JaxptLM(LM):
    """A restored jaxpt checkpoint behind lm-eval's ``LM`` interface.

    Args:
      workdir: the run directory (restored with :func:`jaxpt.restore`); or pass ``restored``.
      step: checkpoint step (default: newest committed).
      mesh: mesh spec to restore onto (default: the saved one if it fits, else data=<devices>).
      batch_size: rows per compiled call.
      max_gen_toks: default generation budget when a request does not give one.
      restored: an already restored checkpoint (:class:`jaxpt.infer.restore.Restored`).
    """

    def __init__(self, workdir: str | None = None, step: int | None = None, mesh: str | None = None,
                 batch_size: int = 16, max_gen_toks: int = 64, restored=None, **unused):
        super().__init__()
        if restored is None:
            if not workdir:
                raise ValueError("JaxptLM: pass workdir=DIR (model_args 'workdir=DIR') or restored=")
            restored = restore(workdir, step=None if step in (None, "") else int(step), mesh=mesh or None)
        self.restored = restored
        self.tokenizer = restored.tokenizer
        self.context_start = boundary.context_start(restored.config.data.document_boundary, self.tokenizer)
        self.scorer = scorer_for_restored(restored, batch_size=int(batch_size))
        self.decoder = self.scorer.decode_step()
        self.max_gen_toks = int(max_gen_toks)

    @property
    def max_length(self) -> int:
        return self.scorer.seq_len

    @property
    def prefix_token_id(self) -> int:
        """The token every input starts with when it has no context (module docstring): BOS or EOS."""
        return self.context_start.prefix_id

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        reqs, empty = [], set()
        for i, r in enumerate(requests):
            context, continuation = r.args
            if not continuation:
                empty.add(i)  # log p("") = 0 and it is trivially greedy
                continue
            ctx, cont = probes.encode_pair(self.tokenizer, context, continuation)
            reqs.append((self.context_start.apply(ctx), cont))
        scored = iter(self.scorer.loglikelihood(reqs))
        return [(0.0, True) if i in empty else next(scored) for i in range(len(requests))]

    def loglikelihood_rolling(self, requests) -> list[float]:
        prefix = np.asarray([self.prefix_token_id], np.int32)
        reqs = [(prefix, self.tokenizer.encode(r.args[0])) for r in requests]
        keep = [i for i, (_, ids) in enumerate(reqs) if len(ids)]
        scored = dict(zip(keep, (lp for lp, _ in self.scorer.loglikelihood([reqs[i] for i in keep]))))
        return [scored.get(i, 0.0) for i in range(len(reqs))]

    def generate_until(self, requests) -> list[str]:
        """Greedy continuations (:func:`jaxpt.infer.decode.greedy`), each stopped at EOS, after its ``max_gen_toks``
        (capped at ``max_length - 1``), or before the first of *its own* ``until`` strings (cut there).

        Raises:
          ValueError: a request asks for sampling.
        """
        groups: dict[int, list[int]] = {}
        stops: list[list[str]] = []
        for i, r in enumerate(requests):
            until, n = self._gen_kwargs(i, r.args[1])
            stops.append(until)
            groups.setdefault(min(n, self.decoder.seq_len - 1), []).append(i)
        out: list[str] = [""] * len(requests)
        for n, idx in groups.items():
            prompts = [self.context_start.apply(self.tokenizer.encode(requests[i].args[0])) for i in idx]
            gens = decode.greedy(self.decoder, prompts, n, eos_id=self.tokenizer.eos_id,
                                 stop_strings=[stops[i] for i in idx], tokenizer=self.tokenizer)
            for i, g in zip(idx, gens):
                out[i] = g.text
        return out

    def _gen_kwargs(self, i: int, kwargs) -> tuple[list[str], int]:
        """``(until strings, max_gen_toks)`` of request ``i``'s generation arguments."""
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
            raise ValueError(f"JaxptLM decodes greedily only; request {i} asks for sampling ({kwargs})")
        until = kwargs.get("until") or []
        return [until] if isinstance(until, str) else list(until), int(kwargs.get("max_gen_toks", self.max_gen_toks))


def run_lm_eval(workdir: str, tasks: Sequence[str], *, step: int | None = None, mesh: str | None = None,
                include_path: str | None = None, limit: float | None = None, batch_size: int = 16,
                restored=None) -> dict[str, Any]:
    """Run ``lm_eval.simple_evaluate`` on a checkpoint with local task files; returns lm-eval's ``results``.

    The Hugging Face hub is never contacted (offline flags set; local tasks load their data themselves).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    lm = JaxptLM(workdir=workdir, step=step, mesh=mesh, batch_size=batch_size, restored=restored)
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit, log_samples=False,
                                  bootstrap_iters=0)
    return {"results": out["results"], "configs": {k: {"num_fewshot": v.get("num_fewshot")}
                                                   for k, v in out.get("configs", {}).items()},
            "checkpoint": {"workdir": fs.absolute(workdir) if workdir else None, "step": lm.restored.step}}
