"""The collector's full passes skip what start-up made, and come rarely, while the service runs."""

from __future__ import annotations

import gc

from app.main import GC_THRESHOLDS
from tests.integration.service.conftest import ServiceFactory


def test_startup_objects_are_frozen_while_serving_and_released_at_shutdown(service: ServiceFactory) -> None:
    defaults = gc.get_threshold()
    svc = service()
    try:
        assert gc.get_freeze_count() > 10_000  # modules, routes, schemas, pools
        assert gc.get_threshold() == GC_THRESHOLDS
        assert svc.api().http.get("/healthz").status_code == 200
    finally:
        svc.stop()
        gc.set_threshold(*defaults)
    assert gc.get_freeze_count() == 0
