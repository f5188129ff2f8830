"""Spike diagnosis: an injected bad batch reproduces on replay (bad batch); a transient state fault does not
(optimizer state); the batch's documents are listed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt.run import monitor
from jaxpt import train
from jaxpt.data import documents
from jaxpt.tools import diagnose


def test_random_tokens_injector_changes_only_its_step_and_keeps_padding():
    local = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6),
             "segment_ids": np.array([[1] * 6, [1] * 4 + [0] * 2]),
             "positions": np.zeros((2, 6), np.int32), "doc_index": np.zeros((2, 6), np.int32)}
    inj = diagnose.RandomTokens(step=3, vocab_size=50, seed=1)
    assert inj(2, local) is local
    out = inj(3, local)
    assert not np.array_equal(out["tokens"][0], local["tokens"][0])
    np.testing.assert_array_equal(out["tokens"][1, 4:], local["tokens"][1, 4:])  # padding kept
    np.testing.assert_array_equal(out["tokens"], inj(3, local)["tokens"])  # the same each call
    assert out["tokens"].max() < 50


class TransientFault:
    """Scales every parameter by 4 before step ``step``; the next step gets the clean state back (a fault that
    never reaches a checkpoint)."""

    def __init__(self, step):
        self.step, self.clean = step, None

    def __call__(self, step, state):
        if step == self.step:
            self.clean = jax.tree.map(jnp.copy, state)
            return state.replace(params=jax.tree.map(lambda p: p * 4.0, state.params))
        if step == self.step + 1 and self.clean is not None:
            return self.clean
        return state


@pytest.mark.slow
def test_diagnose_tells_a_bad_batch_from_a_state_fault(prepared_sample, tmp_path):
    """24 steps at a constant learning rate (warmup 1), spikes judged from step 9 on: rare random tokens at step
    20 (a bad batch) and every parameter scaled by 4 before step 23 only (a state fault); checkpoints every 4."""
    b = tiny_bindings(prepared_sample, tmp_path, **{
        "CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "4",
        "StabilityConfig.spike_min_history": "8", "StabilityConfig.spike_window": "8",
        "StabilityConfig.rollback": "False", "ModelConfig.vocab_size": "2048", "OptimizerConfig.warmup_steps": "1",
        "CheckpointConfig.keep_last": "10"})
    cfg = C.parse(["configs/quickstart.gin"], b, steps=24, mesh="data=2,fsdp=2,tensor=2")
    bad = diagnose.RandomTokens(20, 2048, seed=3)
    train.run_training(cfg, fault_injector=TransientFault(23), batch_injector=bad)
    skipped = {r["step"] for r in monitor.read_metrics(str(tmp_path)) if r.get("event") == "spike_skip"}
    assert {20, 23} <= skipped, skipped

    d = diagnose.diagnose(str(tmp_path), 20, refs=2, batch_injector=bad)
    assert d.checkpoint_step == 16 and d.reproduces and d.verdict.startswith("bad batch")
    assert d.logged["event"] == "spike_skip" and d.replay["loss"] == pytest.approx(d.logged["loss"], rel=1e-4)
    # the control: the random batch stands out on the replayed and on the checkpoint's state
    assert d.on_replayed_state_z > 3 and d.on_checkpoint_state_z > 3
    # its documents are lines of the training file, the ones the run's document log has for step 20
    ids = [x["id"] for x in documents.read_documents(prepared_sample / "train.jsonl.gz")]
    assert d.documents and all(x["id"] == ids[x["doc_index"]] for x in d.documents)

    d = diagnose.diagnose(str(tmp_path), 23, refs=2)
    assert d.checkpoint_step == 20 and not d.reproduces and d.verdict.startswith("optimizer state")
    assert "does not reproduce" in d.text()
