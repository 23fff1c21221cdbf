"""Fixtures of the contract modules (kept here so that they do not leak into other pytest sessions).

``case`` is parametrized by ``lowlat_contract.pytest_plugin`` (one ContractCase per spec and model).
"""

from __future__ import annotations

from typing import Any

import pytest

from lowlat_contract.pytest_plugin import NOTES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the variants contract's (case, variant) pairs of different architectures: each case checks only its
    own architecture's variants (the rest are other cases' work, not skips of this one)."""
    from lowlat_contract.contracts.test_variants import for_other_architecture

    def other(item: pytest.Item) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return "name" in params and item.module.__name__.endswith("test_variants") and \
            for_other_architecture(params.get("case"), params["name"])

    items[:] = [item for item in items if not other(item)]


@pytest.fixture(scope="session")
def contract_notes(request: pytest.FixtureRequest) -> list[str]:
    """Lines a contract adds to the "lowlat contract" summary (e.g. measured step times)."""
    return request.config.stash[NOTES]


@pytest.fixture(scope="session")
def case_trace(case: Any) -> Any:
    """The guard's trace for the case on this machine.

    Skips the case when this machine is not a platform the spec declares, or the model fails one of the spec's
    model requirements (e.g. a tiny preset's head_dim): the suite cannot check that case here.
    """
    from lowlat.loader import resolve_model
    from lowlat.platform import detect_platform
    from lowlat.runtime.plugin_host import evaluate

    trace = evaluate(case.plugin, case.spec, detect_platform(case.device), case.engine_config(),
                     resolve_model(case.model))
    for r in trace.failures:
        if r.requirement == "platform":
            pytest.skip(f"this machine is not a platform the spec declares: {r.reason}")
        if r.requirement.startswith("model."):
            pytest.skip(f"{case.model} fails the spec's {r.requirement} requirement ({r.reason}); "
                        f"pass --lowlat-model with a model the spec accepts")
    return trace


@pytest.fixture(scope="session")
def runner(case: Any, case_trace: Any) -> Any:
    """An eager ModelRunner of the case with the plugin installed (built once per case)."""
    from lowlat.runtime import ModelRunner

    r = ModelRunner(case.engine_config(), show_progress=False)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def dispatcher(runner: Any) -> Any:
    """The runner's Dispatcher; ``force_path`` is reset and leaked KV rows are reported after each test."""
    from lowlat_contract.harness import dispatcher_of

    d = dispatcher_of(runner)
    rows = runner.kv_pool.free_rows
    yield d
    d.force_path = None
    assert runner.kv_pool.free_rows == rows, "a contract test leaked KV request rows (suite bug)"


@pytest.fixture(scope="session")
def cuda_only(case: Any) -> None:
    """Skips a CUDA-only contract on other devices (list it before ``runner`` so no model is built for it)."""
    if case.device != "cuda":
        pytest.skip("runs on CUDA devices only (pass --lowlat-device cuda on a GPU machine)")
