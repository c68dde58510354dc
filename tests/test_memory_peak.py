"""experiments/memory_peak.py finds the peak of an allocation trace and what is alive then."""
import pickle

from experiments.memory_peak import peak_report

MiB = 2**20


def _ev(action, addr, mib, where):
    return {"action": action, "addr": addr, "size": int(mib * MiB),
            "frames": [{"filename": "/x/torch/_ops.py", "line": 1, "name": "__call__"},
                       {"filename": f"/repo/core/{where}.py", "line": 7, "name": where}]}


def test_peak_and_live_set(tmp_path):
    trace = [_ev("alloc", 1, 10, "grads"), _ev("alloc", 2, 30, "gather"),
             _ev("free_requested", 2, 30, "gather"), _ev("free_completed", 2, 30, "gather"),
             _ev("free_completed", 99, 5, "old"),            # a tensor from before recording
             _ev("alloc", 3, 20, "state"), _ev("alloc", 4, 20, "state"),
             _ev("free_completed", 3, 20, "state")]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    text = peak_report(str(path), top=5)
    # levels: 10, 40, 40, 10, 5, 25, 45 (peak), 25
    assert "peak 45.0 MiB" in text
    assert "5.0 MiB of earlier tensors freed" in text
    assert "| 40.0 | 2 | core/state.py:7 state |" in text and "| 10.0 | 1 | core/grads.py:7 grads |" in text
    assert "gather" not in text.split("| MiB |")[1]  # freed before the peak
