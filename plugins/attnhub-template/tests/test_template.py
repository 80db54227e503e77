"""The template backend is discovered through its entry point and passes the kit."""

from __future__ import annotations

import pytest
import torch
from attnhub_template import TemplateChunked

import attnhub
import attnhub.testing


def test_discovered_through_the_entry_point() -> None:
    registry = attnhub.get_registry()
    assert "template_chunked" in registry.names()
    assert registry.origin("template_chunked") == "attnhub-template"
    assert not [f for f in registry.failures if f.distribution == "attnhub-template"]


def test_conformance() -> None:
    assert attnhub.testing.check_backend("template_chunked", "cpu") >= 40


def test_conformance_across_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 16 rows: every small case spans several chunks, some ragged.
    monkeypatch.setattr(TemplateChunked, "chunk", 16)
    assert attnhub.testing.check_backend("template_chunked", "cpu") >= 40


def test_refuses_what_it_does_not_declare() -> None:
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(attnhub.NoBackendError, match=r"template_chunked .*window"):
        attnhub.attention(q, q, q, window=(2, 2), backend="template_chunked")
