"""The attnhub conformance kit: hold any backend to contract.md.

For plugin authors::

    import attnhub.testing
    attnhub.testing.check_backend("my_backend")        # AssertionError naming failing cases

or, as a pytest plugin generating one test per case::

    pytest -p attnhub.testing --attnhub-backend my_backend

Cases come from the backend's declarations (:func:`cases_for`); results are compared
with the float64 reference by contract.md's tolerance rule
(:func:`assert_matches_reference`).
"""

from __future__ import annotations

from .cases import Case, Inputs, case_reasons, cases_for, make_inputs
from .check import (
    case_problems,
    check_backend,
    default_device,
    dropout_problems,
    repeatability_problems,
    run_case,
)
from .pytest_plugin import pytest_addoption, pytest_collection_modifyitems, pytest_configure
from .tolerance import (
    assert_matches_reference,
    compare,
    fully_masked_problems,
    highest_float32_precision,
    tolerance_bound,
)

__all__ = [
    "Case",
    "Inputs",
    "assert_matches_reference",
    "case_problems",
    "case_reasons",
    "cases_for",
    "check_backend",
    "compare",
    "default_device",
    "dropout_problems",
    "fully_masked_problems",
    "highest_float32_precision",
    "make_inputs",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "repeatability_problems",
    "run_case",
    "tolerance_bound",
]
