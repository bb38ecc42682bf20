"""bench tensor's runs spawn their two ranks (h6 item 4: it passed GLOO_SOCKET_IFNAME, which spawn sets, and
crashed with a TypeError before any worker started)."""
from bench.tensor import run_once


def test_bench_tensor_run_once_spawns_both_engines(tmp_path):
    shape = dict(steps=2, batch=8, d_model=8, hidden=16, blocks=1, device="cpu")
    for engine in ("flowtrain", "torch"):
        result = run_once(tmp_path, engine=engine, **shape)
        assert result["samples_per_s"] > 0
        assert result["collectives_per_step"] >= 1
