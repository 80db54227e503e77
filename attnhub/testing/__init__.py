"""The attnhub conformance kit: hold any backend to contract.md.

For plugin authors::

    import attnhub.testing
    attnhub.testing.check_backend("my_backend")        # AssertionError naming failing cases

or, as a pytest plugin generating one test per case::

    pytest -p attnhub.testing --attnhub-backend my_backend

Cases come from the backend's declarations (:func:`cases_for`, a planned few dozen;
:func:`sample_cases`, any number drawn at random from the whole call space; for a
backend that declares ``block_sparse``, :func:`sample_block_sparse_cases`; for one that
declares a serving layout, :func:`sample_serving_cases`; for one that declares
``compile_safe``, two cases through ``torch.compile``); results are compared
with the float64 reference by contract.md's tolerance rule
(:func:`assert_matches_reference`), the bound's width set by the kit's own plain
computation in the input dtype (:func:`plain_attention`). Whatever a backend raises,
returns or changes (its inputs, process-wide settings) is a failure of the case in the
kit's report, never an exception through it (:mod:`attnhub.testing.check`).
"""

from __future__ import annotations

from .block_sparse import (
    BlockSparseCase,
    block_sparse_problems,
    block_sparse_reasons,
    draw_block_sparse_case,
    sample_block_sparse_cases,
)
from .cases import Case, Inputs, case_reasons, cases_for, make_inputs
from .check import (
    CallResult,
    case_problems,
    check_backend,
    compiled_cases,
    compiled_problems,
    default_device,
    dropout_problems,
    repeatability_problems,
    run_call,
    run_case,
)
from .faults import describe_exception
from .pytest_plugin import pytest_addoption, pytest_collection_modifyitems, pytest_configure
from .reference import plain_attention, references
from .sampled import sample_cases
from .serving import (
    ServingCase,
    draw_serving_case,
    sample_serving_cases,
    serving_problems,
    serving_reasons,
)
from .tolerance import (
    assert_matches_reference,
    compare,
    fully_masked_problems,
    highest_float32_precision,
    tolerance_bound,
)

__all__ = [
    "BlockSparseCase",
    "CallResult",
    "Case",
    "Inputs",
    "ServingCase",
    "assert_matches_reference",
    "block_sparse_problems",
    "block_sparse_reasons",
    "case_problems",
    "case_reasons",
    "cases_for",
    "check_backend",
    "compare",
    "compiled_cases",
    "compiled_problems",
    "default_device",
    "describe_exception",
    "draw_block_sparse_case",
    "draw_serving_case",
    "dropout_problems",
    "fully_masked_problems",
    "highest_float32_precision",
    "make_inputs",
    "plain_attention",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "references",
    "repeatability_problems",
    "run_call",
    "run_case",
    "sample_block_sparse_cases",
    "sample_cases",
    "sample_serving_cases",
    "serving_problems",
    "serving_reasons",
    "tolerance_bound",
]
