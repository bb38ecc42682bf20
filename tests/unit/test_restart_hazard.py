"""torchrun's shared rendezvous store across restarts (pytorch/pytorch#135712): the worker names the fix."""
from __future__ import annotations

from flowtrain.parallel.context import restart_hazard


def test_a_shared_store_with_restarts_is_named_with_the_variable_that_fixes_it():
    hazard = restart_hazard({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"})
    assert hazard is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in hazard and "135712" in hazard


def test_no_restarts_or_a_fresh_store_per_round_is_not_a_hazard():
    assert restart_hazard({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_hazard({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}) is None
    assert restart_hazard({}) is None  # flowtrain's own launcher
