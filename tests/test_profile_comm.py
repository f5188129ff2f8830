"""The profile window's communication share by mesh axis (issue 21.5), and the gate's blame and throughput
estimate on a real tiny CPU run (issue 19.1)."""

import gzip
import json

import jax
import numpy as np
import pytest

from conftest import tiny_bindings


from jaxpt import config as C
from jaxpt.tools import gate


from jaxpt.run import monitor, profile_comm
from jaxpt import train
def _op(name, dev, run, ts, dur, tid):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": {"hlo_op": name, "device_ordinal": str(dev), "run_id": str(run)}}


def _rendezvous(devices, ts, tid):
    return {"ph": "X", "name": "Rendezvous", "ts": ts, "dur": 1, "pid": 1, "tid": tid,
            "args": {"name": f"all gather RendezvousKey{{global_devices=[{', '.join(map(str, devices))}], op_id=1}}"}}


def test_comm_share_by_axis_from_a_hand_built_trace(tmp_path):
    """Mesh data=2 x fsdp=2 (devices [[0, 1], [2, 3]]); one program run per device, each 100 us from its first
    op's start to its last op's end: an all-gather of 20 us over {0, 1} (fsdp) on devices 0 and 1, an all-reduce
    of 30 us over all four (data+fsdp) on every device, one of 10 us whose rendezvous is missing. Collective time
    40 + 120 + 10 = 170 us of 400 device-us: shares 0.1 fsdp, 0.3 data+fsdp, 0.025 unknown, 0.425 in all."""
    ev = []
    for d in range(4):
        tid = 10 + d
        ev += [_op("fusion.1", d, 7, 0, 10, tid), _op("all-reduce", d, 7, 50, 30, tid),
               _rendezvous([0, 1, 2, 3], 55, tid), _op("dot.2", d, 7, 90, 10, tid)]
        if d < 2:
            ev += [_op("all-gather.3", d, 7, 20, 20, tid), _rendezvous([0, 1], 25, tid)]
        if d == 3:
            ev += [_op("reduce-scatter", d, 7, 82, 10, tid)]
        ev.append({"ph": "X", "name": "end: all-reduce", "ts": 80, "dur": 0, "pid": 1, "tid": tid})
    path = tmp_path / "plugins" / "profile" / "x" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    devices = np.array([[_Dev(0), _Dev(1)], [_Dev(2), _Dev(3)]])
    out = profile_comm.comm_share_by_axis(str(tmp_path), devices, ("data", "fsdp"))
    assert out["comm_share"] == pytest.approx(0.425)
    assert {k: round(v, 6) for k, v in out.items() if k.startswith("comm_share/")} == {
        "comm_share/fsdp": 0.1, "comm_share/data+fsdp": 0.3, "comm_share/unknown": 0.025}
    assert out["comm_device_s"] == pytest.approx(400e-6)


class _Dev:
    def __init__(self, i):
        self.id = i


@pytest.mark.slow
def test_profile_window_on_a_real_run_gives_axis_shares_and_the_gate_blames_them(prepared_sample, tmp_path):
    """A tiny run on data=2,fsdp=4 profiled over steps 2-3: the trace is there for TensorBoard (xplane.pb) and
    Perfetto; the record of step 3 carries the communication share, split over the mesh axes the sharding
    communicates on (FSDP all-gathers parameters over fsdp; gradients reduce over data and fsdp), summing to
    the total. The gate, given an estimate far above the measured rate, fails the throughput criterion and
    blames what the profile and the data wait say; with no estimate it compiles the run's config here and
    estimates expected_flops_utilization x peak x tokens / compiled FLOPs, equal to jaxpt.tools.compile's report."""
    b = tiny_bindings(prepared_sample, tmp_path, **{"TrainConfig.profile_steps": "'2:3'"})
    cfg = C.parse(["configs/quickstart.gin"], b, steps=4, mesh="data=2,fsdp=4")
    train.run_training(cfg)
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))
    records = monitor.read_metrics(str(tmp_path))
    prof = [r for r in records if "profile_dir" in r]
    assert [r["step"] for r in prof] == [3]
    axes = {k.split("/", 1)[1]: v for k, v in prof[0].items() if k.startswith("comm_share/")}
    assert "fsdp" in axes and set(axes) <= {"data", "fsdp", "data+fsdp"}, axes
    assert 0 < prof[0]["comm_share"] <= 1 and sum(axes.values()) == pytest.approx(prof[0]["comm_share"])

    steps = [r for r in records if "tokens_per_sec" in r and r["step"] > 1 and "event" not in r]
    measured = float(np.median([r["tokens_per_sec"] for r in steps]))
    c = {c.name: c for c in gate.judge(str(tmp_path), estimate_tokens_per_sec=100 * measured)}["tokens_per_sec"]
    median = lambda key: float(np.median([r[key] for r in steps]))  # noqa: E731
    data_share = median("data_wait_s") / median("step_time_s")
    assert c.verdict == gate.FAIL and f"collectives {prof[0]['comm_share']:.0%}" in c.measured, c
    top = max(axes, key=axes.get)
    if prof[0]["comm_share"] > data_share:
        assert f"communication dominates ({top} {axes[top]:.0%}" in c.reason, (c, data_share)
    else:
        assert "communication dominates" not in c.reason, (c, data_share)

    from jaxpt.tools import compile as compile_lib
    report = compile_lib.compile_report(cfg, compile_lib.make_target(f"cpu:{jax.device_count()}"))
    start = next(r for r in records if r.get("event") == "start")
    expected = 0.5 * start["peak_flops_per_device"] * report["tokens_per_step"] / report["flops_per_step"]
    assert report["tokens_per_step"] == 16 * 64
    c = {c.name: c for c in gate.judge(str(tmp_path))}["tokens_per_sec"]
    assert f"vs {expected:.4g})" in c.measured and c.verdict in (gate.PASS, gate.FAIL), c
